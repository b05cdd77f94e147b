import json
import logging

import pytest
import torch
from fuss_run import one_round
from miniatures.segmentation import COCO_DOMINANT, COCO_FINE, COCO_TRAIN_IDS, write_cocostuff

from fedlight.data.datasets.cocostuff import FINE_TO_COARSE, CocoStuff27
from fedlight.data.partition import Dirichlet
from fedlight.errors import ConfigError

#: each listed training image's dominant fine label (the miniature's design), as its coarse class
DOMINANT = [FINE_TO_COARSE[COCO_FINE[COCO_DOMINANT[n % len(COCO_DOMINANT)]]] for n in range(len(COCO_TRAIN_IDS))]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data") / "cocostuff"
    write_cocostuff(root)  # 24 curated training images (and 2 unlisted), 3 curated validation images
    return root


def test_dominant_labels_are_the_most_frequent_coarse_class(root):
    pool = CocoStuff27(str(root), image_size=32).load_train()
    assert pool.labels.tolist() == DOMINANT
    assert (root / "fedlight_dominant_labels_train2017.json").is_file()
    # image 0 is 32×40, its dominant label (person, coarse 9) on columns 0–20 and void on 20–22; the central
    # 32×32 square is columns 4–36
    target = pool.targets[torch.tensor([0])][0]
    assert target[:, :16].eq(9).all() and target[:, 16:18].eq(255).all()


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
    assert pool.labels.tolist() == DOMINANT
    assert str(cache) in caplog.text


def test_fuss_client_lists_become_natural_clients(root, tmp_path):
    lists = tmp_path / "splits"
    lists.mkdir()
    for client, ids in enumerate([[2, 5], [0, 1, 3]]):
        (lists / f"train_MA18__client{client}.txt").write_text("\n".join(COCO_TRAIN_IDS[i] for i in ids))
    pool = CocoStuff27(str(root), client_lists=str(lists), image_size=16).load_train()
    assert pool.groups.tolist() == [0, 0, 1, 1, 1] and len(pool) == 5


def test_a_federated_round_on_dominant_label_dirichlet_clients(tmp_path, root):
    dataset = CocoStuff27(str(root), image_size=16, test_size=16)
    data, metrics = one_round(tmp_path, dataset, 2, Dirichlet(num_clients=2, alpha=0.5, min_size=3))
    assert data.num_samples.sum() == 24 and len(data.test) == 3
    assert 0.0 <= metrics["test/acc"] <= 1.0
    assert {"test/iou_person", "test/iou_food", "test/iou_food_stuff", "test/iou_water"} <= set(metrics)


def test_a_missing_root_says_what_to_download(tmp_path):
    with pytest.raises(ConfigError, match=r"stuffthingmaps_trainval2017\.zip"):
        CocoStuff27(str(tmp_path)).load_train()
