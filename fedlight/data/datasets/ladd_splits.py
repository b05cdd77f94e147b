"""The datasets of LADD's experiments, read through LADD's split files (Shenaj et al., WACV 2023, Sec. 5.1).

LADD ships its federated splits as JSON files in LEAF's layout (``{"users": [...], "num_samples": [...],
"user_data": {user: {"x": [image paths], "y": [label paths]}}}``) and GTA5's as text lines
``/images/00001.png /labels/00001.png``. Point ``root`` at a folder laid out like LADD's ``data/`` folder:
its ``<dataset>/splits/`` copied from LADD's repository and the images extracted under ``<dataset>/data/``:

- :class:`GTA5` (the source): ``gta5/data/images/``, ``gta5/data/labels/``; ``gta5/splits/train.txt``;
- :class:`CityscapesFFREEDA`: ``cityscapes/data/leftImg8bit/``, ``cityscapes/data/gtFine/``;
  ``cityscapes/splits/heterogeneous/{train,test}/*.json``;
- :class:`CrossCity`: images and labels under ``crosscity/data/cities/``;
  ``crosscity/splits/by_city_cpc0_ms27_me10/{train,test}/*.json``;
- :class:`Mapillary`: ``mapillary/data/training/``, ``mapillary/data/validation/``;
  ``mapillary/splits/clustering/{train,test}/*.json``.

Every split file LADD ships must be there (a missing one would silently drop its users), and so must every image
and label file they list; each reader reports all that is missing at set-up in one error naming the files. A split
file that is no valid LEAF JSON, a user listed by two files, and an image or label file that cannot be decoded when a
batch reads it (truncated, garbage, a colour rendering in place of the ids) are errors naming the file too.

Clients are the split files' users (``Rio7``, ``aachen3``, ``EU12``): the datasets give them as natural ids, so
the :class:`~fedlight.data.partition.Natural` partitioner reproduces LADD's partition (144 Cityscapes clients, 472
CrossCity clients, 357 Mapillary clients). The test set is the file's single ``test_user``; CrossCity's test
images carry their city as their group. Label PNGs hold Cityscapes label ids (Mapillary its own ids), mapped to
train ids with LADD's tables (19 classes; 13 for CrossCity and for GTA5 pre-training towards it); other ids
become void (255). CrossCity's training clients have no labels at all: their targets are void everywhere and
only the test set is scored.

Images are read lazily per batch, resized to one ``size`` (H, W) so that batches stack (bilinear for images,
nearest for labels) and normalised with mean = std = 0.5 (LADD's, for every dataset; its code uses ImageNet
statistics on Cityscapes, a quirk not kept). The defaults are the full resolutions LADD reads: it trains GTA5,
Cityscapes and CrossCity on a random scale (0.7–2) of the full image cut to 512×1024 (the run's
``--data.train_transform``, :class:`~fedlight.data.transforms.RandomScaleCropFlip` with ``crop_size: [512,
1024]``) and tests Cityscapes and CrossCity at full resolution. Mapillary's images differ in size: LADD trains
and tests them at width 1024 with each image's aspect ratio kept (:class:`Mapillary`'s ``train_width`` and
``test_width``), cutting a random 512×1024 window from each training image as it is read (:class:`SplitCrops`).
It trains Cityscapes' clients on each image and a copy (:class:`CityscapesFFREEDA`'s ``double``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.labels import CITYSCAPES_19_CLASSES, CROSSCITY_13_CLASSES, lookup_table
from fedlight.data.readers.split_images import SplitCrops, SplitImages, SplitMasks
from fedlight.errors import ConfigError

#: Cityscapes label ids → the 19 train ids (``dataset/target/cityscapes.py`` of LADD).
CITYSCAPES_19 = {7: 0, 8: 1, 11: 2, 12: 3, 13: 4, 17: 5, 19: 6, 20: 7, 21: 8, 22: 9, 23: 10, 24: 11, 25: 12,
                 26: 13, 27: 14, 28: 15, 31: 16, 32: 17, 33: 18}  # fmt: skip
#: Cityscapes label ids → CrossCity's 13 classes (road, sidewalk, building, traffic light, sign, vegetation, sky,
#: person, rider, car, bus, motorcycle, bicycle).
CROSSCITY_13 = {7: 0, 8: 1, 11: 2, 19: 3, 20: 4, 21: 5, 23: 6, 24: 7, 25: 8, 26: 9, 28: 10, 32: 11, 33: 12}
#: Mapillary Vistas v1.2 ids → the 19 Cityscapes train ids.
MAPILLARY_19 = {2: 1, 3: 4, 6: 3, 7: 1, 9: 1, 11: 1, 13: 0, 14: 0, 15: 1, 17: 2, 19: 11, 20: 12, 21: 12, 22: 12,
                24: 0, 26: 9, 27: 10, 29: 9, 30: 8, 43: 0, 44: 5, 45: 5, 46: 5, 47: 5, 48: 6, 50: 7, 52: 18,
                54: 15, 55: 13, 57: 17, 58: 16, 61: 14}  # fmt: skip
_DOWNLOAD = {
    "gta5": "GTA5 from https://download.visinf.tu-darmstadt.de/data/from_games/ (images/ and labels/)",
    "cityscapes": "Cityscapes' leftImg8bit_trainvaltest.zip and gtFine_trainvaltest.zip "
    "from https://www.cityscapes-dataset.com/",
    "crosscity": "NTHU CrossCity (Chen et al., ICCV 2017; cities Rio, Rome, Taipei, Tokyo)",
    "mapillary": "Mapillary Vistas v1.2 from https://www.mapillary.com/dataset/vistas (training/, validation/)",
}


class _SplitDataset(FederatedDataset):
    """Reads LADD's split files and checks that they and every file they name exist, reporting all problems at once.

    A split file that is not valid JSON in LEAF's layout, or a user listed by two of them, is one error naming the
    file; so is an image or label file that cannot be decoded when a batch reads it.
    """

    name: str  # folder under root
    images_dir: str  # under root/<name>/data
    labels_dir: str
    split_dir: str  # under root/<name>/splits
    split_names: ClassVar[dict[str, tuple[str, ...]]]  # the split files LADD ships in split_dir/<split>/
    mapping: dict[int, int]  # label id → class
    class_names: tuple[str, ...]  # of the classes the mapping gives

    def __init__(self, root: str, size: tuple[int, int], test_size: tuple[int, int] | None, num_workers: int) -> None:
        self.root = Path(root).expanduser()
        self.size = (int(size[0]), int(size[1]))
        self.test_size = self.size if test_size is None else (int(test_size[0]), int(test_size[1]))
        self.num_workers = num_workers
        self.num_classes = len(set(self.mapping.values()))
        self.input_shape = (3, *self.size)

    @property
    def folder(self) -> Path:
        return self.root / self.name

    @property
    def _fix(self) -> str:
        """What to do about a missing or damaged file."""
        return (
            f"Download {_DOWNLOAD[self.name]}, extract it under {self.folder / 'data'} and copy LADD's "
            f"data/{self.name}/splits/ (github.com/Erosinho13/LADD) to {self.folder / 'splits'}."
        )

    def _require(self, paths: list[Path], listed_in: list[Path] | None = None) -> None:
        """Raises one error for a missing root or every missing path; ``listed_in``: the split file naming each."""
        sources = dict(zip(paths, listed_in or [None] * len(paths), strict=True))
        # each path once (a doubled pool lists its files twice); a folder is no file (a list line cut short)
        missing = [p for p in sources if not p.is_file()]
        if not self.folder.is_dir() or missing:
            shown = ", ".join(str(p) for p in missing[:5]) + (f" and {len(missing) - 5} more" if missing[5:] else "")
            lists = sorted({str(sources[p]) for p in missing[:5] if sources[p] is not None})
            where = f" (listed in {', '.join(lists)})" if lists else ""
            what = (
                f"{len(missing)} files missing{where}: {shown}."
                if self.folder.is_dir()
                else f"no folder {self.folder}."
            )
            raise ConfigError(
                f"{type(self).__name__} is incomplete under --data.dataset.init_args.root={self.root}: {what}",
                self._fix,
            )

    def _damaged(self, file: Path, problem: str) -> ConfigError:
        return ConfigError(
            f"Split file {file} is damaged: {problem}.",
            f"Copy it again from LADD's repository (github.com/Erosinho13/LADD, data/{self.name}/splits/).",
        )

    def _users(self, files: list[Path]) -> list[tuple[str, str, str | None, Path]]:
        """``(user, image path, label path or None, split file)`` of every image listed in LEAF-style JSON files."""
        self._require(files)
        rows, owner = [], {}
        for file in files:
            try:
                users = json.loads(file.read_text(encoding="utf-8"))["user_data"]
                listed = [
                    (str(user), data["x"], data.get("y") or [None] * len(data["x"])) for user, data in users.items()
                ]
                for user, xs, ys in listed:
                    if not all(isinstance(p, str) for p in xs) or not all(p is None or isinstance(p, str) for p in ys):
                        raise ValueError(f"user {user}'s image and label paths are not strings")
                    if len(xs) != len(ys):
                        raise ValueError(f"user {user} lists {len(xs)} images but {len(ys)} label maps")
            except ValueError as error:  # JSON's and UTF-8's decoding errors among them
                raise self._damaged(file, str(error)) from error
            except (KeyError, TypeError, AttributeError) as error:
                raise self._damaged(file, "not LEAF's layout ({'user_data': {user: {'x': [...]}}})") from error
            for user, xs, ys in listed:
                if user in owner:
                    raise ConfigError(
                        f"User {user} is listed by two split files, {owner[user]} and {file}.",
                        f"Keep only LADD's split files in {file.parent}.",
                    )
                owner[user] = file
                rows += [(user, x, y, file) for x, y in zip(xs, ys, strict=True)]
        return rows

    def _pool(
        self, rows: list[tuple[str, str, str | None, Path]], size: tuple[int, int], with_groups: bool,
        keep_width: int | None = None, flips: list[bool] | None = None,
    ) -> LabelledTensors:  # fmt: skip
        images = [self.folder / "data" / self.images_dir / x.lstrip("/") for _, x, _, _ in rows]
        labels = [None if y is None else self.folder / "data" / self.labels_dir / y.lstrip("/") for _, _, y, _ in rows]
        labelled = [(path, row[3]) for path, row in zip(labels, rows, strict=True) if path is not None]
        self._require(
            images + [path for path, _ in labelled], [row[3] for row in rows] + [file for _, file in labelled]
        )
        fix = f"Restore the file: {self._fix}"
        return LabelledTensors(
            SplitImages(images, size, self.num_workers, keep_width, flips, fix),
            SplitMasks(labels, size, lookup_table(self.mapping), self.num_workers, keep_width, flips, fix),
            groups=np.array([row[0] for row in rows]) if with_groups else None,
            labels=np.zeros(len(rows), dtype=np.int64),  # partitions follow the users, not classes
        )

    def _split_files(self, split: str) -> list[Path]:
        """LADD's split files of ``split`` and any other JSON file beside them, in name order (LADD's listing order
        is the file system's; sorting fixes it). LADD's must all be there: a missing one would drop its users."""
        folder = self.folder / "splits" / self.split_dir / split
        found = sorted(folder.glob("*.json")) if folder.is_dir() else []
        return sorted({*found, *(folder / name for name in self.split_names[split])})

    def _read(self, split: str, size: tuple[int, int], with_groups: bool, **kwargs: Any) -> LabelledTensors:
        return self._pool(self._users(self._split_files(split)), size, with_groups, **kwargs)

    def load_train(self) -> LabelledTensors:
        return self._read("train", self.size, with_groups=True)

    def load_test(self) -> LabelledTensors:
        return self._read("test", self.test_size, with_groups=False)


class CityscapesFFREEDA(_SplitDataset):
    """Cityscapes as FedDrive's "heterogeneous" split: 144 clients of one city each, 10–45 images, 500 test images.

    LADD trains its Cityscapes clients on a "double dataset" (``--double_dataset`` in its Cityscapes configs):
    each client's n images followed by n more, index i ≥ n showing image i − n, and no random flip. Its
    Cityscapes class defines the mirroring of that second copy, but the method is never called, so the code
    trains on every image twice, unflipped. ``double`` gives both: ``flipped``, the second copy mirrored
    left–right as the class intends, and ``repeated``, what the code runs. A client's sample count doubles
    either way, so FedAvg's weights keep their ratios while each local epoch takes twice the steps.

    Args:
        root: LADD's data folder (see the module docstring).
        size: ``(H, W)`` the training images are read at (full resolution; the run's transform cuts LADD's
            512×1024 crop after a random scale).
        test_size: ``(H, W)`` of the test images (default: ``size``); LADD tests at the full 1024×2048.
        double: ``flipped``, ``repeated`` or null (each training image once; then flip at random instead).
        num_workers: threads that decode a batch.
    """

    name, images_dir, labels_dir, split_dir = "cityscapes", "leftImg8bit", "gtFine", "heterogeneous"
    split_names: ClassVar[dict[str, tuple[str, ...]]] = {
        "train": tuple(f"all_data_{i}.json" for i in range(24)),
        "test": ("all_data_0.json",),
    }
    mapping, class_names = CITYSCAPES_19, CITYSCAPES_19_CLASSES

    def __init__(
        self, root: str, size: tuple[int, int] = (1024, 2048), test_size: tuple[int, int] | None = None,
        double: Literal["flipped", "repeated"] | None = None, num_workers: int = 4,
    ) -> None:  # fmt: skip
        if double not in ("flipped", "repeated", None):
            raise ConfigError(
                f"Expected --data.dataset.init_args.double in {{flipped, repeated, null}}, got {double!r}."
            )
        super().__init__(root, size, test_size, num_workers)
        self.double = double

    def load_train(self) -> LabelledTensors:
        if self.double is None:
            return super().load_train()
        rows = self._users(self._split_files("train"))
        # the copies follow the originals; the Natural partitioner gathers each client's by its id
        flips = [False] * len(rows) + [self.double == "flipped"] * len(rows)
        return self._pool(rows + rows, self.size, with_groups=True, flips=flips)


class CrossCity(_SplitDataset):
    """NTHU CrossCity as LADD splits it: Rio, Rome, Taipei and Tokyo in 472 unlabelled clients, 400 test images.

    Every image's city is its folder under ``data/cities/``. The test images carry it as their group (100 per
    city), so that ``--data.test_groups`` scores each city. ``one_client_per_city`` merges each city's users into one
    client, which then holds all of that city's training images (3,200 in LADD's files): the four-client split of
    Yao et al. (FMTDA, WACV 2022) that LADD's Table 8 compares on.

    Args:
        root: LADD's data folder.
        size: ``(H, W)`` images are read at (default: CrossCity's full resolution, which LADD tests at; the
            run's transform cuts the 512×1024 training crop).
        test_size: ``(H, W)`` of the test images (default: ``size``).
        one_client_per_city: one client per city (ids ``Rio``, ``Rome``, ``Taipei``, ``Tokyo``) instead of the
            split files' users (``Rio7``).
        num_workers: threads that decode a batch.
    """

    name, images_dir, labels_dir, split_dir = "crosscity", "cities", "cities", "by_city_cpc0_ms27_me10"
    split_names: ClassVar[dict[str, tuple[str, ...]]] = {
        "train": ("Rio.json", "Rome.json", "Taipei.json", "Tokyo.json"),
        "test": ("test_user.json",),
    }
    mapping, class_names = CROSSCITY_13, CROSSCITY_13_CLASSES
    train_labels = False  # the split files list no label map for a training image

    def __init__(
        self, root: str, size: tuple[int, int] = (1024, 2048), test_size: tuple[int, int] | None = None,
        one_client_per_city: bool = False, num_workers: int = 4,
    ) -> None:  # fmt: skip
        super().__init__(root, size, test_size, num_workers)
        self.one_client_per_city = one_client_per_city

    def cities(self, pool: LabelledTensors) -> np.ndarray:
        """``[N]`` the city of every image of ``pool``: the first folder of its path under ``data/cities/``."""
        base = self.folder / "data" / self.images_dir
        return np.array([path.relative_to(base).parts[0] for path in pool.inputs.paths])

    def load_train(self) -> LabelledTensors:
        pool = super().load_train()
        if self.one_client_per_city:
            pool.groups = self.cities(pool)
        return pool

    def load_test(self) -> LabelledTensors:
        pool = super().load_test()
        pool.groups = self.cities(pool)
        return pool


class Mapillary(_SplitDataset):
    """Mapillary Vistas clustered by GPS per continent into 357 clients (30–100 images), 2,000 test images.

    Mapillary's images differ in size and aspect ratio. LADD tests them resized to width 1024 with their aspect
    ratio kept (its ``FixedResize(width=1024)``); ``test_width`` does the same, and the test batches must then
    hold one image each (``--data.eval_batch_size=1``). It trains on them the same way, each resized to width
    1024, then cut by a random 512×1024 window and mirrored at random, with no random scale: ``train_width``
    and ``crop`` read training batches so (:class:`SplitCrops`), and the run then needs no
    ``--data.train_transform``. With ``train_width`` null, training images are resized to ``size`` and a
    ``train_transform`` augments them.

    Args:
        root: LADD's data folder.
        size: ``(H, W)`` every image of the training pool is resized to for passes that read the clients' data
            without training on it (their styles), and for training when ``train_width`` is null.
        test_size: ``(H, W)`` of the test images, when ``test_width`` is null (default: ``size``).
        test_width: width every test image is resized to, its aspect ratio kept (LADD: 1024); null: ``test_size``.
        train_width: width every training image is resized to, its aspect ratio kept, before the random ``crop``
            (LADD: 1024); null: training batches are read at ``size``.
        crop: ``(H, W)`` of the random training window (LADD: 512×1024).
        flip: mirror each training image left–right with probability ½ (LADD: yes).
        num_workers: threads that decode a batch.
    """

    name, images_dir, labels_dir, split_dir, mapping = "mapillary", "", "", "clustering", MAPILLARY_19
    split_names: ClassVar[dict[str, tuple[str, ...]]] = {
        "train": tuple(f"{c}.json" for c in ("AF", "AS", "EU", "NA", "OC", "SA")),
        "test": ("test_user.json",),
    }
    class_names = CITYSCAPES_19_CLASSES

    def __init__(
        self, root: str, size: tuple[int, int] = (512, 1024), test_size: tuple[int, int] | None = None,
        test_width: int | None = 1024, train_width: int | None = 1024, crop: tuple[int, int] = (512, 1024),
        flip: bool = True, num_workers: int = 4,
    ) -> None:  # fmt: skip
        flag = "--data.dataset.init_args"
        problems = []
        if test_width is not None and test_size is not None:
            problems.append(f"{flag}.test_size and {flag}.test_width both size the test images; set one to null.")
        for name, width in (("test_width", test_width), ("train_width", train_width)):
            if width is not None and width < 1:
                problems.append(f"Expected {flag}.{name} ≥ 1 pixel or null, got {width}.")
        if min(crop) < 1:
            problems.append(f"Expected {flag}.crop = [H, W] of at least 1 pixel each, got {list(crop)}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(root, size, test_size, num_workers)
        self.test_width, self.train_width, self.crop, self.flip = test_width, train_width, tuple(crop), flip
        if train_width is not None:
            self.input_shape = (3, *self.crop)  # what training batches hold

    def load_train(self) -> LabelledTensors:
        pool = super().load_train()
        if self.train_width is not None:
            pool.train_reader = SplitCrops(
                pool.inputs.paths, pool.targets.paths, pool.targets.lookup, self.train_width, self.crop, self.flip,
                self.num_workers,
            )  # fmt: skip
        return pool

    def load_test(self) -> LabelledTensors:
        return self._read("test", self.test_size, with_groups=False, keep_width=self.test_width)


class GTA5(_SplitDataset):
    """GTA5, LADD's labelled source: one natural client (``gta5``), so a Natural partition trains it centralized.

    Args:
        root: LADD's data folder.
        target: the target dataset whose classes the labels are mapped to: ``cityscapes`` and ``mapillary``
            (19 classes) or ``crosscity`` (13).
        split: the split file, ``train`` or ``test``.
        size: ``(H, W)`` images are read at (default: GTA5's 1052×1914; the run's transform cuts LADD's
            512×1024 crop after a random scale).
        evaluate_on: a target dataset whose test set scores the pre-trained model ("source only").
        num_workers: threads that decode a batch.
    """

    name, images_dir, labels_dir, split_dir = "gta5", "", "", ""

    def __init__(
        self,
        root: str,
        target: Literal["cityscapes", "crosscity", "mapillary"] = "cityscapes",
        split: Literal["train", "test"] = "train",
        size: tuple[int, int] = (1052, 1914),
        evaluate_on: FederatedDataset | None = None,
        num_workers: int = 4,
    ) -> None:
        self.mapping = CROSSCITY_13 if target == "crosscity" else CITYSCAPES_19
        self.class_names = CROSSCITY_13_CLASSES if target == "crosscity" else CITYSCAPES_19_CLASSES
        super().__init__(root, size, None, num_workers)
        self.split = split
        self.evaluate_on = evaluate_on

    def load_train(self) -> LabelledTensors:
        listing = self.folder / "splits" / f"{self.split}.txt"
        self._require([listing])
        try:
            lines = listing.read_text(encoding="utf-8").splitlines()
        except ValueError as error:  # not text
            raise self._damaged(listing, str(error)) from error
        pairs = [(number, line.split()) for number, line in enumerate(lines, 1) if line.strip()]
        for number, pair in pairs:
            if len(pair) != 2:
                raise self._damaged(
                    listing, f"line {number} is {lines[number - 1]!r}, not '/images/<file> /labels/<file>'"
                )
        return self._pool([("gta5", x, y, listing) for _, (x, y) in pairs], self.size, with_groups=True)

    def load_test(self) -> LabelledTensors | None:
        return None if self.evaluate_on is None else self.evaluate_on.load_test()
