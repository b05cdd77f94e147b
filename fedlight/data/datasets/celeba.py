"""CelebA smiling-or-not with one client per celebrity: LEAF's benchmark (Caldas et al., 2018)

Follows ``TalwalkarLab/leaf:data/celeba/preprocess/metadata_to_json.py`` and
``models/celeba/cnn.py``: the users are the celebrities of ``identity_CelebA.txt`` with at least 5
images, the label is the ``Smiling`` attribute of ``list_attr_celeba.txt`` (−1 → 0, 1 → 1), and every
aligned 178×218 image is resized to 84×84 RGB, ignoring its aspect ratio. Two departures: pixels are
scaled to [0, 1] (LEAF feeds raw 0–255 values), and resizing uses Pillow's current default filter,
bicubic (LEAF ran on a Pillow whose default was nearest-neighbour).

Files are read from torchvision's layout, ``<root>/celeba/{identity_CelebA.txt, list_attr_celeba.txt,
img_align_celeba/}``, but not through ``torchvision.datasets.CelebA``: it demands three more text
files and checks every text file's MD5, which only the full download passes. CelebA has no direct download
link: its authors share it on Google Drive, and ``download`` fetches the three files it needs from there by
torchvision's file ids and MD5s, through ``gdown`` (the ``celeba`` extra).

Memory: LEAF's 9,343 users hold about 200k images, which take 4.2 GB as 84×84 uint8 and 17 GB as
the float32 pool :class:`~fedlight.data.base.LabelledTensors` holds (1.8 MB per user on average).
``max_users`` keeps a subset for smaller machines. Decoding 200k JPEGs takes minutes, so the decoded
uint8 images are cached next to the data on first use.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.datasets.utils import download_file_from_google_drive

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.datasets.download import download_failed, download_lock, missing_files
from fedlight.data.readers.image_files import read_cached_images, write_cached_images
from fedlight.errors import ConfigError

log = logging.getLogger(__name__)

_LABEL = "Smiling"
_FILES = ("identity_CelebA.txt", "list_attr_celeba.txt", "img_align_celeba")
_ARCHIVE = "img_align_celeba.zip"
_AGAIN = (
    "download it again from the CelebA site (https://mmlab.ie.cuhk.edu.hk/projects/CelebA.html), or delete it and "
    "set --data.dataset.init_args.download=true."
)


class CelebA(FederatedDataset):
    """LEAF's CelebA: ``[N, 3, S, S]`` images in [0, 1], smiling (1) or not (0), one natural client per celebrity.

    ``load_train`` returns the images of the kept celebrities in file order with ``groups`` holding
    each sample's celebrity index (celebrities sorted by identity id), for the
    :class:`~fedlight.data.partition.Natural` partitioner; there is no separate test set. Nothing is
    read before :meth:`load_train`.

    The first call decodes the images and saves them as uint8 to
    ``<root>/fedlight_cache_<S>px_min<min_images>[_users<max_users>].pt``; later calls load that file
    (a stale cache, whose file list differs, or a damaged one, whose images fail their digest, is rebuilt). If
    ``root`` is read-only, nothing is cached.

    Args:
        root: Folder holding ``celeba/identity_CelebA.txt``, ``celeba/list_attr_celeba.txt`` and the
            extracted ``celeba/img_align_celeba/`` (torchvision's layout).
        image_size: Side ``S`` the images are resized to (LEAF: 84).
        min_images: Celebrities with fewer images are dropped (LEAF: 5).
        max_users: Keep only this many celebrities, those with the smallest identity ids, to fit in
            less memory (about 1.8 MB of float32 per celebrity at 84×84); ``None`` keeps all.
        download: fetch the missing files from the authors' Google Drive (1.4 GB of images, each file's MD5
            checked) with ``gdown``: ``pip install -e ".[celeba]"``.
    """

    num_classes = 2

    def __init__(
        self,
        root: str = "data/celeba",
        image_size: int = 84,
        min_images: int = 5,
        max_users: int | None = None,
        download: bool = False,
    ) -> None:
        problems = []
        for name, value in (("image_size", image_size), ("min_images", min_images)):
            if value < 1:
                problems.append(f"Expected --data.dataset.init_args.{name} >= 1, got {value}.")
        if max_users is not None and max_users < 1:
            problems.append(f"Expected --data.dataset.init_args.max_users >= 1 or null (all), got {max_users}.")
        if problems:
            raise ConfigError(*problems)
        self.root = root
        self.download = download
        self.image_size = image_size
        self.min_images = min_images
        self.max_users = max_users
        self.input_shape = (3, image_size, image_size)

    def load_train(self) -> LabelledTensors:
        """Selects the celebrities, reads their labels and loads (or decodes and caches) their images."""
        folder = Path(self.root) / "celeba"
        missing = [name for name in _FILES if not (folder / name).exists()]
        if missing and self.download:
            with download_lock(folder):
                missing = [name for name in _FILES if not (folder / name).exists()]  # another process may have
                if missing:
                    _fetch(folder, missing)
            missing = [name for name in _FILES if not (folder / name).exists()]
        if missing:
            raise ConfigError(
                f"CelebA is incomplete under --data.dataset.init_args.root={self.root}: {folder} lacks "
                f"{', '.join(missing)}.",
                *missing_files([folder / name for name in missing if name.endswith(".txt")]),
                *([f"{folder / 'img_align_celeba'}/ is missing."] if "img_align_celeba" in missing else []),
                "Download img_align_celeba.zip, identity_CelebA.txt and list_attr_celeba.txt "
                f"from the CelebA site (https://mmlab.ie.cuhk.edu.hk/projects/CelebA.html) into {folder}/ and "
                "unzip the images there, or set --data.dataset.init_args.download=true (Google Drive, through gdown: "
                'pip install -e ".[celeba]").',
            )
        filenames, identities, listed = self._select(folder / "identity_CelebA.txt")
        smiling = _read_attribute(folder / "list_attr_celeba.txt", _LABEL)
        if listed != len(smiling):  # both files list every image; a file cut short at a line's end shows here
            raise ConfigError(
                f"{folder / 'identity_CelebA.txt'} lists {listed} images but {folder / 'list_attr_celeba.txt'} lists "
                f"{len(smiling)}: one of them is cut short or damaged; {_AGAIN}"
            )
        unlabelled = [name for name in filenames if name not in smiling]
        if unlabelled:
            raise ConfigError(
                f"{len(unlabelled)} images of identity_CelebA.txt (first: {unlabelled[0]}) have no row in "
                f"{folder / 'list_attr_celeba.txt'}; download the file again."
            )
        _, groups = np.unique(identities, return_inverse=True)  # celebrity index, by identity id
        images = self._load_images(folder / "img_align_celeba", filenames)  # [N, 3, S, S] uint8
        return LabelledTensors(
            inputs=images.float().div_(255.0),
            targets=torch.tensor([(smiling[name] + 1) // 2 for name in filenames], dtype=torch.int64),
            groups=groups.astype(np.int64),
        )

    def _select(self, identity_file: Path) -> tuple[list[str], np.ndarray, int]:
        """Returns the file names and identity ids of the kept celebrities' images, in file order, and the number
        of images the file lists."""
        rows = []
        for number, line in enumerate(_read_lines(identity_file), start=1):
            fields = line.split()
            if fields and (len(fields) != 2 or not fields[1].isdigit()):
                raise ConfigError(
                    f"Line {number} of {identity_file} is not '<image file> <identity id>': {line[:80]!r}; the file "
                    f"is damaged: {_AGAIN}"
                )
            if fields:
                rows.append(fields)
        counts = Counter(identity for _, identity in rows)
        kept = sorted(int(i) for i, count in counts.items() if count >= self.min_images)
        if self.max_users is not None:
            kept = kept[: self.max_users]
        if not kept:
            raise ConfigError(
                f"No celebrity in {identity_file} has at least --data.dataset.init_args.min_images="
                f"{self.min_images} images; lower min_images."
            )
        kept_set = set(kept)
        selected = [(name, int(identity)) for name, identity in rows if int(identity) in kept_set]
        identities = np.array([identity for _, identity in selected], dtype=np.int64)
        return [name for name, _ in selected], identities, len(rows)

    def _load_images(self, image_dir: Path, filenames: list[str]) -> torch.Tensor:
        """Returns the ``[N, 3, S, S]`` uint8 images, from the cache when it holds exactly these files."""
        suffix = f"_users{self.max_users}" if self.max_users is not None else ""
        cache = Path(self.root) / f"fedlight_cache_{self.image_size}px_min{self.min_images}{suffix}.pt"
        if cache.is_file():
            images, problem = read_cached_images(cache, "filenames", filenames, (3, self.image_size, self.image_size))
            if images is not None:
                return images
            log.warning("%s %s: decoding again", cache, problem)
        images = _decode_all(image_dir, filenames, self.image_size)
        write_cached_images(cache, {"filenames": filenames, "images": images})
        return images


def _fetch(folder: Path, missing: list[str]) -> None:
    """Downloads the ``missing`` files of :data:`_FILES` from Google Drive into ``folder`` and unpacks the images."""
    from torchvision.datasets import CelebA as TorchvisionCelebA
    from torchvision.datasets.utils import extract_archive

    if not _gdown_installed():
        raise ConfigError(
            f"CelebA lacks {', '.join(missing)} in {folder}, and --data.dataset.init_args.download=true fetches them "
            'from Google Drive with gdown, which is not installed: pip install -e ".[celeba]" (or gdown), or put the '
            "files there yourself."
        )
    folder.mkdir(parents=True, exist_ok=True)
    wanted = {_ARCHIVE if name == "img_align_celeba" else name for name in missing}
    sources = [(file_id, md5, name) for file_id, md5, name in TorchvisionCelebA.file_list if name in wanted]
    for file_id, md5, name in sources:
        try:
            download_file_from_google_drive(file_id, folder, name, md5)
        except (OSError, RuntimeError) as error:
            urls = [f"https://drive.google.com/uc?id={file_id} ({name})" for file_id, _, name in sources]
            raise download_failed("CelebA", urls, folder, error) from error
    if _ARCHIVE in wanted:
        extract_archive(str(folder / _ARCHIVE), str(folder))


def _gdown_installed() -> bool:
    return importlib.util.find_spec("gdown") is not None


def _read_attribute(attr_file: Path, name: str) -> dict[str, int]:
    """Maps every file name of ``list_attr_celeba.txt`` to its ±1 value of attribute ``name``."""
    lines = _read_lines(attr_file)  # a count, the 40 attribute names, then one row per image
    if len(lines) < 2 or not lines[0].strip().isdigit():
        raise ConfigError(f"{attr_file} does not start with its number of rows and the attribute names: {_AGAIN}")
    header = lines[1].split()
    if name not in header:
        raise ConfigError(f"{attr_file} has no {name!r} column in its header line; download the file again.")
    column = header.index(name) + 1  # the file name comes first in each row
    values = {}
    for number, fields in enumerate(map(str.split, lines[2:]), start=3):
        if not fields:
            continue
        if len(fields) != len(header) + 1 or any(value not in ("1", "-1") for value in fields[1:]):
            raise ConfigError(
                f"Line {number} of {attr_file} is not an image's file name and {len(header)} values of ±1: the "
                f"file is damaged: {_AGAIN}"
            )
        values[fields[0]] = int(fields[column])
    if len(values) != int(lines[0]):  # the count is how a file cut short at a line's end shows
        raise ConfigError(
            f"{attr_file} announces {int(lines[0])} rows but holds {len(values)}: it is cut short or damaged: {_AGAIN}"
        )
    return values


def _read_lines(path: Path) -> list[str]:
    """The lines of one of CelebA's text files, or a :class:`ConfigError` naming it when it is not text."""
    try:
        return path.read_text(encoding="ascii").splitlines()
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path} is not a text file ({error}): it is damaged: {_AGAIN}") from error


def _decode_all(image_dir: Path, filenames: list[str], size: int) -> torch.Tensor:
    """Decodes and resizes the images into one ``[N, 3, size, size]`` uint8 tensor, on all cores."""
    images = torch.empty((len(filenames), 3, size, size), dtype=torch.uint8)

    def decode(index: int) -> None:
        path = image_dir / filenames[index]
        try:
            with Image.open(path) as image:
                pixels = np.array(image.convert("RGB").resize((size, size), Image.Resampling.BICUBIC))
        except FileNotFoundError as error:
            raise ConfigError(
                f"{path} is listed in identity_CelebA.txt but missing; extract img_align_celeba.zip into "
                f"{image_dir.parent}/ again."
            ) from error
        # Pillow reports a file it cannot identify or decode (garbage, cut short) as an OSError
        except (OSError, SyntaxError, ValueError) as error:
            raise ConfigError(
                f"{path} cannot be decoded as an image ({type(error).__name__}: {error}): it is damaged or cut "
                f"short; extract img_align_celeba.zip into {image_dir.parent}/ again."
            ) from error
        images[index] = torch.from_numpy(pixels).permute(2, 0, 1)  # [S, S, 3] → [3, S, S]

    # Pillow releases the GIL while decoding and resizing, so threads use every core
    with ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1)) as pool:
        list(pool.map(decode, range(len(filenames))))
    return images
