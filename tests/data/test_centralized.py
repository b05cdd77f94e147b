"""``FederatedDataModule(centralized=True)``: the federated run's splits, with one training client."""

import numpy as np
import torch

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, Synthetic
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import FedAvg


def make_data(centralized):
    data = FederatedDataModule(Synthetic(num_clients=6, dim=12, seed=1), batch_size=10, centralized=centralized)
    data.setup()
    return data


def test_one_training_client_with_every_training_sample_and_the_same_held_out_splits():
    federated, centralized = make_data(False), make_data(True)
    assert centralized.num_clients == 1 and federated.num_clients == 6
    expected = np.sort(torch.cat(federated.client_train).numpy())
    np.testing.assert_array_equal(centralized.client_train[0].numpy(), expected)
    assert centralized.num_samples.tolist() == [federated.num_samples.sum()]
    torch.testing.assert_close(centralized.held_out_index, federated.held_out_index, rtol=0, atol=0)
    torch.testing.assert_close(centralized.held_out_group, federated.held_out_group, rtol=0, atol=0)
    assert centralized.num_eval_groups == federated.num_eval_groups == 6


def test_a_centralized_run_learns_and_reports_every_client(tmp_path):
    torch.manual_seed(0)
    model = ClassificationClient(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [16]})
    trainer = FederatedTrainer(
        rounds=3,  # epochs over the union
        clients_per_round=1,
        local_epochs=1,
        default_root_dir=tmp_path,
        logger="csv",
        enable_progress_bar=False,
    )
    trainer.fit(model, make_data(True), FedAvg())
    history = trainer.history
    assert [row["round/clients_aggregated"] for row in history] == [1.0, 1.0, 1.0]
    assert history[-1]["test/acc"] > history[0]["test/acc"]
    assert history[-1]["test/loss"] < history[0]["test/loss"]
    assert history[-1]["clients/acc"] == history[-1]["test/acc"]  # pooled over the six clients' held-out splits
    assert np.isfinite(history[-1]["clients/acc_mean"])
