"""scikit-learn's 8×8 handwritten digits, prepared like FedProx's MNIST (Li et al., 2020)

The 1,797 images (UCI "Optical Recognition of Handwritten Digits", shipped with scikit-learn, so no
download is needed) are real data small enough for CPU tests and benchmarks. As FedProx does for
MNIST, the pool is standardised per pixel; pixels that are constant over the pool (the corners) have
no scale and stay 0. Pair with :class:`~fedlight.data.partition.PowerLaw` (e.g. 100 clients,
``base_samples=2``) for a small MNIST-style federation.
"""

from __future__ import annotations

import numpy as np
import torch

from fedlight.data.base import FederatedDataset, LabelledTensors


class Digits(FederatedDataset):
    """scikit-learn's handwritten digits: ``[N, 1, 8, 8]`` per-pixel standardised images, 10 classes.

    There are no natural clients and no separate test set.
    """

    num_classes = 10
    input_shape = (1, 8, 8)

    def load_train(self) -> LabelledTensors:
        """Loads and standardises all 1,797 images."""
        from sklearn.datasets import load_digits  # here: scikit-learn's import is slower than the data

        images, labels = load_digits(return_X_y=True)  # [N, 64] with values 0..16, [N]
        mean, std = images.mean(axis=0), images.std(axis=0)
        standardised = np.divide(images - mean, std, out=np.zeros_like(images), where=std > 0)
        return LabelledTensors(
            inputs=torch.from_numpy(standardised).float().reshape(-1, *self.input_shape),
            targets=torch.from_numpy(labels).long(),
        )
