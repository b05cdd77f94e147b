"""Small components whose federated results are known in closed form, for tests and examples.

:class:`ScalarClient` has one parameter w and loss ½(w − y)². With a batch that holds a client's
whole training split and SGD with lr 1, one local step lands exactly on the mean target of the
client, so the aggregate of any weighting rule can be computed by hand.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import numpy as np
import torch
from torchmetrics import Metric

from fedlight.callbacks.base import RoundCallback
from fedlight.clients.base import FederatedClient
from fedlight.data.base import FederatedDataset, LabelledTensors


class ScalarDataset(FederatedDataset):
    """Client k holds ``sizes[k]`` samples whose target is ``values[k]`` (groups = client ids)."""

    num_classes = 1
    input_shape = (1,)
    float_targets = True

    def __init__(self, sizes: list[int], values: list[float]) -> None:
        self.sizes, self.values = sizes, values

    def load_train(self) -> LabelledTensors:
        groups = np.repeat(np.arange(len(self.sizes)), self.sizes)
        targets = torch.tensor(np.repeat(self.values, self.sizes), dtype=torch.float32)
        return LabelledTensors(torch.zeros(len(groups), 1), targets, groups)


class ClientImages(FederatedDataset):
    """Client k holds ``sizes[k]`` random 8×8 one-channel images of 3 classes drawn from seed ``seeds[k]``.

    Clients with the same seed and size hold identical samples; an image's brightness grows with its class.
    A separate test set of 30 images is drawn from seed 1000, so with ``test_fraction=0`` each client
    trains on all of its samples. For rules that need convolutions or features (FedSLS, MOON, FedDecorr).
    """

    num_classes = 3
    input_shape = (1, 8, 8)

    def __init__(self, sizes: list[int], seeds: list[int]) -> None:
        self.sizes, self.seeds = sizes, seeds

    @staticmethod
    def _draw(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        targets = torch.randint(3, (size,), generator=generator)
        # class-dependent brightness, so that training has something to learn
        inputs = torch.randn(size, 1, 8, 8, generator=generator) + targets.view(-1, 1, 1, 1).float()
        return inputs, targets

    def load_train(self) -> LabelledTensors:
        inputs, targets = zip(*(self._draw(n, s) for n, s in zip(self.sizes, self.seeds, strict=True)), strict=True)
        groups = np.repeat(np.arange(len(self.sizes)), self.sizes)
        return LabelledTensors(torch.cat(inputs), torch.cat(targets), groups)

    def load_test(self) -> LabelledTensors:
        return LabelledTensors(*self._draw(30, 1000))


class MeanSquaredError(Metric):
    """Mean of the per-sample losses (and a constant 0 accuracy, so the trainer's keys exist).

    Its sums are its own states, so that ``reset`` (the engine reuses a metric from one evaluation to the next)
    clears them; a ``MeanMetric`` held inside would keep accumulating across evaluations.
    """

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, loss: torch.Tensor, **_) -> None:
        self.total += loss.detach().double().sum()
        self.count += loss.numel()

    def compute(self) -> dict[str, torch.Tensor]:
        return {"loss": (self.total / self.count).float(), "acc": torch.tensor(0.0)}


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


class Kill(BaseException):
    """Raised by :class:`KillAfterRound` to stop a run as a crash would. Not an ``Exception``: the trainer saves the
    round when a callback raises one, and leaves a client that raises one out of its round; a crash does neither."""


class KillAfterRound(RoundCallback):
    """Stops the run at the end of round ``round_idx``, before it is logged and checkpointed."""

    def __init__(self, round_idx: int) -> None:
        self.round_idx = round_idx

    def on_round_end(self, context, round_idx: int, metrics: dict) -> None:
        if round_idx == self.round_idx:
            raise Kill


class SigkillAtRound(RoundCallback):
    """Kills its own process with SIGKILL when round ``round_idx`` starts, as an out-of-memory killer would."""

    def __init__(self, round_idx: int) -> None:
        self.round_idx = round_idx

    def on_round_start(self, context, round_idx: int) -> None:
        if round_idx == self.round_idx:
            os.kill(os.getpid(), signal.SIGKILL)


class SigkillOnce(RoundCallback):
    """Kills its own process with SIGKILL when round ``round_idx`` starts for the ``skip + 1``-th time in any run
    that shares the file ``marker`` (which counts those starts), so that one run of a sweep dies and the others,
    and its own retry, go on."""

    def __init__(self, round_idx: int, marker: str, skip: int = 0) -> None:
        self.round_idx, self.marker, self.skip = round_idx, marker, skip

    def on_round_start(self, context, round_idx: int) -> None:
        if round_idx != self.round_idx:
            return
        path = Path(self.marker)
        starts = int(path.read_text()) if path.is_file() else 0
        path.write_text(str(starts + 1))
        if starts == self.skip:
            os.kill(os.getpid(), signal.SIGKILL)


class SignalAtRound(RoundCallback):
    """Sends its own process ``signal_name`` (``SIGINT`` as Ctrl-C does, or ``SIGTERM``) when round ``round_idx``
    starts, as a user or a scheduler would while the round runs."""

    def __init__(self, round_idx: int, signal_name: str = "SIGINT") -> None:
        self.round_idx, self.signal_name = round_idx, signal_name

    def on_round_start(self, context, round_idx: int) -> None:
        if round_idx == self.round_idx:
            os.kill(os.getpid(), getattr(signal, self.signal_name))


class PlainPrecision:
    """What the compiled whole step reads of Fabric's precision plugin, for a module's own dtype without autocast:
    to drive :class:`~fedlight.engine.whole_step.WholeStep` outside a run (tests, step benchmarks)."""

    scaler = None

    def forward_context(self):
        return contextlib.nullcontext()

    def convert_input(self, batch):
        return batch
