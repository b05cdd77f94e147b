"""Semantic segmentation with per-pixel cross-entropy: the client of MO-FedProto's Pascal VOC runs (§5.2).

Table 1's segmentation protocol: DeepLab-V3+ with an ImageNet MobileNet-V2 encoder, Adam with
lr 1e-4 and weight decay 4e-5, the learning rate decayed polynomially with power 0.9 over the run.
Augmentation (D11) belongs to the data: ``--data.train_transform`` with
:class:`~fedlight.data.transforms.RandomScaleCropFlip`. Evaluation runs on whole images and reports mIoU
with and without background and per-class IoU from one confusion matrix (D9), each class's IoU named after the
data's classes (``iou_person``), or numbered (``iou_15``) where the data have no names.

Polynomial decay across rounds: the optimizer is re-created every round, so the schedule is a
function of where a step sits in the run. Step s of the S steps of a fit in round t gets

    lr = lr_0 · (1 − (t + s/S) / T)^0.9,

i.e. each round's local steps spread over that round's slice of the run, so the rate falls from lr_0 at
the first step of round 0 towards 0 at the end of round T − 1 for every client, however many steps it runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fedlight.clients.base import FederatedClient, OptimizerCallable, features_and_logits
from fedlight.data.labels import IGNORE_INDEX
from fedlight.errors import ConfigError
from fedlight.metrics.segmentation import GroupedSegmentation, iou_keys
from fedlight.models import create_model


def _adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-4, weight_decay=4e-5)


def poly_factor(round_idx: int, rounds: int, step: int, num_steps: int, power: float) -> float:
    """The learning-rate factor (1 − (t + s/S)/T)^power of step s of S in round t of T.

    >>> poly_factor(0, 10, 0, 5, 0.9), poly_factor(5, 10, 0, 5, 1.0), round(poly_factor(9, 10, 4, 5, 1.0), 6)
    (1.0, 0.5, 0.02)
    """
    progress = (round_idx + step / max(num_steps, 1)) / rounds
    return max(0.0, 1.0 - progress) ** power


class SegmentationClient(FederatedClient):
    """Per-pixel cross-entropy (void pixels ignored) around a registered dense model.

    Args:
        num_classes: number of classes, background included; filled in from ``--data`` by the command line.
        input_shape: shape of one input; filled in from ``--data`` by the command line.
        model: a registered dense model (``deeplabv3plus``).
        model_kwargs: extra arguments of that model, e.g. ``{encoder_weights: null}`` to start without
            ImageNet weights (no network needed).
        optimizer: local optimizer, re-created every round. Default: Adam with lr 1e-4 and weight decay
            4e-5, MO-FedProto's setting.
        poly_power: power of the polynomial learning-rate decay over the run (0.9); 0 keeps the rate
            constant.
        ignore_index: label of void pixels (VOC's 255), left out of the loss and of every score.
    """

    def __init__(
        self,
        num_classes: int,
        input_shape: tuple[int, ...],
        model: str = "deeplabv3plus",
        model_kwargs: dict[str, Any] | None = None,
        optimizer: OptimizerCallable = _adam,
        poly_power: float = 0.9,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        super().__init__()
        if poly_power < 0:
            raise ConfigError(f"Expected --model.init_args.poly_power ≥ 0 (0: constant rate), got {poly_power}.")
        self.net = create_model(model, input_shape=input_shape, num_classes=num_classes, **(model_kwargs or {}))
        self.optimizer = optimizer
        self.poly_power = poly_power
        self.ignore_index = ignore_index
        self.num_classes = num_classes

    @property
    def test_metrics(self) -> tuple[str, ...]:
        """Pixel accuracy, loss, mIoU with and without background, and each class's IoU named after the data's
        classes (``iou_<class>``)."""
        return ("acc", "loss", "miou", "miou_fg", *iou_keys(self.num_classes, self.class_names))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # [B, C, H, W]

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch[0], batch[1]
        features, logits = features_and_logits(self.net, x)  # [B, D, H/4, W/4], [B, C, H, W]
        # mean over valid pixels; a crop that is void everywhere contributes 0, not 0/0
        loss_sum = F.cross_entropy(logits, y, ignore_index=self.ignore_index, reduction="sum")
        loss = loss_sum / (y != self.ignore_index).sum().clamp(min=1)
        outputs = {"loss": loss, "logits": logits}
        return outputs if features is None else {**outputs, "features": features}

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> dict[str, torch.Tensor]:
        x, y, group = batch
        logits = self.net(x).float()
        # [B, H, W], 0 at void pixels
        pixel_loss = F.cross_entropy(logits, y, ignore_index=self.ignore_index, reduction="none")
        return {"loss": pixel_loss.sum(dim=(1, 2)), "preds": logits.argmax(dim=1), "target": y, "group": group}

    def configure_optimizers(self) -> torch.optim.Optimizer | dict[str, Any]:
        optimizer = self.optimizer(self.parameters())
        fit = self.local_fit
        if self.poly_power == 0 or fit is None:
            return optimizer
        power = self.poly_power
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: poly_factor(fit.round_idx, fit.rounds, step, fit.num_steps, power)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def evaluation_metric(self, num_groups: int) -> GroupedSegmentation:
        return GroupedSegmentation(num_groups, self.num_classes, self.ignore_index, self.class_names)
