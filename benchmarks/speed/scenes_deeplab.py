"""Workload (c): FedAvg with DeepLab-V3+ (MobileNet-V2, output stride 16) on procedural 64×64 scenes.

MO-FedProto's segmentation client (Adam lr 1e-4, weight decay 4e-5, polynomial decay of power 0.9
over the run, per-pixel cross-entropy ignoring void) on :class:`~fedlight.data.Scenes`, the offline
stand-in for Pascal VOC: 320 scenes of 64×64 with the 4 macro classes plus background, split over 20
clients by Dirichlet(α = 1) class mixes with power-law sizes. 5 clients per round, F = 2, batch 12 (with
this partition no client is left a last batch of one image, on which BatchNorm cannot train), every
client's held-out split evaluated every round (per-client confusion matrices). The encoder starts from
random weights (``encoder_weights: null``), so nothing is downloaded; there is no data augmentation, so
that the floor and Flower run exactly the same steps.

    python benchmarks/speed/scenes_deeplab.py                # 5 rounds × 3 repeats, all engines
    python benchmarks/speed/scenes_deeplab.py --reduced      # 1 round, 1 repeat
    python benchmarks/speed/scenes_deeplab.py --accelerator cuda --precision bf16-mixed

Flower runs under ``--flower-python`` (default ``.venv-flower/bin/python``); without it the Flower
runs are skipped with a message saying how to install it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

import harness  # noqa: E402

SIZE, CLASSES = 64, 5  # 4 macro classes + background


def make_datamodule():
    from fedlight.data import FederatedDataModule, Scenes
    from fedlight.data.partition import DirichletPowerLaw

    scenes = Scenes(mode="segmentation", label_set="macro", num_samples=320, image_size=SIZE, seed=0)
    return FederatedDataModule(scenes, DirichletPowerLaw(num_clients=20, alpha=1.0), batch_size=12, eval_batch_size=32)


def make_client():
    import torch

    from fedlight.clients import SegmentationClient

    torch.manual_seed(harness.SEED)
    return SegmentationClient(CLASSES, (3, SIZE, SIZE), model_kwargs={"encoder_weights": None}, poly_power=0.9)


WORKLOAD = harness.Workload(
    name="scenes_deeplab",
    title="(c) scenes 64×64, 5 classes, 20 clients (Dirichlet α=1, power-law sizes), DeepLab-V3+ MobileNet-V2, "
    "batch 12, Adam lr 1e-4 wd 4e-5, poly 0.9",
    task="segmentation",
    make_datamodule=make_datamodule,
    make_client=make_client,
    clients_per_round=5,
    local_epochs=2,
    lr=1e-4,
    rounds=5,
    reduced_rounds=1,
    num_classes=CLASSES,
    optimizer="adam",
    weight_decay=4e-5,
    poly_power=0.9,
)

if __name__ == "__main__":
    harness.main(WORKLOAD, __file__, __doc__)
