"""Passes over a client's data that rules and analyses share (part of the hook contract).

A pass reads a client's batches through the run's context (its data, its precision) with a module the caller
has put in the mode it wants; it draws nothing from the random streams, so a local fit after it runs exactly
as it would without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fedlight.metrics.functional.prototypes import class_feature_sums

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext


@torch.no_grad()
def class_feature_batches(context: RunContext, module: LightningModule, client: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Per-batch class feature sums ``[C, D]`` and counts ``[C]`` of ``module`` over a client's training split.

    The features are the classifier's input, ``module.net.forward_features``: ``[B, D]``, or ``[B, D, h, w]``
    for dense models, whose pixels count as samples with void (the module's ``ignore_index``) left out (D5).
    The caller sets the module's mode and adds the batches up.
    """
    precision, num_classes = context.precision, context.datamodule.num_classes
    ignore_index = getattr(module, "ignore_index", None)  # segmentation's void label
    for batch in context.datamodule.client_batches(client, split="train"):
        x, y = precision.convert_input(batch)
        with precision.forward_context():
            features = module.net.forward_features(x)
        yield class_feature_sums(features, y, num_classes, ignore_index)


@torch.no_grad()
def mean_task_loss(context: RunContext, module: LightningModule, client: int) -> float:
    """The mean of ``training_step``'s ``loss`` of ``module`` over a client's training split, by sample.

    Each batch's loss is a mean over its samples, so batches weigh by their size. The caller sets the module's mode
    (eval, for a loss that moves no BatchNorm statistics and draws no dropout).
    """
    precision, total, count = context.precision, 0.0, 0
    for index, batch in enumerate(context.datamodule.client_batches(client, split="train")):
        batch = precision.convert_input(batch)
        with precision.forward_context():
            loss = module.training_step(batch, index)["loss"]
        total += float(loss) * len(batch[1])
        count += len(batch[1])
    return total / count
