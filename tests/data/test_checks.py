"""A dataset's labels, label dtype and inputs are checked when the data are set up, naming the file, the count and
the clients that hold the bad samples; lazily read label maps as they are read; an evaluation error names its
client."""

import numpy as np
import pytest
import torch

from fedlight.clients import ClassificationClient, SegmentationClient
from fedlight.data import FederatedDataModule
from fedlight.data.base import FederatedDataset, LabelledTensors, LazySamples
from fedlight.data.checks import bad_labels
from fedlight.data.datasets.npz import NpzDataset
from fedlight.data.partition import Natural
from fedlight.engine.evaluation import EvaluationFailed
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import FedAvg
from fedlight.testing import ClientImages


def write_npz(path, mutate=None, clients=4, per_client=10):
    """``clients`` clients of ``per_client`` samples of 3 classes, each client's samples together in the file."""
    rng = np.random.default_rng(0)
    n = clients * per_client
    arrays = {
        "inputs": rng.normal(size=(n, 5)).astype(np.float32),
        "targets": np.arange(n, dtype=np.int64) % 3,
        "groups": np.repeat(np.arange(clients), per_client),
    }
    if mutate is not None:
        mutate(arrays)
    np.savez(path, **arrays)
    return path


def fit(tmp_path, data, model=None):
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=2, local_epochs=1, logger="csv", enable_progress_bar=False,
        default_root_dir=tmp_path / "runs",
    )  # fmt: skip
    model = model or ClassificationClient(num_classes=3, input_shape=(5,), model="mlp", model_kwargs={"hidden": [8]})
    return trainer, trainer.fit(model, data, FedAvg())


def held_out_sample(path):
    """A pool index that the partition puts in client 2's held-out split (the split is drawn from the data seed)."""
    data = FederatedDataModule(NpzDataset(str(path)), Natural())
    data.setup()
    return int(data.held_out_index[data.held_out_group == 2][0])


def test_a_label_outside_the_classes_in_one_held_out_split_is_refused_before_the_run_folder(tmp_path):
    index = held_out_sample(write_npz(tmp_path / "good.npz"))
    path = write_npz(tmp_path / "bad.npz", lambda a: a["targets"].__setitem__(index, -1))
    with pytest.raises(ConfigError) as err:
        fit(tmp_path, FederatedDataModule(NpzDataset(str(path)), Natural()))
    assert str(err.value) == (
        f"--data.dataset NpzDataset (path={path}) gives 1 pool samples with labels outside [0, 3), e.g. -1: 1 in "
        "client 2's held-out split. Fix the labels, or the dataset's number of classes."
    )
    assert not (tmp_path / "runs").exists()


def test_labels_beyond_a_given_number_of_classes_name_each_client_and_count(tmp_path):
    path = write_npz(tmp_path / "data.npz")  # labels 0, 1, 2, 0, … ; two classes declared
    with pytest.raises(ConfigError) as err:
        FederatedDataModule(NpzDataset(str(path), num_classes=2), Natural(), test_fraction=0.0).setup()
    # label 2 sits at positions 2, 5, …, 38: three of them in client 0 (0–9), three in 1, four in 2 (20, 23, 26,
    # 29), three in 3
    assert "gives 13 pool samples with labels outside [0, 2), e.g. 2: 3 in client 0's training split, 3 in " in str(
        err.value
    )
    assert "client 1's training split, 4 in client 2's training split, 3 in client 3's training split." in str(
        err.value
    )


def test_float_labels_are_refused_not_truncated(tmp_path):
    path = write_npz(tmp_path / "data.npz", lambda a: a.update(targets=a["targets"] + 0.5))
    with pytest.raises(ConfigError, match=r"targets of dtype float64, not integer class labels \(40 of 40 values"):
        NpzDataset(str(path))


def test_float_labels_of_a_dataset_class_are_refused_at_set_up():
    class FloatLabels(ClientImages):
        def load_train(self):
            pool = super().load_train()
            return LabelledTensors(pool.inputs, pool.targets.float(), pool.groups)

    with pytest.raises(ConfigError, match=r"FloatLabels gives pool targets of dtype torch\.float32"):
        FederatedDataModule(FloatLabels([10, 10], [0, 1])).setup()


def test_non_finite_inputs_are_refused_naming_the_clients(tmp_path):
    path = write_npz(tmp_path / "data.npz", lambda a: a["inputs"].__setitem__((slice(30, 33), 1), np.nan))
    with pytest.raises(ConfigError, match=r"gives 3 pool samples with NaN or Inf inputs: 3 in client 3's training"):
        FederatedDataModule(NpzDataset(str(path)), Natural(), test_fraction=0.0).setup()


def test_label_maps_allow_void_and_refuse_other_values():
    maps = torch.tensor([[[0, 255], [1, 2]], [[3, 0], [0, 0]], [[0, 0], [254, 0]]])
    mask, values = bad_labels(maps, 3)
    assert mask.tolist() == [False, True, True] and values == [3, 254]


class Masks(LazySamples):
    """Label maps read lazily; sample 13's holds class 9 of 3."""

    shape = (40, 8, 8)

    def __getitem__(self, index):
        maps = (index.view(-1, 1, 1) % 3).expand(-1, 8, 8).clone()
        maps[index == 13] = 9
        return maps


class Images(LazySamples):
    shape = (40, 3, 8, 8)

    def __getitem__(self, index):
        return torch.randn(len(index), 3, 8, 8, generator=torch.Generator().manual_seed(int(index.sum())))


class LazyScenes(FederatedDataset):
    num_classes, input_shape = 3, (3, 8, 8)

    def load_train(self):
        return LabelledTensors(Images(), Masks(), groups=np.repeat(np.arange(4), 10), labels=np.arange(40) % 3)


def test_lazily_read_label_maps_are_checked_as_they_are_read(tmp_path):
    data = FederatedDataModule(LazyScenes(), batch_size=5, eval_batch_size=8)
    data.setup()  # not read at set-up: the pool may be far larger than memory
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=4, local_epochs=1, logger=None, enable_progress_bar=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    model = SegmentationClient(num_classes=3, input_shape=(3, 8, 8), model="mini_deeplab")
    with pytest.raises(ConfigError, match=r"1 pool samples with labels outside \[0, 3\) or 255 \(void\), e\.g\. 9 "):
        trainer.fit(model, data, FedAvg())


class FailsOnClient2(ClassificationClient):
    def validation_step(self, batch, batch_idx):
        if bool((batch[2] == 2).any()):
            raise IndexError("index 7 is out of bounds for dimension 0 with size 3")
        return super().validation_step(batch, batch_idx)


def test_an_evaluation_error_names_the_client_whose_split_raised(tmp_path):
    data = FederatedDataModule(ClientImages([20, 20, 20, 20], [0, 1, 2, 3]), batch_size=10)
    model = FailsOnClient2(num_classes=3, input_shape=(1, 8, 8), model="mlp")
    with pytest.raises(EvaluationFailed, match=r"on client 2's held-out split raised \(IndexError: index 7"):
        fit(tmp_path, data, model)
