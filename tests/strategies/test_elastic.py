"""Elastic aggregation through the engine against the paper's client sensitivity and server step written out in
plain torch: an MLP's local steps replayed with ``torch.func.functional_call``, the sensitivity of each step taken
from its own backward pass of the squared output norm, and the server's ζ-scaled step.

Every round has a tolerated straggler, so that clients take different numbers of steps and the moving average's
weights (1 − μ) μ^s do not cancel in the normalisation by max(Ω).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies.elastic import ElasticAggregation
from fedlight.testing import ClientImages, ScalarClient, ScalarDataset

SIZES, SEEDS = [10, 14, 8, 12], [1, 2, 3, 4]
LR, EPOCHS = 0.1, 3


class Recorded(ElasticAggregation):
    """ElasticAggregation that notes each round's clients and their epochs, for the reference to replay."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = []

    def on_round_start(self, context, round_idx, plans):
        self.rounds.append([(plan.client, plan.epochs) for plan in plans if not plan.dropped])


def make_client():
    torch.manual_seed(0)
    return ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="mlp", model_kwargs={"hidden": [6]},
        optimizer=lambda params: torch.optim.SGD(params, lr=LR),
    )  # fmt: skip


def fit_images(root, strategy, rounds, clients_per_round):
    """Every client trains on all its samples, in one full batch per epoch, for EPOCHS epochs (a straggler for
    fewer)."""
    data = FederatedDataModule(ClientImages(SIZES, SEEDS), batch_size=1000, test_fraction=0.0)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round, local_epochs=EPOCHS, straggler_fraction=0.5,
        logger=None, enable_progress_bar=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(make_client(), data, strategy)
    return trainer


def reference(rounds, tau, mu, sensitivity):
    """θ after the rounds (lists of (client, epochs)) of elastic aggregation, from the MLP's W^0, as a state dict."""
    net = make_client().net
    theta = {name: p.detach().clone() for name, p in net.named_parameters()}
    for clients in rounds:
        locals_, omegas, counts = [], [], []
        for k, epochs in clients:
            x, y = ClientImages._draw(SIZES[k], SEEDS[k])  # k's whole training split
            local = {name: t.clone().requires_grad_() for name, t in theta.items()}
            omega = {name: torch.zeros_like(t) for name, t in theta.items()}
            for _ in range(epochs):
                logits = functional_call(net, local, (x,))
                loss = F.cross_entropy(logits, y)
                measured = logits.square().sum(dim=1).mean() if sensitivity == "output" else loss
                g = torch.autograd.grad(measured, list(local.values()), retain_graph=True)
                omega = {name: mu * omega[name] + (1 - mu) * gi.abs() for name, gi in zip(local, g, strict=True)}
                step = torch.autograd.grad(loss, list(local.values()))
                local = {
                    name: (t - LR * gi).detach().requires_grad_()
                    for (name, t), gi in zip(local.items(), step, strict=True)
                }
            locals_.append(local)
            omegas.append(omega)
            counts.append(SIZES[k])
        weights = [n / sum(counts) for n in counts]
        mean_omega = {name: sum(w * o[name] for w, o in zip(weights, omegas, strict=True)) for name in theta}
        peak = max(o.max() for o in mean_omega.values())  # the max over every parameter of the model
        for name in theta:
            average = sum(w * local[name].detach() for w, local in zip(weights, locals_, strict=True))
            zeta = 1 + tau - mean_omega[name] / peak
            theta[name] = theta[name] - zeta * (theta[name] - average)
    return theta


@pytest.mark.parametrize("sensitivity", ["output", "loss"])
def test_rounds_of_partial_participation_follow_the_paper(tmp_path, sensitivity):
    strategy = Recorded(tau=0.5, mu=0.9, sensitivity=sensitivity, tolerate_stragglers=True)
    trainer = fit_images(tmp_path, strategy, rounds=3, clients_per_round=2)
    assert len(strategy.rounds) == 3 and all(len(clients) == 2 for clients in strategy.rounds)
    assert len({tuple(k for k, _ in clients) for clients in strategy.rounds}) > 1, "the same clients every round"
    assert all(len({epochs for _, epochs in clients}) == 2 for clients in strategy.rounds), "a straggler a round"
    theta = reference(strategy.rounds, tau=0.5, mu=0.9, sensitivity=sensitivity)
    names = list(trainer.model.module.state_dict())
    expected = torch.cat([theta[name.removeprefix("net.")].reshape(-1) for name in names])
    torch.testing.assert_close(trainer.global_state, expected, rtol=1e-5, atol=1e-6)
    # the step is not FedAvg's: ζ differs from 1 on average and from parameter to parameter
    plain = reference(strategy.rounds, tau=0.0, mu=0.9, sensitivity=sensitivity)
    assert not torch.allclose(torch.cat([t.reshape(-1) for t in plain.values()]), expected, atol=1e-4)
    assert trainer.history[-1]["elastic/zeta_mean"] != pytest.approx(1.0)


class SlopeClient(ScalarClient):
    """w ∈ R² with loss ½‖w − y (1, ½)‖²: the gradient's second entry is half its first wherever w ∝ (1, ½)."""

    def __init__(self, lr: float = 1.0) -> None:
        super().__init__(lr=lr)
        self.w = torch.nn.Parameter(torch.zeros(2))

    def residual(self, y):
        return self.w - y[:, None] * torch.tensor([1.0, 0.5])  # [B, 2]

    def training_step(self, batch, batch_idx):
        return {"loss": 0.5 * self.residual(batch[1]).square().sum(-1).mean()}

    def validation_step(self, batch, batch_idx):
        return {"loss": 0.5 * self.residual(batch[1]).square().sum(-1)}


def test_one_round_by_hand(tmp_path):
    # Clients 0 (y = 1, two training samples) and 1 (y = −2, four) from w = 0, one step of lr 1: g = −y (1, ½), so
    # Ω_k = (1 − μ)|y|(1, ½) and Ω ∝ (1, ½), ζ = (1 + τ − 1, 1 + τ − ½) = (½, 1) with τ = ½. The clients land on
    # y (1, ½); their n-weighted average is (2·1 − 4·2)/6 (1, ½) = (−1, −½), and w = ζ ⊙ (−1, −½) = (−½, −½).
    data = FederatedDataModule(ScalarDataset([4, 8], [1.0, -2.0]), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=2, local_epochs=1, logger=None, enable_progress_bar=False, default_root_dir=tmp_path
    )
    trainer.fit(SlopeClient(lr=1.0), data, ElasticAggregation(tau=0.5, sensitivity="loss"))
    assert trainer.global_state.tolist() == pytest.approx([-0.5, -0.5])
    assert trainer.history[-1]["elastic/zeta_mean"] == pytest.approx(0.75)


def test_the_output_sensitivity_needs_logits(tmp_path):
    data = FederatedDataModule(ScalarDataset([4, 8], [1.0, -2.0]), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=2, logger=None, enable_progress_bar=False, default_root_dir=tmp_path
    )
    with pytest.raises(ConfigError, match="sensitivity=loss"):
        trainer.fit(ScalarClient(), data, ElasticAggregation())
    assert not list(tmp_path.rglob("checkpoints"))


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        ElasticAggregation(tau=-0.1, mu=1.0)
    assert "--strategy.init_args.tau" in str(err.value) and "--strategy.init_args.mu" in str(err.value)
