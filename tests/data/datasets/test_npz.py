"""``NpzDataset``: a user's arrays, their own client ids, and a partitioner that would drop them."""

import numpy as np
import pytest

from fedlight.data import FederatedDataModule, NpzDataset
from fedlight.data.partition import Natural, PowerLaw
from fedlight.errors import ConfigError


def saved(tmp_path, groups=True):
    path = tmp_path / "mine.npz"
    arrays = {"inputs": np.arange(24, dtype=np.float32).reshape(12, 2), "targets": np.arange(12) % 3}
    if groups:
        arrays["groups"] = np.repeat([7, 8, 9], 4)  # three clients of four samples
    np.savez(path, **arrays)
    return str(path)


def test_the_files_client_ids_are_the_clients_under_natural(tmp_path):
    data = FederatedDataModule(NpzDataset(saved(tmp_path)), Natural(), test_fraction=0.25)
    data.setup()
    assert data.num_clients == 3 and [len(c) for c in data.client_train] == [3, 3, 3]


def test_another_partitioner_would_ignore_the_ids_and_is_refused_naming_both_fixes(tmp_path):
    partitioner = PowerLaw(num_clients=2, classes_per_client=1, base_samples=1)
    with pytest.raises(ConfigError) as error:
        FederatedDataModule(NpzDataset(saved(tmp_path)), partitioner)
    text = str(error.value)
    assert "holds each sample's client id (groups), but --data.partitioner=PowerLaw" in text
    assert "fedlight.data.partition.Natural" in text and "--data.dataset.init_args.ignore_groups=true" in text


def test_ignore_groups_lets_the_partitioner_split_and_a_file_without_ids_needs_nothing(tmp_path):
    partitioner = PowerLaw(num_clients=2, classes_per_client=1, base_samples=1)
    data = FederatedDataModule(NpzDataset(saved(tmp_path), ignore_groups=True), partitioner)
    data.setup()
    assert data.num_clients == 2
    (tmp_path / "plain").mkdir()
    FederatedDataModule(NpzDataset(saved(tmp_path / "plain", groups=False)), partitioner).setup()
