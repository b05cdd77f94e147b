"""FedNova: a_i against closed forms, then hand-worked runs.

ScalarClient (loss ½(w − y)²) and a linear client (loss g·w, a constant gradient g) make every local
trajectory computable by hand: with a constant gradient, momentum SGD moves w by η g a_i in τ_i steps, so
d_i = η g whatever τ_i and ρ.
"""

import pytest
import torch

from fedlight.clients.base import FederatedClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import FedAvg, FedNova
from fedlight.strategies.functional import fednova_normalizer
from fedlight.testing import MeanSquaredError, ScalarClient, ScalarDataset


class LinearClient(FederatedClient):
    """One parameter w with loss mean(y)·w: a constant gradient, stepped by SGD with momentum ρ."""

    def __init__(self, lr: float, momentum: float, optimizer=torch.optim.SGD) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.lr, self.momentum, self.optimizer_class = lr, momentum, optimizer

    def training_step(self, batch, batch_idx):
        return {"loss": (self.w * batch[1]).mean()}

    def validation_step(self, batch, batch_idx):
        return {"loss": self.w * batch[1]}

    def configure_optimizers(self):
        if self.optimizer_class is torch.optim.SGD:
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        return self.optimizer_class(self.parameters(), lr=self.lr)

    def evaluation_metric(self, num_groups):
        return MeanSquaredError()


def fit(root, sizes, values, strategy, client, batch_size=10_000, **trainer_kwargs):
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=batch_size, test_fraction=0.5)
    trainer_kwargs = {"rounds": 1, "clients_per_round": len(sizes), "local_epochs": 1, **trainer_kwargs}
    trainer = FederatedTrainer(logger=None, enable_progress_bar=False, default_root_dir=root, **trainer_kwargs)
    trainer.fit(client, data, strategy)
    return trainer.global_state.item()


@pytest.mark.parametrize("steps", [1, 2, 7])
@pytest.mark.parametrize("rho", [0.5, 0.9])
def test_momentum_normalizer_matches_the_closed_form(steps, rho):
    closed = (steps - rho * (1 - rho**steps) / (1 - rho)) / (1 - rho)
    assert fednova_normalizer(steps, momentum=rho) == pytest.approx(closed)


@pytest.mark.parametrize("steps", [1, 3, 10])
def test_proximal_normalizer_matches_the_geometric_sum(steps):
    lr_mu = 0.2
    assert fednova_normalizer(steps, lr_mu=lr_mu) == pytest.approx((1 - (1 - lr_mu) ** steps) / lr_mu)


def test_equal_plain_sgd_steps_are_fedavg(tmp_path):
    # unequal n_k, but every client runs the same 3 steps: a_i = 3 for all, τ_eff = 3
    sizes, values = [4, 12, 8], [2.0, -2.0, 1.0]
    kwargs = {"rounds": 3, "local_steps": 3, "batch_size": 2}
    fedavg = fit(tmp_path, sizes, values, FedAvg(), ScalarClient(lr=0.3), **kwargs)
    assert fit(tmp_path, sizes, values, FedNova(), ScalarClient(lr=0.3), **kwargs) == pytest.approx(fedavg, abs=1e-6)


def test_unequal_steps_by_hand(tmp_path):
    # Client A: 2 training samples of y = 2, one step of batch 2: w = 0 − 0.5(0 − 2) = 1, a = 1, d = −1.
    # Client B: 6 samples of y = −2, three steps w ← 0.5w − 1: −1, −1.5, −1.75; a = 3, d = 1.75/3.
    # p = (1/4, 3/4), τ_eff = 1/4 + 9/4 = 2.5, Σ p d = −1/4 + 0.4375 = 0.1875, w = −2.5 · 0.1875.
    w = fit(tmp_path, [4, 12], [2.0, -2.0], FedNova(), ScalarClient(lr=0.5), batch_size=2)
    assert w == pytest.approx(-0.46875)
    fedavg = fit(tmp_path, [4, 12], [2.0, -2.0], FedAvg(), ScalarClient(lr=0.5), batch_size=2)
    assert fedavg == pytest.approx(0.25 * 1.0 + 0.75 * -1.75)  # FedAvg leans towards the busier client


def test_momentum_updates_are_normalised_to_the_gradient(tmp_path):
    # Constant gradients g = (1, −3) over 1 and 4 steps with ρ = 0.5: d_i = η g_i exactly, so
    # w = −τ_eff η Σ p_i g_i with τ_eff = Σ p_i a_i.
    lr, rho = 0.1, 0.5
    w = fit(tmp_path, [4, 16], [1.0, -3.0], FedNova(), LinearClient(lr, rho), batch_size=2)
    p = torch.tensor([2.0, 8.0]) / 10
    tau_eff = p[0] * fednova_normalizer(1, rho) + p[1] * fednova_normalizer(4, rho)
    assert w == pytest.approx(float(-tau_eff * lr * (p[0] * 1.0 + p[1] * -3.0)), rel=1e-5)


def test_proximal_fednova_scales_by_the_steps_as_the_official_code(tmp_path):
    # Loss ½(w − 2)² + ½(w − 0)², lr 0.5, 2 full-batch steps: w = 1 then 1; a = 1 then 1.5, so d = −1/1.5.
    # The official τ_eff with μ > 0 is Σ p_i τ_i = 2, so a lone client moves to 0 + 2 · (2/3), past its own w.
    w = fit(tmp_path, [4], [2.0], FedNova(mu=1.0), ScalarClient(lr=0.5), local_epochs=2)
    assert w == pytest.approx(4 / 3)


def test_optimizer_other_than_sgd_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"FedNova normalises SGD steps, but .* gives Adam"):
        fit(tmp_path, [4], [1.0], FedNova(), LinearClient(0.1, 0.0, optimizer=torch.optim.Adam))
