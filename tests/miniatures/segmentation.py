"""Miniatures of the segmentation datasets: Pascal VOC 2012 with SBD, Cityscapes and STEGO's CocoStuff.

Each writer lays its files out as the public archives unpack them, with the real file names, formats and label
encodings, and leaves every derived file (VOC's ``train_aug`` masks and list, label caches) to the reader:

* ``PascalVOC``: ``VOCtrainval_11-May-2012.tar`` unpacked into ``data/`` (``VOCdevkit/VOC2012/JPEGImages/*.jpg``,
  ``SegmentationClass/*.png`` palette PNGs with a void (255) border around every object,
  ``ImageSets/Segmentation/{train,val,trainval}.txt``) and SBD's ``benchmark.tgz`` unpacked into
  ``VOCdevkit/SBD/`` (``benchmark_RELEASE/dataset/{img/*.jpg,cls/*.mat,train.txt,val.txt}``; ``cls/<id>.mat``
  holds the MATLAB struct ``GTcls`` with ``Segmentation``, ``Boundaries`` and ``CategoriesPresent``). Every
  image holds one object class, except one with two and one with none, which the reader filters out.
* ``CityscapesFUSS``: ``leftImg8bit_trainvaltest.zip`` and ``gtFine_trainvaltest.zip`` unpacked into the root:
  one 64×128 frame in each of the 18 training cities and the 3 validation cities, with its ``labelIds``
  (ids 0–33), ``instanceIds`` (16-bit, ``id·1000 + k`` for cars and people), ``color`` and ``polygons.json``.
* ``CocoStuff27``: STEGO's layout: ``images/{train2017,val2017}/<12-digit id>.jpg``,
  ``annotations/{train2017,val2017}/<id>.png`` (stuff+thing maps: grey PNGs of fine labels 0–181, 255
  unlabelled) and the curated lists ``curated/<split>/Coco164kFull_Stuff_Coarse{,_7}.txt``; a few training
  images are on disk but in no list, as most of COCO is. Each training image's most frequent label is one of
  six coarse classes, four images each, so that a Dirichlet partition over the dominant labels can fill clients.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from miniatures import Miniature

# -- Pascal VOC 2012 + SBD ----------------------------------------------------------------------------------

#: VOC's class ids (index in VOC's class list, 0 background) of the object classes the miniature uses.
PERSON, CAT, BUS, SOFA, DOG, AEROPLANE, CAR = 15, 8, 6, 18, 12, 1, 7
VOC_VOID = 255

#: image id → object classes of its mask. The sets of ids follow the archives' overlaps: some of VOC's own
#: ``train`` images are also in SBD, some of VOC's ``val`` images are in SBD's ``val`` (and so not in train_aug).
VOC_TRAIN_ONLY = {"2007_000032": [AEROPLANE], "2007_000039": [PERSON], "2007_000063": [DOG, CAT], "2007_000068": [BUS]}
VOC_TRAIN_AND_SBD = {"2007_000121": [CAT], "2007_000129": [SOFA], "2007_000170": [CAR]}
SBD_ONLY = {
    f"2008_{number:06d}": classes
    for number, classes in zip(
        range(2, 70, 4),
        [[PERSON], [CAT], [BUS], [SOFA], [DOG], [PERSON], [CAT], [PERSON, CAT], [BUS], [],
         [CAR], [AEROPLANE], [PERSON], [DOG], [SOFA], [CAT], [BUS]],
        strict=True,
    )
}  # fmt: skip
VOC_VAL = {
    "2007_000033": [AEROPLANE], "2007_000042": [BUS], "2007_000061": [CAT], "2007_000123": [PERSON],
    "2007_000187": [DOG], "2007_000175": [SOFA],
}  # fmt: skip
#: VOC val images that SBD also annotates (in its val list): excluded from train_aug all the same.
VOC_VAL_IN_SBD = ("2007_000033", "2007_000123")
#: SBD's own lists: every SBD id is in exactly one of them.
SBD_VAL_ONLY = tuple(sorted(SBD_ONLY)[-5:])
VOC_SIZES = ((24, 32), (32, 24), (28, 20))  #: (height, width) of the images, in turn
_SBD_MAT_HEADER = b"MATLAB 5.0 MAT-file, Platform: GLNXA64, Created on: Thu Jun 23 18:09:50 2011"


def voc_palette() -> list[int]:
    """VOC's 256-colour PNG palette, flat ``[r, g, b, …]``: the bits of index c spread over r, g and b."""
    palette = []
    for index in range(256):
        value, rgb = index, [0, 0, 0]
        for shift in range(7, -1, -1):
            for channel in range(3):
                rgb[channel] |= ((value >> channel) & 1) << shift
            value >>= 3
        palette += rgb
    return palette


def voc_all_ids() -> dict[str, list[int]]:
    """Every image id of the miniature (VOC's and SBD's) → its object classes."""
    return VOC_TRAIN_ONLY | VOC_TRAIN_AND_SBD | SBD_ONLY | VOC_VAL


def voc_train_aug_ids() -> list[str]:
    """The ids train_aug holds by its definition: SBD's train and val, plus VOC's train, minus VOC's val."""
    sbd = set(VOC_TRAIN_AND_SBD) | set(SBD_ONLY) | set(VOC_VAL_IN_SBD)
    return sorted((sbd | set(VOC_TRAIN_ONLY) | set(VOC_TRAIN_AND_SBD)) - set(VOC_VAL))


def _object_boxes(classes: list[int], height: int, width: int, rng: np.random.Generator) -> list[tuple]:
    """One rectangle ``(class, top, left, bottom, right)`` per object, side by side, at drawn offsets."""
    boxes, band = [], width // max(1, len(classes))
    for k, label in enumerate(classes):
        top, left = int(rng.integers(2, height // 3)), k * band + int(rng.integers(2, 4))
        boxes.append((label, top, left, height - int(rng.integers(2, 5)), (k + 1) * band - 2))
    return boxes


def _voc_masks(classes: list[int], height: int, width: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """VOC's mask (objects ringed by a one-pixel void border) and SBD's (the same objects, no void)."""
    voc = np.zeros((height, width), dtype=np.uint8)
    sbd = np.zeros((height, width), dtype=np.uint8)
    for label, top, left, bottom, right in _object_boxes(classes, height, width, rng):
        voc[top - 1 : bottom + 1, left - 1 : right + 1] = VOC_VOID
        voc[top:bottom, left:right] = label
        sbd[top:bottom, left:right] = label
    return voc, sbd


def _save_sbd_mat(path: Path, labels: np.ndarray) -> None:
    """SBD's ``cls/<id>.mat``: ``GTcls`` with the class mask, per-class boundary maps and the classes present."""
    from scipy.io import savemat
    from scipy.sparse import csc_matrix

    boundaries = np.empty((20, 1), dtype=object)
    for c in range(20):
        region = labels == c + 1
        edge = region & ~np.pad(region, 1)[2:, 1:-1] | region & ~np.pad(region, 1)[1:-1, 2:]
        boundaries[c, 0] = csc_matrix(edge)
    present = np.array([[c] for c in np.unique(labels) if c != 0], dtype=np.uint8).reshape(-1, 1)
    gt = {"Segmentation": labels.astype(np.uint8), "Boundaries": boundaries, "CategoriesPresent": present}
    buffer = io.BytesIO()
    savemat(buffer, {"GTcls": gt}, do_compression=True)
    # the 116-byte text header carries the time of writing; SBD's fixed one keeps rewritten files identical
    path.write_bytes(_SBD_MAT_HEADER.ljust(116) + buffer.getvalue()[116:])


def write_voc(root: Path) -> list[str]:
    """Writes VOC 2012 and SBD as their archives unpack under the ``VOCdevkit`` folder ``root``."""
    voc, sbd = root / "VOC2012", root / "SBD" / "benchmark_RELEASE" / "dataset"
    folders = (voc / "JPEGImages", voc / "SegmentationClass", voc / "ImageSets" / "Segmentation")
    for folder in (*folders, sbd / "img", sbd / "cls"):
        folder.mkdir(parents=True, exist_ok=True)
    sbd_ids = set(VOC_TRAIN_AND_SBD) | set(SBD_ONLY) | set(VOC_VAL_IN_SBD)
    voc_mask_ids = set(VOC_TRAIN_ONLY) | set(VOC_TRAIN_AND_SBD) | set(VOC_VAL)
    rng = np.random.default_rng(2012)
    palette = voc_palette()
    for n, (image_id, classes) in enumerate(sorted(voc_all_ids().items())):
        height, width = VOC_SIZES[n % len(VOC_SIZES)]
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        image.save(voc / "JPEGImages" / f"{image_id}.jpg", quality=90)
        voc_mask, sbd_mask = _voc_masks(classes, height, width, rng)
        if image_id in voc_mask_ids:
            png = Image.fromarray(voc_mask, mode="P")
            png.putpalette(palette)
            png.save(voc / "SegmentationClass" / f"{image_id}.png")
        if image_id in sbd_ids:
            image.save(sbd / "img" / f"{image_id}.jpg", quality=90)
            _save_sbd_mat(sbd / "cls" / f"{image_id}.mat", sbd_mask)
    lists = voc / "ImageSets" / "Segmentation"
    train, val = sorted(VOC_TRAIN_ONLY | VOC_TRAIN_AND_SBD), sorted(VOC_VAL)
    for name, ids in (("train", train), ("val", val), ("trainval", sorted(train + val))):
        (lists / f"{name}.txt").write_text("".join(f"{i}\n" for i in ids))
    sbd_val = sorted(set(SBD_VAL_ONLY) | set(VOC_VAL_IN_SBD))
    (sbd / "train.txt").write_text("".join(f"{i}\n" for i in sorted(sbd_ids - set(sbd_val))))
    (sbd / "val.txt").write_text("".join(f"{i}\n" for i in sbd_val))
    return []


# -- Cityscapes -------------------------------------------------------------------------------------------

CITYSCAPES_TRAIN = (
    "aachen", "bochum", "bremen", "cologne", "darmstadt", "dusseldorf", "erfurt", "hamburg", "hanover", "jena",
    "krefeld", "monchengladbach", "stuttgart", "strasbourg", "tubingen", "ulm", "weimar", "zurich",
)  # fmt: skip
CITYSCAPES_VAL = ("frankfurt", "lindau", "munster")
CITYSCAPES_SIZE = (64, 128)  #: (height, width), Cityscapes' 1:2 aspect
#: the Cityscapes label ids the scenes use, with their names and colours (cityscapesScripts' labels.py)
CITYSCAPES_IDS = {
    0: ("unlabeled", (0, 0, 0)), 1: ("ego vehicle", (0, 0, 0)), 3: ("out of roi", (0, 0, 0)),
    7: ("road", (128, 64, 128)), 8: ("sidewalk", (244, 35, 232)), 11: ("building", (70, 70, 70)),
    17: ("pole", (153, 153, 153)), 21: ("vegetation", (107, 142, 35)), 23: ("sky", (70, 130, 180)),
    24: ("person", (220, 20, 60)), 26: ("car", (0, 0, 142)), 33: ("bicycle", (119, 11, 32)),
}  # fmt: skip


def cityscapes_frames(root: Path, split: str) -> list[tuple[Path, Path]]:
    """The (image, labelIds) paths the miniature writes for ``split``, in the order of the cities."""
    cities = CITYSCAPES_TRAIN if split == "train" else CITYSCAPES_VAL
    return [
        (
            root / "leftImg8bit" / split / city / f"{city}_000000_000019_leftImg8bit.png",
            root / "gtFine" / split / city / f"{city}_000000_000019_gtFine_labelIds.png",
        )
        for city in cities
    ]


def _street_scene(rng: np.random.Generator) -> tuple[np.ndarray, list[tuple[int, tuple[int, int, int, int]]]]:
    """A street's label ids ``[H, W]`` and its regions ``(id, (top, left, bottom, right))``, painted in order."""
    height, width = CITYSCAPES_SIZE
    horizon = int(rng.integers(20, 30))
    car_left, person_left = int(rng.integers(40, 90)), int(rng.integers(2, 20))
    regions = [
        (23, (0, 0, horizon - 8, width)),  # sky
        (11, (horizon - 8, 0, horizon + 8, width)),  # buildings
        (21, (horizon - 12, int(rng.integers(90, 110)), horizon + 8, width)),  # trees
        (7, (horizon + 8, 24, height, width)),  # road
        (8, (horizon + 8, 0, height, 24)),  # sidewalk
        (17, (horizon - 14, 22, horizon + 10, 24)),  # a pole
        (26, (horizon + 10, car_left, horizon + 22, car_left + 24)),  # a car
        (24, (horizon, person_left, horizon + 14, person_left + 4)),  # a person
        (33, (horizon + 12, car_left + 28, horizon + 18, car_left + 34)),  # a bicycle
        (1, (height - 6, 0, height, width)),  # the ego vehicle's bonnet
        (3, (0, 0, height, 1)),  # out of the region of interest: the image's left and right edges
        (3, (0, width - 1, height, width)),
        (0, (horizon - 2, 60, horizon, 64)),  # an unlabeled patch
    ]
    labels = np.zeros((height, width), dtype=np.uint8)
    for label, (top, left, bottom, right) in regions:
        labels[top:bottom, left:right] = label
    return labels, regions


def _write_frame(image_path: Path, label_path: Path, rng: np.random.Generator) -> None:
    """One frame: its image and its four gtFine files."""
    image_path.parent.mkdir(parents=True, exist_ok=True)
    label_path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (*CITYSCAPES_SIZE, 3), dtype=np.uint8)).save(image_path)
    labels, regions = _street_scene(rng)
    Image.fromarray(labels).save(label_path)
    stem = str(label_path).removesuffix("_labelIds.png")
    instances = labels.astype(np.uint16)
    counts: dict[int, int] = {}
    for label, (top, left, bottom, right) in regions:
        if label in (24, 26, 33):  # things get instance ids id·1000 + k
            instances[top:bottom, left:right] = label * 1000 + counts.setdefault(label, 0)
            counts[label] += 1
    Image.fromarray(instances).save(f"{stem}_instanceIds.png")
    colours = np.array([CITYSCAPES_IDS.get(i, ("", (0, 0, 0)))[1] for i in range(256)], dtype=np.uint8)
    rgba = np.concatenate([colours[labels], np.full((*CITYSCAPES_SIZE, 1), 255, dtype=np.uint8)], axis=-1)
    Image.fromarray(rgba, mode="RGBA").save(f"{stem}_color.png")
    objects = [
        {"label": CITYSCAPES_IDS[label][0], "polygon": [[left, top], [right, top], [right, bottom], [left, bottom]]}
        for label, (top, left, bottom, right) in regions
    ]
    polygons = {"imgHeight": CITYSCAPES_SIZE[0], "imgWidth": CITYSCAPES_SIZE[1], "objects": objects}
    Path(f"{stem}_polygons.json").write_text(json.dumps(polygons, indent=4))


def write_cityscapes(root: Path) -> list[str]:
    """Writes one frame per training and validation city as Cityscapes' two archives unpack under ``root``."""
    rng = np.random.default_rng(2016)
    for split in ("train", "val"):
        for image_path, label_path in cityscapes_frames(root, split):
            _write_frame(image_path, label_path, rng)
    return []


# -- CocoStuff (STEGO's layout) -------------------------------------------------------------------------------

#: fine labels (stuff+thing maps: COCO's category id − 1) by name
COCO_FINE = {
    "person": 0, "car": 2, "dog": 17, "bottle": 43, "grass": 123, "road": 148, "sea": 154, "sky-other": 156,
    "tree": 168, "wall-concrete": 171,
}  # fmt: skip
COCO_UNLABELED = 255
#: the dominant fine label of the training images, in turn (coarse: person, vehicle, animal, plant, sky, ground)
COCO_DOMINANT = ("person", "car", "dog", "grass", "sky-other", "road")
COCO_TRAIN_IDS = tuple(f"{9 + 16 * n:012d}" for n in range(24))
COCO_UNLISTED_IDS = ("000000900001", "000000900002")  #: on disk, in no curated list
COCO_VAL_IDS = tuple(f"{139 + 146 * n:012d}" for n in range(4))
COCO_SIZES = ((32, 40), (40, 32), (36, 48))  #: (height, width), in turn


def _coco_mask(n: int, height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """Image n's map: its dominant label on the left half, two others in the right half, an unlabelled strip."""
    others = [COCO_FINE[name] for name in COCO_FINE if name != COCO_DOMINANT[n % len(COCO_DOMINANT)]]
    second, third = rng.choice(others, size=2, replace=False)
    mask = np.full((height, width), COCO_FINE[COCO_DOMINANT[n % len(COCO_DOMINANT)]], dtype=np.uint8)
    split = int(rng.integers(height // 3, 2 * height // 3))
    mask[:split, width // 2 + 2 :] = second
    mask[split:, width // 2 + 2 :] = third
    mask[:, width // 2 : width // 2 + 2] = COCO_UNLABELED
    return mask


def write_cocostuff(root: Path) -> list[str]:
    """Writes STEGO's CocoStuff layout under ``root``: images, stuff+thing maps and the curated lists."""
    rng = np.random.default_rng(2017)
    splits = (("train2017", COCO_TRAIN_IDS + COCO_UNLISTED_IDS), ("val2017", COCO_VAL_IDS))
    for split, ids in splits:
        for folder in ("images", "annotations", "curated"):
            (root / folder / split).mkdir(parents=True, exist_ok=True)
        for n, image_id in enumerate(ids):
            height, width = COCO_SIZES[n % len(COCO_SIZES)]
            image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            Image.fromarray(image).save(root / "images" / split / f"{image_id}.jpg", quality=90)
            Image.fromarray(_coco_mask(n, height, width, rng)).save(root / "annotations" / split / f"{image_id}.png")
    for split, listed in (("train2017", COCO_TRAIN_IDS), ("val2017", COCO_VAL_IDS)):
        (root / "curated" / split / "Coco164kFull_Stuff_Coarse.txt").write_text("".join(f"{i}\n" for i in listed))
        subset = listed[: len(listed) - 1] if split == "val2017" else listed[::2]
        (root / "curated" / split / "Coco164kFull_Stuff_Coarse_7.txt").write_text("".join(f"{i}\n" for i in subset))
    return []


MINIATURES: list[Miniature] = [
    Miniature(
        "PascalVOC",
        write_voc,
        (
            "--data.partitioner.init_args.num_clients=4",
            "--data.dataset.init_args.canvas_size=32",
            "--data.dataset.init_args.num_workers=2",
            "--data.train_transform.init_args.crop_size=32",
        ),
    ),
    Miniature(
        "CityscapesFUSS",
        write_cityscapes,
        (
            "--data.dataset.init_args.image_size=32",
            "--data.dataset.init_args.test_size=32",
            "--data.dataset.init_args.num_workers=2",
        ),
    ),
    Miniature(
        "CocoStuff27",
        write_cocostuff,
        (
            "--data.partitioner.init_args.num_clients=3",
            "--data.partitioner.init_args.min_size=2",
            "--data.dataset.init_args.image_size=32",
            "--data.dataset.init_args.test_size=32",
            "--data.dataset.init_args.num_workers=2",
        ),
    ),
]
