"""LADD's source augmentation: styles from the clients' pool, colour jitter, the pool file."""

import numpy as np
import pytest
import torch

from fedlight.data.style.fda import apply_style, client_style
from fedlight.data.style.style_augment import StyleAugment, style_pool
from fedlight.data.twins.style_cities import StyleCities
from fedlight.errors import ConfigError

SIZE = 16
TARGET = dict(num_clients_per_city=1, client_size=(3, 4), num_test_per_city=0, image_size=SIZE)


def test_the_pool_holds_each_target_clients_mean_style_of_its_raw_images(tmp_path):
    styles, ids = style_pool(StyleCities(**TARGET), b=1, size=(SIZE, SIZE))
    raw = StyleCities(**TARGET, normalise=False).load_train()
    assert ids == sorted(set(raw.groups.tolist())) == ["cool0", "dim0", "grey0", "warm0"]
    for row, client in zip(styles, ids, strict=True):
        expected = client_style([raw.inputs[torch.from_numpy(raw.groups == client)]], b=1, size=(SIZE, SIZE))
        torch.testing.assert_close(row, expected, rtol=1e-6, atol=0)


def test_the_pool_file_is_written_once_and_each_image_gets_a_pool_style(tmp_path):
    path = tmp_path / "styles.pt"
    augment = StyleAugment(str(path), target=StyleCities(**TARGET), size=(SIZE, SIZE), color_jitter=(0, 0, 0))
    x = torch.rand(6, 3, SIZE, SIZE) * 2 - 1
    y = torch.zeros(6, SIZE, SIZE, dtype=torch.long)
    out, labels = augment(x, y, torch.Generator().manual_seed(0))
    assert path.is_file() and torch.equal(labels, y)
    chosen = torch.randint(4, (6,), generator=torch.Generator().manual_seed(0))  # the same draw, by hand
    assert len(set(chosen.tolist())) > 1
    expected = apply_style(x * 0.5 + 0.5, augment.styles[chosen], 1, (SIZE, SIZE))
    torch.testing.assert_close(out, (expected - 0.5) / 0.5)
    # a second transform reads the file; without it and without a target it says what to do
    torch.testing.assert_close(StyleAugment(str(path), size=(SIZE, SIZE)).styles, augment.styles)
    with pytest.raises(ConfigError, match="target"):
        _ = StyleAugment(str(tmp_path / "none.pt")).styles
    with pytest.raises(ConfigError, match="Delete the file"):
        _ = StyleAugment(str(path), b=2, size=(SIZE, SIZE)).styles


def test_colour_jitter_factors_stay_within_their_range(tmp_path):
    path = tmp_path / "styles.pt"
    torch.save({"styles": torch.zeros(1, 3), "client_ids": ["a"], "b": 0, "size": [SIZE, SIZE]}, path)
    augment = StyleAugment(str(path), b=0, size=(SIZE, SIZE), color_jitter=(0.5, 0.0, 0.0))
    grey = torch.full((200, 3, SIZE, SIZE), 0.4)
    # brightness alone on a constant grey image: 0.4·f with f ∈ [0.5, 1.5]
    values = augment._jitter(grey, torch.Generator().manual_seed(0))[:, 0, 0, 0]
    assert values.min() >= 0.2 - 1e-6 and values.max() <= 0.6 + 1e-6
    assert values.std() > 0.05  # factors do differ between images
    assert np.allclose(augment._jitter(grey, torch.Generator().manual_seed(1)).std(dim=(1, 2, 3)), 0, atol=1e-6)


def test_without_a_style_file_only_colours_and_crops_change():
    from fedlight.data.transforms import RandomScaleCropFlip

    augment = StyleAugment(None, color_jitter=(0, 0, 0), geometry=RandomScaleCropFlip(scale=(1, 1), flip=False))
    x, y = torch.rand(2, 3, SIZE, SIZE) * 2 - 1, torch.randint(3, (2, SIZE, SIZE))
    out, labels = augment(x, y, torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, x, atol=1e-5, rtol=0)
    assert torch.equal(labels, y)


def test_the_training_size_is_the_geometrys_crop():
    from fedlight.data.transforms import RandomScaleCropFlip

    cropped = StyleAugment(None, geometry=RandomScaleCropFlip(crop_size=(4, 6)))
    x, y = torch.rand(2, 3, SIZE, SIZE) * 2 - 1, torch.randint(3, (2, SIZE, SIZE))
    assert cropped.output_size((SIZE, SIZE)) == (4, 6) == tuple(cropped(x, y, torch.Generator())[0].shape[-2:])
    assert StyleAugment(None).output_size((SIZE, SIZE)) == (SIZE, SIZE)
