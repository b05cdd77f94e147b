import numpy as np
import pytest
import torch

from fedlight.data.twins.street_scenes import CITYSCAPES_27, STREET_12, StreetScenes
from fedlight.errors import ConfigError


def small(**kwargs):
    options = {"num_classes": 12, "num_cities": 3, "images_per_city": 12, "num_test_samples": 6, "image_size": 32}
    return StreetScenes(**(options | kwargs))


def test_shapes_cities_and_labels():
    data = small()
    train, test = data.load_train(), data.load_test()
    assert train.inputs.shape == (36, 3, 32, 32) and train.targets.shape == (36, 32, 32)
    assert train.groups.tolist() == [0] * 12 + [1] * 12 + [2] * 12
    assert int(train.targets.max()) < 12 and int(train.targets.min()) >= 0  # every pixel labelled
    assert set(test.groups.tolist()) == {3, 4, 5}  # the test cities hold no client's images
    assert [CITYSCAPES_27.index(c) for c in STREET_12] == sorted(CITYSCAPES_27.index(c) for c in STREET_12)


def test_one_seed_gives_one_dataset():
    a, b = small().load_train(), small().load_train()
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, small(seed=1).load_train().inputs)


def sky_colour_gaps(train):
    sky = STREET_12.index("sky")
    colours = []
    for city in range(3):
        at = torch.from_numpy(train.groups == city)
        pixels = train.inputs[at].permute(0, 2, 3, 1)[train.targets[at] == sky]  # [n, 3]
        colours.append(pixels.mean(dim=0))
    return [float((colours[i] - colours[j]).abs().max()) for i, j in [(0, 1), (0, 2), (1, 2)]]


def test_cities_paint_the_same_class_differently():
    styled = sky_colour_gaps(small(images_per_city=20).load_train())
    plain = sky_colour_gaps(small(images_per_city=20, style_strength=0.0).load_train())
    assert min(styled) > 0.5 and max(plain) < 0.2  # without styles only lighting and noise tell cities apart


def test_dominant_labels_are_the_most_frequent_class():
    train = small().load_train()
    expected = np.array([int(torch.bincount(m.flatten(), minlength=12).argmax()) for m in train.targets])
    assert train.labels.tolist() == expected.tolist()


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        StreetScenes(num_classes=19, num_cities=0)
    assert len(err.value.problems) == 2


def test_distinct_class_colours_are_a_permuted_grid_at_least_0_3_apart():
    colours = StreetScenes(num_classes=27)._classes()[0]  # [27, 3]
    levels = {0.2, 0.5, 0.8}
    assert {tuple(round(v, 4) for v in c.tolist()) for c in colours} == {
        (a, b, c) for a in levels for b in levels for c in levels
    }  # every grid point once
    gaps = torch.cdist(colours, colours, p=float("inf")) + torch.eye(27)  # largest channel difference
    assert gaps.min() >= 0.3 - 1e-6
    drawn = StreetScenes(num_classes=27, class_colours="random")._classes()[0]
    assert (torch.cdist(drawn, drawn, p=float("inf")) + torch.eye(27)).min() < 0.3  # uniform draws crowd


def test_unknown_class_colours_name_the_flag():
    with pytest.raises(ConfigError, match="class_colours"):
        StreetScenes(class_colours="pastel")
