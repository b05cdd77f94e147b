"""TinyImageNet (Stanford CS231n): 200 ImageNet classes at 64×64, the FedSLS paper's ResNet-50 benchmark.

The official archive ``tiny-imagenet-200.zip`` unpacks to::

    <root>/wnids.txt                              the 200 class ids (WordNet ids), one per line
    <root>/words.txt                              "<wnid>\\t<words>" for every WordNet id (not read)
    <root>/train/<wnid>/images/<wnid>_<i>.JPEG    500 training images per class
    <root>/train/<wnid>/<wnid>_boxes.txt          "<file>\\t<box>" per training image (not read)
    <root>/val/images/val_<i>.JPEG                10,000 labelled validation images
    <root>/val/val_annotations.txt                "<file>\\t<wnid>\\t<box>" per validation image
    <root>/test/images/test_<i>.JPEG              10,000 unlabelled test images (not read)

The 100,000 training images are the pool partitioned over the clients; the 10,000 validation images are
the global test set (the official test images have no labels). Classes are numbered in sorted wnid
order, as ``torchvision.datasets.ImageFolder`` numbers ``train/``. Images are ``[N, 3, 64, 64]`` uint8
(greyscale JPEGs expanded to RGB), decoded once and cached (:mod:`fedlight.data.readers.image_files`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.datasets.download import fetch_archive, missing_files
from fedlight.data.readers.image_files import cached_images, class_folder_images
from fedlight.errors import ConfigError

_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
#: training images of each class and validation images in all, as published
TRAIN_PER_CLASS, VAL_IMAGES = 500, 10_000
_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"
_FOLDER = "tiny-imagenet-200"  # what the archive unpacks to


class TinyImageNet(FederatedDataset):
    """TinyImageNet from its official folder layout: 200 classes, ``[N, 3, 64, 64]`` uint8 images.

    Args:
        root: the ``tiny-imagenet-200`` folder (holding ``wnids.txt``, ``train/`` and ``val/``).
        cache: keep the decoded splits in ``<root>/.fedlight_cache/`` for the next load.
        download: fetch the archive from Stanford's CS231n site (MD5 checked) and unpack it next to ``root``,
            which must then end in ``tiny-imagenet-200``, the folder the archive holds.
        subset: read whatever images the folders hold. By default each class's training folder must hold its
            published 500 images and the validation set its 10,000, so that an archive unpacked part-way is
            refused, not trained on.
    """

    num_classes = 200
    input_shape = (3, 64, 64)

    def __init__(
        self, root: str = "data/tiny-imagenet-200", cache: bool = True, download: bool = False, subset: bool = False
    ) -> None:
        if download and Path(root).name != _FOLDER:
            raise ConfigError(
                f"--data.dataset.init_args.download=true unpacks {_URL} into a folder named {_FOLDER}, but "
                f"--data.dataset.init_args.root={root} names another: set root to {Path(root) / _FOLDER}."
            )
        self.root = root
        self.cache = cache
        self.download = download
        self.subset = subset

    def load_train(self) -> LabelledTensors:
        """The 100,000 training images, class by class in sorted file order."""
        root, classes = Path(self.root), self._classes()
        paths, labels, problems = [], [], []
        for label, wnid in enumerate(classes):
            folder = root / "train" / wnid / "images"
            if not folder.is_dir():
                problems.append(f"{folder} is missing, though {root / 'wnids.txt'} lists {wnid}.")
                continue
            published = None if self.subset else TRAIN_PER_CLASS
            files, wrong = class_folder_images(folder, ".JPEG", "TinyImageNet", published)
            problems += wrong
            paths += files
            labels += [label] * len(files)
        if problems:
            raise ConfigError(*problems[:10], self._again())
        images = cached_images(root, "train", paths, (64, 64), self.cache, source=_URL)
        return LabelledTensors(images, torch.tensor(labels))

    def load_test(self) -> LabelledTensors:
        """The 10,000 validation images, in annotation-file order."""
        root, classes = Path(self.root), self._classes()
        index = {wnid: label for label, wnid in enumerate(classes)}
        annotations = root / "val" / "val_annotations.txt"
        paths, labels = [], []
        for number, line in enumerate(_read_text(annotations, self._again()).splitlines(), start=1):
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) < 2 or fields[1] not in index:
                raise ConfigError(
                    f"Line {number} of {annotations} is not '<file>\\t<wnid>\\t<box>' with a wnid of "
                    f"{root / 'wnids.txt'}: {line[:80]!r}.",
                    self._again(),
                )
            paths.append(root / "val" / "images" / fields[0])
            labels.append(index[fields[1]])
        absent = missing_files(paths)
        if absent:
            raise ConfigError(
                *absent, f"Every image {annotations} lists must be in {root / 'val' / 'images'}/. " + self._again()
            )
        if not self.subset and len(paths) != VAL_IMAGES:
            raise ConfigError(
                f"{annotations} lists {len(paths):,} images, not TinyImageNet's {VAL_IMAGES:,}: the archive was "
                "unpacked part-way or the file changed (--data.dataset.init_args.subset=true reads it as it is).",
                self._again(),
            )
        images = cached_images(root, "val", paths, (64, 64), self.cache, source=_URL)
        return LabelledTensors(images, torch.tensor(labels))

    def _again(self) -> str:
        """How to restore a damaged or incomplete copy."""
        return f"Unzip {_URL} again and point --data.dataset.init_args.root at its {_FOLDER}/ folder."

    def _classes(self) -> list[str]:
        root = Path(self.root)
        needed = [root / "wnids.txt", root / "train", root / "val" / "val_annotations.txt"]
        missing = [str(p) for p in needed if not p.exists()]
        if missing and self.download:
            fetch_archive("TinyImageNet", _URL, _MD5, root.parent, done=lambda: all(p.exists() for p in needed))
            missing = [str(p) for p in needed if not p.exists()]
        if missing:
            renamed = missing_files([p for p in needed if p.suffix == ".txt"])  # a hint where a file was renamed
            raise ConfigError(
                f"TinyImageNet was not found under --data.dataset.init_args.root={self.root}: missing "
                f"{', '.join(missing)}. Download {_URL} and unzip it, then point root at its {_FOLDER}/ folder (or set "
                "--data.dataset.init_args.download=true).",
                *(line for line in renamed if " is there: " in line),
            )
        classes = sorted(_read_text(root / "wnids.txt", self._again()).split())
        if len(classes) != self.num_classes:
            raise ConfigError(
                f"{root / 'wnids.txt'} lists {len(classes)} classes, not {self.num_classes}: "
                f"--data.dataset.init_args.root={self.root} is not an intact TinyImageNet. Unzip {_URL} again."
            )
        return classes


def _read_text(path: Path, fix: str) -> str:
    """The text of one of the dataset's listing files, or a :class:`ConfigError` naming it when it is not text."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path} is not a text file ({error}): it is damaged.", fix) from error
