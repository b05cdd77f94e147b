"""Cityscapes for FUSS: 27 classes, clients made of whole training cities, five-crops (FUSS Table 1, Sec. 5.1).

Reads a local copy in the layout of the official archives (torchvision's ``Cityscapes``)::

    <root>/leftImg8bit/{train,val}/<city>/<city>_<seq>_<frame>_leftImg8bit.png
    <root>/gtFine/{train,val}/<city>/<city>_<seq>_<frame>_gtFine_labelIds.png

Classes are STEGO's 27: labelIds 7…33 renumbered 0…26, everything else void (255). The 18 training
cities make 18, 6 or 3 clients: one city each, or consecutive triples or sextuples of the list below, in
the order of the FUSS repository's README. Each training image gives five samples, the four corners and
the centre of size H/2 × W/2 (torchvision's ``five_crop``; sample 5·i + k is crop k of image i), each then
resized (shorter side, nearest) and centre-cropped to ``image_size`` as in STEGO. The validation cities
(frankfurt, lindau, munster; 500 images) are the global test set at ``test_size`` (320 in FUSS's evaluation).
Clients keep all their images: use ``--data.test_fraction=0``. Every image must have its labelIds file and every
labelIds file its image (a renamed or missing file is named when the cities are listed); a file that cannot be
decoded is named when it is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import torch

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.labels import CITYSCAPES_27, lookup_table
from fedlight.data.readers.stego_files import StegoImages, StegoLabels
from fedlight.errors import ConfigError

#: The 18 training cities, in the order FUSS's clients take them.
TRAIN_CITIES = (
    "aachen", "bochum", "bremen", "cologne", "darmstadt", "dusseldorf", "erfurt", "hamburg", "hanover", "jena",
    "krefeld", "monchengladbach", "stuttgart", "strasbourg", "tubingen", "ulm", "weimar", "zurich",
)  # fmt: skip
FIRST_CLASS_ID = 7  # labelId of "road", class 0
IMAGE_SUFFIX = "_leftImg8bit.png"
LABEL_SUFFIX = "_gtFine_labelIds.png"
_IMAGES_ZIP, _LABELS_ZIP = "leftImg8bit_trainvaltest.zip", "gtFine_trainvaltest.zip"
_DOWNLOAD = (
    f"Download {_IMAGES_ZIP} and {_LABELS_ZIP} from https://www.cityscapes-dataset.com/downloads/ (free account)"
)


def label_lookup() -> torch.Tensor:
    """labelId (0…255) → class: 7…33 → 0…26, everything else 255 (LADD's 19 classes map the same ids).

    >>> label_lookup()[[0, 6, 7, 33, 34]].tolist()
    [255, 255, 0, 26, 255]
    """
    return lookup_table({FIRST_CLASS_ID + k: k for k in range(27)})


class CityscapesFUSS(FederatedDataset):
    """Cityscapes' fine training images split by city into FUSS's clients, validation cities as the test set.

    Args:
        root: the folder holding ``leftImg8bit/`` and ``gtFine/``.
        num_clients: 18 (one city each), 6 (triples) or 3 (sextuples).
        five_crop: five samples per training image (FUSS's); ``false``: the whole image.
        image_size: side S of the training samples (224).
        test_size: side of the test images (320, FUSS's evaluation).
        num_workers: threads decoding a batch.
    """

    num_classes = 27
    class_names = CITYSCAPES_27

    def __init__(
        self,
        root: str = "data/cityscapes",
        num_clients: Literal[3, 6, 18] = 3,
        five_crop: bool = True,
        image_size: int = 224,
        test_size: int = 320,
        num_workers: int = 4,
    ) -> None:
        if num_clients not in (3, 6, 18):
            raise ConfigError(f"Expected --data.dataset.init_args.num_clients 3, 6 or 18 (FUSS), got {num_clients}.")
        self.root, self.num_clients, self.five_crop = Path(root), num_clients, five_crop
        self.image_size, self.test_size, self.num_workers = image_size, test_size, num_workers
        self.input_shape = (3, image_size, image_size)

    def load_train(self) -> LabelledTensors:
        pairs, cities = self._pairs("train", TRAIN_CITIES)
        crops = range(5) if self.five_crop else [None]
        images = [(image, k) for image, _ in pairs for k in crops]
        labels = [(label, k) for _, label in pairs for k in crops]
        per_client = len(TRAIN_CITIES) // self.num_clients
        groups = np.repeat(np.array([TRAIN_CITIES.index(c) // per_client for c in cities]), len(crops))
        return LabelledTensors(
            StegoImages(images, self.image_size, self.num_workers, _IMAGES_ZIP),
            StegoLabels(labels, self.image_size, label_lookup(), self.num_workers, _LABELS_ZIP),
            groups=groups,
            labels=np.zeros(len(images), dtype=np.int64),  # partitioned by city, not by class
        )

    def load_test(self) -> LabelledTensors:
        folder = self.root / "leftImg8bit" / "val"
        cities = sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
        pairs, _ = self._pairs("val", cities or ["frankfurt", "lindau", "munster"])
        return LabelledTensors(
            StegoImages([(image, None) for image, _ in pairs], self.test_size, self.num_workers, _IMAGES_ZIP),
            StegoLabels(
                [(label, None) for _, label in pairs], self.test_size, label_lookup(), self.num_workers, _LABELS_ZIP
            ),
        )

    def _pairs(self, split: str, cities) -> tuple[list[tuple[Path, Path]], list[str]]:
        """(image, labelIds) file pairs of ``cities``, sorted, with each pair's city.

        Every image must have its labelIds file and every labelIds file its image, so that a renamed or
        missing file is reported here, by name, rather than silently shrinking a client.
        """
        missing = [
            str(folder)
            for city in cities
            for folder in (self.root / "leftImg8bit" / split / city, self.root / "gtFine" / split / city)
            if not folder.is_dir()
        ]
        if missing:
            raise ConfigError(
                f"Cityscapes is incomplete under --data.dataset.init_args.root={self.root}: missing "
                f"{', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}.",
                f"{_DOWNLOAD} and extract both there, so that "
                f"{self.root}/leftImg8bit/train/aachen and {self.root}/gtFine/train/aachen exist.",
            )
        pairs, owners, problems = [], [], []
        for city in cities:
            image_dir, label_dir = self.root / "leftImg8bit" / split / city, self.root / "gtFine" / split / city
            images = {p.name.removesuffix(IMAGE_SUFFIX): p for p in image_dir.glob(f"*{IMAGE_SUFFIX}")}
            labels = {p.name.removesuffix(LABEL_SUFFIX): p for p in label_dir.glob(f"*{LABEL_SUFFIX}")}
            if not images and not labels:
                problems.append(f"{image_dir} holds no *{IMAGE_SUFFIX} images.")
            problems += [
                f"{labels[stem]} has no image: expected {image_dir / (stem + IMAGE_SUFFIX)}."
                for stem in sorted(labels.keys() - images.keys())
            ]
            problems += [
                f"Cityscapes image {images[stem]} has no labels: expected {label_dir / (stem + LABEL_SUFFIX)}."
                for stem in sorted(images.keys() - labels.keys())
            ]
            for stem in sorted(images.keys() & labels.keys()):
                pairs.append((images[stem], labels[stem]))
                owners.append(city)
        if problems:
            shown = problems[:8] + ([f"… and {len(problems) - 8} more."] if len(problems) > 8 else [])
            raise ConfigError(
                *shown,
                f"Restore these files under --data.dataset.init_args.root={self.root} with the archives' file names "
                f"({_DOWNLOAD} and extract both there again).",
            )
        return pairs, owners
