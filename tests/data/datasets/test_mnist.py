import numpy as np
import pytest
import torch
from miniatures.classification import write_mnist_files

from fedlight.data import MNIST
from fedlight.data.partition import PowerLaw, validate_partition
from fedlight.errors import ConfigError


def fake_mnist(root, num_train: int = 12, num_test: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Writes a tiny MNIST in torchvision's raw layout; returns the pooled images and labels."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (num_train + num_test, 28, 28), dtype=np.uint8)
    images[:, 0, :] = 7  # the top row is constant over the pool, like MNIST's borders
    labels = np.arange(num_train + num_test, dtype=np.uint8) % 10
    write_mnist_files(root, images, labels, num_train)
    return images, labels


def test_mnist_pools_both_splits_and_standardises_like_fedprox(tmp_path) -> None:
    images, labels = fake_mnist(tmp_path)
    dataset = MNIST(root=str(tmp_path))
    pool = dataset.load_train()
    assert dataset.num_classes == 10 and dataset.input_shape == (1, 28, 28) and dataset.load_test() is None
    assert pool.inputs.shape == (20, 1, 28, 28) and pool.inputs.dtype == torch.float32
    assert pool.targets.dtype == torch.int64 and pool.groups is None
    assert pool.targets.tolist() == labels.tolist()  # training images first, then the test images

    pixels = images.reshape(20, 784).astype(np.float64)
    expected = (pixels - pixels.mean(0)) / (pixels.std(0) + 0.001)  # FedProx's generate_niid.py
    np.testing.assert_allclose(pool.inputs.reshape(20, 784).numpy(), expected, atol=1e-4)
    assert torch.isfinite(pool.inputs).all()
    assert torch.all(pool.inputs[:, 0, 0, :] == 0), "constant pixels standardise to 0"


def test_mnist_without_standardisation_is_scaled_to_unit_range(tmp_path) -> None:
    images, _ = fake_mnist(tmp_path)
    pool = MNIST(root=str(tmp_path), standardize=False).load_train()
    torch.testing.assert_close(pool.inputs[:, 0], torch.from_numpy(images).float() / 255)


def test_mnist_feeds_the_fedprox_power_law_partition(tmp_path) -> None:
    fake_mnist(tmp_path, num_train=60, num_test=40)
    targets = MNIST(root=str(tmp_path)).load_train().targets.numpy()
    parts = PowerLaw(num_clients=10, classes_per_client=2, base_samples=2)(targets, 10, np.random.default_rng(0))
    validate_partition(parts, len(targets))
    assert all(np.unique(targets[part]).size == 2 for part in parts)


def test_missing_mnist_names_the_flag_and_what_to_download(tmp_path) -> None:
    dataset = MNIST(root=str(tmp_path / "nowhere"))  # constructing reads nothing
    with pytest.raises(ConfigError) as error:
        dataset.load_train()
    message = str(error.value)
    assert f"--data.dataset.init_args.root={tmp_path / 'nowhere'}" in message
    assert "download=true" in message and "train-images-idx3-ubyte" in message
    assert str(tmp_path / "nowhere" / "MNIST" / "raw") in message
