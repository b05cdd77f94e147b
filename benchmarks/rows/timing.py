"""Timing a row's client module on random tensors of its real shapes: training steps through the engine's local
loop, evaluation batches, FUSS's feature cache and FedSLS's saliency pass (see ``cost.py``)."""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

#: Seconds of timed training steps per measurement, after the warm-up.
STEP_BUDGET_S = 5.0
MIN_STEPS, MAX_STEPS = 2, 20


def loss_owner(strategy: Any) -> str:
    """The class whose ``training_loss`` the rule runs (``Strategy``: the client's task loss alone)."""
    return next(c.__name__ for c in type(strategy).__mro__ if "training_loss" in vars(c))


def is_dense(module: Any) -> bool:
    from fedlight.clients import SegmentationClient, UnsupervisedSegmentationClient

    return isinstance(module, SegmentationClient | UnsupervisedSegmentationClient)


def is_fuss(module: Any) -> bool:
    from fedlight.clients import UnsupervisedSegmentationClient

    return isinstance(module, UnsupervisedSegmentationClient)


def shrink(shape: tuple[int, ...], reduced: bool, dense: bool) -> tuple[int, ...]:
    """``shape`` with its sides divided by 4 in reduced runs of dense models (a smoke test, not a cost)."""
    if not (reduced and dense):
        return shape
    return (shape[0], *(max(32, s // 4) for s in shape[1:]))


def labels(module: Any, shape: tuple[int, ...], batch: int, classes: int) -> torch.Tensor:
    """Random labels: one per sample, or a label map per image for dense models."""
    return torch.randint(0, classes, (batch, *shape[1:]) if is_dense(module) else (batch,))


def training_batch(module: Any, shape: tuple[int, ...], batch: int, classes: int) -> tuple[torch.Tensor, ...]:
    """A batch of the client's training input: images and labels (and pool indices for FUSS)."""
    x, y = torch.randn(batch, *shape), labels(module, shape, batch, classes)
    if is_fuss(module):
        attach_random_features(module, shape, batch)
        return x, y, torch.arange(batch)
    return x, y


def attach_random_features(module: Any, shape: tuple[int, ...], batch: int) -> None:
    """A feature cache of random backbone features for ``max(2·batch, 32)`` pool images: FUSS's steps read cached
    features, their own and their neighbours', instead of running the backbone."""
    from fedlight.data.features.feature_cache import FeatureCache

    pool = max(2 * batch, 32)
    grid = shape[-1] // module.backbone.patch_size
    features = np.random.default_rng(0).standard_normal((pool, module.backbone.out_channels, grid, grid))
    knn = (torch.arange(pool)[:, None] + torch.arange(30)[None, :]) % pool  # self first
    cache = FeatureCache(torch.zeros(pool, dtype=torch.int64), torch.arange(pool), knn, [features.astype(np.float16)])
    module.attach_feature_cache(cache)


def prepare_rule(module: Any, strategy: Any) -> None:
    """What the rule's ``on_client_fit_start`` gives its loss (anchors, frozen copies), with a previous model for
    rules that keep one per client (MOON), as in every participation after a client's first."""
    from fedlight.plans import ClientPlan
    from fedlight.state import FlatState
    from fedlight.strategies.base import Strategy

    if loss_owner(strategy) == Strategy.__name__:
        return
    previous = getattr(strategy, "previous", None)
    if isinstance(previous, dict):
        branch = module.get_submodule(getattr(strategy, "branch", "net"))
        previous[0] = FlatState(branch).flatten(branch).cpu()
    strategy.on_client_fit_start(None, module, ClientPlan(client=0, epochs=1))


def timed_steps(batch: Any, warmups: int, durations: list[float]) -> Iterator[Any]:
    """Yields ``batch`` to the engine's loop and notes each step's seconds in ``durations``: first the warm-up steps
    (:func:`warmup_count`), then steps until ``STEP_BUDGET_S`` has passed (at least ``MIN_STEPS``, at most
    ``MAX_STEPS``)."""
    timed = 0.0
    for index in range(warmups + MAX_STEPS):
        started = time.perf_counter()
        yield batch
        durations.append(time.perf_counter() - started)
        if index < warmup_count(durations, warmups):
            continue
        timed += durations[-1]
        if timed >= STEP_BUDGET_S and len(durations) - warmup_count(durations, warmups) >= MIN_STEPS:
            return


def warmup_count(durations: list[float], warmups: int) -> int:
    """How many of the first steps warm up: at most ``warmups``, the second only after a first step under a second.

    >>> warmup_count([40.0, 35.0], 2), warmup_count([0.2, 0.1, 0.1], 2), warmup_count([0.2], 0)
    (1, 2, 0)
    """
    return min(warmups, 1 if durations[0] >= 1.0 else 2)


#: (network, input shape, batch) that this process has trained already: what a first step pays (the kernels for
#: those shapes) is paid, so another loss on the same network needs no warm-up step.
_WARMED: set[tuple] = set()


def time_training(
    module: Any, strategy: Any, batch: tuple, teacher_roles: tuple[str, ...], reduced: bool, shapes: tuple
) -> tuple[float, list[float]]:
    """Seconds per training step of ``module`` with ``strategy``'s loss, through the engine's local loop, and every
    step's seconds (warm-up first)."""
    from lightning.fabric import Fabric

    from fedlight.clients.base import LocalFit
    from fedlight.engine.local_fit import LocalTraining, optimizers_and_schedulers

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    loop = LocalTraining(None, None, strategy, None, fabric, None, None)
    module.train()
    for name in module.frozen_modules:
        module.get_submodule(name).eval()
    module.teachers = {role: copy.deepcopy(module.net).eval().requires_grad_(False) for role in teacher_roles}
    module.local_fit = LocalFit(round_idx=0, rounds=100, num_steps=MAX_STEPS + 2)
    prepare_rule(module, strategy)
    optimizers, schedulers = optimizers_and_schedulers(module.configure_optimizers())
    warmups = 0 if reduced or shapes in _WARMED else 2
    durations: list[float] = []
    batches = timed_steps(batch, warmups, durations)
    if reduced:  # one step
        batches = (b for b, _ in zip(batches, range(1), strict=False))
    loop.train_steps(module, optimizers, schedulers, batches, strategy.training_loss)
    module.teachers = {}
    _WARMED.add(shapes)
    timed = durations[warmup_count(durations, warmups) :]
    return statistics.median(timed), durations  # the median: robust to a step slowed by other work


@torch.no_grad()
def time_evaluation(module: Any, shape: tuple[int, ...], images: int, classes: int, groups: int) -> float:
    """Seconds per evaluated sample: ``validation_step`` and the metric's update on ``images`` samples, after a
    one-sample warm-up."""
    module.eval()
    metric = module.evaluation_metric(groups)
    x, y = torch.randn(images, *shape), labels(module, shape, images, classes)
    group = torch.randint(0, groups, (images,))
    metric.update(**module.validation_step((x[:1], y[:1], group[:1]), 0))
    started = time.perf_counter()
    metric.update(**module.validation_step((x, y, group), 0))
    return (time.perf_counter() - started) / images


@torch.no_grad()
def time_feature_cache(module: Any, shape: tuple[int, ...], images: int) -> float:
    """Seconds per training image of FUSS's feature cache, built by ``FeatureCache.build`` (which also runs one
    image to learn the features' shape) after a one-image warm-up."""
    from fedlight.data.features.feature_cache import FeatureCache

    pool = torch.randn(images, *shape)
    module.backbone.eval()
    module.backbone(pool[:1])
    with tempfile.TemporaryDirectory(prefix="rows-cost-") as folder:
        started = time.perf_counter()
        FeatureCache.build(module.backbone, lambda i: pool[i], [torch.arange(images)], images, folder, k=images)
        return (time.perf_counter() - started) / (images + 1)


def time_saliency(module: Any, shape: tuple[int, ...], batch: int, classes: int) -> float:
    """Seconds per image of FedSLS's guided-backpropagation pass, on one batch after a 2-image warm-up."""
    from fedlight.metrics.functional.saliency import saliency_norms

    module.eval()
    x, y = torch.randn(batch, *shape), torch.randint(0, classes, (batch,))
    saliency_norms(module, x[:2], y[:2])
    started = time.perf_counter()
    saliency_norms(module, x, y)
    return (time.perf_counter() - started) / batch
