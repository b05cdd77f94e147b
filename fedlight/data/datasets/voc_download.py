"""Pascal VOC 2012 and its SBD "train_aug" split, fetched from their public archives.

VOC's trainval archive (torchvision's URL and MD5) unpacks to ``VOCdevkit/VOC2012/``. The 10,582-image
``train_aug`` split that MO-FedProto trains on is not one archive: it is the images that SBD (Hariharan et al.,
ICCV 2011; torchvision's URL and MD5) or VOC's own ``train`` list annotate, minus VOC's ``val`` images, with
masks in one folder. :func:`build_train_aug` makes it from the two downloads as DeepLab's training scripts lay
it out: SBD's class masks (``cls/<id>.mat``, ``GTcls.Segmentation``) where SBD has the image, VOC's own mask
otherwise, written as index PNGs to ``VOC2012/SegmentationClassAug/``, and the list to
``ImageSets/Segmentation/train_aug.txt``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image

from fedlight.data.datasets.download import download_lock, fetch_archive
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


def build_train_aug(root: str) -> None:
    """Downloads SBD into ``<root>/SBD/`` and writes the ``train_aug`` masks and list into ``<root>/VOC2012/``."""
    voc, sbd_download = Path(root) / "VOC2012", Path(root) / "SBD"
    listing = voc / "ImageSets" / "Segmentation" / "train_aug.txt"
    with download_lock(root):
        if not listing.is_file():  # another process of the run may have written it meanwhile
            fetch_archive("SBD (the train_aug masks)", SBD_URL, SBD_MD5, sbd_download)
            _write_train_aug(voc, sbd_download.joinpath(*_SBD_FOLDER), listing)


def _write_train_aug(voc: Path, sbd: Path, listing: Path) -> None:
    """Writes the masks of the train_aug images and, last, their list."""
    lists = voc / "ImageSets" / "Segmentation"
    sbd_ids = _ids(sbd / "train.txt") | _ids(sbd / "val.txt")
    ids = sorted((sbd_ids | _ids(lists / "train.txt")) - _ids(lists / "val.txt"))
    masks = voc / "SegmentationClassAug"
    masks.mkdir(exist_ok=True)
    from scipy.io import loadmat

    for image_id in ids:
        if image_id in sbd_ids:
            labels = loadmat(sbd / "cls" / f"{image_id}.mat")["GTcls"][0]["Segmentation"][0]  # [h, w] class ids
        else:
            with Image.open(voc / "SegmentationClass" / f"{image_id}.png") as mask:
                labels = np.array(mask)  # palette indices are the class ids, 255 void
        Image.fromarray(labels.astype(np.uint8)).save(masks / f"{image_id}.png")
    tmp = listing.with_name(f"{listing.name}.tmp{os.getpid()}")
    tmp.write_text("".join(f"{image_id}\n" for image_id in ids))
    os.replace(tmp, listing)  # written last: the list's presence means the masks are complete


def _ids(listing: Path) -> set[str]:
    return {line.split()[0] for line in listing.read_text().splitlines() if line.strip()}
