"""Decoding folders of small image files into one uint8 tensor, with a cache next to them.

CINIC-10 (270,000 PNGs) and TinyImageNet (120,000 JPEGs) ship as files. Decoding them takes minutes, so
the first load writes the decoded split as ``<root>/.fedlight_cache/<split>.pt`` (uint8, e.g. 276 MB for
CINIC-10's training split) and later loads read that file. The cache records the file list, so a
changed folder is decoded again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

log = logging.getLogger(__name__)


def decode_images(paths: Sequence[Path], size: tuple[int, int]) -> torch.Tensor:
    """Returns ``[N, 3, H, W]`` uint8 RGB images decoded from ``paths`` (greyscale files are expanded to RGB).

    Raises:
        ValueError: if an image is not ``size`` = (H, W).
    """
    images = torch.empty(len(paths), 3, *size, dtype=torch.uint8)
    for i, path in enumerate(paths):
        with Image.open(path) as file:
            pixels = np.array(file.convert("RGB"))  # [H, W, 3], a writable copy
        if pixels.shape[:2] != tuple(size):
            raise ValueError(f"{path} is {pixels.shape[:2]} pixels, expected {tuple(size)}")
        images[i] = torch.from_numpy(pixels).permute(2, 0, 1)
    return images


def cached_images(root: Path, split: str, paths: Sequence[Path], size: tuple[int, int], cache: bool) -> torch.Tensor:
    """:func:`decode_images` of ``paths``, read from or written to ``<root>/.fedlight_cache/<split>.pt``."""
    names = [str(Path(p).relative_to(root)) for p in paths]
    file = root / ".fedlight_cache" / f"{split}.pt"
    if cache and file.exists():
        stored = torch.load(file, weights_only=True)
        if stored["names"] == names:
            return stored["images"]
        log.info("%s lists other files than %s: decoding again", file, root)
    log.info("decoding %d images of %s/%s (cached afterwards)", len(paths), root, split)
    images = decode_images(paths, size)
    if cache:
        file.parent.mkdir(exist_ok=True)
        temporary = file.with_suffix(".tmp")
        torch.save({"names": names, "images": images}, temporary)
        temporary.replace(file)  # atomic: an interrupted write leaves no half cache
    return images
