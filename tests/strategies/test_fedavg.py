"""FedAvg through the engine, on a client whose local optimum is known: one full-batch SGD step with
lr 1 on ½(w − y)² lands on the client's target, so the new global w is the n_k-weighted mean of the
targets of the clients that were aggregated."""

import numpy as np
import pytest
import torch

from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import FedAvg
from fedlight.testing import ScalarClient, ScalarDataset

# trainers built without a default_root_dir write into the test's own runs/
pytestmark = pytest.mark.usefixtures("runs_in_tmp")


def run(sizes, values, strategy=None, rounds=1, **trainer_kwargs):
    # test_fraction 0.5: client k trains on int(0.5·size) samples, all with target values[k].
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=10_000, test_fraction=0.5)
    trainer_kwargs = {"clients_per_round": len(sizes), "local_epochs": 1, **trainer_kwargs}
    trainer = FederatedTrainer(rounds=rounds, logger=None, enable_progress_bar=False, **trainer_kwargs)
    metrics = trainer.fit(ScalarClient(), data, strategy or FedAvg())
    return trainer.global_state.item(), metrics


def test_fedavg_is_the_sample_weighted_mean():
    w, metrics = run([4, 6, 10], [1.0, 2.0, 4.0])
    # n = (2, 3, 5): (2·1 + 3·2 + 5·4) / 10
    assert w == pytest.approx(2.8)
    assert metrics["round/clients_aggregated"] == 3


def test_fedavg_drops_stragglers_by_default():
    w, metrics = run([4, 6, 10], [1.0, 2.0, 4.0], straggler_fraction=1 / 3, local_epochs=2)
    assert metrics["round/clients_dropped"] == 1 and metrics["round/clients_aggregated"] == 2
    # Whichever client straggled, w is the weighted mean of the other two.
    assert any(w == pytest.approx(v) for v in [(3 * 2 + 5 * 4) / 8, (2 * 1 + 5 * 4) / 7, (2 * 1 + 3 * 2) / 5])


def test_tolerated_stragglers_are_aggregated():
    w, metrics = run(
        [4, 6, 10],
        [1.0, 2.0, 4.0],
        FedAvg(tolerate_stragglers=True),
        straggler_fraction=1 / 3,
        local_epochs=2,
    )
    assert metrics["round/clients_dropped"] == 0 and w == pytest.approx(2.8)


# -- invariants every weighting rule must satisfy -----------------------------------------------------


def test_identical_clients_are_a_fixed_point():
    w, _ = run([6, 8, 12], [1.5, 1.5, 1.5], rounds=3)
    assert w == pytest.approx(1.5)


def test_one_client_reproduces_itself():
    w, _ = run([7], [3.0])
    assert w == pytest.approx(3.0)


def test_result_does_not_depend_on_client_order():
    sizes, values = [4, 6, 10, 8], [1.0, -2.0, 4.0, 0.5]
    order = [2, 0, 3, 1]
    w, _ = run(sizes, values)
    w_permuted, _ = run([sizes[i] for i in order], [values[i] for i in order])
    assert w == pytest.approx(w_permuted)


def test_state_round_trips():
    strategy = FedAvg(tolerate_stragglers=True, sampling="uniform")
    clone = FedAvg()
    clone.load_state_dict(strategy.state_dict())
    assert strategy.state_dict() == clone.state_dict()


def test_partial_participation_samples_the_requested_number():
    _, metrics = run([4, 6, 10, 8, 12], [1.0, 2.0, 3.0, 4.0, 5.0], clients_per_round=2)
    assert metrics["round/clients_sampled"] == 2 and metrics["round/clients_aggregated"] == 2


def test_nan_client_is_left_out_and_counted():
    class PoisonClientOne(FedAvg):
        def on_client_fit_end(self, trainer, module, update):
            if update.client == 1:
                with torch.no_grad():
                    module.w.fill_(float("nan"))

    with pytest.warns(UserWarning, match="NaN/Inf"):
        w, metrics = run([4, 6, 10], [1.0, 2.0, 4.0], PoisonClientOne())
    assert metrics["round/clients_nonfinite"] == 1 and metrics["round/clients_aggregated"] == 2
    assert np.isfinite(w) and w == pytest.approx((2 * 1 + 5 * 4) / 7)
