"""FEMNIST as FedProx samples it (Li et al., 2020, ``litian96/FedProx:data/nist/data/my_sample.py``)

FedProx keeps the ten lower-case letters a–j of NIST's by_class images (class ids 36–45) and draws
4000 random images of each. Here the images come from EMNIST "byclass", the 28×28 release of the
same NIST images, read through ``torchvision.datasets.EMNIST``; its training and test splits are
pooled before sampling. Pixels are scaled to [0, 1] as in FedProx. Pair with
:class:`~fedlight.data.partition.FEMNISTPartition` for FedProx's 200 users.

Orientation: EMNIST stores every image transposed (column-major), and torchvision returns it as
stored, so a letter read through ``EMNIST`` appears mirrored and rotated by 90°. The images are
transposed back here so that letters are upright, as in MNIST and in FedProx's PNGs.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from torchvision.datasets import EMNIST

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.datasets.download import through_torchvision
from fedlight.data.datasets.mnist import check_idx_files
from fedlight.errors import ConfigError

# EMNIST byclass labels: digits 0–9, upper-case A–Z 10–35, lower-case a–z 36–61; a–j are 36–45.
_FIRST_LETTER, _NUM_LETTERS = 36, 10


class FEMNIST(FederatedDataset):
    """The letters a–j of EMNIST byclass, ``images_per_class`` random images each, as ``[N, 1, 28, 28]`` in [0, 1].

    A letter with fewer images keeps all of them, with a warning, as FedProx's ``[:4000]`` slice does.
    Labels are relabelled 0–9 (a = 0, …, j = 9). The pool is ordered by class, each class in random
    order; there are no natural clients and no separate test set. Nothing is read before
    :meth:`load_train`.

    Args:
        root: Folder holding ``EMNIST/raw/emnist-byclass-{train,test}-{images-idx3,labels-idx1}-ubyte``,
            as ``torchvision.datasets.EMNIST(root, split="byclass")`` expects them.
        images_per_class: Images drawn without replacement from each letter (FedProx: 4000).
        seed: Seed of the draw; one seed gives one pool.
        download: fetch NIST's ``gzip.zip`` (every EMNIST split) through torchvision, its MD5 checked, when
            the files are missing.
    """

    num_classes = _NUM_LETTERS
    input_shape = (1, 28, 28)

    def __init__(
        self, root: str = "data/emnist", images_per_class: int = 4000, seed: int = 0, download: bool = False
    ) -> None:
        if images_per_class < 1:
            raise ConfigError(f"Expected --data.dataset.init_args.images_per_class >= 1, got {images_per_class}.")
        self.root = root
        self.images_per_class = images_per_class
        self.seed = seed
        self.download = download

    def load_train(self) -> LabelledTensors:
        """Reads both EMNIST byclass splits and samples ``images_per_class`` images of every letter a–j."""
        image_parts, label_parts = [], []
        for train in (True, False):
            data, targets = _read_split(self.root, train, self.download)
            # keep only a–j at once: byclass holds 814k images, 0.6 GB as uint8
            is_letter = (targets >= _FIRST_LETTER) & (targets < _FIRST_LETTER + _NUM_LETTERS)
            image_parts.append(data[is_letter])  # [n, 28, 28] uint8, transposed
            label_parts.append(targets[is_letter] - _FIRST_LETTER)
        images, labels = torch.cat(image_parts), torch.cat(label_parts).numpy()
        rng = np.random.default_rng(self.seed)
        chosen, short = [], []
        for letter in range(_NUM_LETTERS):
            members = np.flatnonzero(labels == letter)
            if members.size < self.images_per_class:
                short.append(f"'{chr(ord('a') + letter)}' has {members.size}")
            chosen.append(rng.choice(members, size=min(members.size, self.images_per_class), replace=False))
        if short:
            # FedProx's slice [:4000] silently keeps fewer; say so
            warnings.warn(
                f"EMNIST byclass under {self.root} has fewer than images_per_class={self.images_per_class} images of "
                f"some letters ({', '.join(short)}); all of those are used.",
                stacklevel=2,
            )
        index = torch.from_numpy(np.concatenate(chosen))
        upright = images[index].transpose(1, 2)  # undo EMNIST's column-major storage
        return LabelledTensors(
            inputs=upright.unsqueeze(1).float() / 255.0,
            targets=torch.from_numpy(labels[index.numpy()]).long(),
        )


def _read_split(root: str, train: bool, download: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns one byclass split's ``[N, 28, 28]`` uint8 images and ``[N]`` labels, or raises a :class:`ConfigError`."""
    raw = Path(root) / "EMNIST" / "raw"
    files = [
        raw / f"emnist-byclass-{split}-{part}-ubyte"
        for split in ("train", "test")
        for part in ("images-idx3", "labels-idx1")
    ]
    prefix = f"emnist-byclass-{'train' if train else 'test'}"
    split_files = [(raw / f"{prefix}-images-idx3-ubyte", 3), (raw / f"{prefix}-labels-idx1-ubyte", 1)]
    fix = (
        "Replace it with the uncompressed file of NIST's gzip.zip, or delete it and set "
        "--data.dataset.init_args.download=true."
    )
    check_idx_files(split_files, root, fix)
    split = through_torchvision(
        lambda: EMNIST(root, split="byclass", train=train, download=download),
        "EMNIST byclass",
        [EMNIST.url],
        root,
        raw,
        download,
        missing="put the four uncompressed files emnist-byclass-train-images-idx3-ubyte, "
        "emnist-byclass-train-labels-idx1-ubyte, emnist-byclass-test-images-idx3-ubyte and "
        f"emnist-byclass-test-labels-idx1-ubyte (from NIST's gzip.zip) into {raw}/.",
        expected=files,
    )
    if download:
        check_idx_files(split_files, root, fix)  # files fetched just now were not checked above
    return split.data, split.targets
