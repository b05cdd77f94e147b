"""Miniatures of the street-scene datasets of LADD's experiments (Shenaj et al., WACV 2023), in LADD's ``data/`` layout.

All four share one root (a config's ``data/ladd``), each under its own folder, as LADD's ``data/`` folder holds them:

- ``gta5/``: ``data/images/NNNNN.png`` (RGB) and ``data/labels/NNNNN.png`` (palette PNGs whose indices are Cityscapes
  label ids), listed by ``splits/{train,test}.txt`` lines ``/images/NNNNN.png /labels/NNNNN.png``;
- ``cityscapes/``: ``data/leftImg8bit/{train,val}/<city>/<city>_<seq>_<frame>_leftImg8bit.png`` and
  ``data/gtFine/.../<city>_<seq>_<frame>_gtFine_labelIds.png`` (8-bit grey, Cityscapes label ids); the 24 train
  files ``splits/heterogeneous/train/all_data_<i>.json`` and ``splits/heterogeneous/test/all_data_0.json``;
- ``crosscity/``: ``data/cities/<City>/Images/Train/pano_*.jpg`` (no labels), ``<City>/Images/Test/pano_*.png`` and
  ``<City>/Labels/Test/pano_*_eval.png`` (8-bit grey, Cityscapes label ids); ``splits/by_city_cpc0_ms27_me10/train/
  {Rio,Rome,Taipei,Tokyo}.json`` and ``.../test/test_user.json`` (whose user also lists each image's ``city``);
- ``mapillary/``: ``data/{training,validation}/images/<key>.jpg`` of differing sizes and ``.../v1.2/labels/<key>.png``
  (palette PNGs whose indices are Mapillary Vistas v1.2 ids); ``splits/clustering/train/{AF,AS,EU,NA,OC,SA}.json``
  and ``.../test/test_user.json`` (whose ``num_samples`` is a bare number, as LADD's file has it).

The split files are LEAF's JSON (``users``, ``num_samples``, ``user_data``) with users named as LADD's are
(``jena0``, ``Rio1``, ``EU0``, the single ``test_user``). The writers of the three target datasets also write LADD's
cluster file of that dataset under ``clusters_dir/`` (``{"0": [user, ...], ...}``, four clusters). Images hold
seeded random pixels; label maps hold blocks of random ids, void ones included, so several classes show.

Rows of every dataset run on these with their miniature's flags. A GTA5 (pre-training) row also reads its target
dataset, whose miniature must be written too, and needs that target's options: :func:`gta5_row_flags`. The
federated rows start from the pre-training row's checkpoint, so that row runs first.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from miniatures import Miniature

#: (H, W) of the Cityscapes and CrossCity images (1024×2048 / 16) and of the size flags.
SIZE = (64, 128)
#: (H, W) of the GTA5 images: GTA5's 1052×1914 at width 128.
GTA5_SIZE = (70, 128)
#: (H, W) of the training crop the flags ask for: the smallest the networks take (sides divisible by 32).
CROP = (32, 64)

#: Cityscapes: train split file → {user: images}, one user of each of LADD's 24 files, named as in that file.
CITYSCAPES_TRAIN: dict[str, dict[str, int]] = {
    f"all_data_{i}.json": {user: 2 + i % 2}
    for i, user in enumerate(
        ["jena0", "jena6", "stuttgart4", "ulm2", "dusseldorf0", "dusseldorf6", "darmstadt4", "zurich2", "bremen0",
         "bremen6", "bochum4", "hamburg2", "tubingen0", "tubingen6", "aachen4", "krefeld2", "hanover0", "hanover6",
         "weimar4", "strasbourg2", "cologne0", "cologne6", "erfurt4", "monchengladbach2"]
    )
}  # fmt: skip
#: Cityscapes' test images: the validation cities.
CITYSCAPES_TEST = ("frankfurt", "frankfurt", "lindau", "munster")
#: CrossCity: train split file → {user: images}.
CROSSCITY_TRAIN: dict[str, dict[str, int]] = {
    f"{city}.json": {f"{city}1": 3, f"{city}2": 2} for city in ("Rio", "Rome", "Taipei", "Tokyo")
}
#: Mapillary: train split file → {user: (H, W) of each of its images}; the images differ in size as Mapillary's do.
MAPILLARY_TRAIN: dict[str, dict[str, list[tuple[int, int]]]] = {
    "AF.json": {"AF0": [(72, 96), (54, 96)]},
    "AS.json": {"AS0": [(96, 128), (72, 128)], "AS1": [(60, 80), (90, 120)]},
    "EU.json": {"EU0": [(72, 96), (96, 72)], "EU1": [(54, 96), (54, 96)]},
    "NA.json": {"NA0": [(90, 120), (72, 128)]},
    "OC.json": {"OC0": [(60, 80), (72, 96)]},
    "SA.json": {"SA0": [(54, 96), (96, 128)]},
}
#: Mapillary's test (validation) images, (H, W) each.
MAPILLARY_TEST = ((72, 96), (54, 96), (96, 128))
#: GTA5: split → number of images.
GTA5_SPLITS = {"train": 4, "test": 2}

#: Cluster files LADD ships, by dataset folder.
CLUSTER_FILES = {
    "cityscapes": "cityscapes_b1_cluster_heterogeneous.json",
    "crosscity": "crosscity_b1_cluster_by_city_cpc0_ms27_me10.json",
    "mapillary": "mapillary_b1_cluster_clustering.json",
}

_DATASET = "--data.dataset.init_args"
_TRANSFORM = "--data.train_transform.init_args"
_SIZE = f"[{SIZE[0]},{SIZE[1]}]"
_CROP = f"[{CROP[0]},{CROP[1]}]"
#: Flags a GTA5 row needs for its target, beyond GTA5's: the test set it is scored on (``evaluate_on``) and, in the
#: FDA rows (those that set ``data.train_transform.init_args.target``), the clients whose styles it computes.
GTA5_TARGET_FLAGS: dict[str, dict[str, tuple[str, ...]]] = {
    "cityscapes": {"evaluate_on": (), "style_target": (f"{_TRANSFORM}.target.init_args.size={_SIZE}",)},
    "crosscity": {"evaluate_on": (), "style_target": (f"{_TRANSFORM}.target.init_args.size={_SIZE}",)},
    "mapillary": {
        "evaluate_on": (f"{_DATASET}.evaluate_on.init_args.test_width={SIZE[1]}",),
        "style_target": (f"{_TRANSFORM}.target.init_args.size={_SIZE}",),
    },
}


def gta5_row_flags(target: str, style_target: bool) -> tuple[str, ...]:
    """Every flag a GTA5 row needs: GTA5's, then those of its ``target`` (``data.dataset.init_args.target``: the
    dataset scored by ``evaluate_on``), and, in a row that computes the clients' styles (``style_target``: it sets
    ``data.train_transform.init_args.target``), those of that dataset too."""
    extra = GTA5_TARGET_FLAGS[target]
    return (*_GTA5_FLAGS, *extra["evaluate_on"], *(extra["style_target"] if style_target else ()))


# Cityscapes label ids run 0…33 (void ones included); Mapillary Vistas v1.2 has 66 classes (0…65).
_CITYSCAPES_IDS = np.arange(34)
_MAPILLARY_IDS = np.arange(66)


def _rng(*key: object) -> np.random.Generator:
    """A generator seeded by ``key`` alone, so every file's content is fixed whatever else is written."""
    return np.random.default_rng(list(json.dumps(key).encode()))


def write_rgb(path: Path, shape: tuple[int, int], *key: object) -> None:
    """Writes random RGB pixels of ``shape`` (H, W), seeded by ``key``; the suffix chooses PNG or JPEG."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(_rng("rgb", *key).integers(0, 256, (*shape, 3), dtype=np.uint8))
    image.save(path, **({"quality": 95} if path.suffix == ".jpg" else {}))


def label_ids(shape: tuple[int, int], ids: np.ndarray, *key: object) -> np.ndarray:
    """``[H, W]`` uint8 blocks of ids drawn from ``ids`` (a 4 × 8 grid of cells over the image), seeded by ``key``."""
    cells = _rng("labels", *key).choice(ids, size=(4, 8)).astype(np.uint8)
    rows, cols = np.mgrid[: shape[0], : shape[1]]
    return cells[rows * 4 // shape[0], cols * 8 // shape[1]]


def write_labels(path: Path, ids: np.ndarray, palette: bool) -> None:
    """Writes a label map: an 8-bit palette PNG (GTA5, Mapillary) or an 8-bit grey one (Cityscapes, CrossCity)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if palette:  # the indices are the ids; the colours only draw them
        image = Image.frombytes("P", (ids.shape[1], ids.shape[0]), np.ascontiguousarray(ids).tobytes())
        image.putpalette(_rng("palette").integers(0, 256, 768, dtype=np.uint8).tolist())
    else:
        image = Image.fromarray(ids)
    image.save(path)


def write_leaf(path: Path, user_data: dict[str, dict[str, list[str]]], bare_count: bool = False) -> None:
    """Writes a LEAF split file; ``bare_count`` writes ``num_samples`` as one number (a single user's count)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    counts = [len(data["x"]) for data in user_data.values()]
    num_samples: list[int] | int = counts[0] if bare_count else counts
    path.write_text(json.dumps({"users": list(user_data), "num_samples": num_samples, "user_data": user_data}))


def write_clusters(root: Path, dataset: str, users: list[str]) -> Path:
    """Writes LADD's cluster file of ``dataset``: four clusters, user i in cluster i mod 4; returns its path."""
    path = root / "clusters_dir" / CLUSTER_FILES[dataset]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({str(c): users[c::4] for c in range(4)}))
    return path


def cityscapes_files(user: str, index: int, split: str = "train") -> tuple[str, str]:
    """The (image, label) paths a Cityscapes split file lists for ``user``'s ``index``-th image."""
    city = user.rstrip("0123456789")
    stem = f"{split}/{city}/{city}_{int(user[len(city) :] or 0) * 100 + index:06d}_000019"
    return f"{stem}_leftImg8bit.png", f"{stem}_gtFine_labelIds.png"


def write_cityscapes(root: Path) -> list[str]:
    """Cityscapes' images and label ids, LADD's heterogeneous split files and its cluster file."""
    base = root / "cityscapes"
    users = []
    for name, clients in CITYSCAPES_TRAIN.items():
        user_data = {}
        for user, count in clients.items():
            pairs = [cityscapes_files(user, i) for i in range(count)]
            for x, y in pairs:
                write_rgb(base / "data/leftImg8bit" / x, SIZE, "cityscapes", x)
                write_labels(base / "data/gtFine" / y, label_ids(SIZE, _CITYSCAPES_IDS, "cityscapes", y), False)
            user_data[user] = {"x": [x for x, _ in pairs], "y": [y for _, y in pairs]}
            users.append(user)
        write_leaf(base / "splits/heterogeneous/train" / name, user_data)
    test = [cityscapes_files(f"{city}{k}", 0, "val") for k, city in enumerate(CITYSCAPES_TEST)]
    for x, y in test:
        write_rgb(base / "data/leftImg8bit" / x, SIZE, "cityscapes", x)
        write_labels(base / "data/gtFine" / y, label_ids(SIZE, _CITYSCAPES_IDS, "cityscapes", y), False)
    write_leaf(base / "splits/heterogeneous/test/all_data_0.json",
               {"test_user": {"x": [x for x, _ in test], "y": [y for _, y in test]}})  # fmt: skip
    write_clusters(root, "cityscapes", users)
    return []


def write_crosscity(root: Path) -> list[str]:
    """CrossCity's images (training ones unlabelled), its test labels, LADD's split files and its cluster file."""
    base = root / "crosscity"
    users, number = [], 0
    for name, clients in CROSSCITY_TRAIN.items():
        city, user_data = name.removesuffix(".json"), {}
        for user, count in clients.items():
            xs = []
            for i in range(count):
                number += 1
                xs.append(f"{city}/Images/Train/pano_{number:05d}_{i % 2}_{180 * (i % 2)}.jpg")
                write_rgb(base / "data/cities" / xs[-1], SIZE, "crosscity", xs[-1])
            user_data[user] = {"x": xs}
            users.append(user)
        write_leaf(base / "splits/by_city_cpc0_ms27_me10/train" / name, user_data)
    test: dict[str, list[str]] = {"x": [], "y": [], "city": []}
    for k, city in enumerate(("Rio", "Rome", "Taipei", "Tokyo")):
        x, y = f"{city}/Images/Test/pano_{k:05d}_2_0.png", f"{city}/Labels/Test/pano_{k:05d}_2_0_eval.png"
        write_rgb(base / "data/cities" / x, SIZE, "crosscity", x)
        write_labels(base / "data/cities" / y, label_ids(SIZE, _CITYSCAPES_IDS, "crosscity", y), False)
        test["x"].append(x), test["y"].append(y), test["city"].append(city)
    write_leaf(base / "splits/by_city_cpc0_ms27_me10/test/test_user.json", {"test_user": test})
    write_clusters(root, "crosscity", users)
    return []


def mapillary_files(split: str, key: str) -> tuple[str, str]:
    """The (image, label) paths a Mapillary split file lists for the image ``key`` of ``split``."""
    return f"{split}/images/{key}.jpg", f"{split}/v1.2/labels/{key}.png"


def write_mapillary(root: Path) -> list[str]:
    """Mapillary's images of differing sizes, their v1.2 label ids, LADD's split files and its cluster file."""
    base = root / "mapillary"
    users = []

    def write(split: str, key: str, shape: tuple[int, int]) -> tuple[str, str]:
        x, y = mapillary_files(split, key)
        write_rgb(base / "data" / x, shape, "mapillary", x)
        write_labels(base / "data" / y, label_ids(shape, _MAPILLARY_IDS, "mapillary", y), True)
        return x, y

    for name, clients in MAPILLARY_TRAIN.items():
        user_data = {}
        for user, shapes in clients.items():
            pairs = [write("training", f"{user}_{i:02d}", shape) for i, shape in enumerate(shapes)]
            user_data[user] = {"x": [x for x, _ in pairs], "y": [y for _, y in pairs]}
            users.append(user)
        write_leaf(base / "splits/clustering/train" / name, user_data)
    test = [write("validation", f"val_{i:02d}", shape) for i, shape in enumerate(MAPILLARY_TEST)]
    write_leaf(base / "splits/clustering/test/test_user.json",
               {"test_user": {"x": [x for x, _ in test], "y": [y for _, y in test]}}, bare_count=True)  # fmt: skip
    write_clusters(root, "mapillary", users)
    return []


def gta5_files(number: int) -> tuple[str, str]:
    """The (image, label) paths GTA5's split lines give for image ``number``, relative to ``gta5/data``."""
    return f"images/{number:05d}.png", f"labels/{number:05d}.png"


def write_gta5(root: Path) -> list[str]:
    """GTA5's images, their palette label maps (Cityscapes label ids) and LADD's train and test lists."""
    base, number = root / "gta5", 0
    for split, count in GTA5_SPLITS.items():
        lines = []
        for _ in range(count):
            number += 1
            x, y = gta5_files(number)
            write_rgb(base / "data" / x, GTA5_SIZE, "gta5", x)
            write_labels(base / "data" / y, label_ids(GTA5_SIZE, _CITYSCAPES_IDS, "gta5", y), True)
            lines.append(f"/{x} /{y}\n")
        (base / "splits").mkdir(parents=True, exist_ok=True)
        (base / "splits" / f"{split}.txt").write_text("".join(lines))
    return []


#: GTA5 rows: the source images, the target's test images (``evaluate_on``) and StyleAugment's FFT size and crop;
#: GTA5 is one natural client (centralized pre-training), so a round can sample only that one.
_GTA5_FLAGS = (
    "--trainer.clients_per_round=1",
    f"{_DATASET}.size=[{GTA5_SIZE[0]},{GTA5_SIZE[1]}]",
    f"{_DATASET}.evaluate_on.init_args.size={_SIZE}",
    f"{_TRANSFORM}.size={_SIZE}",
    f"{_TRANSFORM}.geometry.init_args.crop_size={_CROP}",
)


def _gta5_flags(config: dict) -> tuple[str, ...]:
    """A GTA5 row's flags, from its resolved config: its target, and whether it restyles with the target's styles."""
    transform = (config["data"].get("train_transform") or {}).get("init_args") or {}
    return gta5_row_flags(config["data"]["dataset"]["init_args"]["target"], transform.get("target") is not None)


GTA5 = Miniature("GTA5", write_gta5, _gta5_flags)
#: the source of a target row whose client reads GTA5 itself (MCD's): its size and its batches' crop
_MODEL_SOURCE_FLAGS = (
    f"--model.init_args.source.init_args.size=[{GTA5_SIZE[0]},{GTA5_SIZE[1]}]",
    f"--model.init_args.source_transform.init_args.crop_size={_CROP}",
)


def _target_flags(*flags: str) -> Callable[[dict], tuple[str, ...]]:
    """A target row's ``flags``, and the source's in a row whose client holds GTA5 as its source."""

    def for_row(config: dict) -> tuple[str, ...]:
        source = (config["model"].get("init_args") or {}).get("source") or {}
        return (*flags, *(_MODEL_SOURCE_FLAGS if str(source.get("class_path", "")).endswith(".GTA5") else ()))

    return for_row


MINIATURES: list[Miniature] = [
    GTA5,
    Miniature(
        "CityscapesFFREEDA",
        write_cityscapes,
        _target_flags(f"{_DATASET}.size={_SIZE}", f"{_DATASET}.test_size={_SIZE}", f"{_TRANSFORM}.crop_size={_CROP}"),
    ),
    Miniature(
        "CrossCity", write_crosscity, _target_flags(f"{_DATASET}.size={_SIZE}", f"{_TRANSFORM}.crop_size={_CROP}")
    ),
    Miniature(
        "Mapillary",
        write_mapillary,
        _target_flags(
            f"{_DATASET}.size={_SIZE}",
            f"{_DATASET}.train_width={SIZE[1]}",
            f"{_DATASET}.crop={_CROP}",
            f"{_DATASET}.test_width={SIZE[1]}",
        ),
    ),
]
