"""CocoStuff-27 for FUSS: STEGO's curated images, 27 coarse classes, dominant-label Dirichlet clients (Sec. 5.1.2).

Reads a local copy in STEGO's layout::

    <root>/images/{train2017,val2017}/<id>.jpg
    <root>/annotations/{train2017,val2017}/<id>.png       stuff+thing maps: fine labels 0…181, 255 void
    <root>/curated/train2017/Coco164kFull_Stuff_Coarse.txt      the training list (~49k ids; FUSS's ~12.4k)
    <root>/curated/val2017/Coco164kFull_Stuff_Coarse_7.txt      the validation list

Fine labels map to STEGO's 27 coarse classes (FINE_TO_COARSE). Every training image's *dominant label*
is its most frequent coarse class (FUSS Eq. 22), computed once from the full-size masks and cached next to
the data with its digest (a damaged cache is computed again); partition by it with
Dirichlet(num_clients=18, alpha=0.5), or pass FUSS's own client lists (client_lists: a folder of
train_MA18__client<k>.txt) for its exact clients. Images are resized
(shorter side, nearest) and centre-cropped to image_size (FUSS: no crops for CocoStuff), test images to
test_size. Every listed id must have its image and its map (a missing one is named when the list is read); a
file that cannot be decoded is named when it is read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.labels import COCOSTUFF_27_CLASSES, IGNORE_INDEX
from fedlight.data.readers.stego_files import StegoImages, StegoLabels, map_files, read_label
from fedlight.errors import ConfigError

log = logging.getLogger(__name__)
_MAPS_ZIP = "stuffthingmaps_trainval2017.zip"
_DOWNLOAD = (
    "Download COCO 2017 images (train2017.zip, val2017.zip from https://cocodataset.org) and the stuff+thing maps "
    "(stuffthingmaps_trainval2017.zip from https://github.com/nightrome/cocostuff)"
)

#: STEGO's map of CocoStuff's 182 fine labels to 27 coarse classes (index = fine label).
FINE_TO_COARSE = (
    9, 11, 11, 11, 11, 11, 11, 11, 11, 8, 8, 8, 8, 8, 8, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 6, 6, 6, 6, 6, 6, 6, 6, 10,
    10, 10, 10, 10, 10, 10, 10, 10, 10, 5, 5, 5, 5, 5, 5, 5, 5, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    3, 3, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 4, 4, 4, 4, 4, 4, 4, 4, 17, 17, 22, 20, 20, 22, 15, 25, 16, 13, 12, 12,
    17, 17, 23, 15, 15, 17, 15, 21, 15, 25, 13, 13, 13, 13, 13, 22, 26, 14, 14, 15, 22, 21, 21, 24, 20, 22, 15, 17,
    16, 15, 22, 24, 21, 17, 25, 16, 21, 17, 22, 16, 21, 21, 25, 21, 26, 21, 24, 20, 17, 14, 21, 26, 15, 23, 20, 21,
    24, 15, 24, 22, 25, 15, 20, 17, 17, 22, 14, 18, 18, 18, 18, 18, 18, 18, 26, 26, 19, 19, 24,
)  # fmt: skip


def coarse_lookup() -> torch.Tensor:
    """Fine label (0…255) → coarse class, 255 for void and unused values.

    >>> coarse_lookup()[[0, 1, 181, 182, 255]].tolist()
    [9, 11, 24, 255, 255]
    """
    lookup = torch.full((256,), IGNORE_INDEX, dtype=torch.int64)
    lookup[: len(FINE_TO_COARSE)] = torch.tensor(FINE_TO_COARSE)
    return lookup


class CocoStuff27(FederatedDataset):
    """STEGO's curated CocoStuff images with 27 coarse classes; dominant labels for non-IID partitions.

    Args:
        root: the folder holding images/, annotations/ and curated/.
        train_list: the curated training list under curated/train2017/.
        test_list: the curated validation list under curated/val2017/.
        client_lists: a folder of FUSS's train_MA18__client<k>.txt files; their clients become the
            natural clients (use the Natural partitioner). null: partition by dominant label.
        image_size: side S of the training images (224).
        test_size: side of the test images (320).
        num_workers: threads decoding a batch.
    """

    num_classes = 27
    class_names = COCOSTUFF_27_CLASSES

    def __init__(
        self,
        root: str = "data/cocostuff",
        train_list: str = "Coco164kFull_Stuff_Coarse.txt",
        test_list: str = "Coco164kFull_Stuff_Coarse_7.txt",
        client_lists: str | None = None,
        image_size: int = 224,
        test_size: int = 320,
        num_workers: int = 4,
    ) -> None:
        self.root, self.train_list, self.test_list = Path(root), train_list, test_list
        self.client_lists = None if client_lists is None else Path(client_lists)
        self.image_size, self.test_size, self.num_workers = image_size, test_size, num_workers
        self.input_shape = (3, image_size, image_size)

    def load_train(self) -> LabelledTensors:
        ids = self._ids("train2017", self.train_list)
        groups = None
        if self.client_lists is not None:
            ids, groups = self._client_ids()
        labels = self._dominant_labels(ids)
        return self._pool(ids, "train2017", self.image_size, groups, labels)

    def load_test(self) -> LabelledTensors:
        return self._pool(self._ids("val2017", self.test_list), "val2017", self.test_size, None, None)

    def _pool(self, ids, split, size, groups, labels) -> LabelledTensors:
        images = [(self.root / "images" / split / f"{i}.jpg", None) for i in ids]
        masks = [(self.root / "annotations" / split / f"{i}.png", None) for i in ids]
        return LabelledTensors(
            StegoImages(images, size, self.num_workers, f"COCO's {split}.zip"),
            StegoLabels(masks, size, coarse_lookup(), self.num_workers, _MAPS_ZIP),
            groups=groups,
            labels=labels,
        )

    def _ids(self, split: str, listing: str) -> list[str]:
        path = self.root / "curated" / split / listing
        missing = [
            str(p) for p in (path, self.root / "images" / split, self.root / "annotations" / split) if not p.exists()
        ]
        if missing:
            raise ConfigError(
                f"CocoStuff is incomplete under --data.dataset.init_args.root={self.root}: "
                f"missing {', '.join(missing)}.",
                f"{_DOWNLOAD} into {self.root}/images/ and {self.root}/annotations/, and STEGO's curated lists into "
                f"{self.root}/curated/ (as STEGO's download_datasets.py lays them out).",
            )
        ids = _read_list(path, "STEGO's curated lists (its download_datasets.py)")
        self._check_files(split, ids, path)
        return ids

    def _check_files(self, split: str, ids: list[str], listing: Path) -> None:
        """Every listed image and its label map must be there: a missing one is named now, not mid-training."""
        expected = [
            path
            for image_id in ids
            for path in (
                self.root / "images" / split / f"{image_id}.jpg",
                self.root / "annotations" / split / f"{image_id}.png",
            )
        ]
        present = {
            folder: {entry.name for entry in os.scandir(folder)}
            for folder in (self.root / "images" / split, self.root / "annotations" / split)
        }
        missing = [path for path in expected if path.name not in present[path.parent]]
        if missing:
            shown = ", ".join(map(str, missing[:4])) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            raise ConfigError(
                f"{listing} lists files that are missing: {shown}.",
                f"Restore them with the archives' file names, or list only the images you have. {_DOWNLOAD}.",
            )

    def _client_ids(self) -> tuple[list[str], np.ndarray]:
        files = sorted(self.client_lists.glob("*client*.txt"), key=lambda p: int(p.stem.rsplit("client", 1)[1]))
        if not files:
            raise ConfigError(
                f"--data.dataset.init_args.client_lists={self.client_lists} holds no train_MA18__client<k>.txt; "
                "copy FUSS's partitioned_splits there, or set it to null to partition by dominant label."
            )
        ids, groups = [], []
        for client, path in enumerate(files):
            listed = _read_list(path, "FUSS's partitioned_splits")
            self._check_files("train2017", listed, path)
            ids += listed
            groups += [client] * len(listed)
        return ids, np.array(groups)

    def _dominant_labels(self, ids: list[str]) -> np.ndarray:
        """Each image's most frequent coarse class (Eq. 22), cached as JSON next to the annotations."""
        cache = self.root / "fedlight_dominant_labels_train2017.json"
        known = _read_dominant_labels(cache) if cache.is_file() else {}
        todo = [i for i in ids if i not in known]
        if todo:
            lookup = coarse_lookup()

            def dominant(image_id: str) -> int:
                labels = read_label(self.root / "annotations" / "train2017" / f"{image_id}.png", lookup, _MAPS_ZIP)
                counts = torch.bincount(labels[labels != IGNORE_INDEX], minlength=27)
                return int(counts.argmax())

            known |= dict(zip(todo, map_files(dominant, todo, self.num_workers), strict=True))
            try:
                tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
                tmp.write_text(json.dumps({"labels": known, "digest": _labels_digest(known)}))
                os.replace(tmp, cache)
            except OSError:  # a read-only dataset folder: the masks are read again next time
                pass
        return np.array([known[i] for i in ids], dtype=np.int64)


def _read_list(path: Path, source: str) -> list[str]:
    """The image ids of a list file, one a line; a file that is not text is named with where to get it again."""
    try:
        return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"{path} cannot be read as a list of image ids ({type(error).__name__}): the file is damaged. Restore it "
            f"again from {source} and run again."
        ) from error


def _labels_digest(labels: dict[str, int]) -> str:
    return hashlib.blake2b(json.dumps(labels, sort_keys=True).encode(), digest_size=16).hexdigest()


def _read_dominant_labels(cache: Path) -> dict[str, int]:
    """The dominant labels a cache file holds if it matches its digest and every label is a coarse class; else
    nothing (with a warning naming the file), so that they are computed again from the masks."""
    try:
        stored = json.loads(cache.read_text())
        labels, digest = stored["labels"], stored["digest"]
        valid = all(isinstance(c, int) and 0 <= c < len(COCOSTUFF_27_CLASSES) for c in labels.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        labels, digest, valid = {}, None, False
    if valid and _labels_digest(labels) == digest:
        return labels
    log.warning("%s is damaged or has no digest: the dominant labels are computed again from the masks", cache)
    return {}
