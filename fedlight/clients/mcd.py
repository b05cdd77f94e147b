"""Maximum Classifier Discrepancy (Saito et al., *Maximum Classifier Discrepancy for Unsupervised Domain
Adaptation*, CVPR 2018), the UDA baseline of LADD's Tables 2–4 (Shenaj et al., WACV 2023, Sec. 5.1).

A feature generator G and two classifiers F1, F2 read the same features. Each batch pairs labelled source images
(x_s, y_s) with unlabelled target images x_t and takes three steps (Sec. 3.2 of the MCD paper):

- **A** trains G, F1 and F2 on the source: min_{G,F1,F2} CE(F1(G(x_s)), y_s) + CE(F2(G(x_s)), y_s);
- **B** fixes G and trains F1, F2 to stay right on the source while disagreeing on the target:
  min_{F1,F2} CE_1 + CE_2 − d(F1(G(x_t)), F2(G(x_t)));
- **C** fixes F1, F2 and trains G to make them agree on the target, min_G d(·), repeated n times (n = 4, the
  MCD authors' segmentation setting),

with the discrepancy d(p1, p2) = mean |p1 − p2| of the two softmax outputs over classes, pixels and images
(Eq. 1 of the MCD paper; :func:`classifier_discrepancy`).

On a DeepLab network G is the ``backbone`` and F1 the whole ``classifier`` head (ASPP, decoder and the last 1×1
convolution), the split LADD's code makes; F2 is a second head of the same shape, initialised independently. The
model scores with F1 (as LADD's code), so the module's ``net`` is an ordinary segmentation network and evaluation
is :class:`~fedlight.clients.segmentation.SegmentationClient`'s. G and the heads train with one optimizer each,
built from ``optimizer``; both are re-created every round and decay polynomially over the run.

The client holds the labelled source (``source``, e.g. GTA5): MCD needs it beside the target at every step, in the
centralized run as in LADD's federated one, where every client trains with its own target images and the whole
source (the paper evaluates MCD "in the UDA setting, where source and target datasets are jointly available").
Each step draws as many source images as the target batch holds, uniformly without replacement, from the client's
random stream.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlight.clients.base import OptimizerCallable
from fedlight.clients.segmentation import SegmentationClient, poly_factor
from fedlight.clients.self_training import hard_negative_mining_ce
from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.labels import IGNORE_INDEX
from fedlight.data.transforms import BatchTransform
from fedlight.errors import ConfigError

_FLAG = "--model.init_args"


def classifier_discrepancy(logits1: Tensor, logits2: Tensor) -> Tensor:
    """d(p1, p2): the mean absolute difference of two classifiers' softmax outputs (Eq. 1 of the MCD paper).

    Args:
        logits1: ``[B, Q, ...]`` F1's logits.
        logits2: ``[B, Q, ...]`` F2's logits.

    Returns:
        The scalar mean of |softmax(logits1) − softmax(logits2)| over images, classes and pixels.

    One pixel, two classes: softmax(0, 0) = (½, ½) and softmax(log 3, 0) = (¾, ¼), so d = (¼ + ¼) / 2 = ¼.

    >>> import math
    >>> round(classifier_discrepancy(torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]])).item(), 6)
    0.25
    """
    probs1 = logits1.float().softmax(dim=1)
    probs2 = logits2.float().softmax(dim=1)
    return (probs1 - probs2).abs().mean()


def _mcd_sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # LADD's MCD configs, decayed polynomially


class MCDClient(SegmentationClient):
    """MCD's three steps per batch on a DeepLab network with a second classifier head.

    Args:
        num_classes: number of classes Q; filled in from ``--data`` by the command line.
        input_shape: shape of one input; filled in from ``--data``.
        source: the labelled source dataset (GTA5 with the target's classes); its training images are read.
        source_transform: augmentation of the source batches (LADD: random scale 0.7–2 and a 512×1024 crop, the
            target's own transform), drawn from the client's stream; null reads them as they are.
        model: a registered network with a ``backbone`` (G) and a ``classifier`` head (F1), such as
            ``deeplabv3_mobilenetv2`` or ``mini_deeplab``.
        model_kwargs: its extra arguments (``encoder_weights``).
        optimizer: the optimizer of G and, separately, of F1 and F2, re-created every round (default SGD, lr 0.05,
            momentum 0.9, LADD's MCD setting).
        num_generator_steps: n, the repetitions of step C per batch (4).
        hnm_ratio: share of each source image's pixel losses averaged in the cross-entropy (1: the plain mean of
            the MCD paper; LADD's code 0.25, its hard-negative mining).
        discrepancy_images: the images steps B and C measure the discrepancy on: ``target`` (the MCD paper), or
            ``source``, as LADD's released code does (its steps B and C run both classifiers on the source batch
            and never read the target images).
        poly_power: power of the polynomial learning-rate decay over the run (0.9); 0 keeps the rate constant.
        ignore_index: label of void pixels.
    """

    def __init__(
        self,
        num_classes: int,
        input_shape: tuple[int, ...],
        source: FederatedDataset,
        source_transform: BatchTransform | None = None,
        model: str = "deeplabv3_mobilenetv2",
        model_kwargs: dict[str, Any] | None = None,
        optimizer: OptimizerCallable = _mcd_sgd,
        num_generator_steps: int = 4,
        hnm_ratio: float = 1.0,
        discrepancy_images: Literal["target", "source"] = "target",
        poly_power: float = 0.9,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        problems = []
        if num_generator_steps < 1:
            problems.append(f"Expected {_FLAG}.num_generator_steps ≥ 1 (n of step C), got {num_generator_steps}.")
        if not 0.0 < hnm_ratio <= 1.0:
            problems.append(f"Expected {_FLAG}.hnm_ratio in (0, 1], got {hnm_ratio}.")
        if discrepancy_images not in ("target", "source"):
            problems.append(f"Expected {_FLAG}.discrepancy_images 'target' or 'source', got {discrepancy_images!r}.")
        if source.num_classes != num_classes:
            problems.append(
                f"{_FLAG}.source has {source.num_classes} classes, the target data {num_classes}: give the source "
                "the target's classes (GTA5's target option)."
            )
        if problems:
            raise ConfigError(*problems)
        super().__init__(num_classes, input_shape, model, model_kwargs, optimizer, poly_power, ignore_index)
        if not all(isinstance(getattr(self.net, part, None), nn.Module) for part in ("backbone", "classifier")):
            raise ConfigError(
                f"{_FLAG}.model={model!r} has no 'backbone' and 'classifier' submodules to serve as MCD's generator "
                "and classifier; use 'deeplabv3_mobilenetv2' or 'mini_deeplab'."
            )
        self.classifier2 = _fresh_copy(self.net.classifier)  # F2
        self.source = source
        self.source_transform = source_transform
        self.num_generator_steps = num_generator_steps
        self.hnm_ratio = hnm_ratio
        self.discrepancy_images = discrepancy_images
        self.automatic_optimization = False
        self._source_pool: LabelledTensors | None = None

    # -- the network -------------------------------------------------------------------------------
    @property
    def generator(self) -> nn.Module:
        """G, the feature generator."""
        return self.net.backbone

    @property
    def heads(self) -> tuple[nn.Module, nn.Module]:
        """(F1, F2), the two classifiers."""
        return self.net.classifier, self.classifier2

    def both_logits(self, features: Tensor, size: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """F1's and F2's logits ``[B, Q, H, W]`` of G's ``features``, upsampled bilinearly to ``size``."""
        return tuple(
            F.interpolate(head(features), size=size, mode="bilinear", align_corners=False) for head in self.heads
        )

    def source_loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """One classifier's cross-entropy on the source (the mean of each image's hardest ``hnm_ratio`` pixels)."""
        return hard_negative_mining_ce(logits, labels, self.hnm_ratio, self.ignore_index)

    # -- the three steps -----------------------------------------------------------------------------
    def step_a(self, source_x: Tensor, source_y: Tensor) -> Tensor:
        """Step A: one update of G, F1 and F2 on the source cross-entropy; returns the loss before it."""
        opt_g, opt_f = self._optimizers()
        logits1, logits2 = self.both_logits(self.generator(source_x), source_x.shape[-2:])
        loss = self.source_loss(logits1, source_y) + self.source_loss(logits2, source_y)
        self._update(loss, opt_g, opt_f)
        return loss.detach()

    def step_b(self, source_x: Tensor, source_y: Tensor, target_x: Tensor) -> Tensor:
        """Step B: one update of F1 and F2 (G fixed) on source cross-entropy minus the discrepancy on ``target_x``;
        returns the loss before it."""
        _, opt_f = self._optimizers()
        with torch.no_grad():  # G is fixed: its features are constants here
            source_features, target_features = self.generator(source_x), self.generator(target_x)
        logits1, logits2 = self.both_logits(source_features, source_x.shape[-2:])
        loss = self.source_loss(logits1, source_y) + self.source_loss(logits2, source_y)
        loss = loss - classifier_discrepancy(*self.both_logits(target_features, target_x.shape[-2:]))
        self._update(loss, opt_f)
        return loss.detach()

    def step_c(self, target_x: Tensor) -> Tensor:
        """Step C, once: one update of G (F1, F2 fixed) on the discrepancy on ``target_x``; returns it before."""
        opt_g, _ = self._optimizers()
        loss = classifier_discrepancy(*self.both_logits(self.generator(target_x), target_x.shape[-2:]))
        self._update(loss, opt_g)
        return loss.detach()

    def _optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        manual = self.manual_steps
        assert manual is not None, "MCDClient steps its own optimizers: the trainer sets manual_steps for a fit"
        opt_g, opt_f = manual.optimizers
        return opt_g, opt_f

    def _update(self, loss: Tensor, *optimizers: torch.optim.Optimizer) -> None:
        """Back-propagates ``loss`` and steps only ``optimizers``; every gradient is cleared before and after, so
        the parameters of the others (which the loss also reaches) keep their values."""
        manual = self.manual_steps
        for optimizer in manual.optimizers:
            optimizer.zero_grad(set_to_none=True)
        manual.backward(loss)
        for optimizer in optimizers:
            manual.step(optimizer)
        for optimizer in manual.optimizers:
            optimizer.zero_grad(set_to_none=True)

    # -- Lightning hooks ------------------------------------------------------------------------------
    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> dict[str, Tensor]:
        target_x = batch[0]  # batch[1], the target's labels, stays unread
        source_x, source_y = self.source_batch(len(target_x))
        discrepancy_x = target_x if self.discrepancy_images == "target" else source_x
        loss_a = self.step_a(source_x, source_y)
        loss_b = self.step_b(source_x, source_y, discrepancy_x)
        discrepancy = torch.stack([self.step_c(discrepancy_x) for _ in range(self.num_generator_steps)]).mean()
        return {"loss": loss_a, "loss_classifiers": loss_b, "discrepancy": discrepancy}

    def configure_optimizers(self) -> list[dict[str, Any]]:
        """Two optimizers from ``optimizer``, re-created every round: G's, then F1's and F2's together, each with the
        run's polynomial decay (:class:`~fedlight.clients.segmentation.SegmentationClient`'s schedule)."""
        heads = [p for head in self.heads for p in head.parameters()]
        return [self._with_schedule(self.optimizer(params)) for params in (self.generator.parameters(), heads)]

    def _with_schedule(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        fit, power = self.local_fit, self.poly_power
        if power == 0 or fit is None:
            return {"optimizer": optimizer}
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: poly_factor(fit.round_idx, fit.rounds, step, fit.num_steps, power)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def configure_model(self) -> None:
        """Loads the pretrained encoder (if any) and reads the source, so that a missing source dataset is an error
        before the first round."""
        super().configure_model()
        self.source_pool  # noqa: B018  (read now for its errors)

    # -- the source --------------------------------------------------------------------------------------
    @property
    def source_pool(self) -> LabelledTensors:
        """The source's training pool, read on first use."""
        if self._source_pool is None:
            self._source_pool = self.source.load_train()
        return self._source_pool

    def source_batch(self, size: int) -> tuple[Tensor, Tensor]:
        """``size`` source images ``[B, 3, H, W]`` and label maps ``[B, H, W]``, drawn uniformly without replacement
        from torch's generator (the client's stream during a fit) and augmented by ``source_transform``."""
        pool = self.source_pool
        index = torch.randperm(len(pool))[:size]
        generator = torch.Generator().manual_seed(int(torch.randint(2**62, ())))  # the augmentations' draws
        if pool.train_reader is not None:
            x, y = pool.train_reader.read(index, generator)
        else:
            x, y = pool.inputs[index], pool.targets[index]
        x, y = x.to(self.device, torch.float32), y.to(self.device, torch.long)
        if self.source_transform is not None:
            x, y = self.source_transform(x, y, generator)
        return x, y


def _fresh_copy(module: nn.Module) -> nn.Module:
    """A module of ``module``'s structure with every layer's parameters drawn afresh (F2 beside F1)."""
    fresh = copy.deepcopy(module)
    for layer in fresh.modules():
        if hasattr(layer, "reset_parameters"):
            layer.reset_parameters()
    return fresh
