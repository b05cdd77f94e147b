"""FedExP: rounds of partial participation through the engine against Algorithm 1 of Jhunjhunwala et al.
(ICLR 2023) written out in plain Python floats, with and without the average of the last two iterates.

ScalarClient's loss is ½(w − y_k)², so E full-batch SGD steps of lr η from w^t land on
w_k = y_k + (1 − η)^E (w^t − y_k).
"""

import pytest

from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import FedExP
from fedlight.testing import ScalarClient, ScalarDataset

SIZES, VALUES = [4, 8, 6, 10, 6], [1.0, -2.0, 3.0, 0.5, -1.0]


class Recorded(FedExP):
    """FedExP that notes each round's clients, for the reference to replay."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = []

    def on_round_start(self, context, round_idx, plans):
        self.rounds.append([plan.client for plan in plans if not plan.dropped])


def fit(root, strategy, rounds, lr=0.5, epochs=2, clients_per_round=3, ckpt_path=None):
    data = FederatedDataModule(ScalarDataset(SIZES, VALUES), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round, local_epochs=epochs, logger=None,
        enable_progress_bar=False, default_root_dir=root,
    )  # fmt: skip
    metrics = trainer.fit(ScalarClient(lr=lr), data, strategy, ckpt_path=ckpt_path)
    return trainer, metrics


def algorithm_1(rounds, epsilon, lr, epochs, average_last_two, w=0.0):
    """The global model after the rounds of Algorithm 1 (each a list of the clients sampled) and the last η_g."""
    model = w
    for t, clients in enumerate(rounds):
        deltas = []
        for k in clients:
            local = w
            for _ in range(epochs):
                local -= lr * (local - VALUES[k])
            deltas.append(w - local)  # Δ_k
        m = len(deltas)
        mean = sum(deltas) / m  # Δ̄
        eta = max(1.0, sum(d**2 for d in deltas) / (2 * m * (mean**2 + epsilon)))
        new = w - eta * mean
        model = (w + new) / 2 if average_last_two and t > 0 else new
        w = new
    return model, eta


@pytest.mark.parametrize("average_last_two", [True, False])
@pytest.mark.parametrize("epsilon", [1e-3, 0.5])
def test_three_rounds_of_partial_participation_follow_algorithm_1(tmp_path, average_last_two, epsilon):
    strategy = Recorded(epsilon=epsilon, average_last_two=average_last_two)
    trainer, metrics = fit(tmp_path, strategy, rounds=3)
    assert len(strategy.rounds) == 3 and all(len(clients) == 3 for clients in strategy.rounds)
    expected, eta = algorithm_1(strategy.rounds, epsilon, 0.5, 2, average_last_two)
    assert trainer.global_state.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["fedexp/step_size"] == pytest.approx(eta, rel=1e-5)


def test_one_round_by_hand(tmp_path):
    # Clients y = 1, −2, 3, ½, −1 from w = 0, one step of lr 1: Δ = −1, 2, −3, −½, 1; Δ̄ = −0.3, ‖Δ̄‖² = 0.09;
    # Σ‖Δ_k‖² = 15.25, η_g = 15.25 / (2·5·(0.09 + 0.01)) = 15.25; w = 0 + 15.25·0.3 = 4.575
    trainer, metrics = fit(tmp_path, FedExP(epsilon=0.01), rounds=1, lr=1.0, epochs=1, clients_per_round=5)
    assert metrics["fedexp/step_size"] == pytest.approx(15.25, rel=1e-6)
    assert trainer.global_state.item() == pytest.approx(4.575, rel=1e-6)


def test_clients_train_from_the_iterate_not_the_average(tmp_path):
    # a resumed run reads the iterate from the checkpoint: without it the clients would start from the average
    straight, _ = fit(tmp_path, FedExP(), rounds=3)
    first, _ = fit(tmp_path, FedExP(), rounds=2)
    assert first.run.strategy.iterate.item() != pytest.approx(first.global_state.item())
    resumed, _ = fit(tmp_path, FedExP(), rounds=3, ckpt_path=first.run_dir / "checkpoints" / "last.ckpt")
    assert resumed.global_state.item() == straight.global_state.item()


def test_bad_epsilon_names_the_flag():
    with pytest.raises(ConfigError, match=r"epsilon \(ε\) > 0, got 0.0"):
        FedExP(epsilon=0.0)
