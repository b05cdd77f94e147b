"""FedAvgM: hand-worked server momentum on ScalarClient, whose full-batch SGD step with lr 1 lands on y."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.plans import ClientUpdate
from fedlight.state import FlatState
from fedlight.strategies import FedAvg, FedAvgM
from fedlight.testing import ScalarClient, ScalarDataset


def fit(root, sizes, values, strategy, rounds, clients_per_round=None, lr=1.0):
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round or len(sizes), local_epochs=1, logger=None,
        enable_progress_bar=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(ScalarClient(lr=lr), data, strategy)
    return trainer.global_state.item()


def test_zero_momentum_is_fedavg(tmp_path):
    sizes, values = [4, 8, 6, 10], [1.0, -2.0, 3.0, 0.5]
    kwargs = {"rounds": 4, "clients_per_round": 2, "lr": 0.5}
    fedavg = fit(tmp_path, sizes, values, FedAvg(sampling="uniform"), **kwargs)
    assert fit(tmp_path, sizes, values, FedAvgM(momentum=0.0), **kwargs) == pytest.approx(fedavg, abs=1e-7)
    assert fit(tmp_path, sizes, values, FedAvgM(momentum=0.0, form="ema"), **kwargs) == pytest.approx(fedavg, abs=1e-7)


@pytest.mark.parametrize(
    ("form", "after_one", "after_two"),
    [
        # Δ = w − 4; hsu: v = −4, w = 4; then Δ = 0, v = 0.5·(−4) = −2, w = 6
        ("hsu", 4.0, 6.0),
        # ema: v = 0.5·(−4) = −2, w = 2; then Δ = 2 − 4 = −2, v = 0.5·(−2) + 0.5·(−2) = −2, w = 4
        ("ema", 2.0, 4.0),
    ],
)
def test_two_rounds_of_momentum_by_hand(tmp_path, form, after_one, after_two):
    assert fit(tmp_path, [6], [4.0], FedAvgM(momentum=0.5, form=form), rounds=1) == pytest.approx(after_one)
    assert fit(tmp_path, [6], [4.0], FedAvgM(momentum=0.5, form=form), rounds=2) == pytest.approx(after_two)


def test_batchnorm_statistics_take_the_average_not_the_momentum():
    norm = nn.BatchNorm1d(1)  # weight, bias, running_mean, running_var
    layout = FlatState(norm)
    strategy = FedAvgM(momentum=0.5)
    strategy.on_fit_start(SimpleNamespace(layout=layout, module=norm, global_state=torch.zeros(4)))
    update = [ClientUpdate(client=0, num_samples=1, epochs=1, num_steps=1, train_loss=0.0)]
    w = strategy.server_update(torch.zeros(4), torch.ones(4), update)  # parameters: v = −1, w = 1
    w = strategy.server_update(w, torch.ones(4), update)  # parameters: v = −0.5, w = 1.5
    assert w.tolist() == [1.5, 1.5, 1.0, 1.0]


def test_velocity_round_trips():
    strategy = FedAvgM()
    strategy.velocity = torch.tensor([1.0, -2.0])
    clone = FedAvgM()
    clone.load_state_dict(strategy.state_dict())
    assert torch.equal(clone.velocity, strategy.velocity)


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        FedAvgM(momentum=1.0, server_lr=0.0)
    assert "momentum (β) in [0, 1), got 1.0" in str(err.value)
    assert "server_lr (η) > 0, got 0.0" in str(err.value)
