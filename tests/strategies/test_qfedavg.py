"""q-FedAvg: rounds of partial participation through the engine against Algorithm 2 of Li et al. (ICLR 2020)
written out in plain Python floats.

ScalarClient's loss is ½(w − y_k)², so F_k(w^t) and the local solution of E full-batch SGD steps are known in
closed form: w̄_k = y_k + (1 − η)^E (w^t − y_k).
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import QFedAvg, qfedavg
from fedlight.testing import ScalarClient, ScalarDataset

SIZES, VALUES = [4, 8, 6, 10], [1.0, -2.0, 3.0, 0.5]


class Recorded(QFedAvg):
    """QFedAvg that notes each round's clients, for the reference to replay."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = []

    def on_round_start(self, context, round_idx, plans):
        self.rounds.append([plan.client for plan in plans if not plan.dropped])


def fit(root, strategy, rounds, lr, epochs, clients_per_round=2):
    data = FederatedDataModule(ScalarDataset(SIZES, VALUES), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round, local_epochs=epochs, logger=None,
        enable_progress_bar=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(ScalarClient(lr=lr), data, strategy)
    return trainer.global_state.item()


def algorithm_2(rounds, q, lr, epochs, lipschitz, w=0.0):
    """w after the rounds of Algorithm 2, each a list of the clients sampled, from w^0 = ``w``."""
    for clients in rounds:
        deltas, hs = [], []
        for k in clients:
            y = VALUES[k]
            loss = 0.5 * (w - y) ** 2  # F_k(w^t)
            local = w
            for _ in range(epochs):
                local -= lr * (local - y)  # ∇F_k = w − y
            grad = lipschitz * (w - local)  # Δw_k
            deltas.append(loss**q * grad)
            hs.append(q * loss ** (q - 1) * grad**2 + lipschitz * loss**q)
        w = w - sum(deltas) / sum(hs)
    return w


@pytest.mark.parametrize(("q", "lipschitz"), [(1.0, None), (2.0, None), (0.5, 5.0)])
def test_three_rounds_of_partial_participation_follow_algorithm_2(tmp_path, q, lipschitz):
    lr, epochs = 0.5, 2
    strategy = Recorded(q=q, lipschitz=lipschitz)
    w = fit(tmp_path, strategy, rounds=3, lr=lr, epochs=epochs)
    assert all(len(clients) == 2 for clients in strategy.rounds) and len(strategy.rounds) == 3
    expected = algorithm_2(strategy.rounds, q, lr, epochs, lipschitz or 1 / lr)
    assert w == pytest.approx(expected, rel=1e-5)
    # the weighting matters here: the rounds' plain means (q = 0) end elsewhere
    assert w != pytest.approx(algorithm_2(strategy.rounds, 0.0, lr, epochs, 1 / lr), rel=1e-3)


def test_one_round_by_hand(tmp_path):
    # Clients 0 and 1 (y = 1, −2) from w = 0 with one step of lr ½ (L = 2): w̄ = ½, −1; F = ½, 2; Δw = −1, 2.
    # q = 1: Δ = −½, 4; h = 1·1 + 2·½ = 2, 1·4 + 2·2 = 8; w = 0 − 3.5/10 = −0.35.
    w = fit(tmp_path, QFedAvg(q=1.0), rounds=1, lr=0.5, epochs=1, clients_per_round=4)
    # all four: clients 2 and 3 (y = 3, ½): w̄ = 1.5, ¼; F = 4.5, ⅛; Δw = −3, −½; Δ = −13.5, −1/16; h = 18, ½
    assert w == pytest.approx(-(-0.5 + 4 - 13.5 - 1 / 16) / (2 + 8 + 18 + 0.5), rel=1e-6)


def test_q_zero_is_the_plain_mean(tmp_path):
    # one full step of lr 1 lands every client on its y
    w = fit(tmp_path, QFedAvg(q=0.0), rounds=1, lr=1.0, epochs=1, clients_per_round=4)
    assert w == pytest.approx(sum(VALUES) / 4, rel=1e-6)


def test_the_loss_is_read_in_eval_mode_and_the_modes_restored(monkeypatch):
    module = nn.Sequential(nn.Linear(1, 1), nn.Dropout(0.5))
    module[0].eval()  # a frozen part, as the engine's train mode leaves it
    seen = []

    def mean_task_loss(context, net, client):
        seen.extend(child.training for child in net.modules())
        return 0.25

    monkeypatch.setattr(qfedavg, "mean_task_loss", mean_task_loss)
    strategy = QFedAvg()
    context = SimpleNamespace(layout=SimpleNamespace(flatten=lambda net: torch.zeros(2)))
    strategy.on_client_fit_start(context, module, SimpleNamespace(client=0))
    assert seen == [False, False, False] and strategy._loss == 0.25
    assert [child.training for child in module.modules()] == [True, False, True]


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        QFedAvg(q=-1.0, lipschitz=0.0)
    assert "q >= 0, got -1.0" in str(err.value) and "lipschitz (L) > 0, got 0.0" in str(err.value)
