"""Self-training on unlabelled clients: LADD's local losses (Shenaj et al., WACV 2023, Sec. 4.3).

A LADD client has no labels. Its loss is L = L_pseudo + λ_KD·L_KD:

- **pseudo-labels** (:func:`pseudo_label_mask`, :func:`self_training_loss`): the cluster teacher g_c labels
  every pixel with its arg-max class ŷ(p); a label is kept when the teacher is confident (max
  probability above 0.9) or when the pixel is among the most confident 66 % of the pixels given the same
  class in the same image (the thresholds of LADD's code), the rule LADD takes from FDA (Yang & Soatto, CVPR 2020);
- **knowledge distillation** (:func:`kd_loss`) from the fixed pre-trained model, with soft targets at
  temperature 2 (Hinton et al., 2015), on the pixels whose pre-trained label survives the same rule;
- **SWA teacher** (:func:`swa_update`): the cluster teachers become running means of the cluster models,
  w_g ← (w_g·n + w_c) / (n + 1) (Sec. 4.3 of the LADD paper, after Izmailov et al., 2018).

LADD's code pre-trains the server's model on the labelled source domain with
:func:`hard_negative_mining_ce`, the mean of the hardest 25 % of pixel losses of each image.

Functions only, so that the client module and the strategy that owns the teachers can share them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch
import torch.nn.functional as F

from fedlight.data.labels import IGNORE_INDEX

State = TypeVar("State", torch.Tensor, Mapping[str, torch.Tensor])


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
        mask: ``[B, H, W]`` bool or 0/1 weights, None for every pixel.
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


def swa_update(average: State, new: State, n: int) -> State:
    """One step of a running mean: (w·n + w_new) / (n + 1), LADD's SWA teacher (Sec. 4.3).

    The first update (n = 0) returns ``new``; after updates with n = 0, 1, …, N−1 the result is the
    arithmetic mean of the N states. State dicts are averaged key by key; integer entries (BatchNorm's
    ``num_batches_tracked``) take the newest value.

    Args:
        average: the current average, a tensor or a state dict.
        new: the state to add, of the same structure.
        n: how many states ``average`` already holds.

    Returns:
        A new average; the inputs are not modified.

    >>> avg = swa_update(torch.tensor([9.0]), torch.tensor([1.0]), n=0)
    >>> swa_update(swa_update(avg, torch.tensor([2.0]), n=1), torch.tensor([6.0]), n=2)
    tensor([3.])
    """
    assert n >= 0, f"n counts the states already averaged, got {n}"
    if isinstance(average, Mapping):
        assert average.keys() == new.keys(), f"states differ in keys: {set(average) ^ set(new)}"
        return {key: swa_update(average[key], new[key], n) for key in average}
    if n == 0 or not average.is_floating_point():
        return new.detach().clone()
    return torch.lerp(average, new.to(average.dtype), 1.0 / (n + 1))  # a = 1/(n+1)
