"""Small components whose federated results are known in closed form, for tests and examples.

:class:`ScalarClient` has one parameter w and loss ½(w − y)². With a batch that holds a client's
whole training split and SGD with lr 1, one local step lands exactly on the mean target of the
client, so the aggregate of any weighting rule can be computed by hand.
"""

from __future__ import annotations

import numpy as np
import torch
from torchmetrics import MeanMetric, Metric

from fedlight.callbacks.base import RoundCallback
from fedlight.clients.base import FederatedClient
from fedlight.data.base import FederatedDataset, LabelledTensors


class ScalarDataset(FederatedDataset):
    """Client k holds ``sizes[k]`` samples whose target is ``values[k]`` (groups = client ids)."""

    num_classes = 1
    input_shape = (1,)

    def __init__(self, sizes: list[int], values: list[float]) -> None:
        self.sizes, self.values = sizes, values

    def load_train(self) -> LabelledTensors:
        groups = np.repeat(np.arange(len(self.sizes)), self.sizes)
        targets = torch.tensor(np.repeat(self.values, self.sizes), dtype=torch.float32)
        return LabelledTensors(torch.zeros(len(groups), 1), targets, groups)


class MeanSquaredError(Metric):
    """Mean of the per-sample losses (and a constant 0 accuracy, so the trainer's keys exist)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = MeanMetric()

    def update(self, loss: torch.Tensor, **_) -> None:
        self.inner.update(loss)

    def compute(self) -> dict[str, torch.Tensor]:
        return {"loss": self.inner.compute(), "acc": torch.tensor(0.0)}


class ScalarClient(FederatedClient):
    """One parameter w with loss ½(w − y)²: a full-batch SGD step with lr 1 lands on the mean target."""

    def __init__(self, num_classes: int = 1, input_shape: tuple[int, ...] = (1,), lr: float = 1.0) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        _, y = batch[0], batch[1]
        return {"loss": 0.5 * ((self.w - y) ** 2).mean()}

    def validation_step(self, batch, batch_idx):
        y = batch[1]
        return {"loss": 0.5 * (self.w - y) ** 2}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def evaluation_metric(self, num_groups: int) -> Metric:
        return MeanSquaredError()


class Kill(Exception):
    """Raised by :class:`KillAfterRound` to stop a run as a crash would."""


class KillAfterRound(RoundCallback):
    """Stops the run at the end of round ``round_idx``, before it is logged and checkpointed."""

    def __init__(self, round_idx: int) -> None:
        self.round_idx = round_idx

    def on_round_end(self, trainer, round_idx: int, metrics: dict) -> None:
        if round_idx == self.round_idx:
            raise Kill
