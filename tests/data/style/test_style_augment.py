"""LADD's source augmentation: styles from the clients' pool, colour jitter, the pool file."""

import numpy as np
import pytest
import torch

from fedlight.data import FederatedDataModule
from fedlight.data.partition import Natural
from fedlight.data.style.fda import apply_style, client_style
from fedlight.data.style.style_augment import StyleAugment, style_pool
from fedlight.data.twins.style_cities import StyleCities
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import FedAvg
from fedlight.testing import ScalarClient

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


# -- the pool file is checked when the data are set up ---------------------------------------------------


def write_pool(path, **changes):
    pool = {"styles": torch.rand(4, 27, dtype=torch.float64) * 100, "client_ids": ["a", "b", "c", "d"], "b": 1}
    torch.save({**pool, "size": [SIZE, SIZE], **changes}, path)


def nan_style(path):
    styles = torch.rand(4, 27, dtype=torch.float64)
    styles[2, 5] = float("nan")
    write_pool(path, styles=styles)


def negative_style(path):
    write_pool(path, styles=-torch.rand(4, 27, dtype=torch.float64))


def truncated(path):
    write_pool(path)
    path.write_bytes(path.read_bytes()[:200])


DAMAGES = {
    "truncated": (truncated, "cannot be read"),
    "text": (lambda path: path.write_text("not a pool\n"), "cannot be read"),
    "no styles": (lambda path: torch.save({"client_ids": ["a"]}, path), "holds no 'styles' tensor"),
    "nan": (nan_style, "non-finite or negative amplitudes in 1 of 4 styles (clients ['c'])"),
    "negative": (negative_style, "non-finite or negative amplitudes in 4 of 4 styles"),
    "too few ids": (lambda path: write_pool(path, client_ids=["a", "b"]), "4 styles, 2 ids"),
    "repeated ids": (lambda path: write_pool(path, client_ids=["a", "b", "a", "d"]), "one distinct client id"),
    "no ids": (lambda path: write_pool(path, client_ids=None), "4 styles, no list of ids"),
}


def source_data(style_file):
    source = StyleCities(domain="source", num_source_samples=8, num_test_per_city=0, image_size=SIZE)
    augment = StyleAugment(str(style_file), size=(SIZE, SIZE))
    return FederatedDataModule(source, Natural(), batch_size=4, test_fraction=0.0, train_transform=augment), augment


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_pool_is_one_error_at_set_up_naming_the_flag(tmp_path, damage):
    path = tmp_path / "styles.pt"
    write, expected = DAMAGES[damage]
    write(path)
    data, _ = source_data(path)
    with pytest.raises(ConfigError) as error:
        data.setup()
    message = str(error.value)
    assert f"Style pool {path} (--data.train_transform.init_args.style_file)" in message
    assert expected in message and "Delete the file" in message


def test_a_damaged_pool_stops_a_run_before_its_folder_exists(tmp_path):
    nan_style(tmp_path / "styles.pt")
    data, _ = source_data(tmp_path / "styles.pt")
    trainer = FederatedTrainer(rounds=1, logger=None, enable_progress_bar=False, default_root_dir=tmp_path / "runs")
    with pytest.raises(ConfigError, match="non-finite"):
        trainer.fit(ScalarClient(), data, FedAvg())
    assert not (tmp_path / "runs").exists()


def test_an_intact_pool_is_read_at_set_up_not_in_the_first_fit(tmp_path):
    write_pool(tmp_path / "styles.pt")
    data, augment = source_data(tmp_path / "styles.pt")
    data.setup()
    assert augment._styles is not None and augment.styles.shape == (4, 27)
