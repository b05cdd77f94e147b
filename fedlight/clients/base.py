"""What the trainer expects of a client task module."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
from lightning import LightningModule
from torchmetrics import Metric

#: ``params → optimizer``; in YAML ``{class_path: torch.optim.SGD, init_args: {lr: 0.01}}``.
OptimizerCallable = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class LocalFit:
    """Where a local fit sits in the run, for schedules that span the run (e.g. polynomial LR decay).

    Attributes:
        round_idx: the round t of this fit, from 0.
        rounds: the run's number of rounds T.
        num_steps: optimizer steps this fit will run (local epochs × batches per epoch).
    """

    round_idx: int
    rounds: int
    num_steps: int


@dataclass(frozen=True)
class ManualSteps:
    """What a client that steps its own optimizers (``automatic_optimization = False``) uses during a local fit.

    Such a client runs several updates per batch inside its ``training_step`` (MCD's three steps, each with
    its own loss and its own parameters), so the trainer hands it the fit's optimizers and the run's backward pass
    and optimizer step instead of running them itself.

    Attributes:
        optimizers: what ``configure_optimizers`` returned, in its order; their schedulers step once per batch.
        backward: the backward pass of a loss under the run's precision (a gradient scaler's scaling included).
        step: one optimizer step under the run's precision.
    """

    optimizers: list[torch.optim.Optimizer]
    backward: Callable[[torch.Tensor], None]
    step: Callable[[torch.optim.Optimizer], None]


class FederatedClient(LightningModule):
    """A LightningModule that one process reuses for every client it hosts.

    The trainer loads the received state into it, calls :meth:`configure_optimizers` for a fresh
    optimizer every round (as every official repository does), and drives ``training_step`` and
    ``validation_step`` itself. Subclasses implement:

    - ``training_step(batch, batch_idx)`` returning a dict with ``loss`` (and, for strategies that
      need them, ``features`` and ``logits``);
    - ``validation_step(batch, batch_idx)`` whose batch carries a third element, each sample's
      group (client) index, returning the keyword arguments of the :meth:`evaluation_metric`'s
      ``update``;
    - :meth:`evaluation_metric`.

    ``configure_optimizers`` may return Lightning's ``{"optimizer": ..., "lr_scheduler": ...}`` with a
    per-step scheduler, or a list of optimizers (each steps once per batch); :attr:`local_fit` tells it
    the round and the length of the fit it is built for. A client with ``automatic_optimization = False``
    runs its own backward passes and optimizer steps in ``training_step`` through :attr:`manual_steps`, and
    returns its ``loss`` detached, for the record.

    Submodules named in :attr:`frozen_modules` (a pretrained backbone), and parameters with
    ``requires_grad=False``, are not federated: they are loaded once, run in eval mode during local
    training, never aggregated, and checkpointed once. During a local fit :attr:`teachers` holds the
    frozen models the strategy hands to the loss (e.g. ``self.teachers["kd"]``).
    ``configure_model`` runs once before W^0 is taken from the module (not when resuming a checkpoint):
    the place to load weights from outside the run, such as a pretrained encoder.
    """

    #: Keys of the evaluation metric's output that are logged for the global test set as ``test/<key>``.
    test_metrics: tuple[str, ...] = ("acc", "loss")
    #: Names of the data's classes 0…C−1 (None: numbered), set by the trainer at set-up from ``--data``; per-class
    #: scores are named after them.
    class_names: tuple[str, ...] | None = None
    #: Set by the trainer before every ``configure_optimizers`` call.
    local_fit: LocalFit | None = None
    #: Names of submodules that are frozen (not trained, not federated), e.g. ``("backbone",)``.
    frozen_modules: tuple[str, ...] = ()
    #: Frozen auxiliary models by role, set by the trainer for the length of a local fit.
    teachers: Mapping[str, torch.nn.Module] = MappingProxyType({})
    #: The fit's optimizers, backward pass and optimizer step, set by the trainer for the length of a local fit of a
    #: client with ``automatic_optimization = False``.
    manual_steps: ManualSteps | None = None

    def configure_model(self) -> None:
        """Loads the network's pretrained weights when it has them (``net.load_pretrained``), once before W^0."""
        load_pretrained = getattr(getattr(self, "net", None), "load_pretrained", None)
        if load_pretrained is not None:
            load_pretrained()

    def evaluation_metric(self, num_groups: int) -> Metric:
        """Returns a fresh metric that accumulates ``validation_step`` outputs over ``num_groups`` groups."""
        raise NotImplementedError


def features_and_logits(net: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The classifier's input and the logits of ``x``: through ``forward_features`` and ``forward_head`` when the
    network has them, else through its plain ``forward``, which gives no features (enough for rules that read
    only the weights, such as FedAvg; those that read features check for them at set-up)."""
    if hasattr(net, "forward_features") and hasattr(net, "forward_head"):
        features = net.forward_features(x)
        return features, net.forward_head(features)
    return None, net(x)
