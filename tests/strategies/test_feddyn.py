"""FedDyn against a step-by-step reference on ScalarClient (loss ½(θ − y_k)², full-batch SGD), three rounds with
two of three clients sampled."""

import pytest

from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import FedDyn
from fedlight.testing import ScalarClient, ScalarDataset

SIZES, VALUES = [6, 10, 8], [1.0, -2.0, 4.0]


class Recorded(FedDyn):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sampled = []

    def on_round_start(self, context, round_idx, plans):
        self.sampled.append([p.client for p in plans])


def reference(sampled, steps, lr, alpha, init=0.0):
    """Algorithm 1 of Acar et al., written out on scalars."""
    theta, h, g = init, 0.0, [0.0] * len(VALUES)
    for clients in sampled:
        trained = []
        for k in clients:
            t = theta
            for _ in range(steps):  # ∇[½(t − y)² − g_k t + (α/2)(t − θ)²]
                t -= lr * ((t - VALUES[k]) - g[k] + alpha * (t - theta))
            g[k] -= alpha * (t - theta)
            trained.append(t)
        h -= alpha / len(VALUES) * sum(t - theta for t in trained)
        theta = sum(trained) / len(trained) - h / alpha
    return theta, h, g


def test_three_rounds_match_algorithm_1(tmp_path):
    data = FederatedDataModule(ScalarDataset(SIZES, VALUES), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=3, clients_per_round=2, local_epochs=3, logger=None, enable_progress_bar=False, default_root_dir=tmp_path
    )
    rule = Recorded(alpha=0.5)
    trainer.fit(ScalarClient(lr=0.3), data, rule)
    theta, h, g = reference(rule.sampled, steps=3, lr=0.3, alpha=0.5)
    assert trainer.global_state.item() == pytest.approx(theta, abs=1e-5)
    assert rule.h.item() == pytest.approx(h, abs=1e-6)
    store = trainer.model.client_states
    assert store.index  # the clients' gradients are kept
    for k in store.index:
        assert store.get(k)["gradient"].item() == pytest.approx(g[k], abs=1e-6)


def test_alpha_must_be_positive():
    with pytest.raises(ConfigError, match="alpha"):
        FedDyn(alpha=0.0)
