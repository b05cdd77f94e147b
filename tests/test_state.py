"""Only what is federated enters a round: frozen parts are loaded once, never summed, checkpointed once."""

import numpy as np
import pytest
import torch
from torch import nn

from fedlight import checkpoint as ckpt_io
from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.state import FlatState, frozen_state_names
from fedlight.strategies import FedAvg

WIDTH = 2200  # backbone width: 16·2200 + 2200 + 2·2200 + 2200² + 2200 ≈ 4.9M parameters
CLASSES = 22  # head: 2200·22 + 22 = 48,422 parameters


class FrozenBackboneNet(nn.Module):
    """A 4.9M-parameter backbone (with BatchNorm) and a 48k-parameter linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(16, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5)
        )
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward_features(self, x):
        return self.backbone(x)

    def forward_head(self, features):
        return self.head(features)

    def forward(self, x):
        return self.head(self.backbone(x))


class Vectors(FederatedDataset):
    """Four clients with 20 random 16-D samples each (no separate test set)."""

    num_classes = CLASSES
    input_shape = (16,)

    def load_train(self) -> LabelledTensors:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(80, 16, generator=generator)
        y = torch.randint(CLASSES, (80,), generator=generator)
        return LabelledTensors(x, y, np.repeat(np.arange(4), 20))


def frozen_client():
    torch.manual_seed(0)
    client = ClassificationClient(num_classes=CLASSES, input_shape=(16,), model="mlp")
    client.net = FrozenBackboneNet()
    client.frozen_modules = ("net.backbone",)
    return client


def test_frozen_parts_are_not_federated_and_stay_bit_identical(tmp_path):
    data = FederatedDataModule(Vectors(), batch_size=10)
    model = frozen_client()
    backbone_before = {k: v.clone() for k, v in model.net.backbone.state_dict().items()}
    head_numel = WIDTH * CLASSES + CLASSES
    settings = {"logger": "csv", "enable_progress_bar": False, "default_root_dir": tmp_path}
    trainer = FederatedTrainer(rounds=2, clients_per_round=2, local_epochs=1, **settings)
    trainer.fit(model, data, FedAvg())

    assert trainer.model.layout.numel == head_numel == 48_422
    # the round's buffers: W^t in fp32 (4 bytes) and the streamed weighted sum in fp64 (8 bytes) per
    # federated entry, plus the fp64 weight total (8 bytes)
    assert trainer.run.pieces.fits.aggregation_nbytes == head_numel * (4 + 8) + 8
    # the backbone, BatchNorm statistics included (it runs in eval mode), is exactly as it was loaded
    for name, value in model.net.backbone.state_dict().items():
        assert torch.equal(value, backbone_before[name]), name
    # the head did train
    assert not torch.equal(model.net.head.weight, frozen_client().net.head.weight)

    checkpoint = ckpt_io.load(trainer.run_dir / "checkpoints" / "last.ckpt")
    assert sorted(checkpoint["global_state"]) == ["net.head.bias", "net.head.weight"]
    assert sorted(checkpoint["frozen_state"]) == sorted(f"net.backbone.{k}" for k in backbone_before)


def test_frozen_entries_follow_requires_grad_and_their_modules():
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Conv2d(2, 2, 1))
    net[1].requires_grad_(False)  # a BatchNorm whose affine weights are frozen keeps its statistics too
    net[2].bias.requires_grad_(False)  # a single frozen parameter: only it is left out
    frozen = frozen_state_names(net)
    assert frozen == {"1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked", "2.bias"}
    layout = FlatState(net)
    assert layout.names == ["0.weight", "0.bias", "2.weight"]
    assert layout.numel == 2 * 9 + 2 + 4
    assert layout.integer_names == []


class PartlyFrozenBlock(nn.Module):
    """A block holding one frozen parameter of its own (a fixed temperature) beside trainable children."""

    def __init__(self) -> None:
        super().__init__()
        self.temp = nn.Parameter(torch.tensor(2.0), requires_grad=False)
        self.fc = nn.Linear(16, 8)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.norm(self.fc(x)) / self.temp


class PartlyFrozenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = PartlyFrozenBlock()
        self.head = nn.Linear(8, CLASSES)

    def forward_features(self, x):
        return self.block(x)

    def forward_head(self, features):
        return self.head(features)

    def forward(self, x):
        return self.head(self.block(x))


def partly_frozen_client():
    torch.manual_seed(0)
    client = ClassificationClient(num_classes=CLASSES, input_shape=(16,), model="mlp")
    client.net = PartlyFrozenNet()
    return client


def test_a_module_is_frozen_only_when_all_its_parameters_are():
    net = PartlyFrozenNet()
    assert frozen_state_names(net) == {"block.temp"}
    assert "block.norm.running_mean" in FlatState(net).names
    all_frozen = PartlyFrozenNet()
    all_frozen.block.requires_grad_(False)  # now every parameter under block is frozen, its statistics too
    assert frozen_state_names(all_frozen) == {f"block.{k}" for k in all_frozen.block.state_dict()}


class RecordClientStates(FedAvg):
    """FedAvg that keeps every client's trained ``block.fc.weight`` and sample count."""

    def __init__(self) -> None:
        super().__init__()
        self.trained: list[tuple[int, torch.Tensor]] = []

    def on_client_fit_end(self, context, module, update) -> None:
        self.trained.append((update.num_samples, module.net.block.fc.weight.detach().clone()))


def test_trainable_children_of_a_partly_frozen_module_are_averaged_checkpointed_and_resumed(tmp_path):
    settings = {"logger": "csv", "enable_progress_bar": False, "clients_per_round": 4, "local_epochs": 1}
    initial = partly_frozen_client().net.block.state_dict()
    strategy = RecordClientStates()
    two_rounds = FederatedTrainer(rounds=2, default_root_dir=tmp_path / "a", **settings)
    two_rounds.fit(partly_frozen_client(), FederatedDataModule(Vectors(), batch_size=10), strategy)
    global_state = two_rounds.model.layout.to_state_dict(two_rounds.global_state, two_rounds.model.integers)

    # averaged: the last round's four clients, weighted by their sample counts (all 20)
    last = strategy.trained[-4:]
    expected = sum(n * w for n, w in last) / sum(n for n, _ in last)
    torch.testing.assert_close(global_state["net.block.fc.weight"], expected)
    # the BatchNorm inside the block trains: its statistics move from their initial values
    assert not torch.equal(global_state["net.block.norm.running_mean"], initial["norm.running_mean"])
    # checkpointed as trained, the frozen temperature alone kept aside
    checkpoint = ckpt_io.load(two_rounds.run_dir / "checkpoints" / "last.ckpt")
    torch.testing.assert_close(checkpoint["global_state"]["net.block.fc.weight"], expected)
    assert sorted(checkpoint["frozen_state"]) == ["net.block.temp"]

    # resumed: one round, then a second from its checkpoint, ends where two uninterrupted rounds do
    one_round = FederatedTrainer(rounds=1, default_root_dir=tmp_path / "b", **settings)
    one_round.fit(partly_frozen_client(), FederatedDataModule(Vectors(), batch_size=10), FedAvg())
    resumed = FederatedTrainer(rounds=2, default_root_dir=tmp_path / "b", **settings)
    resumed.fit(
        partly_frozen_client(),
        FederatedDataModule(Vectors(), batch_size=10),
        FedAvg(),
        ckpt_path=one_round.run_dir / "checkpoints" / "last.ckpt",
    )
    torch.testing.assert_close(resumed.global_state, two_rounds.global_state, rtol=0, atol=0)


def test_a_client_without_federated_parameters_is_refused_at_set_up(tmp_path):
    model = partly_frozen_client()
    model.net.requires_grad_(False)
    trainer = FederatedTrainer(rounds=1, clients_per_round=2, logger="csv", default_root_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"has no federated parameter.*requires_grad"):
        trainer.fit(model, FederatedDataModule(Vectors(), batch_size=10), FedAvg())
    assert list(tmp_path.iterdir()) == []
