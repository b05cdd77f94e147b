import numpy as np
import torch
from sklearn.datasets import load_digits

from fedlight.data.datasets.digits import Digits
from fedlight.data.partition import PowerLaw, validate_partition


def test_digits_are_standardised_per_pixel() -> None:
    dataset = Digits()
    pool = dataset.load_train()
    assert dataset.num_classes == 10 and dataset.input_shape == (1, 8, 8) and dataset.load_test() is None
    assert pool.inputs.shape == (1797, 1, 8, 8) and pool.inputs.dtype == torch.float32
    assert pool.targets.dtype == torch.int64 and pool.groups is None
    assert np.bincount(pool.targets.numpy()).tolist() == np.bincount(load_digits().target).tolist()

    pixels = pool.inputs.reshape(len(pool), 64).double()
    assert torch.isfinite(pixels).all()
    varying = torch.from_numpy(load_digits().data.std(axis=0) > 0)
    assert 0 < (~varying).sum() < 64, "the corner pixels of the digits are constant"
    assert torch.allclose(pixels.mean(0), torch.zeros(64, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(
        pixels.std(0, unbiased=False)[varying], torch.ones(int(varying.sum()), dtype=torch.float64), atol=1e-5
    )
    assert torch.all(pixels[:, ~varying] == 0)


def test_digits_support_a_small_fedprox_mnist_federation() -> None:
    targets = Digits().load_train().targets.numpy()
    parts = PowerLaw(num_clients=100, base_samples=2)(targets, 10, np.random.default_rng(0))
    validate_partition(parts, len(targets))
    assert all(np.unique(targets[part]).size == 2 for part in parts)
