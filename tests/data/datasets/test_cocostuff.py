import json
import logging

import numpy as np
import pytest
import torch
from fuss_run import one_round
from PIL import Image

from fedlight.data.datasets.cocostuff import FINE_TO_COARSE, CocoStuff27
from fedlight.data.partition import Dirichlet
from fedlight.errors import ConfigError

FINE = [0, 1, 51, 91, 179]  # coarse classes 9, 11, 2, 17, 19


def write_split(root, split, ids, rng):
    (root / "images" / split).mkdir(parents=True)
    (root / "annotations" / split).mkdir(parents=True)
    (root / "curated" / split).mkdir(parents=True)
    for n, image_id in enumerate(ids):
        Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(
            root / "images" / split / f"{image_id}.jpg"
        )
        mask = np.full((16, 24), 255, dtype=np.uint8)
        mask[:, :14] = FINE[n % len(FINE)]  # the dominant fine label: 14 of 24 columns
        mask[:, 14:20] = FINE[(n + 1) % len(FINE)]
        Image.fromarray(mask).save(root / "annotations" / split / f"{image_id}.png")
    listing = "Coco164kFull_Stuff_Coarse.txt" if split == "train2017" else "Coco164kFull_Stuff_Coarse_7.txt"
    (root / "curated" / split / listing).write_text("\n".join(ids) + "\n")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cocostuff")
    rng = np.random.default_rng(0)
    write_split(root, "train2017", [f"{i:012d}" for i in range(20)], rng)
    write_split(root, "val2017", [f"{i:012d}" for i in range(100, 103)], rng)
    return root


def test_dominant_labels_are_the_most_frequent_coarse_class(root):
    pool = CocoStuff27(str(root), image_size=16).load_train()
    assert pool.labels.tolist() == [FINE_TO_COARSE[FINE[n % 5]] for n in range(20)]
    assert (root / "fedlight_dominant_labels_train2017.json").is_file()
    target = pool.targets[torch.tensor([0])][0]  # 16×24 resized to 16×24, centre 16×16: columns 4–20
    assert target[:, :10].eq(9).all() and target[:, 10:].eq(11).all()


def swap_a_label(text):
    stored = json.loads(text)
    first = next(iter(stored["labels"]))
    stored["labels"][first] = (stored["labels"][first] + 1) % 27  # still a coarse class, no longer the right one
    return json.dumps(stored)


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],  # truncated
        swap_a_label,
        lambda text: json.dumps(json.loads(text)["labels"]),  # the plain mapping of a cache without a digest
    ],
    ids=["truncated", "swapped", "no digest"],
)
def test_a_damaged_dominant_label_cache_is_computed_again(root, caplog, damage):
    CocoStuff27(str(root), image_size=16).load_train()
    cache = root / "fedlight_dominant_labels_train2017.json"
    cache.write_text(damage(cache.read_text()))
    with caplog.at_level(logging.WARNING):
        pool = CocoStuff27(str(root), image_size=16).load_train()
    assert pool.labels.tolist() == [FINE_TO_COARSE[FINE[n % 5]] for n in range(20)]
    assert str(cache) in caplog.text


def test_fuss_client_lists_become_natural_clients(root, tmp_path):
    lists = tmp_path / "splits"
    lists.mkdir()
    for client, ids in enumerate([[2, 5], [0, 1, 3]]):
        (lists / f"train_MA18__client{client}.txt").write_text("\n".join(f"{i:012d}" for i in ids))
    pool = CocoStuff27(str(root), client_lists=str(lists), image_size=16).load_train()
    assert pool.groups.tolist() == [0, 0, 1, 1, 1] and len(pool) == 5


def test_a_federated_round_on_dominant_label_dirichlet_clients(tmp_path, root):
    dataset = CocoStuff27(str(root), image_size=16, test_size=16)
    data, metrics = one_round(tmp_path, dataset, 2, Dirichlet(num_clients=2, alpha=0.5, min_size=3))
    assert data.num_samples.sum() == 20 and len(data.test) == 3
    assert 0.0 <= metrics["test/acc"] <= 1.0
    assert {"test/iou_person", "test/iou_food", "test/iou_food_stuff", "test/iou_water"} <= set(metrics)


def test_a_missing_root_says_what_to_download(tmp_path):
    with pytest.raises(ConfigError, match=r"stuffthingmaps_trainval2017\.zip"):
        CocoStuff27(str(tmp_path)).load_train()
