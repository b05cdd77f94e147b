"""CIFAR-10 and CIFAR-100 (Krizhevsky 2009) from torchvision's files, as the FedSLS paper uses them.

The 50,000 training images are the pool partitioned over the clients (the MOON-style
:class:`~fedlight.data.partition.Dirichlet`); the 10,000 test images are the global test set.
Images stay ``[N, 3, 32, 32]`` uint8 in memory (150 MB for a pool, a quarter of float32); the ResNet
models standardise them (:class:`~fedlight.models.resnet.ResNet`).
"""

from __future__ import annotations

import torch
from torchvision.datasets import CIFAR10 as TorchvisionCIFAR10
from torchvision.datasets import CIFAR100 as TorchvisionCIFAR100

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.datasets.download import through_torchvision


class CIFAR10(FederatedDataset):
    """CIFAR-10: 10 classes, ``[N, 3, 32, 32]`` uint8 images, a separate 10,000-image test set.

    Args:
        root: the folder holding ``cifar-10-batches-py/`` (what ``torchvision.datasets.CIFAR10(root,
            download=True)`` leaves there).
        download: fetch the archive through torchvision (its MD5 and every batch file's checked) when missing.
    """

    num_classes = 10
    input_shape = (3, 32, 32)
    _torchvision = TorchvisionCIFAR10
    _folder = "cifar-10-batches-py"

    def __init__(self, root: str = "data/cifar10", download: bool = False) -> None:
        self.root = root
        self.download = download

    def load_train(self) -> LabelledTensors:
        """The 50,000 training images, in file order."""
        return self._read(train=True)

    def load_test(self) -> LabelledTensors:
        """The 10,000 test images."""
        return self._read(train=False)

    def _read(self, train: bool) -> LabelledTensors:
        source = self._torchvision
        split = through_torchvision(
            lambda: source(self.root, train=train, download=self.download),
            source.__name__,
            [source.url],
            self.root,
            self.root,
            self.download,
            missing=f"download {source.url} and extract it into {self.root}/ (it unpacks to {self._folder}/).",
        )
        images = torch.from_numpy(split.data).permute(0, 3, 1, 2).contiguous()  # [N, 32, 32, 3] → [N, 3, 32, 32]
        return LabelledTensors(inputs=images, targets=torch.tensor(split.targets, dtype=torch.int64))


class CIFAR100(CIFAR10):
    """CIFAR-100 with its 100 fine classes; otherwise as :class:`CIFAR10`.

    Args:
        root: the folder holding ``cifar-100-python/`` (what ``torchvision.datasets.CIFAR100(root,
            download=True)`` leaves there).
        download: fetch the archive through torchvision (its MD5 and every file's checked) when missing.
    """

    num_classes = 100
    _torchvision = TorchvisionCIFAR100
    _folder = "cifar-100-python"

    def __init__(self, root: str = "data/cifar100", download: bool = False) -> None:
        super().__init__(root, download)
