"""FedFomo through the engine against Algorithm 1 of Zhang et al. (ICLR 2021) written out in plain Python.

On ScalarClient client k's loss is ½(w − y_k)² on every sample, so its validation loss L_k(w) is known in closed
form whatever sample it is read on, and E full-batch SGD steps of lr η take w to y_k + (1 − η)^E (w − y_k).
"""

import copy

import numpy as np
import pytest
import torch

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.state import FlatState
from fedlight.strategies.fedfomo import FedFomo, choose_models
from fedlight.testing import ClientImages, ScalarClient, ScalarDataset

SIZES, VALUES = [6, 8, 10, 4, 6, 8], [1.0, -2.0, 4.0, 0.5, 3.0, -1.0]


class Recorded(FedFomo):
    """FedFomo that notes each round's clients and what they received, for the reference to replay."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds, self.received = [], []

    def on_round_start(self, context, round_idx, plans):
        self.rounds.append([plan.client for plan in plans if not plan.dropped])
        super().on_round_start(context, round_idx, plans)

    def on_round_end(self, context, round_idx, updates):
        self.received.append({u.client: list(u.payload["fomo_received"]) for u in updates})
        return super().on_round_end(context, round_idx, updates)


def fit(root, strategy, rounds, lr=0.5, epochs=1, clients_per_round=3, sizes=SIZES, values=VALUES, **kwargs):
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round, local_epochs=epochs, logger=None,
        enable_progress_bar=False, default_root_dir=root, **kwargs,
    )  # fmt: skip
    trainer.fit(ScalarClient(lr=lr), data, strategy)
    return trainer


def algorithm_1(rounds, num_models, lr, epochs, values=VALUES, w0=0.0):
    """Every trained client's model and the affinities P after ``rounds`` (each a list of the clients that train),
    with ε = 0: each client receives the ``num_models`` models of highest affinity (lower index first on ties)."""
    models, affinity = {}, [[0.0] * len(values) for _ in values]
    for clients in rounds:
        before, added = dict(models), []
        for i in clients:
            y = values[i]

            def loss(w, y=y):
                return 0.5 * (w - y) ** 2  # L_i

            theta = before.get(i, w0)
            others = sorted((n for n in before if n != i), key=lambda n: (-affinity[i][n], n))[:num_models]
            raw = [
                max(0.0, (loss(theta) - loss(before[n])) / abs(before[n] - theta)) if before[n] != theta else 0.0
                for n in others
            ]
            weights = [r / sum(raw) for r in raw] if sum(raw) > 0 else [0.0] * len(raw)
            theta = theta + sum(w * (before[n] - theta) for w, n in zip(weights, others, strict=True))
            for _ in range(epochs):
                theta -= lr * (theta - y)
            models[i] = theta
            added += [(i, n, w) for n, w in zip(others, weights, strict=True)]
        for i, n, w in added:
            affinity[i][n] += w
    return models, affinity


@pytest.mark.parametrize(("num_models", "epochs"), [(2, 1), (1, 2), (5, 1)])
def test_rounds_of_partial_participation_follow_algorithm_1(tmp_path, num_models, epochs):
    lr, rounds = 0.5, 4
    strategy = Recorded(num_models=num_models, epsilon=0.0, val_fraction=0.5)
    trainer = fit(tmp_path, strategy, rounds=rounds, lr=lr, epochs=epochs)
    assert len(strategy.rounds) == rounds and all(len(clients) == 3 for clients in strategy.rounds)
    models, affinity = algorithm_1(strategy.rounds, num_models, lr, epochs)
    state = strategy.state_dict()
    assert sorted(state["models"]) == sorted(models)
    assert {k: v.item() for k, v in state["models"].items()} == pytest.approx(models, abs=1e-5)
    torch.testing.assert_close(state["affinity"], torch.tensor(affinity, dtype=torch.float64), rtol=0, atol=1e-5)
    assert state["affinity"].count_nonzero() > 0  # the affinities steered some draws
    # the engine's own per-client state holds the same θ_k; the others still hold W^0, which W^t stays
    store = trainer.model.client_states
    for k in range(len(SIZES)):
        own = store.values(k, trainer.global_state)["own"].item()
        assert own == pytest.approx(models.get(k, 0.0), abs=1e-5)
    assert trainer.global_state.item() == 0.0
    # each client is scored with its own model on its held-out split
    sizes = trainer.run.datamodule.num_samples.tolist()
    held_out = [n_all - n for n_all, n in zip(SIZES, sizes, strict=True)]
    own = [models.get(k, 0.0) for k in range(len(SIZES))]
    loss = sum(m * 0.5 * (w - y) ** 2 for m, w, y in zip(held_out, own, VALUES, strict=True)) / sum(held_out)
    assert trainer.history[-1]["clients/personal/loss"] == pytest.approx(loss, rel=1e-5)


def test_the_second_round_by_hand(tmp_path):
    # Round 1: every client takes one step of lr ½ from 0 towards y = 4, 6, 8: θ = 2, 3, 4.
    # Round 2, client 0 (L = ½(w − 4)²): L(2) = 2, L(3) = ½, L(4) = 0: w = 1.5/1, 2/2 → 0.6, 0.4;
    #   θ = 2 + 0.6·1 + 0.4·2 = 3.4, trained to 3.7.
    # Client 1 (y = 6): L(3) = 4.5, L(2) = 8, L(4) = 2: w = 0, 2.5/1 → 0, 1; θ = 4, trained to 5.
    # Client 2 (y = 8): L(4) = 8, L(2) = 18, L(3) = 12.5: none better, θ = 4 kept, trained to 6.
    strategy = FedFomo(num_models=2, epsilon=0.0)
    trainer = fit(tmp_path, strategy, rounds=2, sizes=[4, 4, 4], values=[4.0, 6.0, 8.0])
    state = strategy.state_dict()
    assert {k: v.item() for k, v in state["models"].items()} == pytest.approx({0: 3.7, 1: 5.0, 2: 6.0}, abs=1e-6)
    expected = torch.tensor([[0.0, 0.6, 0.4], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(state["affinity"], expected, rtol=0, atol=1e-6)
    last = trainer.history[-1]
    assert last["fedfomo/kept_own"] == pytest.approx(1 / 3)
    assert last["clients/personal/loss"] == pytest.approx((0.5 * 0.09 + 0.5 * 1.0 + 0.5 * 4.0) / 3, rel=1e-5)


def test_the_epsilon_greedy_draw_is_reproducible_from_the_seed(tmp_path):
    def draws(seed, epsilon=0.6):
        strategy = Recorded(num_models=2, epsilon=epsilon, epsilon_decay=0.0)
        fit(tmp_path, strategy, rounds=4, clients_per_round=4, seed=seed)
        return strategy.received, strategy.state_dict()

    received, state = draws(seed=3)
    again, state_again = draws(seed=3)
    assert again == received
    torch.testing.assert_close(state_again["affinity"], state["affinity"], rtol=0, atol=0)
    assert draws(seed=4)[0] != received  # another seed, other draws
    assert draws(seed=3, epsilon=0.0)[0] != received  # the random picks did change what was sent


def test_choose_models_is_greedy_at_zero_and_uniform_at_one():
    affinity = [0.0, 0.3, 0.3, 0.9, 0.0]
    assert choose_models(affinity, [0, 1, 2, 3, 4], 3, 0.0, np.random.default_rng(0)) == [3, 1, 2]
    assert choose_models(affinity, [0, 2, 4], 5, 0.0, np.random.default_rng(0)) == [2, 0, 4]  # all, when fewer
    counts = np.zeros(5)
    for seed in range(2000):
        counts[choose_models(affinity, [0, 1, 2, 3, 4], 1, 1.0, np.random.default_rng(seed))[0]] += 1
    assert counts.min() > 330 and counts.max() < 470  # each about 400 times: uniform, whatever the affinities


def test_a_resumed_run_equals_a_straight_one(tmp_path):
    def make():
        return FedFomo(num_models=2, epsilon=0.5, epsilon_decay=0.1)

    straight = fit(tmp_path, make(), rounds=4, clients_per_round=4)
    first = fit(tmp_path, make(), rounds=2, clients_per_round=4)
    ckpt = first.run_dir / "checkpoints" / "last.ckpt"
    data = FederatedDataModule(ScalarDataset(SIZES, VALUES), batch_size=10_000, test_fraction=0.5)
    resumed = FederatedTrainer(
        rounds=4, clients_per_round=4, local_epochs=1, logger=None, enable_progress_bar=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    resumed.fit(ScalarClient(lr=0.5), data, make(), ckpt_path=ckpt)
    a, b = straight.run.strategy.state_dict(), resumed.run.strategy.state_dict()
    torch.testing.assert_close(b["affinity"], a["affinity"], rtol=0, atol=0)
    assert sorted(b["models"]) == sorted(a["models"])
    for k in a["models"]:
        torch.testing.assert_close(b["models"][k], a["models"][k], rtol=0, atol=0)
    assert resumed.history[-1]["clients/personal/loss"] == straight.history[-1]["clients/personal/loss"]


class Started(FedFomo):
    """FedFomo that notes, for every fit, the models the server held, what the client received and the state it
    trains from after the first-order step; and checks that the step leaves the module's modes as they were."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fits = []

    def on_client_fit_start(self, context, module, plan):
        held = {k: v.clone() for k, v in self.models.items()}
        modes = [child.training for child in module.modules()]
        super().on_client_fit_start(context, module, plan)
        assert [child.training for child in module.modules()] == modes
        start = context.layout.flatten(module).cpu()
        self.fits.append((plan.client, held, list(self._received[plan.client]), start))


def test_the_first_order_step_on_a_cnn_with_batch_norm(tmp_path):
    # Every model's loss is read in eval mode (BatchNorm running statistics) on the client's whole training split
    # (val_fraction = 1); the distance is over the parameters, the step moves the statistics too. Two clients of
    # three per round, so that some client first trains after others have: their models beat its W^0.
    sizes, seeds = [12, 10, 14], [1, 2, 3]
    data = FederatedDataModule(ClientImages(sizes, seeds), batch_size=1000, test_fraction=0.0)
    trainer = FederatedTrainer(
        rounds=3, clients_per_round=2, local_epochs=2, logger=None, enable_progress_bar=False, default_root_dir=tmp_path
    )

    def network():
        torch.manual_seed(0)
        return ClassificationClient(
            num_classes=3, input_shape=(1, 8, 8), model="cnn", model_kwargs={"hidden": 8, "batch_norm": True},
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        )  # fmt: skip

    strategy = Started(num_models=2, epsilon=0.0, val_fraction=1.0)
    trainer.fit(network(), data, strategy)
    net = network()
    layout = FlatState(net)
    initial, is_parameter = layout.flatten(net), layout.parameter_mask(net)
    net.eval()
    moved = 0
    for client, held, received, start in strategy.fits:
        own = held.get(client, initial)
        assert received == [n for n in sorted(held) if n != client]  # two others at most: all are sent
        x, y = next(trainer.run.datamodule.client_batches(client, "train"))

        def loss(flat, x=x, y=y):
            layout.load(net, flat)
            with torch.no_grad():
                return torch.nn.functional.cross_entropy(net(x), y).item()

        raw = []
        for n in received:
            distance = (held[n] - own)[is_parameter].double().norm().item()
            raw.append(max(0.0, (loss(own) - loss(held[n])) / distance))
        expected = own.double().clone()
        for n, r in zip(received, raw, strict=True):
            if r > 0:
                expected += r / sum(raw) * (held[n].double() - own.double())
        torch.testing.assert_close(start, expected.float(), rtol=1e-5, atol=1e-6)
        moved += not torch.equal(start, own)
    assert moved > 0  # some client did take a step


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        FedFomo(num_models=0, epsilon=1.5, epsilon_decay=-0.1, val_fraction=0.0)
    message = str(err.value)
    for flag in ("num_models", "epsilon (ε)", "epsilon_decay", "val_fraction"):
        assert f"--strategy.init_args.{flag}" in message
    with pytest.raises(ConfigError, match="val_fraction"):
        FedFomo(val_fraction=1.5)
    copy.deepcopy(FedFomo(val_fraction=1.0, epsilon=0.0, epsilon_decay=0.0))  # the bounds themselves are accepted
