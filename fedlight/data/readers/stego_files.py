"""Image and label files read the way STEGO and FUSS feed them: an optional crop box, then the shorter side
resized to S with nearest-neighbour sampling and the central S×S square kept (STEGO's ``get_transform``,
``Resize(S, NEAREST)`` + ``CenterCrop(S)`` for images and labels alike), images ImageNet-standardised.

:class:`StegoImages` and :class:`StegoLabels` are :class:`~fedlight.data.base.LazySamples`: a batch is decoded
when it is asked for (threads: Pillow releases the GIL). With a frozen backbone and
:class:`~fedlight.callbacks.BackboneFeatureCache`, training images are decoded once, to compute their features.
A file that is missing or cannot be decoded (truncated, overwritten, not an image) raises one
:class:`~fedlight.errors.ConfigError` naming it (:func:`decode_file`), wherever it is read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from fedlight.data.base import LazySamples
from fedlight.errors import ConfigError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

T = TypeVar("T")

#: A sample: its file and, for five-crops, which of torchvision's ``five_crop`` (tl, tr, bl, br, centre) it is.
Sample = tuple[Path, int | None]


def decode_file(path: Path, decode: Callable[[Image.Image], T], restore: str = "the dataset's archive") -> T:
    """``decode`` applied to the opened image file ``path``, any failure to read it raised as one ConfigError.

    Pillow reports a damaged file in several ways (``UnidentifiedImageError``, ``OSError`` for a truncated
    stream, ``SyntaxError``/``ValueError`` from some decoders); all of them mean the same thing to a user: this
    file must be replaced.

    Args:
        path: the image file.
        decode: what to compute from the open image (it must load the pixels, e.g. ``np.array(image)``).
        restore: where a good copy of the file comes from, for the message.

    Raises:
        ConfigError: naming ``path`` when it is missing or cannot be decoded.
    """
    try:
        with Image.open(path) as image:
            return decode(image)
    except FileNotFoundError as error:
        raise ConfigError(f"{path} is missing; restore it from {restore} and run again.") from error
    except (OSError, SyntaxError, ValueError) as error:  # UnidentifiedImageError is an OSError
        raise ConfigError(
            f"{path} cannot be read as an image ({type(error).__name__}: {error}): the file is damaged. Replace it "
            f"with the file from {restore} and run again."
        ) from error


def stego_view(image: Image.Image, crop: int | None, size: int) -> Image.Image:
    """Crop ``crop`` of the five half-size crops (or the whole image), then resize-nearest and centre-crop to S."""
    if crop is not None:
        width, height = image.size
        image = TF.five_crop(image, [height // 2, width // 2])[crop]
    image = TF.resize(image, size, interpolation=InterpolationMode.NEAREST)
    return TF.center_crop(image, [size, size])


class StegoImages(LazySamples):
    """RGB images as ``[3, S, S]`` float32, ImageNet-standardised."""

    def __init__(
        self, samples: Sequence[Sample], size: int, num_workers: int = 4, source: str = "the dataset's archive"
    ) -> None:
        self.samples, self.size, self.num_workers, self.source = list(samples), size, num_workers, source
        self.shape = (len(self.samples), 3, size, size)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

        def read(i: int) -> torch.Tensor:
            path, crop = self.samples[i]
            rgb = lambda image: np.array(stego_view(image.convert("RGB"), crop, self.size))  # noqa: E731
            view = decode_file(path, rgb, self.source)
            pixels = torch.from_numpy(view).permute(2, 0, 1).float() / 255.0  # [3, S, S]
            return (pixels - mean) / std

        with ThreadPoolExecutor(max_workers=self.num_workers) as pool:
            return torch.stack(list(pool.map(read, index.tolist())))


class StegoLabels(LazySamples):
    """Label PNGs as ``[S, S]`` int64 after ``lookup`` (file value → class, 255 void)."""

    def __init__(
        self,
        samples: Sequence[Sample],
        size: int,
        lookup: torch.Tensor,
        num_workers: int = 4,
        source: str = "the dataset's archive",
    ) -> None:
        self.samples, self.size, self.lookup, self.num_workers = list(samples), size, lookup, num_workers
        self.source = source
        self.shape = (len(self.samples), size, size)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        def read(i: int) -> torch.Tensor:
            path, crop = self.samples[i]
            view = decode_file(path, lambda label: np.array(stego_view(label, crop, self.size)), self.source)
            return self.lookup[torch.from_numpy(_label_values(view, path, self.source))]

        with ThreadPoolExecutor(max_workers=self.num_workers) as pool:
            return torch.stack(list(pool.map(read, index.tolist())))


def read_label(path: Path, lookup: torch.Tensor, source: str = "the dataset's archive") -> torch.Tensor:
    """A whole label PNG ``[h, w]`` after ``lookup``; ``source`` names where a good copy comes from."""
    return lookup[torch.from_numpy(_label_values(decode_file(path, np.array, source), path, source))]


def _label_values(pixels: np.ndarray, path: Path, source: str) -> np.ndarray:
    """A label file's ``[h, w]`` values as int64, refusing colour images (a colour map is not a label map)."""
    if pixels.ndim != 2:
        raise ConfigError(
            f"{path} is a colour image ({pixels.shape[-1]} channels), not a single-channel label map: replace it "
            f"with the label file from {source} (class ids as grey or palette values) and run again."
        )
    return pixels.astype(np.int64)


def map_files(fn: Callable[[Path], object], paths: Sequence[Path], num_workers: int) -> list:
    """``[fn(p) for p in paths]`` on ``num_workers`` threads."""
    with ThreadPoolExecutor(max_workers=num_workers) as pool:
        return list(pool.map(fn, paths))
