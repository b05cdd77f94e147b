"""Your own map-style ``Dataset`` (or ``LightningDataModule``) as a federated pool, and the README's example."""

import csv
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningDataModule
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from fedlight import checkpoint as ckpt_io
from fedlight.cli import main
from fedlight.data import FederatedDataModule, TorchDataset
from fedlight.data.partition import Dirichlet, Natural
from fedlight.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


class Pairs(Dataset):
    """``n`` samples ``[2, 3]`` whose entries all equal the sample's index; label ``i % 3``; optional client ids."""

    def __init__(self, n: int = 12, client_ids=None, shapes=None) -> None:
        self.n, self.reads = n, []
        if client_ids is not None:
            self.client_ids = client_ids
        self.shapes = shapes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        self.reads.append(i)
        shape = self.shapes[i] if self.shapes else (2, 3)
        return np.full(shape, i, dtype=np.float64), i % 3


def test_a_map_style_dataset_becomes_labelled_tensors_in_sample_order() -> None:
    dataset = TorchDataset(Pairs())
    pool = dataset.load_train()
    assert dataset.input_shape == (2, 3) and dataset.num_classes == 3, "largest label + 1"
    assert pool.inputs.dtype == torch.float32 and pool.inputs[:, 0, 0].tolist() == list(range(12))
    assert pool.targets.tolist() == [i % 3 for i in range(12)] and pool.groups is None
    assert dataset.load_test() is None


def test_pil_images_become_unit_range_tensors_and_classes_name_the_labels() -> None:
    class Pictures(Dataset):
        classes = ("cat", "dog")

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return Image.new("RGB", (5, 4), (255 * i, 51, 0)), i

    dataset = TorchDataset(Pictures())
    pool = dataset.load_train()
    assert dataset.input_shape == (3, 4, 5) and dataset.num_classes == 2 and dataset.class_names == ("cat", "dog")
    torch.testing.assert_close(pool.inputs[:, :, 0, 0], torch.tensor([[0.0, 0.2, 0.0], [1.0, 0.2, 0.0]]))


def test_client_ids_give_the_natural_partition_and_another_partitioner_is_refused() -> None:
    ids = ["b", "a", "b", "c", "a", "b"] * 2
    data = FederatedDataModule(Pairs(client_ids=ids), Natural(), test_fraction=0.0)
    data.setup()
    clients = [sorted(ix.tolist()) for ix in data.client_train]
    expected = [[i for i, c in enumerate(ids) if c == client] for client in ("a", "b", "c")]  # sorted id order
    assert clients == expected
    with pytest.raises(ConfigError, match=r"client_ids.*Natural.*ignore_client_ids"):
        FederatedDataModule(Pairs(client_ids=ids), Dirichlet(num_clients=2, alpha=1.0, min_size=1))
    two = Dirichlet(num_clients=2, alpha=1.0, min_size=1)
    ignored = FederatedDataModule(TorchDataset(Pairs(client_ids=ids), ignore_client_ids=True), two)
    ignored.setup()
    assert ignored.num_clients == 2
    with pytest.raises(ConfigError, match="5 client_ids for 12 samples"):
        TorchDataset(Pairs(client_ids=ids[:5]))


def test_a_lazy_pool_reads_inputs_only_for_the_batches_served() -> None:
    source = Pairs(n=6)
    dataset = TorchDataset(source, num_classes=3, in_memory=False)
    pool = dataset.load_train()
    source.reads.clear()
    batch = pool.inputs[torch.tensor([4, 1])]
    assert source.reads == [4, 1] and batch[:, 0, 0].tolist() == [4.0, 1.0] and pool.inputs.shape == (6, 2, 3)
    assert pool.targets.tolist() == [0, 1, 2, 0, 1, 2]


def test_a_lightning_datamodule_gives_its_training_and_test_sets() -> None:
    class PairsModule(LightningDataModule):
        def setup(self, stage: str) -> None:
            self.train_set, self.test_set = Pairs(n=9), Pairs(n=4)

        def train_dataloader(self):
            return DataLoader(self.train_set, batch_size=2)

        def test_dataloader(self):
            return DataLoader(self.test_set, batch_size=2)

    dataset = TorchDataset(PairsModule())
    assert len(dataset.load_train()) == 9 and len(dataset.load_test()) == 4

    class TrainOnly(PairsModule):
        test_dataloader = LightningDataModule.test_dataloader

    assert TorchDataset(TrainOnly()).load_test() is None


def test_items_that_are_no_pairs_or_differ_in_shape_are_refused() -> None:
    class Bare(Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return torch.zeros(3)

    with pytest.raises(ConfigError, match=r"Bare\[0\] is a Tensor, not an \(input, target\) pair"):
        TorchDataset(Bare(), num_classes=2)
    with pytest.raises(ConfigError, match=r"inputs of several shapes \(\(2, 3\), \(4, 3\)\)"):
        TorchDataset(Pairs(n=2, shapes=[(2, 3), (4, 3)]), num_classes=3).load_train()


def _readme_section(title: str) -> str:
    readme = (REPO / "README.md").read_text()
    start = readme.index(f"### {title}\n")
    return readme[start : readme.find("\n#", start + 4)]


def test_the_readmes_own_data_trains_by_import_path_from_the_working_directory(tmp_path, monkeypatch, capsys) -> None:
    section = _readme_section("Your own data")
    code = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL).group(1)
    command = re.search(r"`(fedlight fit [^`]*--data\.dataset=(\w+)\.\w+[^`]*)`", section)
    module = command.group(2)
    (tmp_path / f"{module}.py").write_text(code)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.chdir(tmp_path)
    args = command.group(1).split()[1:]  # the README's own flags, after "fedlight"
    args = [str(REPO / a) if a.startswith("conf/") else a for a in args]
    quick = ["--trainer.rounds=1", "--trainer.local_epochs=1", "--trainer.logger=csv"]
    main([*args, *quick, "--trainer.enable_progress_bar=false"])
    writers = int(re.search(r"--data\.dataset\.init_args\.writers=(\d+)", section).group(1))
    assert f"of {writers} clients per round" in capsys.readouterr().out, "one client per client id"
    monkeypatch.delitem(sys.modules, module)
    run_dir = tmp_path / "runs" / "fedavg" / "version_0"
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert len(rows) == 1 and 0.0 <= float(rows[0]["clients/acc"]) <= 1.0
    state = ckpt_io.load(run_dir / "checkpoints" / "last.ckpt")["global_state"]
    # the CNN reads the example's one-channel 8×8 images: 64 channels of 2×2 after two poolings
    assert state["net.encoder.0.weight"].shape == (32, 1, 5, 5) and state["net.encoder.7.weight"].shape == (256, 256)
