"""Fairness (decision D8): every aggregated client weighs 1/K', whatever its n_k."""

import numpy as np
import pytest

from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import Fairness
from fedlight.testing import ScalarClient, ScalarDataset


def fit(root, strategy, **trainer_kwargs):
    """Returns the global w and metrics after one round; lr 1 and one full batch put client k on y_k."""
    # n = (2, 3, 5) training samples, y = (1, 2, 4).
    data = FederatedDataModule(ScalarDataset([4, 6, 10], [1.0, 2.0, 4.0]), batch_size=10_000, test_fraction=0.5)
    trainer_kwargs = {"rounds": 1, "clients_per_round": 3, "local_epochs": 1, **trainer_kwargs}
    trainer = FederatedTrainer(logger=None, enable_progress_bar=False, default_root_dir=root, **trainer_kwargs)
    metrics = trainer.fit(ScalarClient(), data, strategy)
    return trainer.global_state.item(), metrics


def test_fairness_is_the_plain_mean_of_the_clients(tmp_path):
    w, _ = fit(tmp_path, Fairness())
    assert w == pytest.approx((1.0 + 2.0 + 4.0) / 3)  # FedAvg would give (2·1 + 3·2 + 5·4)/10 = 2.8


def test_stragglers_are_dropped_by_default(tmp_path):
    w, metrics = fit(tmp_path, Fairness(), straggler_fraction=1 / 3, local_epochs=2)
    assert metrics["round/clients_dropped"] == 1 and metrics["round/clients_aggregated"] == 2
    assert any(w == pytest.approx(mean) for mean in [(2.0 + 4.0) / 2, (1.0 + 4.0) / 2, (1.0 + 2.0) / 2])


def test_toleration_averages_the_stragglers_too(tmp_path):
    # A straggler's F' = 1 epoch already lands on its y (lr 1, full batch).
    w, metrics = fit(tmp_path, Fairness(tolerate_stragglers=True), straggler_fraction=1 / 3, local_epochs=2)
    assert metrics["round/clients_dropped"] == 0 and w == pytest.approx(7.0 / 3)


def test_iid_sampling_ignores_sample_counts():
    sizes, rng = np.array([1, 999]), np.random.default_rng(0)
    uniform = np.mean([Fairness(sampling="uniform").sample_clients(sizes, 1, rng)[0] for _ in range(1000)])
    proportional = np.mean([Fairness().sample_clients(sizes, 1, rng)[0] for _ in range(1000)])
    assert 0.4 < uniform < 0.6 and proportional > 0.99
