"""Scores of unsupervised segmentation: clusters matched one-to-one to classes by the Hungarian algorithm.

An unsupervised model predicts cluster indices whose order means nothing, so every score first matches
clusters to classes. As in the evaluation code of STEGO (Hamilton et al. 2022) and FUSS, one match is made
for the whole evaluation set, from one accumulated histogram H with H[k, c] the number of valid pixels of
true class c put in cluster k:

- the match π maximises the matched pixels Σ_k H[k, π(k)] over one-to-one maps, a linear assignment
  problem (the "Hungarian match"), solved by ``scipy.optimize.linear_sum_assignment(H, maximize=True)``;
- with r(c) the cluster matched to class c: TP_c = H[r(c), c], FN_c = Σ_k H[k, c] − TP_c (pixels of c put
  elsewhere) and FP_c = Σ_c' H[r(c), c'] − TP_c (other pixels in c's cluster); IoU_c = TP_c / (TP_c + FP_c +
  FN_c), NaN where the denominator is 0 (class absent from the labels and its cluster empty);
- mIoU is the mean of the defined IoUs; pixel accuracy is Σ_c TP_c / Σ H.

With more clusters than classes the unmatched clusters' pixels count only as misses (FN) and in the
accuracy's denominator; with fewer, an unmatched class present in the labels gets IoU 0.

Histograms of batches, clients and processes add up, so the match and the scores are those of the whole
set, whatever the split of the work. :func:`per_image_miou` scores every image under a fixed match (the
set's), which pairs images across two runs for paired tests such as FUSS's (§5.4: paired t-test, Wilcoxon).
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

__all__ = ["cluster_histogram", "hungarian_match", "matched_scores", "per_image_miou"]


def cluster_histogram(
    clusters: Tensor, target: Tensor, num_clusters: int, num_classes: int, ignore_index: int | None = 255
) -> Tensor:
    """The histogram ``[K, C]`` of (cluster, true class) over the valid pixels, as int64 counts.

    Args:
        clusters: ``[B, ...]`` predicted cluster indices in ``[0, K)``.
        target: ``[B, ...]`` true classes in ``[0, C)``, ``ignore_index`` where void.
        num_clusters: number of clusters K.
        num_classes: number of classes C.
        ignore_index: label of pixels that are not counted.

    >>> cluster_histogram(torch.tensor([[1, 1, 0, 2]]), torch.tensor([[0, 0, 1, 255]]), 3, 2).tolist()
    [[0, 1], [2, 0], [0, 0]]
    """
    if clusters.shape != target.shape:
        raise ValueError(
            f"Expected clusters and target of one shape, got {tuple(clusters.shape)} and {tuple(target.shape)}."
        )
    valid = target != ignore_index if ignore_index is not None else torch.ones_like(target, dtype=torch.bool)
    clusters, target = clusters[valid].long(), target[valid].long()
    if target.numel() and (target.min() < 0 or target.max() >= num_classes):
        raise ValueError(
            f"Expected labels in [0, {num_classes}) or equal to ignore_index={ignore_index}, "
            f"got labels in [{target.min().item()}, {target.max().item()}]."
        )
    if clusters.numel() and (clusters.min() < 0 or clusters.max() >= num_clusters):
        raise ValueError(
            f"Expected cluster indices in [0, {num_clusters}), got [{clusters.min().item()}, {clusters.max().item()}]."
        )
    counts = torch.bincount(clusters * num_classes + target, minlength=num_clusters * num_classes)
    return counts.view(num_clusters, num_classes)


def hungarian_match(histogram: Tensor) -> Tensor:
    """The class matched to every cluster, ``[K]`` int64, −1 for a cluster left unmatched.

    >>> hungarian_match(torch.tensor([[1, 9], [8, 2], [0, 3]])).tolist()
    [1, 0, -1]
    """
    rows, cols = linear_sum_assignment(histogram.detach().double().cpu().numpy(), maximize=True)
    assignment = torch.full((histogram.shape[0],), -1, dtype=torch.int64)
    assignment[torch.from_numpy(rows)] = torch.from_numpy(cols.astype(np.int64))
    return assignment


def _iou_under(histogram: Tensor, assignment: Tensor) -> tuple[Tensor, Tensor]:
    """Per-class IoU ``[..., C]`` and true positives ``[..., C]`` of histograms ``[..., K, C]`` under a match."""
    histogram = histogram.to(torch.float64)
    num_classes = histogram.shape[-1]
    matched = assignment >= 0  # [K]
    # one_hot[k, c] = 1 if cluster k is matched to class c
    one_hot = torch.zeros(assignment.shape[0], num_classes, dtype=torch.float64, device=histogram.device)
    one_hot[matched.nonzero().squeeze(1), assignment[matched]] = 1.0
    tp = (histogram * one_hot).sum(dim=-2)  # [..., C]
    class_pixels = histogram.sum(dim=-2)  # [..., C] TP + FN
    cluster_pixels = histogram.sum(dim=-1) @ one_hot  # [..., C] TP + FP, pixels of the cluster matched to c
    union = class_pixels + cluster_pixels - tp
    return torch.where(union > 0, tp / union.clamp(min=1), torch.nan), tp


def matched_scores(histogram: Tensor, assignment: Tensor | None = None) -> dict[str, Tensor]:
    """mIoU, pixel accuracy and per-class IoU of a histogram ``[K, C]`` after the Hungarian match.

    Args:
        histogram: ``[K, C]`` counts of (cluster, true class).
        assignment: ``[K]`` class of every cluster (−1: none); by default the Hungarian match of ``histogram``.

    Returns:
        ``miou`` and ``acc`` (float64 scalars), ``iou`` ``[C]`` and the ``assignment`` ``[K]`` used.

    Cluster 0 holds class 1 and cluster 1 class 0, so IoU = (3/5, 4/6) after swapping:

    >>> out = matched_scores(torch.tensor([[1, 3], [4, 1]]))
    >>> out["assignment"].tolist(), [round(v, 4) for v in out["iou"].tolist()], round(out["acc"].item(), 4)
    ([1, 0], [0.6667, 0.6], 0.7778)
    """
    if assignment is None:
        assignment = hungarian_match(histogram)
    assignment = assignment.to(histogram.device)
    iou, tp = _iou_under(histogram, assignment)
    return {
        "miou": iou.nanmean(),
        "acc": tp.sum() / histogram.sum().to(torch.float64),
        "iou": iou,
        "assignment": assignment,
    }


def per_image_miou(
    clusters: Tensor, target: Tensor, assignment: Tensor, num_classes: int, ignore_index: int | None = 255
) -> Tensor:
    """Every image's mIoU ``[B]`` under a fixed cluster→class match (the whole set's), NaN for an empty image.

    The mean runs over the classes present in the image's labels or in its matched predictions.

    Args:
        clusters: ``[B, H, W]`` predicted cluster indices.
        target: ``[B, H, W]`` true classes, ``ignore_index`` where void.
        assignment: ``[K]`` class of every cluster (−1: none), e.g. ``matched_scores(...)["assignment"]``.
        num_classes: number of classes C.
        ignore_index: label of pixels that are not counted.

    >>> per_image_miou(torch.tensor([[[0, 0, 1]], [[1, 1, 1]]]), torch.tensor([[[1, 1, 0]], [[0, 0, 1]]]),
    ...                torch.tensor([1, 0]), num_classes=2).tolist()
    [1.0, 0.3333333333333333]
    """
    num_images, num_clusters = target.shape[0], assignment.shape[0]
    if clusters.numel() and (clusters.min() < 0 or clusters.max() >= num_clusters):
        raise ValueError(f"Expected cluster indices in [0, {num_clusters}), got [{clusters.min()}, {clusters.max()}].")
    # one histogram per image: the image index becomes a leading "cluster" digit
    offset = torch.arange(num_images, device=clusters.device).view(-1, *([1] * (clusters.ndim - 1))) * num_clusters
    histograms = cluster_histogram(clusters + offset, target, num_images * num_clusters, num_classes, ignore_index)
    histograms = histograms.view(num_images, num_clusters, num_classes)  # [B, K, C]
    iou, _ = _iou_under(histograms, assignment.to(histograms.device))  # [B, C]
    return iou.nanmean(dim=-1)
