"""Only what is federated enters a round: frozen parts are loaded once, never summed, checkpointed once."""

import numpy as np
import torch
from torch import nn

from fedlight import checkpoint as ckpt_io
from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.engine.trainer import FederatedTrainer
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

    assert trainer.layout.numel == head_numel == 48_422
    # the round's buffers: W^t in fp32 (4 bytes) and the streamed weighted sum in fp64 (8 bytes) per
    # federated entry, plus the fp64 weight total (8 bytes)
    assert trainer.aggregation_nbytes == head_numel * (4 + 8) + 8
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
