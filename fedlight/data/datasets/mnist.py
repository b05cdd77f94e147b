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

import torch
from torchvision.datasets import MNIST as TorchvisionMNIST

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.datasets.download import through_torchvision

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
    split = through_torchvision(
        lambda: TorchvisionMNIST(root, train=train, download=download),
        "MNIST",
        TorchvisionMNIST.mirrors,
        root,
        raw,
        download,
        missing="put the four uncompressed files train-images-idx3-ubyte, train-labels-idx1-ubyte, "
        f"t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte into {raw}/.",
    )
    return split.data, split.targets
