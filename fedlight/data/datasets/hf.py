"""Datasets of the Hugging Face Hub (or saved locally) through the ``datasets`` library: ``pip install -e ".[hf]"``.

Federated benchmarks are published there with their natural clients as a column (``flwrlabs/femnist``'s
``writer_id``, ``flwrlabs/celeba``'s celebrity ids), so ``client_column`` gives the
:class:`~fedlight.data.partition.Natural` partition directly; without it, any fedlight partitioner splits the
split's samples. ``path`` is a Hub repository id, a folder written by ``save_to_disk``, or a local data file or
folder (parquet, csv, …). The library keeps what it downloads in its cache (``HF_DATASETS_CACHE``, by default
``~/.cache/huggingface/datasets``) and, with ``HF_DATASETS_OFFLINE=1``, reads only that cache.

The library is imported only when data are read (its absence is reported when the dataset is built). Nothing
is read at construction when ``num_classes`` and ``input_shape`` are given (a config can then be built
offline); otherwise the split is read to find them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.errors import ConfigError

_FLAG = "--data.dataset.init_args"
_INSTALL = 'pip install -e ".[hf]" (or pip install datasets)'


class HFDataset(FederatedDataset):
    """One split of a Hugging Face dataset as the pool, images and labels from two of its columns.

    Images (the ``Image`` feature, decoded to PIL) become ``[C, H, W]`` floats in [0, 1]; array columns keep
    their values as float32. Every input must have one shape after ``image_size`` and ``image_mode``.

    Args:
        path: a Hub repository id (``flwrlabs/femnist``), a folder written by ``Dataset.save_to_disk`` or
            ``DatasetDict.save_to_disk``, or a local data file or folder that ``datasets.load_dataset`` reads.
        split: the split partitioned over the clients.
        image_column: the column of inputs.
        label_column: the column of class ids.
        client_column: the column of each sample's natural client (writer, user, celebrity), for the ``Natural``
            partitioner; ``null``: no natural clients, ``--data.partitioner`` splits the samples.
        test_split: a split that is the global test set; ``null``: the union of the clients' held-out splits.
        name: the dataset's configuration name, where it has several.
        revision: a Hub commit, branch or tag, to pin the data a run reads.
        image_size: resize images to ``(height, width)`` (a single int: square); ``null`` keeps their size.
        image_mode: convert images to this PIL mode first (``RGB``, ``L``); ``null`` keeps theirs.
        num_classes: the number of classes; ``null``: the label column's ``ClassLabel`` count, else the largest
            id plus one.
        input_shape: one input's shape, ``[C, H, W]``; ``null``: that of the first sample.
        cache_dir: the library's cache folder; ``null``: ``HF_DATASETS_CACHE``.
    """

    def __init__(
        self,
        path: str,
        split: str = "train",
        image_column: str = "image",
        label_column: str = "label",
        client_column: str | None = None,
        test_split: str | None = None,
        name: str | None = None,
        revision: str | None = None,
        image_size: int | tuple[int, int] | None = None,
        image_mode: str | None = None,
        num_classes: int | None = None,
        input_shape: tuple[int, ...] | None = None,
        cache_dir: str | None = None,
    ) -> None:
        spec = importlib.util.find_spec("datasets")
        # a datasets/ folder on the path (a project's data, a test package) is a namespace package, not the library
        if spec is None or spec.origin is None:
            raise ConfigError(
                f"fedlight.data.HFDataset reads through Hugging Face's datasets library, which is not installed: "
                f"{_INSTALL}."
            )
        self.path, self.split, self.test_split = path, split, test_split
        self.image_column, self.label_column, self.client_column = image_column, label_column, client_column
        self.name, self.revision, self.cache_dir = name, revision, cache_dir
        self.image_size = (image_size, image_size) if isinstance(image_size, int) else image_size
        self.image_mode = image_mode
        self._pool: LabelledTensors | None = None
        if num_classes is None or input_shape is None:
            split_data = self._split(split)
            feature = split_data.features[label_column]
            if getattr(feature, "names", None):
                self.class_names = tuple(feature.names)
            if num_classes is None:
                num_classes = feature.num_classes if hasattr(feature, "num_classes") else None
            if input_shape is None:
                input_shape = tuple(self._input(split_data[0][image_column], 0).shape)
            if num_classes is None:
                num_classes = int(self.load_train().partition_labels().max()) + 1
        self.num_classes = int(num_classes)
        self.input_shape = tuple(input_shape)

    def load_train(self) -> LabelledTensors:
        """The split's inputs, labels and (with ``client_column``) client ids, read once."""
        if self._pool is None:
            self._pool = self._read(self.split, with_clients=self.client_column is not None)
        return self._pool

    def load_test(self) -> LabelledTensors | None:
        """``test_split``'s inputs and labels, or ``None``."""
        return None if self.test_split is None else self._read(self.test_split, with_clients=False)

    def partition_problems(self, partitioner: Any) -> list[str]:
        """``[problem]`` when ``client_column`` is set but ``partitioner`` would ignore it."""
        if self.client_column is None or partitioner.uses_groups:
            return []
        return [
            f"{_FLAG}.client_column={self.client_column} names each sample's client, but --data.partitioner="
            f"{type(partitioner).__name__} splits the samples itself and would ignore it. Use "
            f"--data.partitioner=fedlight.data.partition.Natural, or set {_FLAG}.client_column=null."
        ]

    # -- reading -------------------------------------------------------------------------------------
    def _split(self, split: str) -> Any:
        """The ``datasets.Dataset`` of ``split``, from a saved folder, a local file or the Hub (or its cache)."""
        import datasets

        local = Path(self.path).expanduser()
        try:
            if (local / "dataset_dict.json").is_file() or (local / "state.json").is_file():
                loaded = datasets.load_from_disk(str(local))
                if isinstance(loaded, datasets.DatasetDict):
                    if split not in loaded:
                        raise ConfigError(
                            f"{self.path} has the splits {sorted(loaded)}, not {split!r}: set {_FLAG}.split "
                            "(or test_split) to one of them."
                        )
                    return loaded[split]
                return loaded  # a single saved Dataset is every split asked for
            if local.is_file():
                builder = local.suffix.lstrip(".").replace("jsonl", "json")
                return datasets.load_dataset(builder, data_files=str(local), split=split, cache_dir=self.cache_dir)
            return datasets.load_dataset(
                self.path, self.name, split=split, revision=self.revision, cache_dir=self.cache_dir
            )
        except ConfigError:
            raise
        except (OSError, ValueError, KeyError, ConnectionError) as error:
            raise self._unavailable(split, error) from error

    def _unavailable(self, split: str, error: BaseException) -> ConfigError:
        import datasets

        offline = " HF_DATASETS_OFFLINE is set: only the cache was read." if datasets.config.HF_DATASETS_OFFLINE else ""
        where = self.cache_dir or datasets.config.HF_DATASETS_CACHE
        return ConfigError(
            f"Could not read split {split!r} of {_FLAG}.path={self.path} ({str(error).splitlines()[0]}).{offline}",
            f"A Hub dataset is downloaded once into {where} (https://huggingface.co/datasets/{self.path}); without "
            "network, load it on a machine that has one and copy that cache here (or save_to_disk it and point path "
            "at the folder). A local path must be a save_to_disk folder or a data file the datasets library reads.",
        )

    def _read(self, split: str, with_clients: bool) -> LabelledTensors:
        data = self._split(split)
        columns = [self.image_column, self.label_column, *([self.client_column] if with_clients else [])]
        missing = [column for column in columns if column not in data.column_names]
        if missing:
            raise ConfigError(
                f"Split {split!r} of {self.path} has no column {', '.join(map(repr, missing))}; its columns are "
                f"{data.column_names}. Set {_FLAG}.image_column, label_column or client_column to one of them."
            )
        inputs = [self._input(value, i) for i, value in enumerate(data[self.image_column])]
        shapes = sorted({tuple(x.shape) for x in inputs})
        if len(shapes) > 1:
            raise ConfigError(
                f"The {self.image_column!r} inputs of {self.path} have several shapes "
                f"({', '.join(map(str, shapes[:3]))}): set {_FLAG}.image_size (and image_mode) so that they stack."
            )
        groups = np.asarray(list(data[self.client_column])) if with_clients else None
        targets = torch.as_tensor(np.asarray(list(data[self.label_column])), dtype=torch.int64)
        return LabelledTensors(torch.stack(inputs), targets, groups=groups)

    def _input(self, value: Any, index: int) -> torch.Tensor:
        from PIL import Image

        if isinstance(value, Image.Image):
            from torchvision.transforms.functional import to_tensor

            if self.image_mode is not None:
                value = value.convert(self.image_mode)
            if self.image_size is not None:
                value = value.resize(self.image_size[::-1], Image.Resampling.BICUBIC)  # PIL takes (width, height)
            return to_tensor(value)
        try:
            return torch.as_tensor(np.asarray(value, dtype=np.float32))
        except (TypeError, ValueError) as error:
            raise ConfigError(
                f"Sample {index} of {self.path}'s {self.image_column!r} column is a {type(value).__name__}, neither "
                f"an image nor numbers; set {_FLAG}.image_column to the column of inputs."
            ) from error
