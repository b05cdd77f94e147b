"""LocalOnly against hand-computed trajectories: each client continues from its own model, the server keeps W^0, and
``test/personal/*`` is the mean over clients of each own model's score on the test set, each scored alone."""

import numpy as np
import pytest
import torch

from fedlight.clients.base import FederatedClient
from fedlight.data import FederatedDataModule
from fedlight.data.base import LabelledTensors
from fedlight.engine.trainer import FederatedTrainer
from fedlight.metrics.unsupervised import UnsupervisedSegmentation
from fedlight.strategies import LocalOnly
from fedlight.testing import ScalarClient, ScalarDataset

SIZES, VALUES, TEST_TARGET = [6, 10, 8], [1.0, -2.0, 4.0], 0.5
LR, ROUNDS = 0.5, 3


class ScalarsWithTestSet(ScalarDataset):
    """ScalarDataset with a separate test set of 5 samples whose target is ``TEST_TARGET``."""

    def load_test(self) -> LabelledTensors:
        return LabelledTensors(torch.zeros(5, 1), torch.full((5,), TEST_TARGET))


def fit(tmp_path, module, dataset, rounds=ROUNDS):
    data = FederatedDataModule(dataset, batch_size=10_000, test_fraction=0.0)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=len(dataset.sizes), local_epochs=1, logger=None, enable_progress_bar=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, data, LocalOnly())
    return trainer


def test_each_client_continues_from_its_own_model_and_the_server_keeps_w0(tmp_path):
    trainer = fit(tmp_path, ScalarClient(lr=LR), ScalarsWithTestSet(SIZES, VALUES))
    # full-batch SGD on ½(w − y_k)² from w = 0, one step a round, never reset: w_k = y_k (1 − (1 − lr)^T)
    own = [y * (1 - (1 - LR) ** ROUNDS) for y in VALUES]
    store = trainer.model.client_states
    assert [store.get(k)["own"].item() for k in range(3)] == pytest.approx(own, abs=1e-6)
    assert trainer.global_state.tolist() == [0.0]
    last = trainer.history[-1]
    assert last["test/loss"] == pytest.approx(0.5 * TEST_TARGET**2)  # W^0 = 0
    per_client = [0.5 * (w - TEST_TARGET) ** 2 for w in own]
    assert last["test/personal/loss"] == pytest.approx(sum(per_client) / 3, rel=1e-5)  # unweighted over clients
    assert last["test/personal/loss_min"] == pytest.approx(min(per_client), rel=1e-5)
    assert last["test/personal/loss_std"] == pytest.approx(float(np.std(per_client)), rel=1e-5)


class ShiftedClusters(FederatedClient):
    """Predicts cluster (label + round(s)) mod 2 everywhere; s is fitted to the client's scalar target by one step."""

    def __init__(self, num_classes: int = 2, input_shape: tuple[int, ...] = (1,)) -> None:
        super().__init__()
        self.s = torch.nn.Parameter(torch.zeros(()))

    def training_step(self, batch, batch_idx):
        return {"loss": 0.5 * ((self.s - batch[1]) ** 2).mean()}

    def validation_step(self, batch, batch_idx):
        labels = batch[1]
        return {"preds": (labels + self.s.round().long()) % 2, "target": labels}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def evaluation_metric(self, num_groups):
        return UnsupervisedSegmentation(num_clusters=2, num_classes=2)


class TwoClientsAndLabelMaps(ScalarDataset):
    """Client 0 fits s = 0 (clusters = classes), client 1 s = 1 (clusters swapped); the test set holds 4 label maps
    of 2×2 pixels, half of each class."""

    num_classes = 2

    def load_test(self) -> LabelledTensors:
        maps = torch.tensor([[0, 1], [1, 0]]).repeat(4, 1, 1)  # [4, 2, 2]
        return LabelledTensors(torch.zeros(4, 1), maps, labels=np.zeros(4, dtype=np.int64))


def test_every_client_has_its_own_hungarian_match(tmp_path):
    trainer = fit(tmp_path, ShiftedClusters(), TwoClientsAndLabelMaps([4, 4], [0.0, 1.0]), rounds=1)
    last = trainer.history[-1]
    # each own model names the classes consistently, so its own match is perfect; one match over both clients'
    # predictions would see every cluster on both classes equally: IoU 8 / (8 + 8 + 8) = 1/3 for each class
    assert last["test/personal/miou"] == pytest.approx(1.0)
    assert last["test/personal/acc"] == pytest.approx(1.0)
    assert last["test/personal/miou_min"] == pytest.approx(1.0)
