"""MNIST prepared as in FedProx (Li et al., 2020, ``litian96/FedProx:data/mnist/generate_niid.py``)

The 60,000 training and 10,000 test images are pooled into one set of 70,000, since FedProx and the
prototype-margin paper split every client 80/20 instead of using MNIST's test set. Each pixel is
standardised over the pool as FedProx does, ``x ← (x − μ) / (σ + 0.001)`` on the 0–255 scale, so that
pixels constant over the pool (the borders) become 0 rather than NaN. Pair with
:class:`~fedlight.data.partition.PowerLaw` (1000 clients, 2 classes each, 5 base samples), which reads
each class in pool order as FedProx does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torchvision.datasets import MNIST as TorchvisionMNIST

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.datasets.download import through_torchvision
from fedlight.errors import ConfigError

# FedProx adds this to the per-pixel standard deviation (0–255 scale) before dividing.
_STD_EPS = 0.001


class MNIST(FederatedDataset):
    """MNIST's 70,000 pooled images as ``[N, 1, 28, 28]`` float32, 10 classes, no natural clients.

    Reads the four uncompressed IDX files that ``torchvision.datasets.MNIST`` keeps in ``<root>/MNIST/raw/``;
    nothing is read (or downloaded) before :meth:`load_train`.

    Args:
        root: Folder holding ``MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``.
        standardize: Standardise every pixel over the pool as FedProx does; otherwise scale to [0, 1].
        download: fetch missing files through torchvision (its mirrors, each file's MD5 checked) first.
    """

    num_classes = 10
    input_shape = (1, 28, 28)

    def __init__(self, root: str = "data/mnist", standardize: bool = True, download: bool = False) -> None:
        self.root = root
        self.standardize = standardize
        self.download = download

    def load_train(self) -> LabelledTensors:
        """Loads the training then the test images, in file order, as one pool."""
        splits = [_read_split(self.root, train, self.download) for train in (True, False)]
        # float64 sums of 0..255 over 70k images are exact, so constant pixels standardise to exactly 0
        images = torch.cat([data for data, _ in splits]).double()  # [70000, 28, 28], 0..255
        targets = torch.cat([labels for _, labels in splits]).long()
        if self.standardize:
            std, mean = torch.std_mean(images, dim=0, correction=0)
            images = (images - mean) / (std + _STD_EPS)
        else:
            images = images / 255.0
        return LabelledTensors(inputs=images.float().unsqueeze(1), targets=targets)


def _read_split(root: str, train: bool, download: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns one split's ``[N, 28, 28]`` uint8 images and ``[N]`` labels, or raises a :class:`ConfigError`."""
    raw = Path(root) / "MNIST" / "raw"
    kind = "train" if train else "t10k"
    files = [raw / f"{prefix}-{part}-ubyte" for prefix in ("train", "t10k") for part in ("images-idx3", "labels-idx1")]
    fix = (
        "Replace it with MNIST's original file (uncompressed), or delete it and set "
        "--data.dataset.init_args.download=true."
    )
    split_files = [(raw / f"{kind}-images-idx3-ubyte", 3), (raw / f"{kind}-labels-idx1-ubyte", 1)]
    check_idx_files(split_files, root, fix)
    split = through_torchvision(
        lambda: TorchvisionMNIST(root, train=train, download=download),
        "MNIST",
        TorchvisionMNIST.mirrors,
        root,
        raw,
        download,
        missing="put the four uncompressed files train-images-idx3-ubyte, train-labels-idx1-ubyte, "
        f"t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte into {raw}/.",
        expected=files,
    )
    if download:
        check_idx_files(split_files, root, fix)  # files fetched just now were not checked above
    return split.data, split.targets


def idx_problem(path: Path, ndim: int) -> str | None:
    """What is wrong with ``path`` as an uncompressed uint8 IDX file of ``ndim`` dimensions, or None when nothing is.

    The format (LeCun's MNIST page): bytes 0, 0, 0x08 (uint8) and the number of dimensions, each dimension's size as
    a big-endian 32-bit integer, then the values. Only the header and the file's size are read.
    """
    with open(path, "rb") as file:
        header = file.read(4 + 4 * ndim)
    if header[:2] == b"\x1f\x8b":
        return f"{path} is gzip-compressed: unpack it (gunzip) in place, keeping this name without .gz"
    if len(header) < 4 + 4 * ndim or header[:4] != bytes([0, 0, 0x08, ndim]):
        return f"{path} does not start with the header of a {ndim}-dimensional uint8 IDX file"
    sizes = [int.from_bytes(header[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    expected = len(header) + int(np.prod(sizes))
    actual = path.stat().st_size
    if actual != expected:
        shape = "×".join(map(str, sizes))
        return (
            f"{path} holds {actual} bytes, but its header announces {shape} values ({expected} bytes): it is cut "
            "short or damaged"
        )
    return None


def check_idx_files(files: list[tuple[Path, int]], root: str, fix: str) -> None:
    """Raises one :class:`ConfigError` naming each present file of ``(path, ndim)`` that is not a valid IDX file,
    or whose number of items differs from the other files' (images and their labels)."""
    problems = [problem for path, ndim in files if path.is_file() and (problem := idx_problem(path, ndim))]
    present = [path for path, _ in files if path.is_file()]
    if not problems and len(present) == len(files):
        counts = {path: _first_size(path) for path in present}
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"{path} holds {count}" for path, count in counts.items())
            problems = [f"The IDX files of one split hold different numbers of items ({listed})"]
    if problems:
        raise ConfigError(*(f"{problem} (under --data.dataset.init_args.root={root})." for problem in problems), fix)


def _first_size(path: Path) -> int:
    """The number of items of an IDX file: its first dimension."""
    with open(path, "rb") as file:
        return int.from_bytes(file.read(8)[4:8], "big")
