"""What the trainer expects of a client task module."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from lightning import LightningModule
from torchmetrics import Metric

#: ``params → optimizer``; in YAML ``{class_path: torch.optim.SGD, init_args: {lr: 0.01}}``.
OptimizerCallable = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


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
    """

    def evaluation_metric(self, num_groups: int) -> Metric:
        """Returns a fresh metric that accumulates ``validation_step`` outputs over ``num_groups`` groups."""
        raise NotImplementedError
