"""LADD's four readers on miniatures of their real layouts: an intact one loads, a broken one is one clear error."""

import json
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from miniatures.street import (
    CITYSCAPES_TRAIN,
    CROSSCITY_TRAIN,
    GTA5_SIZE,
    GTA5_SPLITS,
    MAPILLARY_TEST,
    MAPILLARY_TRAIN,
    SIZE,
    write_cityscapes,
    write_crosscity,
    write_gta5,
    write_mapillary,
)
from PIL import Image

from fedlight.data.base import FederatedDataset
from fedlight.data.datasets.ladd_splits import GTA5, CityscapesFFREEDA, CrossCity, Mapillary
from fedlight.errors import ConfigError

# The label tables as LADD's dataset classes write them (dataset/target/*.py), copied here by hand.
CITYSCAPES_IDS = {7: 0, 8: 1, 11: 2, 12: 3, 13: 4, 17: 5, 19: 6, 20: 7, 21: 8, 22: 9, 23: 10, 24: 11, 25: 12, 26: 13,
                  27: 14, 28: 15, 31: 16, 32: 17, 33: 18}  # fmt: skip
CROSSCITY_IDS = {7: 0, 8: 1, 11: 2, 19: 3, 20: 4, 21: 5, 23: 6, 24: 7, 25: 8, 26: 9, 28: 10, 32: 11, 33: 12}
MAPILLARY_IDS = {2: 1, 3: 4, 6: 3, 7: 1, 9: 1, 11: 1, 13: 0, 14: 0, 15: 1, 17: 2, 19: 11, 20: 12, 21: 12, 22: 12,
                 24: 0, 26: 9, 27: 10, 29: 9, 30: 8, 43: 0, 44: 5, 45: 5, 46: 5, 47: 5, 48: 6, 50: 7, 52: 18, 54: 15,
                 55: 13, 57: 17, 58: 16, 61: 14}  # fmt: skip


def by_hand(path: Path, table: dict[int, int]) -> torch.Tensor:
    """The label PNG's ids mapped through ``table``, every other id void (255)."""
    ids = np.array(Image.open(path))
    return torch.tensor([[table.get(int(v), 255) for v in row] for row in ids])


def normalised(path: Path) -> torch.Tensor:
    """``[3, H, W]`` the image's RGB pixels scaled to mean = std = 0.5."""
    pixels = np.array(Image.open(path).convert("RGB"), dtype=np.float32)
    return torch.from_numpy(pixels / 127.5 - 1).permute(2, 0, 1)


def leaf(path: Path) -> dict[str, dict[str, list[str]]]:
    return json.loads(path.read_text())["user_data"]


@dataclass(frozen=True)
class Reader:
    """A reader, its miniature, and the files a broken-miniature test breaks (relative to the root)."""

    write: Callable[[Path], list[str]]
    make: Callable[[Path], FederatedDataset]
    image: Callable[[Path], Path]  # the first training image
    label: Callable[[Path], Path]  # a label map a pass reads
    split: Callable[[Path], Path]  # a split file


def _cityscapes_first(root: Path, key: str) -> Path:
    user = leaf(root / "cityscapes/splits/heterogeneous/train/all_data_0.json")["jena0"]
    return root / "cityscapes/data" / ("leftImg8bit" if key == "x" else "gtFine") / user[key][0]


def _crosscity_image(root: Path) -> Path:
    rio = leaf(root / "crosscity/splits/by_city_cpc0_ms27_me10/train/Rio.json")
    return root / "crosscity/data/cities" / rio["Rio1"]["x"][0]


def _crosscity_label(root: Path) -> Path:
    test = leaf(root / "crosscity/splits/by_city_cpc0_ms27_me10/test/test_user.json")["test_user"]
    return root / "crosscity/data/cities" / test["y"][0]


def _mapillary_first(root: Path, key: str) -> Path:
    return root / "mapillary/data" / leaf(root / "mapillary/splits/clustering/train/AF.json")["AF0"][key][0]


def _gta5_first(root: Path, column: int) -> Path:
    line = (root / "gta5/splits/train.txt").read_text().splitlines()[0]
    return root / "gta5/data" / line.split()[column].lstrip("/")


READERS = {
    "CityscapesFFREEDA": Reader(
        write_cityscapes,
        lambda root: CityscapesFFREEDA(str(root), size=SIZE, num_workers=1),
        lambda root: _cityscapes_first(root, "x"),
        lambda root: _cityscapes_first(root, "y"),
        lambda root: root / "cityscapes/splits/heterogeneous/train/all_data_0.json",
    ),
    "CrossCity": Reader(
        write_crosscity,
        lambda root: CrossCity(str(root), size=SIZE, num_workers=1),
        _crosscity_image,
        _crosscity_label,
        lambda root: root / "crosscity/splits/by_city_cpc0_ms27_me10/train/Rio.json",
    ),
    "Mapillary": Reader(
        write_mapillary,
        lambda root: Mapillary(
            str(root), size=SIZE, test_width=SIZE[1], train_width=SIZE[1], crop=(32, 64), num_workers=1
        ),
        lambda root: _mapillary_first(root, "x"),
        lambda root: _mapillary_first(root, "y"),
        lambda root: root / "mapillary/splits/clustering/test/test_user.json",
    ),
    "GTA5": Reader(
        write_gta5,
        lambda root: GTA5(str(root), size=GTA5_SIZE, num_workers=1),
        lambda root: _gta5_first(root, 0),
        lambda root: _gta5_first(root, 1),
        lambda root: root / "gta5/splits/train.txt",
    ),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    """Each reader's miniature, written once; tests break copies of it."""
    roots = {}
    for name, reader in READERS.items():
        roots[name] = tmp_path_factory.mktemp(name)
        assert reader.write(roots[name]) == []
    return roots


def read_everything(dataset: FederatedDataset) -> None:
    """Sets the dataset up and reads every sample of its pools one at a time, as batches would."""
    for pool in (dataset.load_train(), dataset.load_test()):
        if pool is None:
            continue
        for i in range(len(pool)):
            pool.inputs[torch.tensor([i])], pool.targets[torch.tensor([i])]
        if pool.train_reader is not None:
            pool.train_reader.read(torch.arange(len(pool.train_reader)), torch.Generator().manual_seed(0))


def test_writing_twice_into_one_root_leaves_each_miniatures_files(tmp_path, written):
    for reader in READERS.values():  # the four share one root, as LADD's data/ folder holds them
        reader.write(tmp_path)
        reader.write(tmp_path)
    files = {p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()}
    alone = [{p.relative_to(r) for p in r.rglob("*") if p.is_file()} for r in written.values()]
    assert files == set().union(*alone) and sum(map(len, alone)) == len(files)  # no file written by two
    for root in written.values():
        for path in root.rglob("*"):
            assert not path.is_file() or path.read_bytes() == (tmp_path / path.relative_to(root)).read_bytes(), path


def test_cityscapes_clients_are_the_split_files_users_and_labels_are_cityscapes_ids(written):
    root = written["CityscapesFFREEDA"]
    dataset = CityscapesFFREEDA(str(root), size=SIZE, num_workers=1)
    train, test = dataset.load_train(), dataset.load_test()
    images = {user: n for clients in CITYSCAPES_TRAIN.values() for user, n in clients.items()}
    assert Counter(train.groups.tolist()) == images and len(images) == 24  # one user from each of LADD's 24 files
    test_user = leaf(root / "cityscapes/splits/heterogeneous/test/all_data_0.json")["test_user"]
    assert test.groups is None and len(test) == len(test_user["x"])
    for i, (x, y) in enumerate(zip(test_user["x"], test_user["y"], strict=True)):
        inputs, targets = test.inputs[torch.tensor([i])], test.targets[torch.tensor([i])]
        assert inputs.shape == (1, 3, *SIZE) and targets.shape == (1, *SIZE)
        torch.testing.assert_close(inputs[0], normalised(root / "cityscapes/data/leftImg8bit" / x))
        expected = by_hand(root / "cityscapes/data/gtFine" / y, CITYSCAPES_IDS)
        assert torch.equal(targets[0], expected) and len(expected.unique()) >= 3  # several classes and void
    first = _cityscapes_first(root, "y")
    assert torch.equal(train.targets[torch.tensor([0])][0], by_hand(first, CITYSCAPES_IDS))


def test_crosscity_clients_are_unlabelled_and_the_test_labels_are_mapped_to_13_classes(written):
    root = written["CrossCity"]
    dataset = CrossCity(str(root), size=SIZE, num_workers=1)
    train, test = dataset.load_train(), dataset.load_test()
    images = {user: n for clients in CROSSCITY_TRAIN.values() for user, n in clients.items()}
    assert Counter(train.groups.tolist()) == images and dataset.num_classes == 13
    assert (train.targets[torch.arange(len(train))] == 255).all()  # no training labels
    torch.testing.assert_close(train.inputs[torch.tensor([0])][0], normalised(_crosscity_image(root)))
    test_user = leaf(root / "crosscity/splits/by_city_cpc0_ms27_me10/test/test_user.json")["test_user"]
    assert sorted(test_user["city"]) == ["Rio", "Rome", "Taipei", "Tokyo"] and len(test) == 4
    for i, y in enumerate(test_user["y"]):
        expected = by_hand(root / "crosscity/data/cities" / y, CROSSCITY_IDS)
        assert torch.equal(test.targets[torch.tensor([i])][0], expected) and len(expected.unique()) >= 3


def test_mapillary_images_of_differing_sizes_load_with_v12_label_ids(written):
    root = written["Mapillary"]
    dataset = Mapillary(str(root), size=SIZE, test_width=SIZE[1], train_width=SIZE[1], crop=(32, 64), num_workers=1)
    train, test = dataset.load_train(), dataset.load_test()
    shapes = {user: s for clients in MAPILLARY_TRAIN.values() for user, s in clients.items()}
    assert Counter(train.groups.tolist()) == {user: len(s) for user, s in shapes.items()}
    # the pool read at `size` (styles), label ids mapped by hand after the same nearest resize
    first = _mapillary_first(root, "y")
    (h, w), ids = shapes["AF0"][0], by_hand(first, MAPILLARY_IDS)
    rows, cols = (torch.arange(SIZE[0]) * h) // SIZE[0], (torch.arange(SIZE[1]) * w) // SIZE[1]
    assert torch.equal(train.targets[torch.tensor([0])][0], ids[rows][:, cols]) and len(ids.unique()) >= 3
    x, y = train.train_reader.read(torch.arange(len(train)), torch.Generator().manual_seed(0))
    assert x.shape == (len(train), 3, 32, 64) and y.shape == (len(train), 32, 64)
    test_user = leaf(root / "mapillary/splits/clustering/test/test_user.json")["test_user"]
    for i, ((h, w), y) in enumerate(zip(MAPILLARY_TEST, test_user["y"], strict=True)):
        height = round(SIZE[1] * h / w)  # width SIZE[1], aspect ratio kept
        targets = test.targets[torch.tensor([i])][0]
        assert test.inputs[torch.tensor([i])].shape == (1, 3, height, SIZE[1]) and targets.shape == (height, SIZE[1])
        if w == SIZE[1]:  # not resized: the ids map one to one
            assert torch.equal(targets, by_hand(root / "mapillary/data" / y, MAPILLARY_IDS))
    assert json.loads((root / "mapillary/splits/clustering/test/test_user.json").read_text())["num_samples"] == 3


@pytest.mark.parametrize(("target", "table"), [("cityscapes", CITYSCAPES_IDS), ("crosscity", CROSSCITY_IDS)])
def test_gta5_is_one_client_whose_palette_labels_hold_cityscapes_ids(written, target, table):
    root = written["GTA5"]
    train = GTA5(str(root), target=target, size=GTA5_SIZE, num_workers=1).load_train()
    assert train.groups.tolist() == ["gta5"] * GTA5_SPLITS["train"]
    assert Image.open(_gta5_first(root, 1)).mode == "P"
    expected = by_hand(_gta5_first(root, 1), table)
    assert torch.equal(train.targets[torch.tensor([0])][0], expected) and len(expected.unique()) >= 3
    torch.testing.assert_close(train.inputs[torch.tensor([0])][0], normalised(_gta5_first(root, 0)))
    assert len(GTA5(str(root), split="test", size=GTA5_SIZE).load_train()) == GTA5_SPLITS["test"]


def _rename(path: Path) -> None:
    path.rename(path.with_name(f"renamed_{path.name}"))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3 + 1])  # mid-record: not at the end of a line of a list


def _garble(path: Path) -> None:
    path.write_bytes(b"\xff\xfe garbage \x00" * 8)


BREAKS = {"renamed": _rename, "missing": Path.unlink, "truncated": _truncate, "garbage": _garble}


@pytest.mark.parametrize("kind", ["image", "label", "split"])
@pytest.mark.parametrize("damage", list(BREAKS))
@pytest.mark.parametrize("name", list(READERS))
def test_a_broken_miniature_is_one_error_naming_the_file_and_what_to_do(tmp_path, written, name, kind, damage):
    reader, root = READERS[name], tmp_path / "ladd"
    shutil.copytree(written[name], root)
    broken = getattr(reader, kind)(root)
    BREAKS[damage](broken)
    with pytest.raises(ConfigError) as error:
        read_everything(reader.make(root))
    message = str(error.value)
    assert str(broken) in message, message
    assert len(error.value.problems) == 2 and any(w in error.value.problems[1] for w in ("Download", "Copy", "Restore"))


def test_a_user_in_two_split_files_and_a_colour_label_map_are_refused(tmp_path, written):
    root = tmp_path / "ladd"
    shutil.copytree(written["CrossCity"], root)
    splits = root / "crosscity/splits/by_city_cpc0_ms27_me10/train"
    rio = json.loads((splits / "Rio.json").read_text())
    rome = json.loads((splits / "Rome.json").read_text())
    rome["users"].append("Rio1")
    rome["user_data"]["Rio1"] = rio["user_data"]["Rio1"]
    (splits / "Rome.json").write_text(json.dumps(rome))
    with pytest.raises(ConfigError, match=r"Rio1 is listed by two split files, .*Rio\.json and .*Rome\.json"):
        CrossCity(str(root)).load_train()
    label = _crosscity_label(root)
    ids = np.array(Image.open(label))
    Image.fromarray(np.stack([ids] * 3, axis=-1)).save(label)  # an RGB rendering instead of the ids
    test = CrossCity(str(root), size=SIZE).load_test()
    with pytest.raises(ConfigError, match=rf"Label file {label} holds RGB pixels, not 8-bit label ids"):
        test.targets[torch.tensor([0])]
