"""LADD's split-file datasets on generated miniatures of their on-disk layouts."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from miniatures.street import (
    CITYSCAPES_TRAIN,
    CROSSCITY_TRAIN,
    GTA5_SIZE,
    GTA5_SPLITS,
    MAPILLARY_TRAIN,
    SIZE,
    cityscapes_files,
    mapillary_files,
    write_cityscapes,
    write_crosscity,
    write_gta5,
    write_labels,
    write_leaf,
    write_mapillary,
    write_rgb,
)
from PIL import Image

from fedlight.clients import SelfTrainingClient
from fedlight.data import FederatedDataModule
from fedlight.data.datasets.ladd_splits import (
    CITYSCAPES_19,
    CROSSCITY_13,
    GTA5,
    CityscapesFFREEDA,
    CrossCity,
    Mapillary,
)
from fedlight.data.labels import CITYSCAPES_19_CLASSES, CITYSCAPES_27, CROSSCITY_13_CLASSES
from fedlight.data.partition import Natural
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import LADD

H, W = 16, 32


def _halves(path, left, right, shape=SIZE):
    """Overwrites a label map with id ``left`` on its left half and ``right`` on its right half."""
    ids = np.full(shape, left, dtype=np.uint8)
    ids[:, shape[1] // 2 :] = right
    write_labels(path, ids, palette=path.parent.name == "labels")  # GTA5's and Mapillary's are palette PNGs


def _leaf(path):
    return json.loads(path.read_text())["user_data"]


CROSSCITY_SPLITS = "crosscity/splits/by_city_cpc0_ms27_me10"


def test_crosscity_clients_are_the_split_files_users_unlabelled_and_the_test_set_is_mapped(tmp_path):
    write_crosscity(tmp_path)
    test_user = _leaf(tmp_path / CROSSCITY_SPLITS / "test/test_user.json")["test_user"]
    _halves(tmp_path / "crosscity/data/cities" / test_user["y"][0], 7, 26)  # road | car
    _halves(tmp_path / "crosscity/data/cities" / test_user["y"][1], 7, 0)  # road | void
    dataset = CrossCity(str(tmp_path), size=SIZE)
    train, test = dataset.load_train(), dataset.load_test()
    assert dataset.num_classes == 13 and dataset.input_shape == (3, *SIZE)
    assert sorted(set(train.groups.tolist())) == sorted(u for users in CROSSCITY_TRAIN.values() for u in users)
    assert (train.targets[torch.arange(len(train))] == 255).all()  # FFREEDA's clients have no labels
    x = train.inputs[torch.tensor([0])]
    first = _leaf(tmp_path / CROSSCITY_SPLITS / "train/Rio.json")["Rio1"]["x"][0]
    pixels = np.array(Image.open(tmp_path / "crosscity/data/cities" / first).convert("RGB"))
    torch.testing.assert_close(x[0], (torch.from_numpy(pixels).permute(2, 0, 1).float() / 255 - 0.5) / 0.5)
    labels = test.targets[torch.tensor([0, 1])]
    assert labels[0, 0, 0] == 0 and labels[0, 0, -1] == 9 and labels[1, 0, -1] == 255  # road, car, void
    assert test.groups.tolist() == [x.split("/")[0] for x in test_user["x"]] and len(test) == len(test_user["x"])


def test_one_client_per_city_merges_the_split_files_users_and_keeps_their_images(tmp_path):
    write_crosscity(tmp_path)
    users = CrossCity(str(tmp_path), size=SIZE).load_train()
    cities = CrossCity(str(tmp_path), size=SIZE, one_client_per_city=True).load_train()
    assert cities.inputs.paths == users.inputs.paths
    assert cities.groups.tolist() == [re.sub(r"\d+$", "", user) for user in users.groups]  # Rio7 → Rio
    clients = Natural()(cities.partition_labels(), 13, np.random.default_rng(0), groups=cities.groups)
    sizes = [sum(counts.values()) for counts in CROSSCITY_TRAIN.values()]  # Rio, Rome, Taipei, Tokyo: name order
    assert [len(client) for client in clients] == sizes


def _ladd_fit(data, tmp_path, num_classes, cluster_layers, rounds):
    """LADD on ``data`` with mini_deeplab, two clients a round; returns the trainer and its final metrics."""
    torch.manual_seed(0)
    model = SelfTrainingClient(num_classes=num_classes, input_shape=(3, H, W), model="mini_deeplab")
    strategy = LADD(k_range=(2, 3), n_init=2, fda_size=(H, W), cluster_layers=cluster_layers)
    trainer = FederatedTrainer(rounds=rounds, clients_per_round=2, local_epochs=1, logger="csv",
                               enable_progress_bar=False, default_root_dir=tmp_path / "runs")  # fmt: skip
    return trainer, trainer.fit(model, data, strategy)


def test_a_federated_ladd_round_on_the_crosscity_miniature(tmp_path):
    write_crosscity(tmp_path)
    data = FederatedDataModule(CrossCity(str(tmp_path), size=(H, W), num_workers=1), batch_size=2, test_fraction=0.0,
                               drop_last=True, eval_batch_size=2)  # fmt: skip
    trainer, metrics = _ladd_fit(data, tmp_path, num_classes=13, cluster_layers="classifier", rounds=2)
    assert data.num_clients == sum(map(len, CROSSCITY_TRAIN.values())) and trainer.model.bank.num_clusters == 2
    assert 0 <= metrics["test/routed/miou"] <= 1 and "test/miou" in metrics
    assert metrics["round/clients_aggregated"] == 2


def test_table8s_round_on_the_four_city_clients_scores_every_city(tmp_path):
    write_crosscity(tmp_path)
    dataset = CrossCity(str(tmp_path), size=(H, W), one_client_per_city=True, num_workers=1)
    data = FederatedDataModule(dataset, batch_size=2, test_fraction=0.0, drop_last=True, eval_batch_size=3,
                               test_groups=True)  # fmt: skip
    torch.manual_seed(0)
    model = SelfTrainingClient(num_classes=13, input_shape=(3, H, W), model="mini_deeplab")
    trainer = FederatedTrainer(rounds=1, clients_per_round=4, local_epochs=1, logger="csv", enable_progress_bar=False,
                               default_root_dir=tmp_path / "runs")  # fmt: skip
    metrics = trainer.fit(model, data, LADD(clustering=False, fda_size=(H, W), swa_start=1))
    cities = ("Rio", "Rome", "Taipei", "Tokyo")
    assert data.num_clients == 4 and data.test_group_names == cities and metrics["round/clients_aggregated"] == 4
    scores = [metrics[f"test/{city}/miou"] for city in cities]
    assert all(0 <= score <= 1 for score in scores)
    assert metrics["test/group_mean/miou"] == pytest.approx(np.mean(scores))


def test_cityscapes_mapillary_and_gta5_layouts_map_their_label_ids(tmp_path):
    write_cityscapes(tmp_path)
    test_user = _leaf(tmp_path / "cityscapes/splits/heterogeneous/test/all_data_0.json")["test_user"]
    _halves(tmp_path / "cityscapes/data/gtFine" / test_user["y"][0], 7, 33)  # road | bicycle
    cityscapes = CityscapesFFREEDA(str(tmp_path), size=(H, W), test_size=(2 * H, 2 * W))
    users = [user for clients in CITYSCAPES_TRAIN.values() for user in clients]
    assert cityscapes.num_classes == 19 and sorted(set(cityscapes.load_train().groups)) == sorted(users)
    labels = cityscapes.load_test().targets[torch.tensor([0])]
    assert labels.shape == (1, 2 * H, 2 * W) and labels[0, 0, 0] == 0 and labels[0, 0, -1] == 18  # road, bicycle

    write_mapillary(tmp_path)
    af0 = _leaf(tmp_path / "mapillary/splits/clustering/train/AF.json")["AF0"]
    _halves(tmp_path / "mapillary/data" / af0["y"][0], 55, 3, MAPILLARY_TRAIN["AF.json"]["AF0"][0])
    masks = Mapillary(str(tmp_path), size=(H, W)).load_train().targets[torch.tensor([0])]
    assert masks[0, 0, 0] == 13 and masks[0, 0, -1] == 4  # Car → car 13, Fence → fence 4

    write_gta5(tmp_path)
    label = (tmp_path / "gta5/splits/train.txt").read_text().split()[1]
    _halves(tmp_path / "gta5/data" / label.lstrip("/"), 26, 32, GTA5_SIZE)  # car, motorcycle
    to_crosscity = GTA5(str(tmp_path), target="crosscity", size=(H, W)).load_train()
    assert to_crosscity.groups.tolist() == ["gta5"] * GTA5_SPLITS["train"]
    assert to_crosscity.targets[torch.tensor([0])][0, 0, [0, -1]].tolist() == [9, 11]  # CrossCity's car, motorcycle
    source = GTA5(str(tmp_path), target="cityscapes", size=(H, W), evaluate_on=cityscapes)
    assert source.num_classes == 19 and len(source.load_test()) == len(test_user["x"])  # the target's test images


def test_a_missing_root_or_absent_images_give_one_error_that_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match=r"root=.*no folder .*crosscity[\s\S]*CrossCity[\s\S]*splits"):
        CrossCity(str(tmp_path / "nowhere")).load_train()
    write_crosscity(tmp_path)
    images = _leaf(tmp_path / CROSSCITY_SPLITS / "train/Rio.json")["Rio1"]["x"][:2]
    for image in images:
        (tmp_path / "crosscity/data/cities" / image).unlink()
    names = [re.escape(Path(image).name) for image in images]
    with pytest.raises(
        ConfigError, match=rf"2 files missing \(listed in .*Rio\.json\): .*{names[0]}, .*{names[1]}\."
    ) as error:
        CrossCity(str(tmp_path)).load_train()
    assert len(error.value.problems) == 2  # what is missing, then where to get it


@pytest.mark.parametrize("double", ["flipped", "repeated"])
def test_cityscapes_double_dataset_gives_every_client_its_images_and_a_copy(tmp_path, double):
    write_cityscapes(tmp_path)
    listed = {}  # user → its images, in the order of the split files' names
    for name in sorted(CITYSCAPES_TRAIN):
        listed |= {
            user: data["x"] for user, data in _leaf(tmp_path / "cityscapes/splits/heterogeneous/train" / name).items()
        }
    _halves(tmp_path / "cityscapes/data/gtFine" / cityscapes_files("jena0", 0)[1], 7, 33)  # road | bicycle
    train = CityscapesFFREEDA(str(tmp_path), size=SIZE, double=double, num_workers=1).load_train()
    order = [user for user, xs in listed.items() for _ in xs]
    n = len(order)
    assert train.groups.tolist() == order * 2  # originals, then the copies
    clients = Natural()(train.partition_labels(), len(listed), np.random.default_rng(0), groups=train.groups)
    assert sorted(len(c) for c in clients) == sorted(2 * len(xs) for xs in listed.values())  # n images count twice
    images, masks = train.inputs[torch.arange(2 * n)], train.targets[torch.arange(2 * n)]
    for i, x in enumerate(x for xs in listed.values() for x in xs):
        pixels = np.array(Image.open(tmp_path / "cityscapes/data/leftImg8bit" / x).convert("RGB"), dtype=np.float32)
        copy = pixels[:, ::-1] if double == "flipped" else pixels  # mirrored left–right, or the same image
        for index, expected in ((i, pixels), (i + n, copy)):
            torch.testing.assert_close(images[index], torch.from_numpy(expected.copy() / 127.5 - 1).permute(2, 0, 1))
    assert order[0] == "jena0" and masks[0, 0, [0, -1]].tolist() == [0, 18]  # road | bicycle
    assert masks[n, 0, [0, -1]].tolist() == ([18, 0] if double == "flipped" else [0, 18])


def test_cityscapes_without_doubling_reads_each_image_once_and_a_bad_mode_is_reported(tmp_path):
    write_cityscapes(tmp_path)
    images = sum(n for clients in CITYSCAPES_TRAIN.values() for n in clients.values())
    assert len(CityscapesFFREEDA(str(tmp_path), size=(H, W)).load_train()) == images
    with pytest.raises(ConfigError, match=r"double in \{flipped, repeated, null\}"):
        CityscapesFFREEDA(str(tmp_path), double="mirrored")


def test_mapillary_test_images_keep_their_aspect_ratio_at_the_test_width(tmp_path):
    base = tmp_path / "mapillary/data"
    shapes = {"a": (20, 40), "b": (30, 40)}  # (height, width) of two validation images
    test = {"x": [], "y": []}
    for name, (h, w) in shapes.items():
        x, y = mapillary_files("validation", name)
        write_rgb(base / x, (h, w), name)
        labels = np.full((h, w), 13, dtype=np.uint8)  # road (train id 0) above, car (13) below the middle row
        labels[h // 2 :] = 55
        write_labels(base / y, labels, palette=True)
        test["x"].append(x), test["y"].append(y)
    write_leaf(tmp_path / "mapillary/splits/clustering/test/test_user.json", {"test_user": test}, bare_count=True)
    dataset = Mapillary(str(tmp_path), size=(H, W), test_width=16, num_workers=1)
    pool = dataset.load_test()
    first, second = pool.inputs[torch.tensor([0])], pool.inputs[torch.tensor([1])]
    assert first.shape == (1, 3, 8, 16) and second.shape == (1, 3, 12, 16)  # 16·20/40 = 8, 16·30/40 = 12
    mask = pool.targets[torch.tensor([1])][0]
    assert mask.shape == (12, 16) and (mask[:6] == 0).all() and (mask[6:] == 13).all()
    with pytest.raises(ConfigError, match="eval_batch_size=1"):
        pool.inputs[torch.tensor([0, 1])]
    fixed = Mapillary(str(tmp_path), size=(H, W), test_width=None, num_workers=1).load_test()
    assert fixed.inputs[torch.tensor([0, 1])].shape == (2, 3, H, W)  # null: every test image at one size
    with pytest.raises(ConfigError, match="set one to null"):
        Mapillary(str(tmp_path), test_size=(H, W), test_width=16)


def _coded_mapillary(root, shapes):
    """Mapillary training clients of LADD's first split file (AF.json; the other continents' files list no one),
    one per image of ``(height, width)``: pixel (r, c) shows (r, c, 0) and is labelled road (train id 0) where
    r + c is even, car (13) where odd; and a test user with the first image."""
    base, users = root / "mapillary", {}
    for k, (h, w) in enumerate(shapes):
        rows, cols = np.mgrid[:h, :w]
        x, y = (path.replace(".jpg", ".png") for path in mapillary_files("training", str(k)))  # lossless codes
        Image.fromarray(np.stack([rows, cols, np.zeros_like(rows)], axis=-1).astype(np.uint8)).save(
            _mkdir(base / "data" / x)
        )
        write_labels(base / "data" / y, np.where((rows + cols) % 2 == 0, 13, 55).astype(np.uint8), palette=True)
        users[f"AF{k}"] = {"x": [x], "y": [y]}
    for continent in ("AF", "AS", "EU", "NA", "OC", "SA"):
        write_leaf(base / f"splits/clustering/train/{continent}.json", users if continent == "AF" else {})
    write_leaf(base / "splits/clustering/test/test_user.json", {"test_user": users["AF0"]}, bare_count=True)


def _mkdir(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def test_mapillary_training_reads_a_random_window_of_each_image_and_its_labels_alike(tmp_path):
    _coded_mapillary(tmp_path, [(20, 40), (6, 40)])
    dataset = Mapillary(str(tmp_path), size=(H, W), train_width=40, crop=(8, 40), num_workers=2)
    reader = dataset.load_train().train_reader
    generator = torch.Generator().manual_seed(0)
    tops, flips = set(), 0
    for _ in range(60):
        x, y = reader.read(torch.tensor([0, 1]), generator)
        assert x.shape == (2, 3, 8, 40) and y.shape == (2, 8, 40)
        raw = ((x * 0.5 + 0.5) * 255).round().long()  # the pixels' (row, column) codes
        # the 20×40 image: a window of rows top..top+7 at full width, mirrored or not
        top, flipped = int(raw[0, 0, 0, 0]), bool(raw[0, 1, 0, 0] == 39)
        rows = torch.arange(top, top + 8)[:, None].expand(8, 40)
        cols = (39 - torch.arange(40) if flipped else torch.arange(40)).expand(8, 40)
        assert 0 <= top <= 12 and torch.equal(raw[0, 0], rows) and torch.equal(raw[0, 1], cols)
        assert torch.equal(y[0], torch.where((rows + cols) % 2 == 0, 0, 13))
        tops.add(top)
        flips += flipped
        # the 6×40 image is padded by ⌊(1 + 8 − 6)/2⌋ = 1 pixel on every side (LADD's RandomCrop), to 8×42
        assert (y[1, [0, 7]] == 255).all() and (x[1, :, [0, 7]] == -1).all()
        inside = y[1, 1:7] != 255  # 40 − 1 or 40 − 2 columns of the image, by where the 40-wide window sits
        assert inside.all(dim=0).sum() in (38, 39, 40) and (inside == inside[:1]).all()
    assert len(tops) >= 10 and 15 <= flips <= 45  # uniform offsets over 0..12, flips about half the time
    again = Mapillary(str(tmp_path), size=(H, W), train_width=40, crop=(8, 40), num_workers=1).load_train()
    first = reader.read(torch.tensor([0, 1]), torch.Generator().manual_seed(3))
    second = again.train_reader.read(torch.tensor([0, 1]), torch.Generator().manual_seed(3))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])  # the seed fixes the crops


def test_mapillary_training_resizes_to_the_width_keeping_the_aspect_ratio_before_the_crop(tmp_path):
    _coded_mapillary(tmp_path, [(40, 80)])
    reader = Mapillary(str(tmp_path), size=(H, W), train_width=20, crop=(6, 20), flip=False).load_train().train_reader
    tops = set()
    for seed in range(12):
        x, y = reader.read(torch.tensor([0]), torch.Generator().manual_seed(seed))
        assert x.shape == (1, 3, 6, 20)  # 40×80 → 10×20, then a 6-row window
        raw = (x[0] * 0.5 + 0.5) * 255
        # resized row i averages source rows 4i..4i+3, so shows 4i + 1.5 (border rows and columns excepted)
        top = round((float(raw[0, 1, 0]) - 1.5) / 4) - 1
        expected = 4 * torch.arange(top + 1, top + 5).float() + 1.5  # window rows 1..4: never a border row
        assert 0 <= top <= 4 and torch.allclose(raw[0, 1:5, 5], expected, atol=1e-3)
        assert torch.allclose(raw[1, 0, 1:19], 4 * torch.arange(1, 19).float() + 1.5, atol=1e-3)  # inner columns
        assert (y == 0).all()  # nearest labels come from source pixels (4i, 4j), where r + c is even: road
        tops.add(top)
    assert len(tops) >= 3


@pytest.mark.parametrize("bad", [{"train_width": 0}, {"crop": (0, 1024)}])
def test_bad_mapillary_training_sizes_name_the_flag(tmp_path, bad):
    flag = next(iter(bad))
    with pytest.raises(ConfigError, match=rf"--data.dataset.init_args.{flag}"):
        Mapillary(str(tmp_path), **bad)


def test_a_federated_ladd_round_on_mapillary_images_of_different_sizes(tmp_path):
    _coded_mapillary(tmp_path, [(20, 40), (30, 40), (16, 48), (40, 32)])
    dataset = Mapillary(str(tmp_path), size=(H, W), test_width=None, train_width=W, crop=(H, W), num_workers=1)
    data = FederatedDataModule(dataset, batch_size=1, test_fraction=0.0, drop_last=True, eval_batch_size=1)
    data.setup()
    x, y = next(data.train_batches(3, torch.Generator().manual_seed(0)))  # 40×32 → 40×32 at width 32, cropped
    assert data.input_shape == (3, H, W) == Mapillary(str(tmp_path), crop=(H, W)).input_shape  # the crop
    assert x.shape == (1, 3, H, W) and y.shape == (1, H, W) and set(y.unique().tolist()) <= {0, 13}
    _, metrics = _ladd_fit(data, tmp_path, num_classes=19, cluster_layers="bn", rounds=1)
    assert metrics["round/clients_aggregated"] == 2 and 0 <= metrics["test/routed/miou"] <= 1


def test_class_names_are_those_of_the_cityscapes_label_ids_each_mapping_keeps(tmp_path):
    # Cityscapes' labelIds 7…33 are CITYSCAPES_27 in order; a mapping names class c after the label id it maps to c
    for mapping, names in ((CITYSCAPES_19, CITYSCAPES_19_CLASSES), (CROSSCITY_13, CROSSCITY_13_CLASSES)):
        by_class = {c: CITYSCAPES_27[label_id - 7] for label_id, c in mapping.items()}
        assert tuple(by_class[c] for c in range(len(by_class))) == names
    for dataset in (CityscapesFFREEDA(tmp_path), Mapillary(tmp_path), GTA5(tmp_path), CrossCity(tmp_path)):
        assert FederatedDataModule(dataset).class_names == dataset.class_names
    assert CityscapesFFREEDA(tmp_path).class_names[:3] == ("road", "sidewalk", "building")
    assert GTA5(tmp_path, target="crosscity").class_names == CrossCity(tmp_path).class_names == CROSSCITY_13_CLASSES
