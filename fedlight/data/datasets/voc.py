"""Pascal VOC 2012 segmentation with one object class per image: MO-FedProto's FPascal benchmark.

Reads a local VOCdevkit in the layout of the official archive, optionally with the SBD "train_aug"
annotations in the layout DeepLab's training scripts use::

    <root>/VOC2012/JPEGImages/<id>.jpg
    <root>/VOC2012/SegmentationClass/<id>.png              official masks (palette PNGs)
    <root>/VOC2012/SegmentationClassAug/<id>.png           SBD + official masks (index PNGs), for train_aug
    <root>/VOC2012/ImageSets/Segmentation/{train,val,train_aug}.txt

Where only SBD's archive is unpacked (``<root>/SBD/benchmark_RELEASE/dataset/{cls/<id>.mat,train.txt,val.txt}``),
the train_aug masks and list are written from it on first use (:mod:`fedlight.data.datasets.voc_download`).
Every listed image must have its JPEG and its mask: one that is missing is named when the split is listed, one
that cannot be decoded when it is read, each as one :class:`~fedlight.errors.ConfigError`.

Step 1 of §6.5 keeps the images whose mask holds exactly one object class besides background and void
(about 6.6k of train_aug's 10,582; the paper reports 6,665). That class is the image's partition label,
so the VOC partition (:class:`~fedlight.data.partition.DirichletPowerLaw`, Pareto sizes with γ = 3 and
Dir(α·p) class mixes over 100 clients) applies as for classification. ``label_set="macro"`` remaps the
masks to MO-FedProto's 4 macro classes after the filter, so both variants share the identical partition.

The pool does not fit in memory as float32 (6.6k images of 500×375 are 15 GB), so images and masks are
:class:`~fedlight.data.base.LazySamples` that decode the JPEGs and PNGs of each batch on demand (threads:
Pillow releases the GIL) and place them top-left on a fixed ``canvas_size`` square: images ImageNet-
standardised with zero padding, masks padded with void (255). Batches therefore stack without per-sample
collation, the D11 augmentation acts on the whole canvas, and evaluation runs on the whole image, the
padding counting nowhere. The object classes found in each mask are cached next to the data
(``fedlight_voc_classes_<split>.json``), so the filter decodes the 10k masks only once.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from fedlight.data.base import FederatedDataset, LabelledTensors, LazySamples
from fedlight.data.datasets.voc_download import (
    SBD_URL,
    VOC_URL,
    build_train_aug,
    check_download_root,
    fetch_voc,
    read_mask,
    sbd_missing,
    sbd_unpacked,
)
from fedlight.data.labels import IGNORE_INDEX, VOC_CLASSES, LabelSet, class_names, macro_lookup
from fedlight.data.readers.stego_files import decode_file
from fedlight.errors import ConfigError

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_REBUILD = " (or delete it to have it written from SBD again)"
_MASK_DIRS = {"train_aug": "SegmentationClassAug", "train": "SegmentationClass", "val": "SegmentationClass"}


class PascalVOC(FederatedDataset):
    """Pascal VOC 2012 images with exactly one object class, as lazily read ``[3, S, S]`` canvases.

    Targets are ``[S, S]`` int64 label maps (0 background, 1–20 objects or 1–4 macro classes, 255 void and
    padding); partition labels are the object class (1–20) of each image. There are no natural clients.

    Args:
        root: the ``VOCdevkit`` folder, holding ``VOC2012/``.
        split: image list of the pool: ``train_aug`` (10,582 images, SBD + VOC; MO-FedProto's) or ``train``
            (VOC's own 1,464).
        label_set: ``fine`` (20 classes + background) or ``macro`` (4 + background, the same partition).
        single_class_only: keep only images with exactly one object class (§6.5 step 1); ``false`` keeps
            every image, partitioned by its most frequent object class.
        test_split: ``val`` adds VOC's 1,449 validation images, all of them, as a global test set; ``null``
            evaluates on the union of the clients' held-out 20% only, as the paper does.
        canvas_size: side S of the square canvas images are placed on; VOC images are at most 500 pixels,
            larger ones are shrunk to fit. Must be divisible by the model's output stride.
        num_workers: threads decoding a batch.
        download: fetch what is missing: VOC 2012 trainval (2 GB, unpacked next to ``root``, which must then be
            named ``VOCdevkit``) and, for ``train_aug``, SBD (1.4 GB), from which the split's masks and list are
            written (:mod:`fedlight.data.datasets.voc_download`). SBD already unpacked under ``<root>/SBD/`` is
            used as it is, with or without ``download``.
    """

    def __init__(
        self,
        root: str = "data/VOCdevkit",
        split: Literal["train_aug", "train"] = "train_aug",
        label_set: LabelSet = "fine",
        single_class_only: bool = True,
        test_split: Literal["val"] | None = None,
        canvas_size: int = 512,
        num_workers: int = 4,
        download: bool = False,
    ) -> None:
        if download:
            check_download_root(root)
        problems = []
        if canvas_size < 16:
            problems.append(f"Expected --data.dataset.init_args.canvas_size ≥ 16, got {canvas_size}.")
        if num_workers < 1:
            problems.append(f"Expected --data.dataset.init_args.num_workers ≥ 1, got {num_workers}.")
        if problems:
            raise ConfigError(*problems)
        self.root = root
        self.split = split
        self.label_set = label_set
        self.single_class_only = single_class_only
        self.test_split = test_split
        self.canvas_size = canvas_size
        self.num_workers = num_workers
        self.download = download
        self.num_classes = 5 if label_set == "macro" else 21
        self.class_names = class_names(label_set)
        self.input_shape = (3, canvas_size, canvas_size)
        self.partition_classes = VOC_CLASSES  #: the partition labels are the fine VOC classes in both label sets

    def load_train(self) -> LabelledTensors:
        """Lists the split, keeps the single-class images and returns their lazy pool."""
        ids = self._read_ids(self.split)
        classes = self._object_classes(self.split, ids)
        if self.single_class_only:
            keep = [i for i, present in enumerate(classes) if len(present) == 1]
        else:
            keep = [i for i, present in enumerate(classes) if present]
        if not keep:
            raise ConfigError(
                f"No image of {self.split} under --data.dataset.init_args.root={self.root} has "
                f"{'exactly one' if self.single_class_only else 'any'} object class; check the masks."
            )
        labels = np.array([_dominant(classes[i]) for i in keep], dtype=np.int64)
        return self._pool([ids[i] for i in keep], self.split, labels)

    def load_test(self) -> LabelledTensors | None:
        """VOC's validation images (all of them) when ``test_split`` is ``val``."""
        if self.test_split is None:
            return None
        ids = self._read_ids(self.test_split)
        return self._pool(ids, self.test_split, labels=None)

    # -- files ---------------------------------------------------------------------------------------
    @property
    def _voc(self) -> Path:
        return Path(self.root) / "VOC2012"

    def _read_ids(self, split: str) -> list[str]:
        listing = self._voc / "ImageSets" / "Segmentation" / f"{split}.txt"
        mask_dir = self._voc / _MASK_DIRS[split]
        needed = (listing, self._voc / "JPEGImages", mask_dir)
        missing = [str(p) for p in needed if not p.exists()]
        if missing and self.download and not (self._voc / "JPEGImages").is_dir():
            fetch_voc(self.root)
        # SBD unpacked by hand counts as downloaded: the split is derived from it as a download would be
        build = split == "train_aug" and not listing.is_file() and (self._voc / "JPEGImages").is_dir()
        if build and (self.download or sbd_unpacked(self.root)):
            build_train_aug(self.root, download=self.download)
        missing = [str(p) for p in needed if not p.exists()]
        if missing:
            hint = ""
            if split == "train_aug":
                sbd = Path(self.root) / "SBD"
                partial = sbd_missing(self.root) if sbd.is_dir() else []  # an SBD unpacked in part is named
                found = f" (SBD there is incomplete: missing {', '.join(map(str, partial))})" if partial else ""
                hint = (
                    f"For train_aug also unpack SBD ({SBD_URL}) into {sbd}{found}, from which its masks and list "
                    "are written, or add them yourself as VOC2012/SegmentationClassAug/ and "
                    "ImageSets/Segmentation/train_aug.txt (the layout of DeepLab's scripts), or choose "
                    "--data.dataset.init_args.split=train."
                )
            raise ConfigError(
                f"Pascal VOC 2012 is incomplete under --data.dataset.init_args.root={self.root}: missing "
                f"{', '.join(missing)}.",
                f"Download {VOC_URL} and extract it so that {self._voc} exists (or set "
                f"--data.dataset.init_args.download=true). {hint}".rstrip(),
            )
        try:
            ids = [line.split()[0] for line in listing.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(
                f"{listing} cannot be read as a list of image ids ({type(error).__name__}): the file is damaged. "
                f"Restore it from {VOC_URL}{_REBUILD if split == 'train_aug' else ''} and run again."
            ) from error
        self._check_files(listing, ids, mask_dir)
        return ids

    def _check_files(self, listing: Path, ids: list[str], mask_dir: Path) -> None:
        """Every listed image must have its JPEG and its mask: a missing one is named now, not mid-training."""
        folders = (self._voc / "JPEGImages", mask_dir)
        present = {folder: {entry.name for entry in os.scandir(folder)} for folder in folders}
        missing = [
            str(folder / f"{image_id}{suffix}")
            for image_id in ids
            for folder, suffix in zip(folders, (".jpg", ".png"), strict=True)
            if f"{image_id}{suffix}" not in present[folder]
        ]
        if missing:
            shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            derived = listing.stem == "train_aug" and any(Path(m).parent == mask_dir for m in missing)
            rebuild = f"; train_aug's masks are written again from SBD once {listing} is deleted" if derived else ""
            raise ConfigError(
                f"{listing} lists images whose files are missing: {shown}.",
                f"Restore them from {VOC_URL} (keeping the archive's file names){rebuild}, or list only the images "
                "you have.",
            )

    def _object_classes(self, split: str, ids: list[str]) -> list[list[int]]:
        """The object classes (1–20, by pixel count, most frequent first) of each mask, cached as JSON."""
        cache = Path(self.root) / f"fedlight_voc_classes_{split}.json"
        if cache.is_file():
            try:
                cached = json.loads(cache.read_text(encoding="utf-8"))
                if cached.get("ids") == ids and len(cached["classes"]) == len(ids):
                    return cached["classes"]
            except (OSError, ValueError, KeyError, TypeError, AttributeError):  # damaged: the masks are read again
                log.warning("%s is damaged: the object classes are read again from the masks", cache)
        mask_dir = self._voc / _MASK_DIRS[split]

        def classes_of(image_id: str) -> list[int]:
            counts = np.bincount(read_mask(mask_dir / f"{image_id}.png").ravel(), minlength=256)[1:21]
            present = np.flatnonzero(counts)
            return [int(c) + 1 for c in present[np.argsort(-counts[present], kind="stable")]]

        with ThreadPoolExecutor(max_workers=self.num_workers) as pool:
            classes = list(pool.map(classes_of, ids))
        try:
            tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
            tmp.write_text(json.dumps({"ids": ids, "classes": classes}))
            os.replace(tmp, cache)
        except OSError:  # a read-only dataset folder: the masks are read again next time
            pass
        return classes

    def _pool(self, ids: list[str], split: str, labels: np.ndarray | None) -> LabelledTensors:
        lookup = macro_lookup() if self.label_set == "macro" else None
        images = VOCImages([self._voc / "JPEGImages" / f"{i}.jpg" for i in ids], self.canvas_size, self.num_workers)
        mask_paths = [self._voc / _MASK_DIRS[split] / f"{i}.png" for i in ids]
        masks = VOCMasks(mask_paths, self.canvas_size, self.num_workers, lookup)
        return LabelledTensors(images, masks, labels=labels)


class VOCImages(LazySamples):
    """JPEGs decoded per batch, ImageNet-standardised, on a zero-padded ``[3, S, S]`` canvas."""

    def __init__(self, paths: list[Path], canvas_size: int, num_workers: int = 4) -> None:
        self.paths, self.canvas_size, self.num_workers = paths, canvas_size, num_workers
        self.shape = (len(paths), 3, canvas_size, canvas_size)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

        def read(i: int) -> torch.Tensor:
            rgb = decode_file(self.paths[i], lambda image: np.array(image.convert("RGB")), restore=VOC_URL)
            pixels = torch.from_numpy(rgb).permute(2, 0, 1)  # [3, h, w] uint8
            standardised = (pixels.float() / 255.0 - mean) / std
            return _on_canvas(standardised, self.canvas_size, fill=0.0, mode="bilinear")

        with ThreadPoolExecutor(max_workers=self.num_workers) as pool:
            return torch.stack(list(pool.map(read, index.tolist())))


class VOCMasks(LazySamples):
    """Label PNGs decoded per batch on a void-padded ``[S, S]`` canvas, optionally remapped (macro classes)."""

    def __init__(
        self, paths: list[Path], canvas_size: int, num_workers: int = 4, lookup: torch.Tensor | None = None
    ) -> None:
        self.paths, self.canvas_size, self.num_workers, self.lookup = paths, canvas_size, num_workers, lookup
        self.shape = (len(paths), canvas_size, canvas_size)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        def read(i: int) -> torch.Tensor:
            labels = torch.from_numpy(read_mask(self.paths[i]).astype(np.int64))  # [h, w]
            if self.lookup is not None:
                labels = self.lookup[labels]
            return _on_canvas(labels[None], self.canvas_size, fill=IGNORE_INDEX, mode="nearest")[0]

        with ThreadPoolExecutor(max_workers=self.num_workers) as pool:
            return torch.stack(list(pool.map(read, index.tolist())))


def _dominant(classes: list[int]) -> int:
    return classes[0]  # most frequent object class first


def _on_canvas(data: torch.Tensor, size: int, fill: float, mode: Literal["bilinear", "nearest"]) -> torch.Tensor:
    """Places ``[C, h, w]`` top-left on a ``[C, size, size]`` canvas filled with ``fill``, shrunk to fit if larger."""
    height, width = data.shape[-2:]
    if max(height, width) > size:
        factor = size / max(height, width)
        new_size = (max(1, int(height * factor)), max(1, int(width * factor)))
        resized = F.interpolate(data[None].float(), size=new_size, mode=mode)[0]
        data = resized if data.is_floating_point() else resized.round().to(data.dtype)
        height, width = new_size
    canvas = torch.full((data.shape[0], size, size), fill, dtype=data.dtype)
    canvas[:, :height, :width] = data
    return canvas
