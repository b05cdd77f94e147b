"""pFedMe through the engine against Algorithm 1 of T. Dinh et al. (NeurIPS 2020) written out in plain Python floats.

ScalarClient's loss is f_k(θ) = ½(θ − y_k)² on every batch, so ∇f_k(θ) = θ − y_k: the inner problem's K gradient
steps, the outer step w ← w − ηλ(w − θ̂) and the server's mix (1 − β) w + β · mean are written out as the paper
states them, with partial participation replayed from the rounds' drawn clients.
"""

import pytest
import torch

from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies.pfedme import PFedMe
from fedlight.testing import ScalarClient, ScalarDataset

SIZES, VALUES = [4, 8, 6, 10], [1.0, -2.0, 3.0, 0.5]


class Recorded(PFedMe):
    """PFedMe that notes each round's clients, for the reference to replay."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = []

    def on_round_start(self, context, round_idx, plans):
        self.rounds.append([plan.client for plan in plans if not plan.dropped])


def fit(root, strategy, rounds, lr, epochs, clients_per_round=2, sizes=SIZES, values=VALUES):
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round, local_epochs=epochs, logger=None,
        enable_progress_bar=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(ScalarClient(lr=lr), data, strategy)
    return trainer


def algorithm_1(rounds, sizes, lam, inner_steps, personal_lr, beta, lr, epochs, weighting="uniform", w=0.0):
    """w and the personal models θ̂_k after the rounds, each a list of the drawn clients, from w^0 = ``w``."""
    personal = {}
    for clients in rounds:
        local_models, weights = [], []
        for k in clients:
            y, local = VALUES[k], w  # w_{k,0} = w^t
            theta = w  # the inner solve starts where it last ended, from w^t
            for _ in range(epochs):  # one full batch per epoch: R = epochs local steps
                for _ in range(inner_steps):
                    theta -= personal_lr * ((theta - y) + lam * (theta - local))  # ∇h = ∇f(θ) + λ(θ − w_{k,r})
                local -= lr * lam * (local - theta)
            personal[k] = theta
            local_models.append(local)
            weights.append(1.0 if weighting == "uniform" else sizes[k])
        mean = sum(a * b for a, b in zip(weights, local_models, strict=True)) / sum(weights)
        w = (1 - beta) * w + beta * mean
    return w, personal


@pytest.mark.parametrize(
    ("lam", "inner_steps", "personal_lr", "beta", "weighting"),
    [(15.0, 5, 0.05, 1.0, "uniform"), (2.0, 3, 0.2, 2.0, "uniform"), (5.0, 2, 0.1, 0.5, "samples")],
)
def test_three_rounds_of_partial_participation_follow_algorithm_1(
    tmp_path, lam, inner_steps, personal_lr, beta, weighting
):
    lr, epochs = 0.02, 3
    strategy = Recorded(lam=lam, inner_steps=inner_steps, personal_lr=personal_lr, beta=beta, weighting=weighting)
    trainer = fit(tmp_path, strategy, rounds=3, lr=lr, epochs=epochs)
    assert len(strategy.rounds) == 3 and all(len(clients) == 2 for clients in strategy.rounds)
    sizes = trainer.run.datamodule.num_samples.tolist()
    w, personal = algorithm_1(strategy.rounds, sizes, lam, inner_steps, personal_lr, beta, lr, epochs, weighting)
    assert trainer.global_state.item() == pytest.approx(w, rel=1e-5)
    store = trainer.model.client_states
    for k in range(len(VALUES)):
        state = store.get(k)
        if k in personal:
            assert state["personal"].item() == pytest.approx(personal[k], rel=1e-5)
        else:
            assert state is None
    # every client is scored with θ̂_k on its held-out split; one not drawn yet with the global model
    own = [personal.get(k, w) for k in range(len(VALUES))]
    held_out = [n_all - n for n_all, n in zip(SIZES, sizes, strict=True)]
    loss = sum(m * 0.5 * (v - y) ** 2 for m, v, y in zip(held_out, own, VALUES, strict=True)) / sum(held_out)
    assert trainer.history[-1]["clients/personal/loss"] == pytest.approx(loss, rel=1e-5)
    # the inner solve matters: without it (K = 0) the model ends elsewhere
    assert w != pytest.approx(algorithm_1(strategy.rounds, sizes, lam, 0, personal_lr, beta, lr, epochs)[0], rel=1e-3)


def test_one_round_by_hand(tmp_path):
    # Clients y = 1, −2 from w = 0; λ = 1, K = 1, personal lr ½, η = 1, one local step, β = 2.
    # θ̂_0 = 0 − ½((0 − 1) + 0) = ½, w_0 = 0 − 1·1·(0 − ½) = ½;  θ̂_1 = 0 − ½(0 + 2) = −1, w_1 = −1.
    # w = (1 − 2)·0 + 2·(½ − 1)/2 = −½.
    strategy = PFedMe(lam=1.0, inner_steps=1, personal_lr=0.5, beta=2.0)
    trainer = fit(tmp_path, strategy, rounds=1, lr=1.0, epochs=1, clients_per_round=2, sizes=[4, 6], values=[1, -2])
    assert trainer.global_state.item() == pytest.approx(-0.5, abs=1e-6)
    store = trainer.model.client_states
    assert [store.get(k)["personal"].item() for k in (0, 1)] == pytest.approx([0.5, -1.0], abs=1e-6)


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        PFedMe(lam=0.0, inner_steps=0, personal_lr=-1.0, beta=0.0, weighting="median")
    message = str(err.value)
    for flag in ("lam (λ) > 0", "inner_steps (K)", "personal_lr > 0", "beta (β) > 0", "weighting"):
        assert f"--strategy.init_args.{flag}" in message


def test_a_client_that_steps_its_own_optimizers_is_refused():
    client = ScalarClient()
    client.automatic_optimization = False
    (problem,) = PFedMe().check(client, None)
    assert "automatic optimization" in problem
    assert PFedMe().check(ScalarClient(), None) == []


def test_buffers_take_the_mean_when_beta_extrapolates():
    strategy = PFedMe(beta=2.0)
    strategy._parameter_mask = torch.tensor([True, False])
    new = strategy.server_update(torch.tensor([1.0, 1.0]), torch.tensor([2.0, 3.0]), [])
    assert new.tolist() == [3.0, 3.0]  # parameter: −1·1 + 2·2; buffer: the mean itself
