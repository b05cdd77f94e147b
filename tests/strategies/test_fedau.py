"""FedAU: the participation bookkeeping by hand, and runs of ScalarClient against a reference loop.

The reference follows ``IBM/fedau:main.py`` (``-weighting adaptive``) client by client, independently of
the strategy's vectorised bookkeeping.
"""

import numpy as np
import pytest
import torch

from fedlight.callbacks import RoundCallback
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.plans import ClientUpdate
from fedlight.strategies import FedAU, FedAvg
from fedlight.testing import ScalarClient, ScalarDataset


class RecordClients(RoundCallback):
    def __init__(self):
        self.rounds = []

    def on_round_end(self, context, round_idx, metrics):
        self.rounds.append([p.client for p in context.plans])


def fit(root, sizes, values, strategy, rounds, clients_per_round, callbacks=None):
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round, local_epochs=1, logger=None, enable_progress_bar=False,
        default_root_dir=root, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(ScalarClient(lr=1.0), data, strategy)  # a client's full-batch step lands on its y
    return trainer.global_state.item()


def fedau_reference(values, participants_per_round, cutoff=None):
    """W after FedAU rounds where client n, when participating, lands on values[n]; W^0 = 0."""
    n = len(values)
    w, absent, intervals = 0.0, [0] * n, [[] for _ in range(n)]
    for participants in participants_per_round:
        total = 0.0
        for client in range(n):
            if client in participants:
                weight = float(np.mean(intervals[client])) if intervals[client] else 1.0
                total += weight * (values[client] - w)
                intervals[client].append(absent[client] + 1)
                absent[client] = 0
            else:
                absent[client] += 1
                if cutoff is not None and absent[client] >= cutoff:
                    intervals[client].append(absent[client])
                    absent[client] = 0
        w += total / n
    return w


def with_clients(strategy, num_clients):
    """The strategy with fresh bookkeeping for ``num_clients`` clients, as ``on_fit_start`` sets it up."""
    names = ("interval_sum", "interval_count", "absent")
    strategy.load_state_dict({name: torch.zeros(num_clients, dtype=torch.int64) for name in names})
    return strategy


def update(client):
    return ClientUpdate(client=client, num_samples=1, epochs=1, num_steps=1, train_loss=0.0)


def test_intervals_by_hand():
    # client 0 takes part in rounds 0, 3 and 5: weights 1, mean([1]) = 1, then mean([1, 3]) = 2
    strategy = with_clients(FedAU(), 2)
    weights = []
    for round_idx, participates in enumerate([True, False, False, True, False, True]):
        updates = [update(0)] if participates else []
        for u in updates:
            weights.append(strategy.client_weights(u)[0])
            u.weights = (weights[-1],)
        strategy.on_round_end(None, round_idx, updates)
    assert weights == [1.0, 1.0, 2.0]


def test_cutoff_records_long_absences():
    # with K = 2, client 0 takes part in round 0 (interval 1), is absent for rounds 1–2 (K reached: records 2)
    # and round 3; its next weight is mean(1, 2)
    strategy = with_clients(FedAU(cutoff=2), 1)
    for round_idx, participates in enumerate([True, False, False, False]):
        updates = [update(0)] if participates else []
        for u in updates:
            u.weights = strategy.client_weights(u)
        strategy.on_round_end(None, round_idx, updates)
    assert strategy.client_weights(update(0)) == (1.5,)  # mean(1, 2)


def test_constant_participation_is_fedavg_with_equal_sizes(tmp_path):
    sizes, values = [6, 6, 6, 6], [1.0, -2.0, 4.0, 0.5]
    fedavg = fit(tmp_path, sizes, values, FedAvg(), rounds=3, clients_per_round=4)
    assert fit(tmp_path, sizes, values, FedAU(), rounds=3, clients_per_round=4) == pytest.approx(fedavg, abs=1e-6)


@pytest.mark.parametrize("cutoff", [None, 2])
def test_partial_participation_matches_the_reference_loop(tmp_path, cutoff):
    sizes, values = [6, 8, 4, 10, 6], [1.0, -2.0, 4.0, 0.5, 3.0]
    record = RecordClients()
    w = fit(tmp_path, sizes, values, FedAU(cutoff=cutoff), rounds=8, clients_per_round=2, callbacks=[record])
    assert w == pytest.approx(fedau_reference(values, record.rounds, cutoff), abs=1e-5)
    assert len({tuple(r) for r in record.rounds}) > 1  # different clients took part
