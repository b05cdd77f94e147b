import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jsonargparse import ArgumentParser

from fedlight.data.base import FederatedDataset
from fedlight.data.labels import MACRO_CLASSES, VOC_CLASSES
from fedlight.data.partition import DirichletPowerLaw
from fedlight.data.twins.scenes import Scenes
from fedlight.errors import ConfigError

SIZE = 32


@pytest.fixture(scope="module")
def fine():
    return Scenes(num_samples=300, image_size=SIZE, seed=3).load_train()


def test_one_object_class_per_image_and_void_borders(fine) -> None:
    assert fine.inputs.shape == (300, 3, SIZE, SIZE) and fine.targets.shape == (300, SIZE, SIZE)
    assert fine.targets.dtype == torch.int64 and fine.labels.dtype == np.int64
    for mask, label in zip(fine.targets, fine.labels, strict=True):
        assert set(mask.unique().tolist()) == {0, int(label), 255}
    assert set(np.unique(fine.labels)) <= set(range(1, 21)) and len(np.unique(fine.labels)) == 20


def test_void_band_is_where_the_unbordered_map_changes(fine) -> None:
    plain = Scenes(num_samples=300, image_size=SIZE, seed=3, void_border=0).load_train()
    assert torch.equal(plain.inputs, fine.inputs) and not (plain.targets == 255).any()
    # a pixel is void iff it is background with an object pixel in its 3×3 neighbourhood
    occupied = (plain.targets > 0).float()[:, None]
    windows = F.unfold(F.pad(occupied, (1, 1, 1, 1)), 3)  # [N, 9, S·S]
    band = (windows.max(dim=1).values > 0).view(-1, SIZE, SIZE) & (plain.targets == 0)
    assert torch.equal(fine.targets == 255, band)
    assert torch.equal(fine.targets[~band], plain.targets[~band])


def test_same_seed_same_scenes_other_seed_other_scenes(fine) -> None:
    again = Scenes(num_samples=300, image_size=SIZE, seed=3).load_train()
    assert torch.equal(again.inputs, fine.inputs) and torch.equal(again.targets, fine.targets)
    other = Scenes(num_samples=300, image_size=SIZE, seed=4).load_train()
    assert not torch.equal(other.inputs, fine.inputs)


def test_test_set_is_a_separate_draw() -> None:
    dataset = Scenes(num_samples=50, num_test_samples=40, image_size=SIZE)
    train, test = dataset.load_train(), dataset.load_test()
    assert len(test) == 40 and not torch.equal(train.inputs[:40], test.inputs)
    assert Scenes(num_samples=50, image_size=SIZE).load_test() is None


def test_colour_tells_the_hue_family(fine) -> None:
    # classes 5h…5h+4 share hue family h of red, green, blue, yellow: the object's mean colour shows it
    rgb = fine.inputs * 0.25 + 0.5  # undo the standardisation
    objects = (fine.targets > 0) & (fine.targets != 255)
    mean = (rgb * objects[:, None]).sum(dim=(2, 3)) / objects.sum(dim=(1, 2))[:, None]  # [N, 3]
    hues = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    family = F.normalize(mean - mean.mean(dim=1, keepdim=True), dim=1) @ F.normalize(hues - 0.5, dim=1).T
    family = family.argmax(dim=1)  # the nearest pure hue by angle, grey removed
    assert (family == torch.from_numpy((fine.labels - 1) // 5)).float().mean() > 0.95


def test_macro_variant_shares_images_and_partition_labels(fine) -> None:
    macro = Scenes(num_samples=300, image_size=SIZE, seed=3, label_set="macro").load_train()
    assert torch.equal(macro.inputs, fine.inputs) and np.array_equal(macro.labels, fine.labels)
    names = [MACRO_CLASSES[m] for m in macro.targets[fine.targets == fine.labels[:, None, None]].unique()]
    assert set(names) <= {"person", "vehicle", "household", "animal"}
    for mask, label in zip(macro.targets[:40], fine.labels[:40], strict=True):
        expected = {"person": 1, "vehicle": 2, "household": 3, "animal": 4}
        name = VOC_CLASSES[label]
        group = next(
            g
            for g, members in {
                "person": ["person"],
                "vehicle": ["aeroplane", "bicycle", "boat", "bus", "car", "motorbike", "train"],
                "household": ["bottle", "chair", "diningtable", "pottedplant", "sofa", "tvmonitor"],
                "animal": ["bird", "cat", "cow", "dog", "horse", "sheep"],
            }.items()
            if name in members
        )
        assert set(mask.unique().tolist()) == {0, expected[group], 255}
    assert Scenes(label_set="macro").num_classes == 5 and Scenes().num_classes == 21


def test_classification_mode() -> None:
    dataset = Scenes(mode="classification", num_samples=200, image_size=SIZE, num_object_classes=10)
    pool = dataset.load_train()
    assert dataset.num_classes == 10 and dataset.input_shape == (3, SIZE, SIZE)
    assert pool.targets.shape == (200,) and pool.targets.max() < 10
    assert np.array_equal(pool.labels, pool.targets.numpy())
    segmentation = Scenes(num_samples=200, image_size=SIZE, num_object_classes=10).load_train()
    assert torch.equal(segmentation.inputs, pool.inputs)
    assert np.array_equal(segmentation.labels, pool.labels + 1)  # segmentation counts background as 0
    macro = Scenes(mode="classification", label_set="macro", num_samples=200, image_size=SIZE)
    assert macro.num_classes == 4 and macro.load_train().targets.max() <= 3


def test_voc_partitioner_applies_unchanged(fine) -> None:
    parts = DirichletPowerLaw(num_clients=10, alpha=0.1)(fine.partition_labels(), 21, np.random.default_rng(0))
    assert sum(len(p) for p in parts) == len(fine)
    # with α = 0.1 most clients are dominated by one class
    dominant = [np.bincount(fine.labels[p]).max() / len(p) for p in parts]
    assert np.median(dominant) > 0.5


def test_selectable_from_yaml() -> None:
    parser = ArgumentParser()
    parser.add_subclass_arguments(FederatedDataset, "dataset")
    cfg = parser.parse_args(
        [
            "--dataset=fedlight.data.Scenes",
            "--dataset.init_args.mode=classification",
            "--dataset.init_args.image_size=32",
        ]
    )
    dataset = parser.instantiate(cfg).dataset
    assert isinstance(dataset, Scenes) and dataset.input_shape == (3, 32, 32) and dataset.num_classes == 20


def test_errors_name_the_flags() -> None:
    with pytest.raises(ConfigError) as info:
        Scenes(num_object_classes=30, image_size=4)
    assert "num_object_classes in [1, 20], got 30" in str(info.value) and "image_size ≥ 8" in str(info.value)
    with pytest.raises(ConfigError, match="label_set=macro groups all 20"):
        Scenes(label_set="macro", num_object_classes=10)


def test_the_test_set_is_drawn_apart_from_the_training_pool():
    scenes = Scenes(num_samples=16, num_test_samples=16, image_size=32)
    train, test = scenes.load_train(), scenes.load_test()
    assert not torch.equal(train.inputs, test.inputs)
    assert torch.equal(Scenes(num_samples=16, num_test_samples=16, image_size=32).load_test().inputs, test.inputs)
