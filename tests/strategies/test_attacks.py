"""Attacks through the engine, against hand computations.

On ScalarClient a full-batch SGD step with lr 1 from w = 0 lands on the client's target y_k, so an honest
update is Δ_k = y_k and the attacked aggregate follows by hand from the attackers' ids.
"""

from statistics import NormalDist

import numpy as np
import pytest
import torch

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.data.base import LabelledTensors
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import Attack, FedAvg, RobustAggregation
from fedlight.testing import ClientImages, ScalarClient, ScalarDataset

# trainers built without a default_root_dir write into the test's own runs/
pytestmark = pytest.mark.usefixtures("runs_in_tmp")

SIZES, VALUES = [4, 6, 8, 10, 12], [1.0, 2.0, 3.0, 4.0, 5.0]
N = np.array([2, 3, 4, 5, 6], dtype=float)  # n_k = int(0.5·size)


def fit(strategy, sizes=SIZES, values=VALUES, rounds=1, clients_per_round=None):
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round or len(sizes), local_epochs=1, logger=None,
        enable_progress_bar=False,
    )  # fmt: skip
    metrics = trainer.fit(ScalarClient(), data, strategy)
    return trainer, metrics


def fedavg_of(states):
    return float((N * np.asarray(states)).sum() / N.sum())


def test_sign_flip_reverses_and_scales_the_attackers_updates():
    trainer, metrics = fit(Attack(kind="sign_flip", fraction=0.4, scale=3.0))
    attackers = trainer.run.strategy.malicious
    assert len(attackers) == 2 and metrics["attack/clients"] == 2
    # W⁰ = 0: an attacker sends W⁰ − 3(y_k − W⁰) = −3 y_k
    expected = [-3.0 * y if k in attackers else y for k, y in enumerate(VALUES)]
    assert trainer.global_state.item() == pytest.approx(fedavg_of(expected))


def test_gaussian_replaces_the_update_by_noise_from_the_clients_stream():
    results = {}
    for scale in (1.0, 3.0):
        trainer, _ = fit(Attack(kind="gaussian", fraction=0.9, scale=scale), sizes=[4], values=[2.0])
        results[scale] = trainer.global_state.item()
    # the lone client attacks: W¹ = s·ξ, ξ drawn from a child of its (seed, round, client) stream
    sequence = np.random.SeedSequence(trainer.run.streams.client_seed(0, 0), spawn_key=(1,))
    xi = torch.randn((), generator=torch.Generator().manual_seed(int(sequence.generate_state(1, np.uint64)[0] >> 1)))
    assert results[1.0] == pytest.approx(xi.item())
    assert results[3.0] == pytest.approx(3.0 * xi.item())


def _alie_and_ipm_expectation(attackers, malicious_of):
    honest = np.array([y for k, y in enumerate(VALUES) if k not in attackers])
    malicious = malicious_of(honest)
    return fedavg_of([malicious if k in attackers else y for k, y in enumerate(VALUES)])


def test_alie_sends_the_honest_mean_minus_z_standard_deviations():
    trainer, metrics = fit(Attack(kind="alie", fraction=0.4))
    attackers = trainer.run.strategy.malicious
    # K = 5, m = 2: s = ⌊5/2 + 1⌋ − 2 = 1, z = Φ⁻¹(4/5)
    z = NormalDist().inv_cdf(0.8)
    expected = _alie_and_ipm_expectation(attackers, lambda h: h.mean() - z * h.std(ddof=1))
    assert trainer.global_state.item() == pytest.approx(expected)
    assert metrics["attack/clients"] == 2


def test_ipm_sends_minus_epsilon_times_the_honest_mean():
    trainer, _ = fit(Attack(kind="ipm", fraction=0.4, scale=2.0))
    expected = _alie_and_ipm_expectation(trainer.run.strategy.malicious, lambda h: -2.0 * h.mean())
    assert trainer.global_state.item() == pytest.approx(expected)


def test_alie_inside_a_robust_aggregator():
    # attack around the defense: the median sees the two ALIE rows
    trainer, _ = fit(Attack(RobustAggregation(aggregator="median"), kind="alie", fraction=0.4, scale=1.0))
    attackers = trainer.run.strategy.malicious
    honest = np.array([y for k, y in enumerate(VALUES) if k not in attackers])
    rows = [honest.mean() - honest.std(ddof=1) if k in attackers else y for k, y in enumerate(VALUES)]
    assert trainer.global_state.item() == pytest.approx(float(np.median(rows)))


class FlippedImages(ClientImages):
    """ClientImages with every label y replaced by 2 − y (C = 3)."""

    def load_train(self) -> LabelledTensors:
        honest = super().load_train()
        return LabelledTensors(honest.inputs, 2 - honest.targets, honest.groups)


def test_label_flip_trains_on_flipped_labels():
    def run(dataset, strategy):
        data = FederatedDataModule(dataset, batch_size=1000, test_fraction=0.0)
        trainer = FederatedTrainer(
            rounds=1, clients_per_round=1, local_epochs=2, logger=None, enable_progress_bar=False
        )
        torch.manual_seed(0)
        client = ClassificationClient(
            num_classes=3, input_shape=(1, 8, 8), model="cnn", model_kwargs={"hidden": 8},
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        )  # fmt: skip
        trainer.fit(client, data, strategy)
        return trainer

    attacked = run(ClientImages([12], [3]), Attack(kind="label_flip", fraction=0.9))
    flipped = run(FlippedImages([12], [3]), FedAvg())
    honest = run(ClientImages([12], [3]), FedAvg())
    torch.testing.assert_close(attacked.global_state, flipped.global_state, rtol=0, atol=0)
    assert not torch.equal(attacked.global_state, honest.global_state)
    assert "training_step" not in vars(attacked.model.module)  # the class's method is back after the fit


def test_redrawn_attackers_change_every_round_and_have_the_requested_count():
    trainer, _ = fit(Attack(kind="sign_flip", fraction=0.5, redraw=True), rounds=4, clients_per_round=4)
    counts = [row["attack/clients"] for row in trainer.history]
    assert counts == [2.0] * 4  # round(0.5 · 4) of each round's clients


def test_fixed_attackers_come_from_the_seed():
    first, _ = fit(Attack(kind="sign_flip", fraction=0.4))
    second, _ = fit(Attack(kind="sign_flip", fraction=0.4))
    assert first.run.strategy.malicious == second.run.strategy.malicious


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError, match="fraction") as error:
        Attack(fraction=1.0, scale=0.0)
    assert "scale" in str(error.value)
