"""CINIC-10 (Darlow et al. 2018): CIFAR-10's classes with downsampled ImageNet images added, 32×32 PNGs.

The official archive unpacks to ``<root>/{train,valid,test}/<class>/*.png``, 90,000 images per split.
The FedSLS paper uses 90K training and 90K test images: ``train`` is the pool partitioned over
the clients and ``test`` the global test set; ``valid`` is unused unless ``train_splits`` adds it. Classes
are numbered in sorted folder order, which is CIFAR-10's (airplane … truck). Images are ``[N, 3, 32, 32]``
uint8, decoded once and cached (:mod:`fedlight.data.readers.image_files`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.datasets.download import fetch_archive
from fedlight.data.readers.image_files import cached_images, class_folder_images
from fedlight.errors import ConfigError

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
_URL = "https://datashare.ed.ac.uk/bitstream/handle/10283/3192/CINIC-10.tar.gz"
_MD5 = "6ee4d0c996905fe93221de577967a372"  # the archive unpacks to train/, valid/ and test/
#: images in each class folder of each split, as published
IMAGES_PER_CLASS = 9000


class CINIC10(FederatedDataset):
    """CINIC-10 from its folder layout: 10 classes, ``[N, 3, 32, 32]`` uint8 images.

    Args:
        root: the folder holding ``train/``, ``valid/`` and ``test/``.
        train_splits: the splits pooled for the clients (``[train]``: the paper's 90K images;
            ``[train, valid]`` gives 180K).
        cache: keep the decoded splits in ``<root>/.fedlight_cache/`` for the next load.
        download: fetch the archive from the University of Edinburgh's DataShare (MD5 checked) and unpack it
            into ``root`` when a split's folders are missing.
        subset: read whatever images the class folders hold. By default every class folder of a split read must
            hold its published 9,000 images, so that an archive unpacked part-way (a run killed during the
            270,000-file extraction leaves every folder present and images missing) is refused, not trained on.
    """

    num_classes = 10
    input_shape = (3, 32, 32)

    def __init__(
        self,
        root: str = "data/cinic10",
        train_splits: tuple[str, ...] = ("train",),
        cache: bool = True,
        download: bool = False,
        subset: bool = False,
    ) -> None:
        self.root = root
        self.train_splits = tuple(train_splits)
        self.cache = cache
        self.download = download
        self.subset = subset

    def load_train(self) -> LabelledTensors:
        """The pooled training splits, class by class in sorted file order."""
        parts = [self._read(split) for split in self.train_splits]
        return LabelledTensors(torch.cat([p.inputs for p in parts]), torch.cat([p.targets for p in parts]))

    def load_test(self) -> LabelledTensors:
        """The 90,000 test images."""
        return self._read("test")

    def _read(self, split: str) -> LabelledTensors:
        root = Path(self.root)
        folders = [root / split / name for name in CLASSES]
        missing = [str(f) for f in folders if not f.is_dir()]
        if missing and self.download:
            fetch_archive("CINIC-10", _URL, _MD5, root, done=lambda: all(f.is_dir() for f in folders))
            missing = [str(f) for f in folders if not f.is_dir()]
        if missing:
            raise ConfigError(
                f"CINIC-10 was not found under --data.dataset.init_args.root={self.root}: missing "
                f"{', '.join(missing)}. Download {_URL} and extract it so that "
                f"{root}/{{train,valid,test}}/<class>/*.png exist, or set --data.dataset.init_args.download=true."
            )
        paths, labels, problems = [], [], []
        for label, folder in enumerate(folders):
            files, wrong = class_folder_images(folder, ".png", "CINIC-10", None if self.subset else IMAGES_PER_CLASS)
            problems += wrong
            paths += files
            labels += [label] * len(files)
        if problems:
            raise ConfigError(
                *problems,
                f"Give every file of {root}/{{train,valid,test}}/<class>/ its original name, or extract {_URL} into "
                f"{root}/ again.",
            )
        images = cached_images(root, split, paths, (32, 32), self.cache, source=_URL)
        return LabelledTensors(images, torch.tensor(labels, dtype=torch.int64))
