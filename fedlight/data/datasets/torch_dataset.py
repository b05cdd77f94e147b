"""Your own data: any map-style ``torch.utils.data.Dataset``, or a ``LightningDataModule``'s, as a federated pool.

``--data.dataset=mypkg.MyData`` (with ``--data.dataset.init_args.*`` for its constructor) is enough: the data
module wraps a plain ``Dataset`` or ``LightningDataModule`` in :class:`TorchDataset` with its defaults, and
fedlight's partitioners split it. ``--data.dataset=fedlight.data.TorchDataset`` with ``init_args.dataset``
gives the options below (a test set, the number of classes, reading lazily).

What a dataset provides (the protocol):

- ``len(dataset)`` and ``dataset[i] -> (input, target)``: the input a tensor or a NumPy array (kept as float32
  values) or a PIL image (``[C, H, W]`` floats in [0, 1], as torchvision's ``to_tensor`` makes them), every
  input of one shape; the target a class id (an int or a 0-d tensor) or a label map (``[H, W]`` ints, 255 void).
- optionally ``client_ids``: a sequence of ``len(dataset)`` ids (ints or strings), the natural client of each
  sample (its writer, user, hospital). With it, ``fedlight.data.partition.Natural`` makes one client per id;
  another partitioner is refused unless ``ignore_client_ids`` is set, so that the ids are never dropped silently.
- optionally ``classes`` (the class names, in label order, as torchvision's datasets name them) or
  ``num_classes``; otherwise the number of classes is the largest class id plus one.

A ``LightningDataModule`` is prepared (``prepare_data``, ``setup("fit")``) and its ``train_dataloader()``'s
dataset is the pool; its ``test_dataloader()``'s, when it has one (after ``setup("test")``), the global test set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule
from torch.utils.data import Dataset

from fedlight.data.base import FederatedDataset, LabelledTensors, LazySamples
from fedlight.errors import ConfigError

_FLAG = "--data.dataset"


class TorchDataset(FederatedDataset):
    """A map-style torch ``Dataset`` (or a ``LightningDataModule``'s datasets) partitioned by fedlight.

    Args:
        dataset: the pool partitioned over the clients: a ``Dataset`` or a ``LightningDataModule``, by
            ``class_path`` and ``init_args`` (see the module docstring for what its items must be).
        test_dataset: a separate global test set (a ``Dataset``); ``null``: a ``LightningDataModule``'s own test
            set, if it has one, else the union of the clients' held-out splits.
        num_classes: the number of classes; ``null``: the dataset's ``num_classes``, else ``len(classes)``, else
            the largest class id plus one.
        in_memory: read every sample once at set-up and keep the pool in memory; ``false`` reads the inputs of
            each batch when it is served (for pools larger than memory), the targets still once at set-up.
        ignore_client_ids: leave the dataset's ``client_ids`` unused and let ``--data.partitioner`` split it.
    """

    def __init__(
        self,
        dataset: Dataset | LightningDataModule,
        test_dataset: Dataset | None = None,
        num_classes: int | None = None,
        in_memory: bool = True,
        ignore_client_ids: bool = False,
    ) -> None:
        train, test = _datasets_of(dataset)
        self.dataset = train
        self.test_dataset = test_dataset if test_dataset is not None else test
        self.in_memory = in_memory
        self.source = type(dataset).__name__
        if len(train) == 0:
            raise ConfigError(f"{_FLAG}={type(dataset).__qualname__} has no samples.")
        self.input_shape = tuple(_input_of(_pair(train, 0, self.source)[0], 0, self.source).shape)
        client_ids = None if ignore_client_ids else getattr(train, "client_ids", None)
        if client_ids is not None and len(client_ids) != len(train):
            raise ConfigError(
                f"{_FLAG}={self.source} gives {len(client_ids)} client_ids for {len(train)} samples: client_ids needs "
                "one id per sample, in sample order."
            )
        self.client_ids = None if client_ids is None else np.asarray(client_ids)
        classes = getattr(train, "classes", None)
        if classes is not None and all(isinstance(name, str) for name in classes):
            self.class_names = tuple(classes)
        self._pool: LabelledTensors | None = None
        if num_classes is None:
            num_classes = getattr(train, "num_classes", None) or (len(classes) if classes is not None else None)
        if num_classes is None:
            num_classes = int(self.load_train().partition_labels().max()) + 1
        self.num_classes = int(num_classes)

    def load_train(self) -> LabelledTensors:
        """The pool, read once (the inputs of a lazy pool are read per batch)."""
        if self._pool is None:
            self._pool = _read(self.dataset, self.source, self.in_memory, self.client_ids)
        return self._pool

    def load_test(self) -> LabelledTensors | None:
        """The separate test set, read like the pool, or ``None``."""
        if self.test_dataset is None:
            return None
        return _read(self.test_dataset, f"{self.source}'s test set", self.in_memory, None)

    def partition_problems(self, partitioner: Any) -> list[str]:
        """``[problem]`` when the dataset's client ids would be left unused by ``partitioner``."""
        if self.client_ids is None or partitioner.uses_groups:
            return []
        return [
            f"{_FLAG}={self.source} gives each sample's client id (client_ids), but --data.partitioner="
            f"{type(partitioner).__name__} splits the samples itself and would ignore them. Use "
            "--data.partitioner=fedlight.data.partition.Natural for one client per id, or wrap the dataset in "
            "fedlight.data.TorchDataset with ignore_client_ids: true to partition anew."
        ]


class DatasetInputs(LazySamples):
    """The inputs of a map-style dataset, read item by item when a batch is asked for."""

    def __init__(self, dataset: Dataset, first: torch.Tensor, source: str) -> None:
        self.dataset, self.source = dataset, source
        self.shape = (len(dataset), *first.shape)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        return torch.stack([_input_of(self.dataset[i][0], i, self.source) for i in index.tolist()])


def _datasets_of(source: Any) -> tuple[Dataset, Dataset | None]:
    """The training and test datasets of a ``Dataset`` (no test set) or of a ``LightningDataModule``."""
    if isinstance(source, LightningDataModule):
        source.prepare_data()
        source.setup("fit")
        train = source.train_dataloader().dataset
        try:
            source.setup("test")
            test = source.test_dataloader().dataset
        except MisconfigurationException:  # what Lightning's default test_dataloader raises
            test = None
        return train, test
    if not (hasattr(source, "__getitem__") and hasattr(source, "__len__")):
        raise ConfigError(
            f"{_FLAG}={type(source).__qualname__} is not a map-style dataset: it needs __len__ and __getitem__ "
            "returning (input, target), or give a fedlight FederatedDataset or a LightningDataModule."
        )
    return source, None


def _read(dataset: Dataset, source: str, in_memory: bool, client_ids: np.ndarray | None) -> LabelledTensors:
    """Reads ``(input, target)`` items into stacked tensors (inputs lazily unless ``in_memory``)."""
    inputs, targets = [], []
    for i in range(len(dataset)):
        item = _pair(dataset, i, source)
        if in_memory or i == 0:
            inputs.append(_input_of(item[0], i, source))
        targets.append(torch.as_tensor(np.asarray(item[1])).long())
    for name, parts in (("inputs", inputs), ("targets", targets)):
        shapes = sorted({tuple(part.shape) for part in parts})
        if len(shapes) > 1:
            raise ConfigError(
                f"{_FLAG}={source} gives {name} of several shapes ({', '.join(map(str, shapes[:3]))}): batches "
                "stack samples of one shape; resize or crop them in the dataset (a transform)."
            )
    stacked = torch.stack(inputs) if in_memory else DatasetInputs(dataset, inputs[0], source)
    return LabelledTensors(stacked, torch.stack(targets), groups=client_ids)


def _pair(dataset: Dataset, index: int, source: str) -> Sequence:
    """``dataset[index]``, checked to be an ``(input, target)`` pair."""
    item = dataset[index]
    if not isinstance(item, Sequence) or len(item) < 2:
        raise ConfigError(
            f"{_FLAG}={source}[{index}] is a {type(item).__name__}, not an (input, target) pair: __getitem__ must "
            "return the sample's input and its class id or label map."
        )
    return item


def _input_of(value: Any, index: int, source: str) -> torch.Tensor:
    """One sample's input as float32: tensors' and arrays' values as they are, PIL images ``[C, H, W]`` in [0, 1]."""
    from PIL import Image

    if isinstance(value, Image.Image):
        from torchvision.transforms.functional import to_tensor

        return to_tensor(value)
    if isinstance(value, torch.Tensor | np.ndarray):
        return torch.as_tensor(value).float()
    raise ConfigError(
        f"{_FLAG}={source}[{index}] has an input of type {type(value).__name__}: return a tensor, a NumPy array or "
        "a PIL image (or add a transform that makes one)."
    )
