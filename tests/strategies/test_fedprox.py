"""FedProx: the proximal term on its own, then hand-worked runs of ScalarClient.

With loss ½(w − y)² + (μ/2)(w − w0)², full-batch SGD with lr η takes
w ← w − η[(w − y) + μ(w − w0)], whose fixed point is the prox optimum (y + μ·w0)/(1 + μ).
"""

from pathlib import Path

import pytest
import torch
from torch import nn

from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import FedAvg, FedProx
from fedlight.strategies.fedprox import proximal_term
from fedlight.testing import ScalarClient, ScalarDataset


def fit(root, sizes, values, strategy, lr=1.0, init=0.0, **trainer_kwargs):
    """Returns the global w after the run; client k trains on int(0.5·sizes[k]) samples of target values[k]."""
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=10_000, test_fraction=0.5)
    trainer_kwargs = {"rounds": 1, "clients_per_round": len(sizes), "local_epochs": 1, **trainer_kwargs}
    trainer = FederatedTrainer(logger=None, enable_progress_bar=False, default_root_dir=root, **trainer_kwargs)
    client = ScalarClient(lr=lr)
    with torch.no_grad():
        client.w.fill_(init)
    metrics = trainer.fit(client, data, strategy)
    return trainer.global_state.item(), metrics


def test_proximal_term_value_and_gradient_cover_trainable_parameters_only():
    module = nn.Sequential(nn.Linear(2, 1), nn.BatchNorm1d(1))
    module[1].bias.requires_grad_(False)  # a frozen parameter is not regularised either
    strategy = FedProx(mu=0.5)
    strategy.on_client_fit_start(None, module, None)
    with torch.no_grad():
        module[0].weight += torch.tensor([[1.0, -2.0]])
        module[0].bias += 3.0
        module[1].weight += 0.5
        module[1].bias += 100.0
        module[1].running_mean += 100.0  # a buffer
    loss = strategy.training_loss(module, None, {"loss": torch.tensor(1.0)})
    # 1 + (μ/2)·(1² + 2² + 3² + 0.5²) = 1 + 0.25·14.25
    assert loss.item() == pytest.approx(4.5625)
    loss.backward()
    # ∇ = μ(w − w^t)
    torch.testing.assert_close(module[0].weight.grad, torch.tensor([[0.5, -1.0]]))
    torch.testing.assert_close(module[0].bias.grad, torch.tensor([1.5]))
    torch.testing.assert_close(module[1].weight.grad, torch.tensor([0.25]))
    assert module[1].bias.grad is None


def test_proximal_term_gradient_passes_gradcheck():
    params = [
        torch.randn(3, 2, dtype=torch.float64, requires_grad=True),
        torch.randn(4, dtype=torch.float64, requires_grad=True),
    ]
    anchors = [torch.randn(3, 2, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    assert torch.autograd.gradcheck(lambda *p: proximal_term(p, anchors), params)


def test_proximal_term_is_zero_with_zero_gradient_at_the_received_state():
    module = nn.Linear(3, 2)
    strategy = FedProx(mu=1.0)
    strategy.on_client_fit_start(None, module, None)
    loss = strategy.training_loss(module, None, {"loss": torch.tensor(0.0)})
    loss.backward()
    assert loss.item() == 0.0 and module.weight.grad.abs().max().item() == 0.0


def test_anchors_are_released_after_the_local_fit():
    module = nn.Linear(3, 2)
    strategy = FedProx()
    strategy.on_client_fit_start(None, module, None)
    strategy.on_client_fit_end(None, module, None)
    assert strategy._anchors == []


def test_two_local_steps_by_hand(tmp_path):
    # y = 2, w0 = 0, μ = 0.5, η = 0.5.
    # step 1: ∇ = (0 − 2) + 0.5·0 = −2        → w = 1
    # step 2: ∇ = (1 − 2) + 0.5·(1 − 0) = −0.5 → w = 1.25   (FedAvg's client would reach 1.5)
    w, _ = fit(tmp_path, [4], [2.0], FedProx(mu=0.5), lr=0.5, local_epochs=2)
    assert w == pytest.approx(1.25)
    w_fedavg, _ = fit(tmp_path, [4], [2.0], FedAvg(), lr=0.5, local_epochs=2)
    assert w_fedavg == pytest.approx(1.5)


def test_many_small_steps_reach_the_prox_optima(tmp_path):
    # w0 = 1, μ = 1: client optima (y + μ·w0)/(1 + μ) = (3 + 1)/2 = 2 and (−1 + 1)/2 = 0;
    # n = (2, 6): the aggregate is (2·2 + 6·0)/8 = 0.5. The error shrinks by (1 − η(1 + μ)) = 0.8 per step.
    w, _ = fit(tmp_path, [4, 12], [3.0, -1.0], FedProx(mu=1.0), lr=0.1, init=1.0, local_epochs=120)
    assert w == pytest.approx(0.5, abs=1e-6)


def test_mu_zero_is_fedavg_with_toleration(tmp_path):
    kwargs = {"lr": 0.5, "local_epochs": 3, "straggler_fraction": 0.5, "rounds": 2}
    w, _ = fit(tmp_path, [4, 6, 10, 8], [1.0, -2.0, 4.0, 0.5], FedProx(mu=0.0), **kwargs)
    w_fedavg, _ = fit(tmp_path, [4, 6, 10, 8], [1.0, -2.0, 4.0, 0.5], FedAvg(tolerate_stragglers=True), **kwargs)
    assert w == w_fedavg


def test_stragglers_are_kept_by_default(tmp_path):
    _, metrics = fit(tmp_path, [4, 6, 10], [1.0, 2.0, 4.0], FedProx(mu=0.1), straggler_fraction=1 / 3, local_epochs=2)
    assert metrics["round/clients_dropped"] == 0 and metrics["round/clients_aggregated"] == 3


@pytest.mark.parametrize("mu", [-0.1, float("nan")])
def test_negative_mu_names_the_flag(mu):
    with pytest.raises(ConfigError, match=r"--strategy\.init_args\.mu"):
        FedProx(mu=mu)


@pytest.mark.parametrize("delta", [0, 50, 80])
def test_synthetic_configs_keep_stragglers_with_the_papers_mu(delta):
    from fedlight.cli import build_parser

    path = Path(__file__).resolve().parents[2] / f"conf/fedproto/synthetic/fedprox_delta{delta}.yaml"
    parser = build_parser()
    strategy = parser.instantiate(parser.parse_args(["fit", "--config", str(path)])).fit.strategy
    assert isinstance(strategy, FedProx)
    assert strategy.mu == 0.1 and strategy.tolerate_stragglers is True
