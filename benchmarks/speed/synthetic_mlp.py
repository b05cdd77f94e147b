"""Workload (a): FedAvg on Synthetic(1,1) with the MLP — fedlight, the plain-PyTorch floor and Flower.

The prototype-margin paper's Synthetic setting: 30 clients, MLP 60→128→256→10, SGD lr 0.01, 10
clients per round sampled ∝ n_k, F = 20 local epochs, batch 10, evaluation of the global model on
every client's held-out split every round. Steps take about a tenth of a millisecond, so the run is
overhead-bound: the hardest case for a framework. Targets: fedlight/floor ≤ 1.10, time outside local
training ≤ 20 ms per round and ≤ a tenth of Flower's, Flower/fedlight ≥ 1.25 at equal cores.

    python benchmarks/speed/synthetic_mlp.py                 # 20 rounds × 3 repeats, all engines
    python benchmarks/speed/synthetic_mlp.py --reduced       # CI: 3 rounds, 1 repeat
    python benchmarks/speed/synthetic_mlp.py --engines floor1,fedlight1,fedlight2
    python benchmarks/speed/synthetic_mlp.py --accelerator cuda --precision bf16-mixed

Flower runs under ``--flower-python`` (default ``.venv-flower/bin/python``); without it the Flower
runs are skipped with a message saying how to install it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

import harness  # noqa: E402


def make_datamodule():
    from fedlight.data import FederatedDataModule, Synthetic

    return FederatedDataModule(Synthetic(alpha=1.0, beta=1.0), batch_size=10)


def make_client():
    import torch

    from fedlight.clients import ClassificationClient

    torch.manual_seed(harness.SEED)
    return ClassificationClient(num_classes=10, input_shape=(60,), model="mlp")


WORKLOAD = harness.Workload(
    name="synthetic_mlp",
    title="(a) Synthetic(1,1), MLP 60→128→256→10, 30 clients, batch 10, SGD lr 0.01",
    task="classification",
    make_datamodule=make_datamodule,
    make_client=make_client,
    clients_per_round=10,
    local_epochs=20,
    lr=0.01,
    rounds=20,
    reduced_rounds=3,
)

if __name__ == "__main__":
    harness.main(WORKLOAD, __file__, __doc__)
