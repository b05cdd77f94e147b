"""Images and label maps read lazily by the batch from the file lists of LADD's split files.

Each sample is one file (a street image, its label map): read when a batch asks for it, resized to one size so that
batches stack (bilinear for images, nearest for labels) or, for images of differing sizes (Mapillary), resized to a
width with the aspect kept and cut to a random window as they are read. Label ids are mapped to train ids through
a lookup table; a file that cannot be decoded is one :class:`~fedlight.errors.ConfigError` naming it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from fedlight.data.base import LazySamples, PairedSamples
from fedlight.data.labels import IGNORE_INDEX
from fedlight.errors import ConfigError


def resized_shape(height: int, width: int, size: tuple[int, int] | None, keep_width: int | None) -> tuple[int, int]:
    """The ``(H, W)`` an image of ``height × width`` is resized to: ``size``, or width ``keep_width`` with the
    aspect ratio kept (LADD's ``FixedResize(width=…)``: H = round(keep_width · height / width)).

    >>> resized_shape(1500, 2000, None, 1024), resized_shape(1500, 2000, (16, 32), None)
    ((768, 1024), (16, 32))
    """
    if keep_width is None:
        return size
    return round(keep_width * height / width), keep_width


def _stack(samples: list[torch.Tensor]) -> torch.Tensor:
    if len({tuple(sample.shape) for sample in samples}) > 1:
        raise ConfigError(
            f"Images resized to one width keep their aspect ratio, so a batch of them has mixed shapes "
            f"({sorted({tuple(s.shape[-2:]) for s in samples})}). Set --data.eval_batch_size=1, as LADD tests."
        )
    return torch.stack(samples)


def _decode(path: Path, fix: str) -> Image.Image:
    """The decoded image file at ``path``; a file PIL cannot read (garbage, truncated, vanished) is a
    :class:`ConfigError` naming it, since it surfaces mid-run, far from the file that caused it."""
    try:
        with Image.open(path) as image:
            image.load()  # decodes now: a truncated file fails here, not in a later conversion
            return image
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise ConfigError(f"Cannot read image file {path}: {error}.", fix) from error


def _read_pixels(
    path: Path, size: tuple[int, int] | None, keep_width: int | None, fix: str = "Restore the file."
) -> torch.Tensor:
    """An RGB image file as ``[3, H, W]`` float in 0–255, resized bilinearly to :func:`resized_shape`'s size."""
    pixels = torch.from_numpy(np.array(_decode(path, fix).convert("RGB"))).permute(2, 0, 1).float()  # [3, h, w]
    size = resized_shape(*pixels.shape[-2:], size, keep_width)
    if tuple(pixels.shape[-2:]) != size:
        pixels = F.interpolate(pixels[None], size, mode="bilinear", antialias=True)[0]
    return pixels


def _read_labels(
    path: Path, lookup: torch.Tensor, size: tuple[int, int] | None, keep_width: int | None,
    fix: str = "Restore the file.",
) -> torch.Tensor:  # fmt: skip
    """A label file as ``[H, W]`` int64 train ids (``lookup``), resized by nearest neighbour like the images."""
    mask = _decode(path, fix)
    ids = np.array(mask).astype(np.int64)
    # a colour rendering (Cityscapes' gtFine_color, an RGB copy) or 16-bit ids would index the table wrongly
    if ids.ndim != 2 or (ids.size and not 0 <= ids.min() <= ids.max() < len(lookup)):
        raise ConfigError(
            f"Label file {path} holds {mask.mode} pixels, not 8-bit label ids (a grey or palette PNG).", fix
        )
    labels = lookup[torch.from_numpy(ids)]  # [h, w]
    size = resized_shape(*labels.shape, size, keep_width)
    if tuple(labels.shape) != size:
        labels = F.interpolate(labels[None, None].float(), size, mode="nearest")[0, 0].long()
    return labels


def _normalise(pixels: torch.Tensor) -> torch.Tensor:
    """0–255 → mean = std = 0.5 (LADD's normalisation)."""
    return (pixels / 255.0 - 0.5) / 0.5


class SplitImages(LazySamples):
    """RGB image files read per batch, resized and normalised with mean = std = 0.5.

    Every image is resized to ``size``, or to width ``keep_width`` with its aspect ratio kept (then images of
    different aspect ratios need batches of one). Images whose ``flips`` entry is true are mirrored left–right.
    A file that cannot be decoded is a :class:`ConfigError` naming it, with ``fix`` as its advice.
    """

    def __init__(
        self, paths: list[Path], size: tuple[int, int], num_workers: int = 4, keep_width: int | None = None,
        flips: list[bool] | None = None, fix: str = "Restore the file.",
    ) -> None:  # fmt: skip
        self.paths, self.size, self.num_workers, self.keep_width = paths, tuple(size), num_workers, keep_width
        self.flips, self.fix = flips or [False] * len(paths), fix
        self.shape = (len(paths), 3, *self.size)  # with keep_width, the height is the first image's

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        def read(i: int) -> torch.Tensor:
            pixels = _read_pixels(self.paths[i], self.size, self.keep_width, self.fix)
            return _normalise(pixels.flip(-1) if self.flips[i] else pixels)

        with ThreadPoolExecutor(max_workers=self.num_workers) as pool:
            return _stack(list(pool.map(read, index.tolist())))  # [B, 3, H, W]


class SplitMasks(LazySamples):
    """Label files read per batch, mapped to train ids and resized (nearest) like :class:`SplitImages`; ``None``
    paths are void. A file that cannot be decoded, or holds no 8-bit ids, is a :class:`ConfigError` naming it."""

    def __init__(
        self, paths: list[Path | None], size: tuple[int, int], lookup: torch.Tensor, num_workers: int = 4,
        keep_width: int | None = None, flips: list[bool] | None = None, fix: str = "Restore the file.",
    ) -> None:  # fmt: skip
        self.paths, self.size, self.lookup, self.num_workers = paths, tuple(size), lookup, num_workers
        self.keep_width, self.flips, self.fix = keep_width, flips or [False] * len(paths), fix
        self.shape = (len(paths), *self.size)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        def read(i: int) -> torch.Tensor:
            if self.paths[i] is None:
                return torch.full(self.size, IGNORE_INDEX, dtype=torch.int64)
            labels = _read_labels(self.paths[i], self.lookup, self.size, self.keep_width, self.fix)
            return labels.flip(-1) if self.flips[i] else labels

        with ThreadPoolExecutor(max_workers=self.num_workers) as pool:
            return _stack(list(pool.map(read, index.tolist())))  # [B, H, W]


class SplitCrops(PairedSamples):
    """LADD's training reads of images whose sizes differ (its Mapillary pipeline), image and label map alike.

    Each image is mirrored left–right with probability ½, resized to ``width`` with its aspect ratio kept
    (bilinear; nearest for labels), padded where it is smaller than ``crop`` and cut by a uniformly placed
    ``crop`` window (LADD's ``RandomHorizontalFlip``, ``FixedResize(width)``, ``RandomCrop(pad_if_needed=True)``).
    The padding is LADD's: where the width falls short, ⌊(1 + crop_w − w)/2⌋ pixels on *every* side, then,
    where the height still falls short, ⌊(1 + crop_h − h)/2⌋ on every side; padded pixels are black (−1 once
    normalised) and void in the labels. Images are normalised with mean = std = 0.5.

    Three uniform numbers per sample are drawn from the client's generator before decoding (flip, row, column),
    so the crops do not depend on which thread decodes which image.
    """

    def __init__(
        self, images: list[Path], labels: list[Path | None], lookup: torch.Tensor, width: int,
        crop: tuple[int, int], flip: bool = True, num_workers: int = 4, fix: str = "Restore the file.",
    ) -> None:  # fmt: skip
        self.images, self.labels, self.lookup, self.width = images, labels, lookup, width
        self.crop, self.flip, self.num_workers, self.fix = (int(crop[0]), int(crop[1])), flip, num_workers, fix

    def __len__(self) -> int:
        return len(self.images)

    def read(self, index: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        draws = torch.rand(len(index), 3, generator=generator, dtype=torch.float64)  # [B, (flip, row, column)]

        def read(i: int, draw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            pixels = _read_pixels(self.images[i], None, self.width, self.fix)  # [3, H, W] at width `width`
            if self.labels[i] is None:
                labels = torch.full(pixels.shape[-2:], IGNORE_INDEX, dtype=torch.int64)
            else:
                labels = _read_labels(self.labels[i], self.lookup, None, self.width, self.fix)
            (crop_h, crop_w), (height, width) = self.crop, tuple(pixels.shape[-2:])
            for short, missing in ((width < crop_w, crop_w - width), (height < crop_h, crop_h - height)):
                if short:  # LADD pads every side by the same amount
                    pad = (1 + missing) // 2
                    pixels = F.pad(pixels, (pad,) * 4, value=0.0)
                    labels = F.pad(labels, (pad,) * 4, value=IGNORE_INDEX)
                    height, width = height + 2 * pad, width + 2 * pad
            if self.flip and draw[0] < 0.5:
                pixels, labels = pixels.flip(-1), labels.flip(-1)
            top = min(int(draw[1] * (height - crop_h + 1)), height - crop_h)
            left = min(int(draw[2] * (width - crop_w + 1)), width - crop_w)
            window = (slice(top, top + crop_h), slice(left, left + crop_w))
            return _normalise(pixels[(..., *window)]), labels[window]

        with ThreadPoolExecutor(max_workers=self.num_workers) as pool:
            pairs = list(pool.map(read, index.tolist(), draws))
        return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])  # [B, 3, h, w], [B, h, w]
