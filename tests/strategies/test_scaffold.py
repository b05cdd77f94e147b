"""SCAFFOLD against a step-by-step reference on ScalarClient (loss ½(w − y_k)², full-batch SGD), three rounds with
two of three clients sampled, so that N ≠ |S| and a client's control variate waits across a round."""

import pytest

from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import SCAFFOLD
from fedlight.testing import ScalarClient, ScalarDataset

SIZES, VALUES = [6, 10, 8], [1.0, -2.0, 4.0]


class Recorded(SCAFFOLD):
    """SCAFFOLD that remembers each round's clients."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sampled = []

    def on_round_start(self, context, round_idx, plans):
        self.sampled.append([p.client for p in plans])


def reference(sampled, steps, lr, server_lr, init=0.0):
    """Algorithm 1 of Karimireddy et al. (option II), written out on scalars."""
    x, c, c_k = init, 0.0, [0.0] * len(VALUES)
    for clients in sampled:
        ys, deltas = [], []
        for k in clients:
            y = x
            for _ in range(steps):
                y -= lr * ((y - VALUES[k]) - c_k[k] + c)  # g_k(y) − c_k + c
            new = c_k[k] - c + (x - y) / (steps * lr)
            deltas.append(new - c_k[k])
            c_k[k] = new
            ys.append(y)
        x += server_lr * (sum(ys) / len(ys) - x)
        c += sum(deltas) / len(VALUES)
    return x, c, c_k


@pytest.mark.parametrize("server_lr", [1.0, 0.5])
def test_three_rounds_match_algorithm_1(tmp_path, server_lr):
    data = FederatedDataModule(ScalarDataset(SIZES, VALUES), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=3, clients_per_round=2, local_epochs=3, logger=None, enable_progress_bar=False, default_root_dir=tmp_path
    )
    rule = Recorded(server_lr=server_lr)
    trainer.fit(ScalarClient(lr=0.3), data, rule)
    x, c, c_k = reference(rule.sampled, steps=3, lr=0.3, server_lr=server_lr)
    assert len({k for clients in rule.sampled for k in clients}) == 3  # every client trained at least once
    assert trainer.global_state.item() == pytest.approx(x, abs=1e-6)
    assert rule.control.item() == pytest.approx(c, abs=1e-6)
    store = trainer.model.client_states
    for k in store.index:
        assert store.get(k)["control"].item() == pytest.approx(c_k[k], abs=1e-5)


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="server_lr"):
        SCAFFOLD(server_lr=0)
    with pytest.raises(ConfigError, match="local_lr"):
        SCAFFOLD(local_lr=-1.0)
