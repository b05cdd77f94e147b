"""Semantic-segmentation scores from confusion matrices: per-class IoU, mIoU with and without background.

Everything is computed from one accumulated confusion matrix M, with M[t, p] the number of valid
pixels of true class t predicted as p. Confusion matrices of batches, clients and processes add up, so
the scores of a whole test set are exact whatever the split of the work (decision D9; LADD's mIoU is the
same confusion-matrix score):

- IoU[c] = M[c, c] / (Σ_p M[c, p] + Σ_t M[t, c] − M[c, c]), undefined (NaN) when class c is neither in
  the labels nor in the predictions;
- mIoU = mean of IoU over the classes where it is defined (torchmetrics' ``MulticlassJaccardIndex`` with
  ``average="macro"``, the standard VOC score); the foreground mIoU leaves class 0, background, out;
- pixel accuracy = Σ_c M[c, c] / Σ M.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["confusion_matrix", "intersection_over_union", "mean_iou", "pixel_accuracy"]


def confusion_matrix(
    preds: Tensor,
    target: Tensor,
    num_classes: int,
    ignore_index: int | None = 255,
    groups: Tensor | None = None,
    num_groups: int = 1,
) -> Tensor:
    """Per-group confusion matrices ``[G, C, C]`` (rows: true class, columns: prediction), as int64 counts.

    Args:
        preds: ``[B, ...]`` predicted classes.
        target: ``[B, ...]`` true classes, ``ignore_index`` where void.
        num_classes: number of classes C.
        ignore_index: label of pixels that are not counted.
        groups: ``[B]`` group (client) of every sample; ``None`` puts all in group 0.
        num_groups: number of groups G.

    Returns:
        ``[G, C, C]`` int64 counts.

    Example:
        >>> preds = torch.tensor([[0, 1, 1, 2]])
        >>> target = torch.tensor([[0, 1, 2, 255]])
        >>> confusion_matrix(preds, target, num_classes=3)[0].tolist()
        [[1, 0, 0], [0, 1, 0], [0, 1, 0]]
    """
    if preds.shape != target.shape:
        raise ValueError(f"Expected preds and target of one shape, got {tuple(preds.shape)} and {tuple(target.shape)}.")
    if groups is None:
        groups = torch.zeros(target.shape[0], dtype=torch.int64, device=target.device)
    pixel_groups = groups.long().view(-1, *([1] * (target.ndim - 1))).expand_as(target)
    valid = target != ignore_index if ignore_index is not None else torch.ones_like(target, dtype=torch.bool)
    target, preds, pixel_groups = target[valid].long(), preds[valid].long(), pixel_groups[valid]
    if target.numel() and (target.min() < 0 or target.max() >= num_classes):
        raise ValueError(
            f"Expected labels in [0, {num_classes}) or equal to ignore_index={ignore_index}, "
            f"got labels in [{target.min().item()}, {target.max().item()}]."
        )
    cell = (pixel_groups * num_classes + target) * num_classes + preds  # flat index of (g, t, p)
    counts = torch.bincount(cell, minlength=num_groups * num_classes * num_classes)
    return counts.view(num_groups, num_classes, num_classes)


def intersection_over_union(confmat: Tensor) -> Tensor:
    """Per-class IoU ``[..., C]`` of confusion matrices ``[..., C, C]``; NaN for classes absent from both sides.

    Example:
        >>> confmat = torch.tensor([[3, 1, 0], [0, 2, 0], [0, 0, 0]])
        >>> intersection_over_union(confmat).tolist()
        [0.75, 0.6666666865348816, nan]
    """
    confmat = confmat.to(torch.promote_types(confmat.dtype, torch.float32))
    intersection = confmat.diagonal(dim1=-2, dim2=-1)
    union = confmat.sum(dim=-1) + confmat.sum(dim=-2) - intersection
    return torch.where(union > 0, intersection / union.clamp(min=1), torch.nan)


def mean_iou(confmat: Tensor, include_background: bool = True) -> Tensor:
    """mIoU ``[...]``: the mean IoU over the classes present in labels or predictions (NaN if none).

    Args:
        confmat: ``[..., C, C]`` confusion matrices.
        include_background: count class 0; ``False`` gives the foreground mIoU (D9's secondary score).

    Example:
        >>> confmat = torch.tensor([[3, 1, 0], [0, 2, 0], [0, 0, 0]])
        >>> round(mean_iou(confmat).item(), 4), round(mean_iou(confmat, include_background=False).item(), 4)
        (0.7083, 0.6667)
    """
    iou = intersection_over_union(confmat)
    if not include_background:
        iou = iou[..., 1:]
    return iou.nanmean(dim=-1)


def pixel_accuracy(confmat: Tensor) -> Tensor:
    """Share of valid pixels predicted correctly, ``[...]`` from ``[..., C, C]``.

    Example:
        >>> pixel_accuracy(torch.tensor([[3, 1], [0, 2]])).item()
        0.8333333134651184
    """
    confmat = confmat.to(torch.promote_types(confmat.dtype, torch.float32))
    return confmat.diagonal(dim1=-2, dim2=-1).sum(dim=-1) / confmat.sum(dim=(-2, -1))
