"""CIFAR-10 and CIFAR-100 (Krizhevsky 2009) from torchvision's files, as the FedSLS paper uses them.

The 50,000 training images are the pool partitioned over the clients (the MOON-style
:class:`~fedlight.data.partition.Dirichlet`); the 10,000 test images are the global test set.
Images stay ``[N, 3, 32, 32]`` uint8 in memory (150 MB for a pool, a quarter of float32); the ResNet
models standardise them (:class:`~fedlight.models.resnet.ResNet`).

torchvision verifies every batch file against the MD5 sums published with the dataset before reading it. A copy
whose files differ byte for byte (a mirror that re-pickled them, a re-packed archive) gives its own sums in
``checksums``, which the same verification then uses instead.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torchvision.datasets import CIFAR10 as TorchvisionCIFAR10
from torchvision.datasets import CIFAR100 as TorchvisionCIFAR100
from torchvision.datasets.utils import calculate_md5

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.datasets.download import missing_files, read_checksums, through_torchvision
from fedlight.errors import ConfigError

_CHECKSUMS_FLAG = "--data.dataset.init_args.checksums"


class CIFAR10(FederatedDataset):
    """CIFAR-10: 10 classes, ``[N, 3, 32, 32]`` uint8 images, a separate 10,000-image test set.

    Args:
        root: the folder holding ``cifar-10-batches-py/`` (what ``torchvision.datasets.CIFAR10(root,
            download=True)`` leaves there).
        download: fetch the archive through torchvision (its MD5 and every batch file's checked) when missing.
        checksums: a file of MD5 sums in ``md5sum``'s format (``<md5>  <path relative to root>`` per line, e.g.
            ``c99cafc152244af753f735de768cd75f  cifar-10-batches-py/data_batch_1``) that replaces the published
            ones, for a mirror or a re-packed copy of the dataset. It must list every batch file and the
            ``batches.meta`` file; every file is still verified, against these sums. ``None``: the published sums.
    """

    num_classes = 10
    input_shape = (3, 32, 32)
    _torchvision = TorchvisionCIFAR10
    _folder = "cifar-10-batches-py"

    def __init__(self, root: str = "data/cifar10", download: bool = False, checksums: str | None = None) -> None:
        self.root = root
        self.download = download
        self.checksums = checksums

    def load_train(self) -> LabelledTensors:
        """The 50,000 training images, in file order."""
        return self._read(train=True)

    def load_test(self) -> LabelledTensors:
        """The 10,000 test images."""
        return self._read(train=False)

    def _read(self, train: bool) -> LabelledTensors:
        source = self._source()
        folder = Path(self.root) / self._folder
        expected = [folder / name for name in _file_names(source)]
        try:
            split = through_torchvision(
                lambda: source(self.root, train=train, download=self.download),
                source.__name__,
                [source.url],
                self.root,
                self.root,
                self.download,
                missing=f"download {source.url} and extract it into {self.root}/ (it unpacks to {self._folder}/).",
                expected=expected,
            )
        except ConfigError as error:
            mismatched = self._mismatched(source)  # torchvision says only "not found or corrupted"
            if not mismatched:
                raise
            if self.download or missing_files(expected):  # the failed download's or the missing files' lines
                raise ConfigError(*mismatched, *error.problems) from error
            raise ConfigError(*mismatched, self._fix(source)) from error
        except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError, AttributeError, IndexError) as error:
            # files that match their sums but are no batches: only a list of sums can vouch for such files
            raise ConfigError(
                f"{_unreadable(folder, source, error)}: it matches its MD5 sum but is no CIFAR batch file (a pickled "
                f"dict of 'data' and labels). {self._fix(source)}",
            ) from error
        images = torch.from_numpy(split.data).permute(0, 3, 1, 2).contiguous()  # [N, 32, 32, 3] → [N, 3, 32, 32]
        return LabelledTensors(inputs=images, targets=torch.tensor(split.targets, dtype=torch.int64))

    def _source(self) -> type[TorchvisionCIFAR10]:
        """torchvision's class, or a subclass of it whose MD5 sums are those of :attr:`checksums`."""
        base = self._torchvision
        if self.checksums is None:
            return base
        sums = read_checksums(self.checksums, _CHECKSUMS_FLAG)
        keys = {name: f"{self._folder}/{name}" for name in _file_names(base)}
        unlisted = [key for key in keys.values() if key not in sums]
        if unlisted:
            raise ConfigError(
                f"{_CHECKSUMS_FLAG}={self.checksums} lists no MD5 sum for {', '.join(unlisted)}; add a line "
                f"'<md5>  <path>' for each (paths relative to --data.dataset.init_args.root={self.root}, as "
                f"`md5sum {self._folder}/*` run there writes them)."
            )
        return type(
            base.__name__,  # messages name the dataset as torchvision does
            (base,),
            {
                "train_list": [[name, sums[keys[name]]] for name, _ in base.train_list],
                "test_list": [[name, sums[keys[name]]] for name, _ in base.test_list],
                "meta": {**base.meta, "md5": sums[keys[base.meta["filename"]]]},
            },
        )

    def _mismatched(self, source: type[TorchvisionCIFAR10]) -> list[str]:
        """One line per present file whose MD5 differs from the sum ``source`` holds for it."""
        folder, lines = Path(self.root) / self._folder, []
        listed_in = (
            f"{_CHECKSUMS_FLAG}={self.checksums}" if self.checksums is not None else "the dataset's published sums"
        )
        sums = [*source.train_list, *source.test_list, [source.meta["filename"], source.meta["md5"]]]
        for name, expected in sums:
            path = folder / name
            if path.is_file() and (actual := calculate_md5(str(path))) != expected:
                lines.append(
                    f"{path} does not match its MD5 sum {expected} in {listed_in} (the file's is {actual}): it is "
                    "damaged, cut short or not this dataset's file."
                )
        return lines

    def _fix(self, source: type[TorchvisionCIFAR10]) -> str:
        """What to do about files that fail their sums."""
        other_sums = (
            f"correct the sums in {_CHECKSUMS_FLAG}={self.checksums}"
            if self.checksums is not None
            else f"for a re-packed copy, list its sums in {_CHECKSUMS_FLAG}"
        )
        return (
            f"Extract {source.url} into {self.root}/ again (it unpacks to {self._folder}/), or {other_sums}; with "
            "--data.dataset.init_args.download=true a file that fails its sum is fetched again."
        )


class CIFAR100(CIFAR10):
    """CIFAR-100 with its 100 fine classes; otherwise as :class:`CIFAR10`.

    Args:
        root: the folder holding ``cifar-100-python/`` (what ``torchvision.datasets.CIFAR100(root,
            download=True)`` leaves there).
        download: fetch the archive through torchvision (its MD5 and every file's checked) when missing.
        checksums: a file of MD5 sums in ``md5sum``'s format (``<md5>  <path relative to root>`` per line, e.g.
            ``16019d7e3df5f24257cddd939b257f8d  cifar-100-python/train``) that replaces the published ones, for a
            mirror or a re-packed copy of the dataset. It must list ``train``, ``test`` and ``meta``; every file is
            still verified, against these sums. ``None``: the published sums.
    """

    num_classes = 100
    _torchvision = TorchvisionCIFAR100
    _folder = "cifar-100-python"

    def __init__(self, root: str = "data/cifar100", download: bool = False, checksums: str | None = None) -> None:
        super().__init__(root, download, checksums)


def _file_names(source: type[TorchvisionCIFAR10]) -> list[str]:
    """The batch files and the metadata file of the dataset, as torchvision names them."""
    return [name for name, _ in [*source.train_list, *source.test_list]] + [source.meta["filename"]]


def _unreadable(folder: Path, source: type[TorchvisionCIFAR10], error: BaseException) -> str:
    """Names the first file of ``folder`` that does not unpickle to a batch or metadata dict."""
    for name in _file_names(source):
        try:
            with open(folder / name, "rb") as file:
                entry = pickle.load(file, encoding="latin1")
            keys = {source.meta["key"]} if name == source.meta["filename"] else {"data"}
            if not isinstance(entry, dict) or not keys <= entry.keys():
                raise KeyError(f"no {', '.join(sorted(keys))} in it")
        except Exception as problem:  # whatever unpickling garbage raises
            return f"{folder / name} cannot be read ({type(problem).__name__}: {problem})"
    return f"A file of {folder} cannot be read ({type(error).__name__}: {error})"
