"""A network with only ``forward`` (a torchvision model, a user's first network) under rules that need nothing
more, and a clear refusal at set-up from those that read the classifier's features."""

import math

import pytest
import torch
from torch import nn

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, Synthetic
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import MOON, FedAvg, FedDecorr, FedProto


class ForwardOnly(nn.Module):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))

    def forward(self, x):
        return self.layers(x)


def setting(tmp_path):
    data = FederatedDataModule(Synthetic(num_clients=4, dim=12, seed=1), batch_size=10)
    model = ClassificationClient(10, (12,), model=f"{__name__}.ForwardOnly")
    trainer = FederatedTrainer(
        rounds=2, clients_per_round=2, local_epochs=1, logger="csv", default_root_dir=tmp_path,
        enable_progress_bar=False,
    )  # fmt: skip
    return trainer, model, data


def test_a_forward_only_network_trains_under_fedavg(tmp_path):
    trainer, model, data = setting(tmp_path)
    start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    metrics = trainer.fit(model, data, FedAvg())
    assert metrics["round/clients_failed"] == 0 and math.isfinite(metrics["train/loss"])
    assert not torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), start)


@pytest.mark.parametrize("rule", [FedDecorr, FedProto, MOON])
def test_rules_that_read_features_refuse_it_before_the_run_folder_exists(tmp_path, rule):
    trainer, model, data = setting(tmp_path)
    with pytest.raises(ConfigError, match="forward_features"):
        trainer.fit(model, data, rule())
    assert not (tmp_path / "fedlight").exists()
