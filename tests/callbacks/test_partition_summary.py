import json

import numpy as np

from fedlight.callbacks import PartitionSummary
from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, Scenes
from fedlight.data.partition import DirichletPowerLaw
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import FedAvg


def test_summary_of_the_runs_partition_is_saved(tmp_path):
    data = FederatedDataModule(
        Scenes(mode="classification", num_samples=200, image_size=16),
        DirichletPowerLaw(num_clients=8, alpha=0.1),
        batch_size=20,
    )
    trainer = FederatedTrainer(
        rounds=1,
        clients_per_round=2,
        local_epochs=1,
        logger="csv",
        enable_progress_bar=False,
        default_root_dir=tmp_path,
        callbacks=[PartitionSummary()],
    )
    trainer.fit(ClassificationClient(20, (3, 16, 16), model="cnn"), data, FedAvg())
    assert (trainer.run_dir / "partition_summary.png").stat().st_size > 10_000
    record = json.loads((trainer.run_dir / "partition_summary.json").read_text())
    counts = np.array(record["counts"])  # [K, C], every client's training and held-out samples
    assert counts.shape == (8, 20) and counts.sum() == 200
    sizes = [len(ix) for ix in data.client_train]
    assert (counts.sum(axis=1) >= np.array(sizes)).all()
    assert record["class_names"][:2] == ["aeroplane", "bicycle"] and record["summary"]["clients"] == 8
