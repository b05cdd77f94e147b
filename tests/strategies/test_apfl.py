"""APFL against Algorithm 1 of Deng, Kamani & Mahdavi (2020) written out in plain Python floats, on ScalarClient
(loss ½(w − y_k)², full-batch SGD): the global copy w steps on its own loss, the personal model v_k on the loss of
v̄ = α_k v_k + (1 − α_k) w, both from the values of the step before, and α_k by Eq. 10."""

import pytest
import torch

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import FedAvg
from fedlight.strategies.apfl import APFL
from fedlight.testing import ClientImages, ScalarClient, ScalarDataset

SIZES, VALUES = [6, 10, 8, 4], [1.0, -2.0, 4.0, 0.5]
LR, EPOCHS = 0.3, 3


class Recorded(APFL):
    """APFL that notes each round's clients, for the reference to replay."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = []

    def on_round_start(self, context, round_idx, plans):
        self.rounds.append([plan.client for plan in plans if not plan.dropped])


def fit(root, strategy, rounds, clients_per_round=2, sizes=SIZES, values=VALUES, epochs=EPOCHS):
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round, local_epochs=epochs, logger=None,
        enable_progress_bar=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(ScalarClient(lr=LR), data, strategy)
    return trainer


def algorithm_1(rounds, alpha, alpha_lr=None):
    """w after the rounds, and every client's v_k and α_k (``None`` for one that never came); ``alpha_lr`` adapts α."""
    w, personal, mixing = 0.0, [None] * len(VALUES), [alpha] * len(VALUES)
    for clients in rounds:
        trained = []
        for k in clients:
            y, w_k, a = VALUES[k], w, mixing[k]
            v = w if personal[k] is None else personal[k]  # v_k⁰: the first model the client receives
            for _ in range(EPOCHS):
                gradient = (a * v + (1 - a) * w_k) - y  # ∇f_k(v̄)
                if alpha_lr is not None:
                    a, v = min(max(a - alpha_lr * (v - w_k) * gradient, 0.0), 1.0), v - LR * a * gradient
                else:
                    v -= LR * a * gradient
                w_k -= LR * (w_k - y)
            personal[k], mixing[k] = v, a
            trained.append(w_k)
        w = sum(trained) / len(trained)  # 1/|U_t| each
    return w, personal, mixing


@pytest.mark.parametrize(
    ("alpha", "adapt_alpha", "alpha_lr"), [(0.25, False, None), (0.5, True, None), (0.3, True, 5.0)]
)
def test_rounds_of_partial_participation_follow_algorithm_1(tmp_path, alpha, adapt_alpha, alpha_lr):
    strategy = Recorded(alpha=alpha, adapt_alpha=adapt_alpha, alpha_lr=alpha_lr)
    trainer = fit(tmp_path, strategy, rounds=4)
    rounds = strategy.rounds
    assert len(rounds) == 4 and all(len(clients) == 2 for clients in rounds)
    assert len({k for clients in rounds for k in clients}) < 8  # a client came back to its v_k and α_k
    w, personal, mixing = algorithm_1(rounds, alpha, (alpha_lr or LR) if adapt_alpha else None)
    assert trainer.global_state.item() == pytest.approx(w, abs=1e-6)
    store = trainer.model.client_states
    came = [k for k in range(len(VALUES)) if personal[k] is not None]
    assert [store.get(k)["personal"].item() for k in came] == pytest.approx([personal[k] for k in came], abs=1e-6)
    if adapt_alpha:
        alphas = [alpha + store.get(k)["alpha_shift"].item() for k in came]
        assert alphas == pytest.approx([mixing[k] for k in came], abs=1e-6)
        assert any(a != pytest.approx(alpha) for a in alphas)  # α moved
        projected = [a for a in alphas if a == pytest.approx(0.0, abs=1e-6) or a == pytest.approx(1.0)]
        assert alpha_lr is None or projected  # and was projected onto [0, 1]
    # each client is scored with α_k v_k + (1 − α_k) W^T; one that never came with W^T
    sizes = trainer.run.datamodule.num_samples.tolist()
    held_out = [n_all - n for n_all, n in zip(SIZES, sizes, strict=True)]
    own = [w if v is None else a * v + (1 - a) * w for v, a in zip(personal, mixing, strict=True)]
    loss = sum(m * 0.5 * (u - y) ** 2 for m, u, y in zip(held_out, own, VALUES, strict=True)) / sum(held_out)
    assert trainer.history[-1]["clients/personal/loss"] == pytest.approx(loss, rel=1e-5)
    assert trainer.history[-1]["clients/loss"] != pytest.approx(loss, rel=1e-3)  # the global model scores otherwise


def test_one_step_by_hand(tmp_path):
    # Clients 0 and 1 (y = 1, −2) from w = v = 0, α = 0.5 adapted with η_α = 1, one step of lr 0.3:
    # ∇f(v̄) = 0 − y = −1, 2; v = 0 − 0.3·0.5·∇ = 0.15, −0.3; ⟨v − w, ∇⟩ = 0, so α stays 0.5;
    # w_k = 0.3, −0.6 and W = (0.3 − 0.6)/2 = −0.15, the same weight for both although n_k differ.
    trainer = fit(tmp_path, APFL(alpha=0.5, adapt_alpha=True, alpha_lr=1.0), 1, 2, [6, 10], [1.0, -2.0], epochs=1)
    assert trainer.global_state.item() == pytest.approx(-0.15, abs=1e-7)
    store = trainer.model.client_states
    assert [store.get(k)["personal"].item() for k in (0, 1)] == pytest.approx([0.15, -0.3], abs=1e-7)
    assert [store.get(k)["alpha_shift"].item() for k in (0, 1)] == [0.0, 0.0]


def fit_images(root, strategy, rounds=2):
    data = FederatedDataModule(ClientImages([12, 12, 12], [1, 2, 3]), batch_size=6, test_fraction=0.25)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=3, local_epochs=1, logger=None, enable_progress_bar=False,
        default_root_dir=root,
    )  # fmt: skip
    torch.manual_seed(0)
    client = ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="cnn", model_kwargs={"hidden": 8, "batch_norm": True},
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    )  # fmt: skip
    trainer.fit(client, data, strategy)
    return trainer


def test_personal_steps_leave_the_global_cnn_and_its_batchnorm_alone(tmp_path):
    # Equal client sizes, all clients every round: the global model is FedAvg's to the bit, BatchNorm statistics
    # included, although every step also ran v̄ forward and stepped v_k with its own momentum SGD.
    apfl = fit_images(tmp_path, APFL(alpha=0.5, adapt_alpha=True))
    fedavg = fit_images(tmp_path, FedAvg())
    torch.testing.assert_close(apfl.global_state, fedavg.global_state, rtol=0, atol=0)
    store, layout = apfl.model.client_states, apfl.model.layout
    v = store.get(0)["personal"]
    assert not torch.equal(v, apfl.global_state.cpu())  # v_0 trained
    running = layout.mask([name for name in layout.names if "running" in name])
    assert running.any() and not torch.equal(v[running], apfl.global_state.cpu()[running])  # v_0's own statistics
    assert 0 <= apfl.history[-1]["apfl/alpha_mean"] <= 1
    assert "clients/personal/acc" in apfl.history[-1]


def test_settings_are_checked():
    with pytest.raises(ConfigError) as err:
        APFL(alpha=1.5, adapt_alpha=True, alpha_lr=0.0)
    assert "alpha (α) in [0, 1], got 1.5" in str(err.value) and "alpha_lr (η_α) > 0 or null, got 0.0" in str(err.value)
    with pytest.raises(ConfigError, match="adapt_alpha is false"):
        APFL(alpha_lr=0.1)
    several = ClassificationClient(num_classes=3, input_shape=(1, 8, 8))
    several.configure_optimizers = lambda: [torch.optim.SGD([p], lr=0.1) for p in several.parameters()]
    assert "single optimizer" in APFL().check(several, None)[0]
