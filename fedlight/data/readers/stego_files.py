"""Image and label files read the way STEGO and FUSS feed them: an optional crop box, then the shorter side
resized to S with nearest-neighbour sampling and the central S×S square kept (STEGO's ``get_transform``,
``Resize(S, NEAREST)`` + ``CenterCrop(S)`` for images and labels alike), images ImageNet-standardised.

:class:`StegoImages` and :class:`StegoLabels` are :class:`~fedlight.data.base.LazySamples`: a batch is decoded
when it is asked for (threads: Pillow releases the GIL). With a frozen backbone and
:class:`~fedlight.callbacks.BackboneFeatureCache`, training images are decoded once, to compute their features.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from fedlight.data.base import LazySamples

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

#: A sample: its file and, for five-crops, which of torchvision's ``five_crop`` (tl, tr, bl, br, centre) it is.
Sample = tuple[Path, int | None]


def stego_view(image: Image.Image, crop: int | None, size: int) -> Image.Image:
    """Crop ``crop`` of the five half-size crops (or the whole image), then resize-nearest and centre-crop to S."""
    if crop is not None:
        width, height = image.size
        image = TF.five_crop(image, [height // 2, width // 2])[crop]
    image = TF.resize(image, size, interpolation=InterpolationMode.NEAREST)
    return TF.center_crop(image, [size, size])


class StegoImages(LazySamples):
    """RGB images as ``[3, S, S]`` float32, ImageNet-standardised."""

    def __init__(self, samples: Sequence[Sample], size: int, num_workers: int = 4) -> None:
        self.samples, self.size, self.num_workers = list(samples), size, num_workers
        self.shape = (len(self.samples), 3, size, size)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

        def read(i: int) -> torch.Tensor:
            path, crop = self.samples[i]
            with Image.open(path) as image:
                view = stego_view(image.convert("RGB"), crop, self.size)
            pixels = torch.from_numpy(np.array(view)).permute(2, 0, 1).float() / 255.0  # [3, S, S]
            return (pixels - mean) / std

        with ThreadPoolExecutor(max_workers=self.num_workers) as pool:
            return torch.stack(list(pool.map(read, index.tolist())))


class StegoLabels(LazySamples):
    """Label PNGs as ``[S, S]`` int64 after ``lookup`` (file value → class, 255 void)."""

    def __init__(self, samples: Sequence[Sample], size: int, lookup: torch.Tensor, num_workers: int = 4) -> None:
        self.samples, self.size, self.lookup, self.num_workers = list(samples), size, lookup, num_workers
        self.shape = (len(self.samples), size, size)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        def read(i: int) -> torch.Tensor:
            path, crop = self.samples[i]
            with Image.open(path) as label:
                view = stego_view(label, crop, self.size)
            return self.lookup[torch.from_numpy(np.array(view).astype(np.int64))]

        with ThreadPoolExecutor(max_workers=self.num_workers) as pool:
            return torch.stack(list(pool.map(read, index.tolist())))


def read_label(path: Path, lookup: torch.Tensor) -> torch.Tensor:
    """A whole label PNG ``[h, w]`` after ``lookup``."""
    with Image.open(path) as label:
        return lookup[torch.from_numpy(np.array(label).astype(np.int64))]


def map_files(fn: Callable[[Path], object], paths: Sequence[Path], num_workers: int) -> list:
    """``[fn(p) for p in paths]`` on ``num_workers`` threads."""
    with ThreadPoolExecutor(max_workers=num_workers) as pool:
        return list(pool.map(fn, paths))
