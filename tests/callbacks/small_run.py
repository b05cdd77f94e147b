"""The small federated run the analysis-callback tests share: 6 Synthetic users, a one-layer MLP, 3 per round."""

import torch

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, Synthetic
from fedlight.engine.trainer import FederatedTrainer


def make_data(eval_batch_size):
    """Small evaluation batches make a client's held-out pass span several batches."""
    return FederatedDataModule(Synthetic(num_clients=6, dim=12, seed=1), batch_size=10, eval_batch_size=eval_batch_size)


def make_model(seed=0, hidden=16):
    torch.manual_seed(seed)
    return ClassificationClient(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [hidden]})


def make_trainer(tmp_path, rounds=2, callbacks=None, logger="csv"):
    return FederatedTrainer(
        rounds=rounds,
        clients_per_round=3,
        local_epochs=1,
        straggler_fraction=0.5,  # FedAvg drops stragglers: they still count in K^t
        default_root_dir=tmp_path,
        logger=logger,
        enable_progress_bar=False,
        callbacks=callbacks,
    )
