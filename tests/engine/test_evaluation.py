"""Each client's accuracy at evaluation reaches W&B (histogram and table) and its spread reaches metrics.csv; with
``--data.test_groups`` the test set is scored group by group too."""

import csv

import numpy as np
import pytest
import torch
import wandb

import fedlight.engine.loggers
from fedlight.clients import SegmentationClient
from fedlight.data import FederatedDataModule, StyleCities
from fedlight.data.twins.style_cities import CITIES
from fedlight.engine.loggers import client_spread, histogram_metrics
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import FedAvg
from tests.callbacks.small_run import make_data, make_model, make_trainer


class RecordingLogger:
    """Stands in for the W&B logger: keeps what the trainer logs."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step):
        self.logged.append((step, dict(metrics)))

    def finalize(self, status):
        pass


def _accuracy_by_hand(trainer, client: int) -> float:
    model = trainer.model.evaluation_module()
    correct = total = 0
    with torch.no_grad():
        for x, y in trainer.run.datamodule.client_batches(client, split="held_out"):
            correct += int((model(x).argmax(dim=1) == y).sum())
            total += len(y)
    return correct / total


def test_each_clients_accuracy_is_logged_with_its_spread(tmp_path, monkeypatch):
    recorder = RecordingLogger()
    monkeypatch.setattr(fedlight.engine.loggers, "wandb_logger", lambda *args, **kwargs: recorder)
    trainer = make_trainer(tmp_path, rounds=2, logger=["csv", "wandb"])
    data = make_data(eval_batch_size=7)
    trainer.fit(make_model(), data, FedAvg())

    expected = np.array([_accuracy_by_hand(trainer, k) for k in range(data.num_clients)])  # the final model's
    step, logged = recorder.logged[-1]
    assert step == 2  # the second round, counted from 1
    histogram = logged["clients/acc_per_client"]
    assert isinstance(histogram, wandb.Histogram)
    counts, edges = np.histogram(expected, bins=64)  # wandb.Histogram's own binning of the same values
    assert histogram.histogram == counts.tolist()
    np.testing.assert_allclose(histogram.bins, edges, rtol=1e-6)
    table = logged["clients/acc_table"]
    assert table.columns == ["client", "acc"]
    assert [row[0] for row in table.data] == list(range(data.num_clients))
    np.testing.assert_allclose([row[1] for row in table.data], expected, rtol=1e-6)

    with (trainer.run_dir / "metrics.csv").open() as f:
        last = list(csv.DictReader(f))[-1]
    assert np.isclose(float(last["clients/acc_min"]), expected.min())
    assert np.isclose(float(last["clients/acc_p10"]), np.percentile(expected, 10))
    assert np.isclose(float(last["clients/acc_std"]), np.std(expected))
    assert np.isclose(float(last["clients/acc_mean"]), expected.mean())
    assert "clients/acc_per_client" not in last  # the values themselves stay out of the CSV


def test_clients_without_held_out_data_are_left_out_of_the_spread():
    spread = client_spread({"group_acc": torch.tensor([0.5, float("nan"), 1.0, 0.0]), "acc": torch.tensor(0.6)})
    assert spread["acc_min"] == 0.0
    assert np.isclose(spread["acc_p10"], np.percentile([0.5, 1.0, 0.0], 10))
    assert np.isclose(spread["acc_std"], np.std([0.5, 1.0, 0.0]))
    assert torch.equal(spread["acc_per_client"].isnan(), torch.tensor([False, True, False, False]))
    assert set(spread) == {"acc_per_client", "acc_min", "acc_p10", "acc_std"}


def test_the_table_names_each_client_with_data_and_the_histogram_counts_them():
    logged = histogram_metrics({"clients/acc_per_client": torch.tensor([0.5, float("nan"), 1.0])})
    assert logged["clients/acc_table"].data == [[0, 0.5], [2, 1.0]]
    assert sum(logged["clients/acc_per_client"].histogram) == 2


def _miou_by_hand(preds: np.ndarray, target: np.ndarray, num_classes: int) -> float:
    """mIoU from one confusion matrix counted with numpy: the mean IoU over the classes in labels or predictions."""
    valid = target != 255
    confmat = np.bincount(num_classes * target[valid] + preds[valid], minlength=num_classes**2)
    confmat = confmat.reshape(num_classes, num_classes)  # [true, predicted]
    intersection = np.diag(confmat)
    union = confmat.sum(axis=0) + confmat.sum(axis=1) - intersection
    return float(np.mean(intersection[union > 0] / union[union > 0]))


def test_the_test_set_is_scored_city_by_city_from_one_confusion_matrix_per_city(tmp_path):
    cities = StyleCities(num_clients_per_city=1, client_size=(4, 6), num_test_per_city=3, image_size=16,
                         num_object_classes=2, seed=0)  # fmt: skip
    # batches of 5 of the 12 test images cut across the cities' runs of 3
    data = FederatedDataModule(cities, batch_size=4, test_fraction=0.0, eval_batch_size=5, test_groups=True)
    torch.manual_seed(0)
    model = SegmentationClient(num_classes=3, input_shape=(3, 16, 16), model="mini_deeplab")
    trainer = FederatedTrainer(rounds=1, clients_per_round=2, local_epochs=1, default_root_dir=tmp_path, logger="csv",
                               enable_progress_bar=False)  # fmt: skip
    metrics = trainer.fit(model, data, FedAvg())

    with torch.no_grad():
        preds = trainer.model.evaluation_module()(data.test.inputs).argmax(dim=1).numpy()
    target, city = data.test.targets.numpy(), data.test.groups
    expected = {name: _miou_by_hand(preds[city == name], target[city == name], 3) for name in CITIES}
    assert {name: metrics[f"test/{name}/miou"] for name in CITIES} == pytest.approx(expected, abs=1e-6)
    assert metrics["test/group_mean/miou"] == pytest.approx(np.mean(list(expected.values())), abs=1e-6)
    assert metrics["test/miou"] == pytest.approx(_miou_by_hand(preds, target, 3), abs=1e-6)  # still pooled
    with open(trainer.run_dir / "metrics.csv", newline="") as file:
        assert float(list(csv.DictReader(file))[-1]["test/grey/miou"]) == pytest.approx(expected["grey"], abs=1e-6)
