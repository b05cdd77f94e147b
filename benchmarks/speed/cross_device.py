"""Workload (x): cross-device FedAvg of pfl-research's benchmark shape — fedlight, batched, the floor and Flower.

1,000 users with 50 training images each (random 3×32×32, labels uniform over 10 classes) and 2 held-out
ones, a cohort of 50 users per round sampled ∝ n_k (uniformly, since all users are equal), one local epoch
of batch 10 (5 steps), SGD lr 0.01, the 2-conv CNN; the global model is evaluated on the 2,000 held-out
images every round. Many small clients with few steps each: the case where training a round's clients
together as one vectorised model (``--trainer.client_batching``) should pay most. The engines:
``floor`` (plain PyTorch), ``fedlight`` (sequential clients), ``batched`` (the cohort vectorised and
compiled) and ``flower`` (Flower's simulation engine). Target: batched ≥ 7× Flower's rounds/s on a GPU
under ``bf16-mixed``; on a CPU the ratios are reported with the profile in ``README.md``.

    python benchmarks/speed/cross_device.py --engines floor1,fedlight1,batched1,flower1 --rounds 10 --repeats 2
    python benchmarks/speed/cross_device.py --reduced --engines floor1,fedlight1,batched1   # CI: 100 users, 3 rounds
    python benchmarks/speed/cross_device.py --accelerator cuda --precision bf16-mixed --engines batched1,flower1

Flower runs under ``--flower-python`` (default ``.venv-flower/bin/python``); without it the Flower
runs are skipped with a message saying how to install it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

import harness  # noqa: E402

# The child processes rebuild the data, so the reduced size travels to them in the environment.
if "--reduced" in sys.argv:
    os.environ["FEDLIGHT_CROSS_DEVICE_USERS"] = "100"
USERS = int(os.environ.get("FEDLIGHT_CROSS_DEVICE_USERS", "1000"))
TRAIN_PER_USER, HELD_OUT_PER_USER = 50, 2


def make_datamodule():
    from batched import CrossDevice

    from fedlight.data import FederatedDataModule

    per_user = TRAIN_PER_USER + HELD_OUT_PER_USER  # int(0.97 · 52) = 50 train, 2 held out
    return FederatedDataModule(CrossDevice(USERS, per_user), batch_size=10, test_fraction=0.03)


def make_client():
    import torch

    from fedlight.clients import ClassificationClient

    torch.manual_seed(harness.SEED)
    return ClassificationClient(num_classes=10, input_shape=(3, 32, 32), model="cnn")


WORKLOAD = harness.Workload(
    name="cross_device",
    title=f"(x) cross-device: {USERS} users × {TRAIN_PER_USER} random 3×32×32 images, 2-conv CNN, batch 10, "
    "SGD lr 0.01",
    task="classification",
    make_datamodule=make_datamodule,
    make_client=make_client,
    clients_per_round=50 if USERS >= 1000 else 10,
    local_epochs=1,
    lr=0.01,
    rounds=10,
    reduced_rounds=3,
)

if __name__ == "__main__":
    harness.main(WORKLOAD, __file__, __doc__)
