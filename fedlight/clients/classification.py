"""Image/vector classification with cross-entropy: the client of the classification benchmarks."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fedlight.clients.base import FederatedClient, OptimizerCallable, features_and_logits
from fedlight.metrics.classification import GroupedClassification
from fedlight.models import create_model


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


class ClassificationClient(FederatedClient):
    """Cross-entropy classifier around a registered model.

    Args:
        num_classes: number of classes; filled in from ``--data`` by the command line.
        input_shape: shape of one input; filled in from ``--data`` by the command line.
        model: a registered model name (``fedlight.models.list_models()``).
        model_kwargs: extra arguments of that model (e.g. ``{hidden: [128, 256]}`` for ``mlp``).
        optimizer: local optimizer, re-created every round. Default: SGD with lr 0.01, the papers'
            setting for Synthetic and MNIST.
    """

    def __init__(
        self,
        num_classes: int,
        input_shape: tuple[int, ...],
        model: str = "mlp",
        model_kwargs: dict[str, Any] | None = None,
        optimizer: OptimizerCallable = _sgd,
    ) -> None:
        super().__init__()
        self.net = create_model(model, input_shape=input_shape, num_classes=num_classes, **(model_kwargs or {}))
        self.optimizer = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch[0], batch[1]
        features, logits = features_and_logits(self.net, x)  # [B, D], [B, C]
        outputs = {"loss": F.cross_entropy(logits, y), "logits": logits}
        return outputs if features is None else {**outputs, "features": features}

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> dict[str, torch.Tensor]:
        x, y, group = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits.float(), y, reduction="none")  # [B]
        return {"loss": loss, "preds": logits.argmax(dim=1), "target": y, "group": group}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer(self.parameters())

    def evaluation_metric(self, num_groups: int) -> GroupedClassification:
        return GroupedClassification(num_groups)
