"""Decoding folders of small image files into one uint8 tensor, with a cache next to them.

CINIC-10 (270,000 PNGs) and TinyImageNet (120,000 JPEGs) ship as files. Decoding them takes minutes, so
the first load writes the decoded split as ``<root>/.fedlight_cache/<split>.pt`` (uint8, e.g. 276 MB for
CINIC-10's training split) and later loads read that file. The cache records the file list and the images'
BLAKE2b digest, so a changed folder, or a cache damaged on disk, is decoded again.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fedlight.data.cache_files import tensor_digest
from fedlight.errors import ConfigError

log = logging.getLogger(__name__)


def class_folder_images(folder: Path, suffix: str, dataset: str, published: int | None) -> tuple[list[Path], list[str]]:
    """The images of one class folder, sorted, and what is wrong with the folder.

    Hidden files (a desktop's ``.DS_Store``) are no images; anything else not named ``*<suffix>`` is one renamed.
    With ``published`` (None: a subset, read as it is), a folder holding another number of images is refused: an
    archive unpacked part-way leaves every folder present and images missing.
    """
    with os.scandir(folder) as scan:  # scandir knows each entry's kind without a stat call per file
        entries = [(entry.name, entry.is_file()) for entry in scan if not entry.name.startswith(".")]
    files = sorted(folder / name for name, is_file in entries if is_file and name.endswith(suffix))
    others = sorted(folder / name for name, is_file in entries if not (is_file and name.endswith(suffix)))
    problems = [f"{path} is not a {suffix} file, the only kind {dataset} holds." for path in others[:5]]
    if not files:
        problems.append(f"{folder} holds no {suffix} images.")
    elif published is not None and len(files) != published:
        problems.append(
            f"{folder} holds {len(files):,} images, not {dataset}'s {published:,}: the archive was unpacked part-way "
            "or the folder changed (--data.dataset.init_args.subset=true reads it as it is)."
        )
    return files, problems


def decode_images(paths: Sequence[Path], size: tuple[int, int], source: str = "the dataset") -> torch.Tensor:
    """Returns ``[N, 3, H, W]`` uint8 RGB images decoded from ``paths`` (greyscale files are expanded to RGB).

    Args:
        paths: the image files.
        size: their (H, W).
        source: where the original files come from (an archive), for the message.

    Raises:
        ConfigError: naming the file, if an image is missing, cannot be decoded or is not ``size``.
    """
    images = torch.empty(len(paths), 3, *size, dtype=torch.uint8)
    for i, path in enumerate(paths):
        try:
            with Image.open(path) as file:
                pixels = np.array(file.convert("RGB"))  # [H, W, 3], a writable copy
        except FileNotFoundError as error:
            raise ConfigError(f"{path} is missing; restore it from {source}.") from error
        # Pillow reports a file it cannot identify or decode (garbage, cut short) as an OSError, or a
        # SyntaxError from its PNG parser; either way the file is bad, not the code
        except (OSError, SyntaxError, ValueError) as error:
            raise ConfigError(
                f"{path} cannot be decoded as an image ({type(error).__name__}: {error}): it is damaged or cut "
                f"short; replace it with the original from {source}."
            ) from error
        if pixels.shape[:2] != tuple(size):
            raise ConfigError(
                f"{path} is {pixels.shape[0]}×{pixels.shape[1]} pixels, but every image of this dataset is "
                f"{size[0]}×{size[1]}; replace it with the original from {source}."
            )
        images[i] = torch.from_numpy(pixels).permute(2, 0, 1)
    return images


def cached_images(
    root: Path, split: str, paths: Sequence[Path], size: tuple[int, int], cache: bool, source: str = "the dataset"
) -> torch.Tensor:
    """:func:`decode_images` of ``paths``, read from or written to ``<root>/.fedlight_cache/<split>.pt``.

    The cache holds the file list and the images' digest; a cache that cannot be read, lists other files or
    whose images no longer match their digest is decoded again (with a warning naming it). A folder the cache
    cannot be written to (read-only, full) only costs the decoding next time. ``source`` names where the
    original files come from, for the message about a file that cannot be decoded.
    """
    names = [str(Path(p).relative_to(root)) for p in paths]
    file = root / ".fedlight_cache" / f"{split}.pt"
    if cache and file.exists():
        images, problem = read_cached_images(file, "names", names, (3, *size))
        if images is not None:
            return images
        log.warning("%s %s: decoding again", file, problem)
    log.info("decoding %d images of %s/%s (cached afterwards)", len(paths), root, split)
    images = decode_images(paths, size, source)
    if cache:
        write_cached_images(file, {"names": names, "images": images})
    return images


def read_cached_images(
    file: Path, key: str, names: list[str], shape: tuple[int, ...]
) -> tuple[torch.Tensor | None, str]:
    """The uint8 ``[N, *shape]`` images of a decoded-image cache whose ``key`` lists ``names`` and whose images
    match their recorded digest, or ``(None, why not)``."""
    try:
        stored = torch.load(file, weights_only=True)
        images, listed, digest = stored["images"], stored[key], stored["digest"]
    except Exception as err:  # truncated, not a torch file, a cache from before digests were recorded
        return None, f"cannot be read or records no digest ({type(err).__name__}: {err})"
    if listed != names:
        return None, "lists other files"
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.shape != (len(names), *shape):
        return None, f"holds images of another shape than [{len(names)}, {', '.join(map(str, shape))}] uint8"
    if tensor_digest(images) != digest:
        return None, "holds images that changed since they were written (their digest differs)"
    return images, ""


def write_cached_images(file: Path, contents: dict) -> None:
    """Writes a decoded-image cache with its images' digest through a temporary file (an interrupted write
    leaves no half cache); a folder that cannot take it is a warning, and the images are decoded next time."""
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        file.parent.mkdir(exist_ok=True)
        torch.save({**contents, "digest": tensor_digest(contents["images"])}, tmp)
        os.replace(tmp, file)
    except OSError as err:
        with contextlib.suppress(OSError):  # nothing to remove where the folder could not be made
            tmp.unlink(missing_ok=True)
        log.warning("could not cache the decoded images at %s (%s); they will be decoded again next time", file, err)
