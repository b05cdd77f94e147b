"""Self-training on unlabelled clients: LADD's local losses (Shenaj et al., WACV 2023, Sec. 4.3).

A LADD client has no labels. Its loss is L = L_pseudo + λ_KD·L_KD:

- **pseudo-labels** (:func:`pseudo_label_mask`, :func:`self_training_loss`): the cluster teacher g_c labels
  every pixel with its arg-max class ŷ(p); a label is kept when the teacher is confident (max
  probability above 0.9) or when the pixel is among the most confident 66 % of the pixels given the same
  class in the same image (the thresholds of LADD's code), the rule LADD takes from FDA (Yang & Soatto, CVPR 2020);
- **knowledge distillation** (:func:`kd_loss`) from the fixed pre-trained model, with soft targets at
  temperature 2 (Hinton et al., 2015), on the pixels whose pre-trained label survives the same rule;
- **SWA teacher** (:meth:`fedlight.teachers.Teachers.average_in`): the cluster teachers become running means
  of the cluster models, w_g ← (w_g·n + w_c) / (n + 1) (Sec. 4.3 of the LADD paper, after Izmailov et al., 2018).

LADD's code pre-trains the server's model on the labelled source domain with
:func:`hard_negative_mining_ce`, the mean of the hardest 25 % of pixel losses of each image.

The functions are shared by the client modules below and by the strategy that owns the teachers
(:class:`fedlight.strategies.ladd.LADD`):

- :class:`SelfTrainingClient`, a target client: L = L_pseudo + λ_KD·L_KD with the teachers the strategy
  hands it (``self.teachers["pseudo"]``, the cluster teacher g_c; ``self.teachers["kd"]``, the pre-trained
  model). It never reads its labels while training; they only score it. Without a pseudo-label teacher
  (LADD's round 0, before any cluster model exists) the student labels its own online prediction.
- :class:`SourcePretrainingClient`, the server's labelled pre-training on the source domain: cross-entropy
  with hard-negative mining, SGD with polynomial decay (LADD, Sec. 4.1 and supplementary S3).

Both wrap the same registered network under the same attribute, so the pre-training run's checkpoint seeds
the federated run (``--trainer.init_from``) key for key.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fedlight.clients.base import OptimizerCallable
from fedlight.clients.segmentation import SegmentationClient
from fedlight.data.labels import IGNORE_INDEX
from fedlight.errors import ConfigError


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Softmax statistics in fp32 at least: half-precision logits under autocast lose the small probabilities."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def pseudo_label_mask(
    probs: torch.Tensor, conf_th: float = 0.9, fraction: float = 0.66, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Returns the teacher's arg-max labels, ``ignore_index`` where they are not trusted (LADD, Sec. 4.3).

    A pixel p keeps ŷ(p) = argmax_c probs_c(p) when m(p) = max_c probs_c(p) > ``conf_th``, or when p is
    among the ⌊fraction·n_c⌋ pixels of highest m in its image whose label is c = ŷ(p), n_c of them in all.
    Equal confidences are ranked by pixel position (row-major).

    Args:
        probs: ``[B, Q, H, W]`` the teacher's class probabilities.
        conf_th: confidence above which a label is always kept (0.9); 1 disables the rule.
        fraction: share of each class's pixels kept per image (0.66); 0 disables the rule.
        ignore_index: label of the pixels left out.

    Returns:
        ``[B, H, W]`` int64 pseudo-labels.

    One image of four pixels, two classes: class 1 holds the 3 right pixels, ⌊0.66·3⌋ = 1 of them kept by
    rank (the 0.7); class 0 holds the left one, ⌊0.66·1⌋ = 0 kept by rank, but its 0.95 passes the threshold.

    >>> p1 = torch.tensor([[[[0.05, 0.7, 0.6, 0.65]]]])
    >>> pseudo_label_mask(torch.cat([1 - p1, p1], dim=1))
    tensor([[[  0,   1, 255, 255]]])
    """
    confidence, labels = probs.max(dim=1)  # m(p), ŷ(p): [B, H, W]
    conf, flat_labels = confidence.flatten(1), labels.flatten(1)  # [B, N]
    batch, num_pixels = conf.shape
    # group each image's pixels by class, most confident first within a class (two stable sorts)
    by_confidence = conf.argsort(dim=1, descending=True, stable=True)  # [B, N]
    by_class = flat_labels.gather(1, by_confidence).argsort(dim=1, stable=True)
    order = by_confidence.gather(1, by_class)  # [B, N] pixel indices, class-major
    ordered_labels = flat_labels.gather(1, order)
    counts = torch.zeros(batch, probs.shape[1], dtype=torch.long, device=probs.device)
    counts.scatter_add_(1, flat_labels, torch.ones_like(flat_labels))  # n_c per image: [B, Q]
    starts = counts.cumsum(1) - counts  # where each class begins in `order`
    rank = torch.arange(num_pixels, device=probs.device) - starts.gather(1, ordered_labels)  # 0 = most confident
    kept_per_class = (counts.double() * fraction).floor().long()  # ⌊fraction·n_c⌋
    in_top = torch.zeros_like(conf, dtype=torch.bool)
    in_top.scatter_(1, order, rank < kept_per_class.gather(1, ordered_labels))
    keep = in_top.view_as(labels) | (confidence > conf_th)
    return torch.where(keep, labels, torch.full_like(labels, ignore_index))


def self_training_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None = None,
    conf_th: float = 0.9,
    fraction: float = 0.66,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """L_pseudo: cross-entropy with the teacher's pseudo-labels, averaged over all pixels (LADD, Sec. 4.3).

    Pixels without a pseudo-label contribute 0 but still count in the mean, as in LADD's code, so a
    teacher that trusts fewer pixels gives a smaller loss.

    Args:
        student_logits: ``[B, Q, H, W]``.
        teacher_logits: ``[B, Q, H, W]`` of the cluster teacher g_c; None labels the student's own
            predictions (LADD's first round, before any cluster model exists).
        conf_th: see :func:`pseudo_label_mask`.
        fraction: see :func:`pseudo_label_mask`.
        ignore_index: label of untrusted pixels.

    Returns:
        The scalar loss.

    Two pixels, the second untrusted: (log(1 + e⁻²) + 0) / 2.

    >>> import math
    >>> student = torch.tensor([[[[2.0, 0.0]], [[0.0, 0.0]]]])
    >>> teacher = torch.tensor([[[[5.0, 0.1]], [[0.0, 0.0]]]])
    >>> round(self_training_loss(student, teacher).item(), 6), round(math.log1p(math.exp(-2.0)) / 2, 6)
    (0.063464, 0.063464)
    """
    teacher = (student_logits if teacher_logits is None else teacher_logits).detach()
    labels = pseudo_label_mask(_at_least_fp32(teacher).softmax(dim=1), conf_th, fraction, ignore_index)  # [B, H, W]
    pixel_loss = F.cross_entropy(student_logits, labels, ignore_index=ignore_index, reduction="none")
    return pixel_loss.mean()


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 2.0,
) -> torch.Tensor:
    """L_KD: distillation from soft teacher predictions, averaged over all pixels (LADD, Sec. 4.3).

    With q = softmax(z_T / T) (the temperature on the teacher only) and the student's log-probabilities,

        ℓ(p) = −(1/Q) Σ_c q_c(p) · log softmax(z_S(p))_c,    L_KD = (1/N) Σ_p mask(p) · ℓ(p),

    a cross-entropy divided by the number of classes Q. LADD's mask is
    ``pseudo_label_mask(teacher_logits.softmax(1)) != 255``: the pixels whose pre-trained label would be
    trusted.

    Args:
        student_logits: ``[B, Q, H, W]`` z_S.
        teacher_logits: ``[B, Q, H, W]`` z_T of the fixed pre-trained model.
        mask: ``[B, H, W]`` bool or per-pixel weights, None for every pixel.
        temperature: T, 2 in LADD (its code multiplies the teacher's logits by α = 0.5).

    Returns:
        The scalar loss.

    Equal student logits give log-probabilities log ½, so ℓ = −½ (q₀ + q₁) log ½ = ½ log 2:

    >>> import math
    >>> teacher = torch.tensor([[[[3.0]], [[1.0]]]])
    >>> round(kd_loss(torch.zeros(1, 2, 1, 1), teacher).item(), 6), round(0.5 * math.log(2), 6)
    (0.346574, 0.346574)
    """
    soft_targets = (_at_least_fp32(teacher_logits.detach()) / temperature).softmax(dim=1)  # q: [B, Q, H, W]
    pixel_loss = -(soft_targets * _at_least_fp32(student_logits).log_softmax(dim=1)).mean(dim=1)  # ℓ: [B, H, W]
    if mask is not None:
        pixel_loss = pixel_loss * mask.to(pixel_loss.dtype)
    return pixel_loss.mean()


def hard_negative_mining_ce(
    logits: torch.Tensor, labels: torch.Tensor, ratio: float = 0.25, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Cross-entropy over the hardest pixels: the mean of each image's top ``ratio`` pixel losses.

    LADD's source pre-training loss. Each image keeps its ⌊ratio·H·W⌋ largest per-pixel losses (at least
    one); void pixels have loss 0, so they are kept only when fewer pixels than that have a label. The
    per-image means are then averaged over the batch.

    Args:
        logits: ``[B, Q, H, W]``.
        labels: ``[B, H, W]`` int64, ``ignore_index`` for void pixels.
        ratio: share of each image's pixels kept (0.25).
        ignore_index: label of void pixels.

    Returns:
        The scalar loss.

    Four pixels with losses 0, 0, 0 and log 2 (two equal logits): the top ⌊0.25·4⌋ = 1 is log 2.

    >>> import math
    >>> logits = torch.tensor([[[[50.0, 50.0, 50.0, 0.0]], [[0.0, 0.0, 0.0, 0.0]]]])
    >>> round(hard_negative_mining_ce(logits, torch.zeros(1, 1, 4, dtype=torch.long)).item(), 6), round(math.log(2), 6)
    (0.693147, 0.693147)
    """
    pixel_loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none").flatten(1)  # [B, N]
    k = max(1, int(ratio * pixel_loss.shape[1]))
    return pixel_loss.topk(k, dim=1).values.mean(dim=1).mean()


def _ladd_target_sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)  # CrossCity's lr_fed; constant, re-created every round


def _ladd_source_sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=5e-3, momentum=0.9)  # pre-training, decayed polynomially


class SelfTrainingClient(SegmentationClient):
    """A target client of FFREEDA: self-training on pseudo-labels plus distillation (LADD, Sec. 4.3).

    Each step computes, on an unlabelled batch x (its labels are never read),

        L = L_pseudo(f(x), g_c(x)) + λ_KD · L_KD(f(x), f_0(x))

    with g_c = ``self.teachers["pseudo"]`` (the student itself, detached, when the strategy gives none) and
    f_0 = ``self.teachers["kd"]`` (no KD term when absent or λ_KD = 0). Teachers run in eval mode without
    gradients. Evaluation is :class:`SegmentationClient`'s (mIoU from one confusion matrix).

    Args:
        num_classes: number of classes Q; filled in from ``--data`` by the command line.
        input_shape: shape of one input; filled in from ``--data``.
        model: a registered segmentation model; LADD's is ``deeplabv3_mobilenetv2``.
        model_kwargs: its extra arguments (``encoder_weights``: a local ImageNet file, or null).
        optimizer: local optimizer, re-created every round. Default: SGD with lr 0.01 (CrossCity) and momentum
            0.9, LADD's, at a constant rate.
        lambda_kd: λ_KD, the weight of the distillation term (CrossCity 20, Cityscapes and Mapillary 10).
        conf_th: confidence above which a teacher's label is always kept (0.9).
        fraction: share of each class's most confident pixels kept per image (0.66).
        temperature: T of the KD teacher's soft targets (2).
        kd_mask: restrict L_KD to the pixels whose KD-teacher label survives the pseudo-label rule, as LADD's
            code does; false distils every pixel.
        kd_label_weights: multiply each pixel's KD term by the pixel's ground-truth label id, as LADD's released
            code does on Cityscapes and Mapillary (it hands the batch's labels to its KD loss, which multiplies
            by them: a road pixel, id 0, weighs 0, a void one 255). A leak of the labels the clients should
            not have; the paper's loss has no such weight, so the default is false. CrossCity's clients have
            no labels, and the code's loss is unweighted there; set-up refuses it with such data.
        poly_power: power of a polynomial learning-rate decay over the run; 0 (LADD) keeps it constant.
        ignore_index: label of void pixels in the evaluation masks.
    """

    def __init__(
        self,
        num_classes: int,
        input_shape: tuple[int, ...],
        model: str = "deeplabv3_mobilenetv2",
        model_kwargs: dict[str, Any] | None = None,
        optimizer: OptimizerCallable = _ladd_target_sgd,
        lambda_kd: float = 20.0,
        conf_th: float = 0.9,
        fraction: float = 0.66,
        temperature: float = 2.0,
        kd_mask: bool = True,
        kd_label_weights: bool = False,
        poly_power: float = 0.0,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        flag = "--model.init_args"
        problems = []
        if lambda_kd < 0:
            problems.append(f"Expected {flag}.lambda_kd ≥ 0 (0: no distillation), got {lambda_kd}.")
        if not 0.0 <= fraction <= 1.0:
            problems.append(f"Expected {flag}.fraction in [0, 1], got {fraction}.")
        if temperature <= 0:
            problems.append(f"Expected {flag}.temperature > 0, got {temperature}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(num_classes, input_shape, model, model_kwargs, optimizer, poly_power, ignore_index)
        self.lambda_kd = lambda_kd
        self.conf_th = conf_th
        self.fraction = fraction
        self.temperature = temperature
        self.kd_mask = kd_mask
        self.kd_label_weights = kd_label_weights

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> dict[str, torch.Tensor]:
        x = batch[0]  # batch[1], the labels, stays unread (FFREEDA's clients have none) unless kd_label_weights
        logits = self.net(x)  # [B, Q, H, W]
        pseudo_teacher = self.teachers.get("pseudo")
        teacher_logits = None
        if pseudo_teacher is not None:
            with torch.no_grad():
                teacher_logits = pseudo_teacher(x)  # g_c(x), [B, Q, H, W]
        loss_pseudo = self_training_loss(logits, teacher_logits, self.conf_th, self.fraction, self.ignore_index)
        loss = loss_pseudo
        outputs = {"loss_pseudo": loss_pseudo.detach()}
        kd_teacher = self.teachers.get("kd")
        if kd_teacher is not None and self.lambda_kd > 0:
            with torch.no_grad():
                kd_logits = kd_teacher(x)  # f_0(x), [B, Q, H, W]
            mask = None
            if self.kd_mask:
                labels = pseudo_label_mask(_at_least_fp32(kd_logits).softmax(dim=1), self.conf_th, self.fraction)
                mask = labels != self.ignore_index  # [B, H, W]
            if self.kd_label_weights:  # the released code's per-pixel weight: the ground-truth label id
                weights = batch[1].to(torch.float32)  # [B, H, W], void pixels 255
                mask = weights if mask is None else weights * mask
            loss_kd = kd_loss(logits, kd_logits, mask, self.temperature)
            loss = loss + self.lambda_kd * loss_kd
            outputs["loss_kd"] = loss_kd.detach()
        return {"loss": loss, "logits": logits, **outputs}


class SourcePretrainingClient(SegmentationClient):
    """LADD's server-side pre-training on the labelled source domain (Sec. 4.1, supplementary S3).

    Cross-entropy with hard-negative mining (:func:`hard_negative_mining_ce`: each image's hardest 25 % of
    pixel losses) and SGD with lr 5e-3, momentum 0.9 and polynomial decay (power 0.9) over the run. Run it
    centralized (``--data.centralized=true``, one round per epoch) on the source images restyled by
    :class:`fedlight.data.style.style_augment.StyleAugment`; its checkpoint is the federated run's W^0
    (``--trainer.init_from``).

    Args:
        num_classes: number of classes Q; filled in from ``--data``.
        input_shape: shape of one input; filled in from ``--data``.
        model: a registered segmentation model, the same as the federated run's.
        model_kwargs: its extra arguments.
        optimizer: the optimizer (default SGD, lr 5e-3, momentum 0.9).
        hnm_ratio: share of each image's pixel losses averaged (0.25); 1 is the plain mean over pixels.
        poly_power: power of the polynomial decay over the run (0.9).
        ignore_index: label of void pixels.
    """

    def __init__(
        self,
        num_classes: int,
        input_shape: tuple[int, ...],
        model: str = "deeplabv3_mobilenetv2",
        model_kwargs: dict[str, Any] | None = None,
        optimizer: OptimizerCallable = _ladd_source_sgd,
        hnm_ratio: float = 0.25,
        poly_power: float = 0.9,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        if not 0.0 < hnm_ratio <= 1.0:
            raise ConfigError(f"Expected --model.init_args.hnm_ratio in (0, 1], got {hnm_ratio}.")
        super().__init__(num_classes, input_shape, model, model_kwargs, optimizer, poly_power, ignore_index)
        self.hnm_ratio = hnm_ratio

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch[0], batch[1]
        logits = self.net(x)  # [B, Q, H, W]
        return {"loss": hard_negative_mining_ce(logits, y, self.hnm_ratio, self.ignore_index), "logits": logits}
