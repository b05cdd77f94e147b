"""One federated FUSS round on a dataset, shared by the real-layout dataset tests."""

import torch

from fedlight.callbacks import BackboneFeatureCache
from fedlight.clients import UnsupervisedSegmentationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import FedCC


def one_round(tmp_path, dataset, clients, partitioner=None):
    data = FederatedDataModule(dataset, partitioner, batch_size=4, test_fraction=0.0, return_index=True)
    torch.manual_seed(0)
    module = UnsupervisedSegmentationClient(
        num_classes=27, input_shape=dataset.input_shape, backbone="conv_patch8", backbone_kwargs={"out_channels": 8},
        dim=3, feature_samples=2, num_negatives=1,
    )  # fmt: skip
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=clients, local_steps=1, logger=None, enable_progress_bar=False,
        default_root_dir=tmp_path / "runs", callbacks=[BackboneFeatureCache(k=3)],
    )  # fmt: skip
    metrics = trainer.fit(module, data, FedCC())
    return data, metrics
