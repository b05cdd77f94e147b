"""Pascal VOC 2012 and its SBD "train_aug" split, fetched from their public archives.

VOC's trainval archive (torchvision's URL and MD5) unpacks to ``VOCdevkit/VOC2012/``. The 10,582-image
``train_aug`` split that MO-FedProto trains on is not one archive: it is the images that SBD (Hariharan et al.,
ICCV 2011; torchvision's URL and MD5) or VOC's own ``train`` list annotate, minus VOC's ``val`` images, with
masks in one folder. :func:`build_train_aug` makes it from the two downloads as DeepLab's training scripts lay
it out: SBD's class masks (``cls/<id>.mat``, ``GTcls.Segmentation``) where SBD has the image, VOC's own mask
otherwise, written as index PNGs to ``VOC2012/SegmentationClassAug/``, and the list to
``ImageSets/Segmentation/train_aug.txt``. SBD already unpacked under ``VOCdevkit/SBD/`` (its archive's
``benchmark_RELEASE/dataset/`` tree) is used as it is, with or without ``download``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image

from fedlight.data.datasets.download import download_lock, fetch_archive
from fedlight.data.readers.stego_files import decode_file
from fedlight.errors import ConfigError

VOC_URL = "https://thor.robots.ox.ac.uk/pascal/VOC/voc2012/VOCtrainval_11-May-2012.tar"
VOC_MD5 = "6cd6e144f989b92b3379bac3b3de84fd"
SBD_URL = "https://www2.eecs.berkeley.edu/Research/Projects/CS/vision/grouping/semantic_contours/benchmark.tgz"
SBD_MD5 = "82b4d87ceb2ed10f6038a1cba92111cb"
_SBD_FOLDER = ("benchmark_RELEASE", "dataset")  # where the SBD archive puts cls/, train.txt and val.txt


def check_download_root(root: str) -> None:
    """Refuses a ``root`` that the VOC archive cannot unpack into (it holds a ``VOCdevkit/`` folder)."""
    if Path(root).name != "VOCdevkit":
        raise ConfigError(
            f"--data.dataset.init_args.download=true unpacks {VOC_URL} into a folder named VOCdevkit, but "
            f"--data.dataset.init_args.root={root} names another: set root to {Path(root) / 'VOCdevkit'}."
        )


def fetch_voc(root: str) -> None:
    """Downloads and unpacks VOC 2012 trainval so that ``<root>/VOC2012/`` exists (``root`` is the VOCdevkit)."""
    images = Path(root) / "VOC2012" / "JPEGImages"
    fetch_archive("Pascal VOC 2012", VOC_URL, VOC_MD5, Path(root).parent, done=images.is_dir)


def sbd_folder(root: str | Path) -> Path:
    """Where SBD's archive, unpacked into ``<root>/SBD/``, puts ``cls/``, ``train.txt`` and ``val.txt``."""
    return Path(root).joinpath("SBD", *_SBD_FOLDER)


def sbd_missing(root: str | Path) -> list[Path]:
    """The parts of SBD that ``train_aug`` is built from (``cls/``, ``train.txt``, ``val.txt``) missing under
    ``<root>/SBD/``."""
    folder = sbd_folder(root)
    return [path for path in (folder / "cls", folder / "train.txt", folder / "val.txt") if not path.exists()]


def sbd_unpacked(root: str | Path) -> bool:
    """Whether SBD's files are unpacked under ``<root>/SBD/`` (then ``train_aug`` is built without a download)."""
    return not sbd_missing(root)


def build_train_aug(root: str, download: bool = True) -> None:
    """Writes the ``train_aug`` masks and list into ``<root>/VOC2012/`` from SBD under ``<root>/SBD/``.

    Args:
        root: the VOCdevkit folder.
        download: fetch SBD's archive into ``<root>/SBD/`` when it is not unpacked there yet.

    Raises:
        ConfigError: when SBD is neither unpacked nor downloadable, or one of its or VOC's files that the split
            needs is missing or damaged (named).
    """
    voc, sbd_download = Path(root) / "VOC2012", Path(root) / "SBD"
    listing = voc / "ImageSets" / "Segmentation" / "train_aug.txt"
    with download_lock(root):
        if not listing.is_file():  # another process of the run may have written it meanwhile
            if download:  # an archive unpacked by hand (or by an earlier run) is not fetched again
                fetch_archive(
                    "SBD (the train_aug masks)", SBD_URL, SBD_MD5, sbd_download, done=lambda: sbd_unpacked(root)
                )
            _write_train_aug(voc, sbd_folder(root), listing)


def _write_train_aug(voc: Path, sbd: Path, listing: Path) -> None:
    """Writes the masks of the train_aug images and, last, their list."""
    lists = voc / "ImageSets" / "Segmentation"
    sbd_ids = _ids(sbd / "train.txt", SBD_URL) | _ids(sbd / "val.txt", SBD_URL)
    ids = sorted((sbd_ids | _ids(lists / "train.txt", VOC_URL)) - _ids(lists / "val.txt", VOC_URL))
    sources = {i: sbd / "cls" / f"{i}.mat" if i in sbd_ids else voc / "SegmentationClass" / f"{i}.png" for i in ids}
    # every source is checked before any mask is written, so that one message names all that is missing
    missing = [str(path) for path in sources.values() if not path.is_file()]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ConfigError(
            f"The train_aug split cannot be built: its lists name masks that are missing: {shown}.",
            f"Unpack {SBD_URL} into {sbd.parent.parent} and {VOC_URL} into {voc.parent.parent} again (keeping their "
            "file names), or choose --data.dataset.init_args.split=train.",
        )
    masks = voc / "SegmentationClassAug"
    masks.mkdir(exist_ok=True)
    for image_id, source in sources.items():
        labels = _read_sbd_mask(source) if source.suffix == ".mat" else read_mask(source)
        Image.fromarray(labels.astype(np.uint8)).save(masks / f"{image_id}.png")
    tmp = listing.with_name(f"{listing.name}.tmp{os.getpid()}")
    tmp.write_text("".join(f"{image_id}\n" for image_id in ids))
    os.replace(tmp, listing)  # written last: the list's presence means the masks are complete


def _read_sbd_mask(path: Path) -> np.ndarray:
    """SBD's class mask ``GTcls.Segmentation`` ``[h, w]`` of a ``cls/<id>.mat`` file."""
    from scipy.io import loadmat

    try:
        labels = np.asarray(loadmat(path)["GTcls"][0]["Segmentation"][0])
    except Exception as error:  # scipy raises ValueError, TypeError, OSError… for a damaged .mat; all mean the same
        raise ConfigError(
            f"{path} cannot be read as SBD's class mask (GTcls.Segmentation; {type(error).__name__}: {error}): the "
            f"file is damaged. Unpack it again from {SBD_URL} and run again."
        ) from error
    if labels.ndim != 2 or labels.size == 0:
        raise ConfigError(
            f"{path} holds a GTcls.Segmentation of shape {labels.shape}, not a 2-D class mask: the file is damaged. "
            f"Unpack it again from {SBD_URL} and run again."
        )
    return labels


def read_mask(path: Path) -> np.ndarray:
    """A VOC label PNG as its ``[h, w]`` uint8 class indices, 255 void (palette and grey PNGs alike).

    Raises:
        ConfigError: naming ``path`` when it is missing, damaged or a colour (RGB) rendering of the classes.
    """
    labels = decode_file(path, np.array, restore=VOC_URL)
    if labels.ndim != 2:
        raise ConfigError(
            f"{path} is a colour image, not a palette or grey PNG whose values are the classes: replace it with "
            f"the file from {VOC_URL} (or the mask written from SBD) and run again."
        )
    return labels


def _ids(listing: Path, source: str) -> set[str]:
    """The image ids of a split list; a missing or damaged list is named, with where it comes from."""
    try:
        return {line.split()[0] for line in listing.read_text(encoding="utf-8").splitlines() if line.strip()}
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"{listing} cannot be read ({type(error).__name__}): unpack it again from {source} and run again."
        ) from error
