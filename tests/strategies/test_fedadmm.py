"""FedADMM: rounds of partial participation through the engine against Algorithm 2 of Wang, Marella & Anderson
(CDC 2022) written out in plain Python floats.

ScalarClient's loss is ½(w − y_k)², so a full-batch SGD step on the augmented Lagrangian is
w ← w − η((w − y_k) + λ_k + ρ(w − θ)), with λ_k the client's dual variable.
"""

import pytest

from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies.fedadmm import FedADMM
from fedlight.testing import ScalarClient, ScalarDataset

SIZES, VALUES = [4, 8, 6, 10, 6], [1.0, -2.0, 3.0, 0.5, -1.0]
LR, EPOCHS = 0.3, 2
N = len(VALUES)


class Recorded(FedADMM):
    """FedADMM that notes each round's clients, for the reference to replay."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = []

    def on_round_start(self, context, round_idx, plans):
        self.rounds.append([plan.client for plan in plans if not plan.dropped])


def fit(root, strategy, rounds, clients_per_round=2, sizes=SIZES, values=VALUES, ckpt_path=None, init=0.0):
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round, local_epochs=EPOCHS, logger=None,
        enable_progress_bar=False, default_root_dir=root,
    )  # fmt: skip
    client = ScalarClient(lr=LR)
    client.w.data.fill_(init)
    trainer.fit(client, data, strategy, ckpt_path=ckpt_path)
    return trainer


def algorithm_2(rounds, rho, server_lr=None, theta=0.0):
    """θ and every client's dual and last message after the rounds, each a list of the clients sampled."""
    dual, message = [0.0] * N, [theta] * N  # λ_k⁰ = 0, x̂_k⁰ = θ⁰
    for clients in rounds:
        changes = []
        for k in clients:
            w = theta
            for _ in range(EPOCHS):
                w -= LR * ((w - VALUES[k]) + dual[k] + rho * (w - theta))
            dual[k] += rho * (w - theta)
            new = w + dual[k] / rho
            changes.append(new - message[k])
            message[k] = new
        step = len(clients) / N if server_lr is None else server_lr
        theta += step * sum(changes) / len(clients)
    return theta, dual, message


@pytest.mark.parametrize(("rho", "server_lr"), [(0.5, None), (2.0, None), (1.0, 0.7)])
def test_rounds_of_partial_participation_follow_algorithm_2(tmp_path, rho, server_lr):
    strategy = Recorded(rho=rho, server_lr=server_lr)
    trainer = fit(tmp_path, strategy, rounds=4)
    rounds = strategy.rounds
    assert len(rounds) == 4 and all(len(clients) == 2 for clients in rounds)
    # the case partial participation is about: some client comes back, and some joins after θ has moved
    first = {}  # each client's first round
    for t, clients in enumerate(rounds):
        for k in clients:
            first.setdefault(k, t)
    assert max(first.values()) > 0 and len(first) < sum(map(len, rounds)), rounds
    theta, dual, message = algorithm_2(rounds, rho, server_lr)
    assert trainer.global_state.item() == pytest.approx(theta, abs=1e-5)
    store = trainer.model.client_states
    for k in first:
        assert store.get(k)["dual"].item() == pytest.approx(dual[k], abs=1e-5)
        assert store.get(k)["sent"].item() == pytest.approx(message[k], abs=1e-5)  # x̂_k − θ⁰, θ⁰ = 0
    # a new client's first change is measured from θ⁰: measured from the θ it receives, θ ends elsewhere
    if server_lr is None:
        assert theta == pytest.approx(sum(message) / len(message))  # θ is the mean of all last messages
        assert trainer.global_state.item() != pytest.approx(_from_received(rounds, rho), abs=1e-3)


def _from_received(rounds, rho):
    """The same rounds with each client's old message taken as the θ it receives on its first round."""
    theta, dual, message = 0.0, [0.0] * N, [None] * N
    for clients in rounds:
        changes = []
        for k in clients:
            w = theta
            for _ in range(EPOCHS):
                w -= LR * ((w - VALUES[k]) + dual[k] + rho * (w - theta))
            dual[k] += rho * (w - theta)
            old = theta if message[k] is None else message[k]
            message[k] = w + dual[k] / rho
            changes.append(message[k] - old)
        theta += sum(changes) / N
    return theta


def test_one_round_by_hand(tmp_path):
    # Clients 0 and 1 (y = 1, −2) of 2 from θ = 0, ρ = 1, two steps of lr 0.3 on ½(w − y)² + ½w²:
    # w ← w − 0.3(2w − y) = 0.4w + 0.3y: w_0 = 0.3 then 0.42; w_1 = −0.6 then −0.84.
    # λ = ρ(w − θ) = 0.42, −0.84; x̂ = w + λ/ρ = 0.84, −1.68; θ = 0 + ½(0.84 − 1.68) = −0.42.
    trainer = fit(tmp_path, FedADMM(rho=1.0), rounds=1, clients_per_round=2, sizes=[6, 6], values=[1.0, -2.0])
    assert trainer.global_state.item() == pytest.approx(-0.42, abs=1e-6)
    store = trainer.model.client_states
    assert [store.get(k)["dual"].item() for k in (0, 1)] == pytest.approx([0.42, -0.84], abs=1e-6)


def test_a_resumed_run_equals_a_straight_one(tmp_path):
    # θ⁰ is server state: a client first sampled after the resume measures its change from it
    straight = fit(tmp_path, FedADMM(rho=0.5), rounds=4, init=0.25)
    first = fit(tmp_path, FedADMM(rho=0.5), rounds=1, init=0.25)
    ckpt = first.run_dir / "checkpoints" / "last.ckpt"
    resumed = fit(tmp_path, FedADMM(rho=0.5), rounds=4, ckpt_path=ckpt, init=0.25)
    assert resumed.global_state.item() == straight.global_state.item()
    assert resumed.run.strategy.start.item() == 0.25


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        FedADMM(rho=0.0, server_lr=-1.0)
    assert "rho (ρ) > 0, got 0.0" in str(err.value) and "server_lr (η) > 0 or null, got -1.0" in str(err.value)
