"""Workload (b): FedAvg with the 2-conv CNN on scikit-learn's digits under the MNIST protocol.

``conf/digits/fedavg.yaml``: the 1,797 8×8 digits split as FedProx splits MNIST (power-law sizes, two
classes per client, here 100 clients with 2 base samples), the 2-conv CNN of the MNIST experiments,
SGD lr 0.01, batch 10, 10 clients per round sampled ∝ n_k, F = 20, every client's held-out split
evaluated every round. Targets: fedlight/floor ≤ 1.03, Flower/fedlight ≥ 1.25 at equal cores, and two
processes ≥ 1.6× the rounds/s of one on a 100-round run with the same final model.

    python benchmarks/speed/digits_cnn.py                    # 20 rounds × 3 repeats, all engines
    python benchmarks/speed/digits_cnn.py --rounds 100 --repeats 1 --engines fedlight1,fedlight2   # scaling
    python benchmarks/speed/digits_cnn.py --reduced          # CI: 3 rounds, 1 repeat
    python benchmarks/speed/digits_cnn.py --accelerator cuda --precision bf16-mixed

Flower runs under ``--flower-python`` (default ``.venv-flower/bin/python``); without it the Flower
runs are skipped with a message saying how to install it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

import harness  # noqa: E402


def make_datamodule():
    from fedlight.data import Digits, FederatedDataModule
    from fedlight.data.partition import PowerLaw

    partitioner = PowerLaw(num_clients=100, classes_per_client=2, base_samples=2)
    return FederatedDataModule(Digits(), partitioner, batch_size=10, test_fraction=0.2)


def make_client():
    import torch

    from fedlight.clients import ClassificationClient

    torch.manual_seed(harness.SEED)
    return ClassificationClient(num_classes=10, input_shape=(1, 8, 8), model="cnn")


WORKLOAD = harness.Workload(
    name="digits_cnn",
    title="(b) digits 8×8, MNIST protocol (PowerLaw, 100 clients, 2 classes each), 2-conv CNN, batch 10, SGD lr 0.01",
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
