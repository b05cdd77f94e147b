"""TinyImageNet (Stanford CS231n): 200 ImageNet classes at 64×64, the FedSLS paper's ResNet-50 benchmark.

The official archive ``tiny-imagenet-200.zip`` unpacks to::

    <root>/wnids.txt                              the 200 class ids (WordNet ids)
    <root>/train/<wnid>/images/*.JPEG             500 training images per class
    <root>/val/images/*.JPEG                      10,000 labelled validation images
    <root>/val/val_annotations.txt                "<file>\\t<wnid>\\t<box>" per validation image

The 100,000 training images are the pool partitioned over the clients; the 10,000 validation images are
the global test set (the official test images have no labels). Classes are numbered in sorted wnid
order, as ``torchvision.datasets.ImageFolder`` numbers ``train/``. Images are ``[N, 3, 64, 64]`` uint8
(greyscale JPEGs expanded to RGB), decoded once and cached (:mod:`fedlight.data.readers.image_files`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.datasets.download import fetch_archive
from fedlight.data.readers.image_files import cached_images
from fedlight.errors import ConfigError

_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"
_FOLDER = "tiny-imagenet-200"  # what the archive unpacks to


class TinyImageNet(FederatedDataset):
    """TinyImageNet from its official folder layout: 200 classes, ``[N, 3, 64, 64]`` uint8 images.

    Args:
        root: the ``tiny-imagenet-200`` folder (holding ``wnids.txt``, ``train/`` and ``val/``).
        cache: keep the decoded splits in ``<root>/.fedlight_cache/`` for the next load.
        download: fetch the archive from Stanford's CS231n site (MD5 checked) and unpack it next to ``root``,
            which must then end in ``tiny-imagenet-200``, the folder the archive holds.
    """

    num_classes = 200
    input_shape = (3, 64, 64)

    def __init__(self, root: str = "data/tiny-imagenet-200", cache: bool = True, download: bool = False) -> None:
        if download and Path(root).name != _FOLDER:
            raise ConfigError(
                f"--data.dataset.init_args.download=true unpacks {_URL} into a folder named {_FOLDER}, but "
                f"--data.dataset.init_args.root={root} names another: set root to {Path(root) / _FOLDER}."
            )
        self.root = root
        self.cache = cache
        self.download = download

    def load_train(self) -> LabelledTensors:
        """The 100,000 training images, class by class in sorted file order."""
        root, classes = Path(self.root), self._classes()
        paths, labels = [], []
        for label, wnid in enumerate(classes):
            files = sorted((root / "train" / wnid / "images").glob("*.JPEG"))
            paths += files
            labels += [label] * len(files)
        return LabelledTensors(cached_images(root, "train", paths, (64, 64), self.cache), torch.tensor(labels))

    def load_test(self) -> LabelledTensors:
        """The 10,000 validation images, in annotation-file order."""
        root, classes = Path(self.root), self._classes()
        index = {wnid: label for label, wnid in enumerate(classes)}
        paths, labels = [], []
        for line in (root / "val" / "val_annotations.txt").read_text().splitlines():
            if line.strip():
                name, wnid = line.split("\t")[:2]
                paths.append(root / "val" / "images" / name)
                labels.append(index[wnid])
        return LabelledTensors(cached_images(root, "val", paths, (64, 64), self.cache), torch.tensor(labels))

    def _classes(self) -> list[str]:
        root = Path(self.root)
        needed = [root / "wnids.txt", root / "train", root / "val" / "val_annotations.txt"]
        missing = [str(p) for p in needed if not p.exists()]
        if missing and self.download:
            fetch_archive("TinyImageNet", _URL, _MD5, root.parent, done=lambda: all(p.exists() for p in needed))
            missing = [str(p) for p in needed if not p.exists()]
        if missing:
            raise ConfigError(
                f"TinyImageNet was not found under --data.dataset.init_args.root={self.root}: missing "
                f"{', '.join(missing)}. Download {_URL} and unzip it, then point root at its {_FOLDER}/ folder (or set "
                "--data.dataset.init_args.download=true)."
            )
        classes = sorted((root / "wnids.txt").read_text().split())
        if len(classes) != self.num_classes:
            raise ConfigError(
                f"{root / 'wnids.txt'} lists {len(classes)} classes, not {self.num_classes}: "
                f"--data.dataset.init_args.root={self.root} is not an intact TinyImageNet. Unzip {_URL} again."
            )
        return classes
