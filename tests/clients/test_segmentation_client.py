import math

import pytest
import torch

from fedlight.clients import LocalFit, SegmentationClient
from fedlight.data import FederatedDataModule, FederatedDataset, LabelledTensors, Scenes
from fedlight.data.partition import DirichletPowerLaw
from fedlight.data.transforms import RandomScaleCropFlip
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import FedAvg

TINY = {"encoder_weights": None, "decoder_channels": 16}


def _client(num_classes=5, **kwargs):
    torch.manual_seed(0)
    return SegmentationClient(num_classes, (3, 32, 32), model_kwargs=TINY, **kwargs)


def test_loss_is_the_mean_over_valid_pixels():
    client = _client()
    x = torch.randn(2, 3, 32, 32)
    y = torch.randint(0, 5, (2, 32, 32))
    y[0, :10] = 255
    out = client.training_step((x, y), 0)
    log_probs = out["logits"].log_softmax(dim=1)  # [B, C, H, W]
    valid = y != 255
    picked = log_probs.gather(1, y.clamp(max=4)[:, None])[:, 0]
    assert out["loss"].item() == pytest.approx(-picked[valid].mean().item(), rel=1e-5)
    assert out["features"].shape == (2, 16, 8, 8)
    y[:] = 255
    assert client.training_step((x, y), 0)["loss"].item() == 0.0  # void everywhere: no signal, no NaN


def test_polynomial_decay_spans_the_run():
    client = _client()
    client.local_fit = LocalFit(round_idx=2, rounds=4, num_steps=3)
    configured = client.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.defaults["weight_decay"] == 4e-5
    rates = []
    for _ in range(3):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([1e-4 * (1 - (2 + s / 3) / 4) ** 0.9 for s in range(3)])
    constant = _client(poly_power=0.0)
    constant.local_fit = client.local_fit
    assert isinstance(constant.configure_optimizers(), torch.optim.Adam)


def test_a_federated_run_reports_segmentation_scores(tmp_path):
    data = FederatedDataModule(
        Scenes(num_samples=48, image_size=32, label_set="macro", num_test_samples=8),
        DirichletPowerLaw(num_clients=4, alpha=1.0),
        batch_size=4,
        eval_batch_size=8,
        train_transform=RandomScaleCropFlip(crop_size=32),
    )
    settings = {"logger": "csv", "enable_progress_bar": False, "default_root_dir": tmp_path}
    trainer = FederatedTrainer(rounds=1, clients_per_round=2, local_epochs=1, **settings)
    metrics = trainer.fit(_client(num_classes=5), data, FedAvg())
    for key in ("test/miou", "test/miou_fg", "test/acc", "test/iou_background", "clients/miou", "clients/miou_mean"):
        assert key in metrics and math.isfinite(metrics[key]), key
    assert 0.0 <= metrics["test/miou"] <= 1.0
    # the macro scenes name their classes: each class's IoU is logged under its name, for the test set and the clients
    names = ("background", "person", "vehicle", "household", "animal")
    for split in ("test", "clients"):
        assert sorted(key for key in metrics if key.startswith(f"{split}/iou_")) == sorted(
            f"{split}/iou_{name}" for name in names
        )


class UnnamedScenes(FederatedDataset):
    """Scenes whose classes have no names, as a dataset that knows only their number."""

    def __init__(self, scenes: Scenes) -> None:
        self.scenes, self.num_classes, self.input_shape = scenes, scenes.num_classes, scenes.input_shape

    def load_train(self) -> LabelledTensors:
        return self.scenes.load_train()


def test_classes_without_names_are_scored_by_number(tmp_path):
    scenes = UnnamedScenes(Scenes(num_samples=16, image_size=32, label_set="macro"))
    data = FederatedDataModule(scenes, DirichletPowerLaw(num_clients=2, alpha=1.0), batch_size=8)
    settings = {"logger": "csv", "enable_progress_bar": False, "default_root_dir": tmp_path}
    metrics = FederatedTrainer(rounds=1, clients_per_round=1, local_steps=1, **settings).fit(_client(), data, FedAvg())
    assert sorted(key for key in metrics if key.startswith("test/iou_")) == [f"test/iou_{c}" for c in range(5)]
