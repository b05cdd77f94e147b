"""Prototype maths of MO-FedProto.

Michieli & Ozay, "Prototype Guided Federated Learning of Visual Feature Representations". The paper calls
its method FedProto; it is not Tan et al.'s FedProto (AAAI'22), so fedlight calls it MO-FedProto.

Pure tensor functions for Eqs. 4–15 and the decisions D1, D2 and D6 of docs/decisions.md:

- class prototypes and counts (Eq. 4), accumulable over batches from sums and counts, also of dense
  (per-pixel) features with label maps downsampled to their resolution (D5);
- min–max normalisation of each prototype over its channels (D1);
- the semantic prototype margin μ (Eqs. 5–7), which gives LPM (Eq. 8) and APM (Eq. 9);
- client deviations, normalised attention and the attention weights (Eqs. 11–13);
- the count-weighted aggregate prototypes with carry-over of unseen classes (Eq. 10, D2);
- the aggregate mean margin AMM, reconstructed (D6) and as written (Eq. 15).

Shapes: K clients, C classes, D feature channels. Functions on prototypes accept extra leading dimensions
where noted, so all clients of a round are processed in one call.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "aggregate_mean_margin",
    "aggregate_mean_margin_as_written",
    "aggregate_prototypes",
    "attention_weights",
    "class_feature_sums",
    "class_prototypes",
    "client_deviation",
    "dense_features_and_labels",
    "minmax_normalize",
    "prototypes_from_sums",
    "semantic_prototype_margin",
]


def dense_features_and_labels(features: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Pixels of dense features as samples, labelled by the label map downsampled by nearest neighbour (D5).

    MO-FedProto's segmentation prototypes use DeepLab-V3+ decoder features, ``[B, D, h, w]`` at a quarter of
    the input resolution, and labels "downsampled by nearest neighbour" (Supp. S3.2): feature pixel (i, j)
    takes the label of input pixel (⌊i·H/h⌋, ⌊j·W/w⌋), PyTorch's ``nearest`` rule, so void (255) stays void.

    Args:
        features: ``[B, D, h, w]`` per-pixel features.
        targets: ``[B, H, W]`` integer label maps.

    Returns:
        ``([B·h·w, D] features, [B·h·w] labels)``, pixels in (b, i, j) order.

    Example:
        >>> features = torch.arange(8.0).view(1, 2, 2, 2)  # D = 2 channels on a 2×2 grid
        >>> labels = torch.tensor([[[1, 1, 2, 2], [1, 1, 2, 2], [0, 0, 255, 255], [0, 0, 255, 255]]])
        >>> pixels, pixel_labels = dense_features_and_labels(features, labels)
        >>> pixels.tolist(), pixel_labels.tolist()
        ([[0.0, 4.0], [1.0, 5.0], [2.0, 6.0], [3.0, 7.0]], [1, 2, 0, 255])
    """
    if features.ndim != 4 or targets.ndim != 3 or targets.shape[0] != features.shape[0]:
        raise ValueError(
            f"Expected features [B, D, h, w] and targets [B, H, W], got {tuple(features.shape)} and "
            f"{tuple(targets.shape)}."
        )
    size = features.shape[-2:]
    # label values up to 255 are exact in float32; nearest picks pixel ⌊i·H/h⌋
    small = F.interpolate(targets[:, None].float(), size=size, mode="nearest")[:, 0].to(targets.dtype)  # [B, h, w]
    pixels = features.permute(0, 2, 3, 1).reshape(-1, features.shape[1])  # [B·h·w, D]
    return pixels, small.reshape(-1)


def class_feature_sums(
    features: Tensor, targets: Tensor, num_classes: int, ignore_index: int | None = None
) -> tuple[Tensor, Tensor]:
    """Per-class feature sums and counts: the sufficient statistics of the prototypes of Eq. 4.

    Σ[c] = Σ_{j : y_j = c} e_j and n[c] = |{j : y_j = c}|. Sums and counts of several batches add up, so a
    caller accumulates them over a data loader and divides once with :func:`prototypes_from_sums`.
    Dense features ``[B, D, h, w]`` with label maps ``[B, H, W]`` count every feature pixel as a sample,
    labelled as :func:`dense_features_and_labels` says (D5).

    Args:
        features: ``[N, D]`` encoder outputs, or ``[B, D, h, w]`` per-pixel features.
        targets: ``[N]`` integer class labels, or ``[B, H, W]`` label maps.
        num_classes: number of classes C.
        ignore_index: label whose samples are skipped (255 for VOC segmentation).

    Returns:
        ``([C, D] sums, [C] int64 counts)``. Sums are accumulated in at least float32.

    Raises:
        ValueError: on mismatched shapes or a label outside ``[0, num_classes)``.

    Example:
        >>> features = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
        >>> sums, counts = class_feature_sums(features, torch.tensor([0, 0, 2, 255]), 3, ignore_index=255)
        >>> sums.tolist(), counts.tolist()
        ([[4.0, 6.0], [0.0, 0.0], [5.0, 6.0]], [2, 0, 1])
    """
    if features.ndim == 4:
        features, targets = dense_features_and_labels(features, targets)
    if features.ndim != 2 or targets.shape != features.shape[:1]:
        raise ValueError(
            f"Expected features [N, D] and targets [N], got {tuple(features.shape)} and {tuple(targets.shape)}."
        )
    if targets.is_floating_point():
        raise ValueError(f"Expected integer class labels, got targets of dtype {targets.dtype}.")
    if ignore_index is not None:
        keep = targets != ignore_index
        features, targets = features[keep], targets[keep]
    targets = targets.long()
    if targets.numel() and (targets.min() < 0 or targets.max() >= num_classes):
        raise ValueError(
            f"Expected labels in [0, {num_classes}) or equal to ignore_index={ignore_index}, "
            f"got labels in [{targets.min().item()}, {targets.max().item()}]."
        )
    dtype = torch.promote_types(features.dtype, torch.float32)
    sums = features.new_zeros(num_classes, features.shape[1], dtype=dtype)  # [C, D]
    sums.index_add_(0, targets, features.to(dtype))
    counts = torch.bincount(targets, minlength=num_classes)  # [C]
    return sums, counts


def prototypes_from_sums(sums: Tensor, counts: Tensor) -> Tensor:
    """Prototypes from accumulated sums and counts (Eq. 4): p[c] = Σ[c] / n[c], and 0 where n[c] = 0.

    Args:
        sums: ``[..., C, D]`` per-class feature sums.
        counts: ``[..., C]`` per-class sample counts.

    Returns:
        ``[..., C, D]`` prototypes; absent classes are zero vectors, as the paper's initialisation p⁰ = 0.

    Example:
        >>> prototypes_from_sums(torch.tensor([[4.0, 6.0], [0.0, 0.0]]), torch.tensor([2, 0])).tolist()
        [[2.0, 3.0], [0.0, 0.0]]
    """
    return sums / counts.clamp(min=1).unsqueeze(-1).to(sums.dtype)


def class_prototypes(
    features: Tensor, targets: Tensor, num_classes: int, ignore_index: int | None = None
) -> tuple[Tensor, Tensor]:
    """Class prototypes and counts of one set of features (Eq. 4).

    p[c] = (1 / n[c]) Σ_{j : y_j = c} e_j, with n[c] the number of samples of class c and p[c] = 0 when
    n[c] = 0. For data that does not fit in one tensor, accumulate :func:`class_feature_sums` over batches.

    Args:
        features: ``[N, D]`` encoder outputs.
        targets: ``[N]`` integer class labels.
        num_classes: number of classes C.
        ignore_index: label whose samples are skipped.

    Returns:
        ``([C, D] prototypes, [C] int64 counts)``.

    Example:
        >>> features = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
        >>> prototypes, counts = class_prototypes(features, torch.tensor([0, 0, 2]), num_classes=3)
        >>> prototypes.tolist(), counts.tolist()
        ([[2.0, 3.0], [0.0, 0.0], [5.0, 6.0]], [2, 0, 1])
    """
    sums, counts = class_feature_sums(features, targets, num_classes, ignore_index)
    return prototypes_from_sums(sums, counts), counts


def minmax_normalize(prototypes: Tensor, eps: float = 1e-12) -> Tensor:
    """Min–max normalisation of each prototype over its channels (Sec. 3.1, decision D1).

    p̂[c] = (p[c] − min_d p[c]_d) / (max_d p[c]_d − min_d p[c]_d + ε). Each row then spans [0, 1]; a
    constant row, the all-zero prototype of an absent class included, maps to zeros.

    Args:
        prototypes: ``[..., C, D]`` prototypes.
        eps: ε that keeps constant rows finite.

    Returns:
        ``[..., C, D]`` normalised prototypes.

    Example:
        >>> minmax_normalize(torch.tensor([[1.0, 5.0, 3.0], [0.0, 0.0, 0.0]])).tolist()
        [[0.0, 1.0, 0.5], [0.0, 0.0, 0.0]]
    """
    low = prototypes.amin(dim=-1, keepdim=True)  # [..., C, 1]
    high = prototypes.amax(dim=-1, keepdim=True)
    return (prototypes - low) / (high - low + eps)


def _safe_ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    """numerator / denominator where the denominator is positive, else 0 (the 0/0 guard)."""
    positive = denominator > 0
    return torch.where(positive, numerator / torch.where(positive, denominator, 1.0), 0.0)


def _margin_distances(p_i: Tensor, p_j: Tensor, present: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """d⁺ (Eq. 5), d⁻ (Eq. 6) and |C′| for prototypes ``[..., C, D]`` and the ``[..., C]`` mask C′."""
    p_i, p_j = torch.broadcast_tensors(p_i, p_j)
    # [..., C, C]: d(p_i[c], p_j[c']); the exact mode keeps d⁺ = 0 for identical prototypes
    distances = torch.cdist(p_i, p_j, compute_mode="donot_use_mm_for_euclid_dist")
    d_plus = distances.diagonal(dim1=-2, dim2=-1)  # [..., C]
    num_classes = distances.shape[-1]
    not_self = ~torch.eye(num_classes, dtype=torch.bool, device=distances.device)
    negatives = present.unsqueeze(-2) & not_self  # [..., C, C]: c' ∈ C′ \ {c}
    num_present = present.sum(dim=-1, keepdim=True)  # [..., 1]: |C′|
    d_minus = torch.where(negatives, distances, 0.0).sum(dim=-1) / (num_present - 1).clamp(min=1)
    return d_plus, d_minus, num_present


def semantic_prototype_margin(p_i: Tensor, p_j: Tensor, n_i: Tensor, n_j: Tensor, use_negatives: bool = True) -> Tensor:
    """Semantic prototype margin μ(p_i[c], p_j) of every class (Definition 3.1, Eqs. 5–7).

    On C′ = {c : n_i[c] > 0 and n_j[c] > 0}, with d the Euclidean distance:

    - d⁺[c] = d(p_i[c], p_j[c])                                   (Eq. 5)
    - d⁻[c] = (1 / |C′ \\ {c}|) Σ_{c′ ∈ C′ \\ {c}} d(p_i[c], p_j[c′])   (Eq. 6)
    - μ[c] = (d⁻[c] − d⁺[c]) / (d⁻[c] + d⁺[c]) ∈ [−1, 1]             (Eq. 7)

    μ = 0 outside C′, everywhere when |C′| ≤ 1 (d⁻ is undefined, D2), and where d⁻ = d⁺ = 0 (0/0).
    LPM (Eq. 8) is μ(p̂_before, p̂_after); APM (Eq. 9) is μ(p̂_k, p̂_agg of the previous round).

    ``use_negatives=False`` is the "d⁺ only" ablation of Table 3 (row 7), for which the paper gives no
    formula. fedlight decision: keep the bounded ratio of Eq. 7 and replace the negatives' distance d⁻ by
    the prototypes' own scale r[c] = (‖p_i[c]‖ + ‖p_j[c]‖) / 2, so μ[c] = (r[c] − d⁺[c]) / (r[c] + d⁺[c]).
    It uses no other class, lies in [−1, 1] (by the triangle inequality d⁺ ≤ 2r), is 1 for identical
    prototypes and decreases monotonically in d⁺; like Eq. 7 it is invariant to a common rescaling of the
    features, so Σ_c μ feeds σ in Eq. 11 on the same scale. It is defined for |C′| = 1 (no d⁻ is needed),
    is 0 outside C′, and is 0 for r = d⁺ = 0 (two zero prototypes).

    Args:
        p_i: ``[..., C, D]`` prototypes, e.g. LPM's before-training or APM's local ones.
        p_j: ``[..., C, D]`` reference prototypes; broadcast against ``p_i`` (e.g. ``[C, D]`` aggregate
            prototypes against ``[K, C, D]`` local ones).
        n_i: ``[..., C]`` counts (or presence flags) of ``p_i``.
        n_j: ``[..., C]`` counts (or presence flags) of ``p_j``.
        use_negatives: ``True`` for Eq. 7, ``False`` for the "d⁺ only" ablation above.

    Returns:
        ``[..., C]`` margins μ.

    Example:
        >>> p_i = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
        >>> p_j = torch.tensor([[0.0, 0.0], [3.0, 0.0], [3.0, 4.0]])  # class 2 moved by 3
        >>> counts = torch.tensor([5, 5, 5])
        >>> [round(m, 4) for m in semantic_prototype_margin(p_i, p_j, counts, counts).tolist()]
        [1.0, 1.0, 0.2]
        >>> [round(m, 4) for m in semantic_prototype_margin(p_i, p_j, counts, counts, False).tolist()]
        [0.0, 1.0, 0.2]
    """
    present = (n_i > 0) & (n_j > 0)  # [..., C]: C′
    if use_negatives:
        d_plus, d_minus, num_present = _margin_distances(p_i, p_j, present)
        margin = _safe_ratio(d_minus - d_plus, d_minus + d_plus)  # Eq. 7
        defined = present & (num_present > 1)
    else:
        d_plus = torch.linalg.vector_norm(p_i - p_j, dim=-1)  # [..., C], Eq. 5
        scale = (torch.linalg.vector_norm(p_i, dim=-1) + torch.linalg.vector_norm(p_j, dim=-1)) / 2
        margin = _safe_ratio(scale - d_plus, scale + d_plus)
        defined = present
    return torch.where(defined, margin, 0.0)


def client_deviation(
    margins: Tensor, reduction: Literal["sum", "mean"] = "sum", present: Tensor | None = None
) -> Tensor:
    """Client deviations v[k] = σ(Σ_c μ[k, c]) (Eq. 11).

    Margins outside C′ are 0 (D2), so the sum over C equals the sum over C′. The sum grows with |C′|;
    ``reduction="mean"`` divides by each client's |C′| instead (D2's option), which needs ``present``.
    A client with an empty C′ gets σ(0) = 0.5.

    Args:
        margins: ``[K, C]`` (or ``[..., C]``) margins μ_loc or μ_agg.
        reduction: ``"sum"`` as written in Eq. 11, or ``"mean"`` over C′.
        present: ``[K, C]`` bool mask of each client's C′; margins outside it are ignored.

    Returns:
        ``[K]`` deviations in (0, 1).

    Raises:
        ValueError: for an unknown ``reduction`` or ``reduction="mean"`` without ``present``.

    Example:
        >>> margins = torch.tensor([[1.0, 1.0, 0.2], [0.0, 0.0, 0.0]])
        >>> [round(v, 4) for v in client_deviation(margins).tolist()]
        [0.9002, 0.5]
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"Expected reduction 'sum' or 'mean', got {reduction!r}.")
    if present is not None:
        margins = torch.where(present, margins, 0.0)
    total = margins.sum(dim=-1)  # [K]
    if reduction == "mean":
        if present is None:
            raise ValueError("reduction='mean' averages over each client's C′: pass its mask as `present`.")
        total = total / present.sum(dim=-1).clamp(min=1)
    return torch.sigmoid(total)


def attention_weights(v_loc: Tensor | None, v_agg: Tensor | None, num_samples: Tensor, first_round: bool) -> Tensor:
    """Aggregation weights a[k] of the sampled clients (Eqs. 12–13).

    a_ι[k] = v_ι[k] / Σ_j v_ι[j] (Eq. 12). a[k] = n_k / Σ_j n_j in the first round, otherwise the mean of
    the available normalised terms: (a_agg[k] + a_loc[k]) / 2 (Eq. 13), or the one given, for Table 3's
    "LPM only" and "APM only" ablations. The weights sum to 1.

    Args:
        v_loc: ``[K]`` deviations from LPM, or ``None``.
        v_agg: ``[K]`` deviations from APM, or ``None``.
        num_samples: ``[K]`` training-sample counts n_k.
        first_round: whether this is round t = 0, which uses FedAvg's weights.

    Returns:
        ``[K]`` weights a.

    Raises:
        ValueError: after the first round when neither ``v_loc`` nor ``v_agg`` is given, or on a shape
            mismatch.

    Example:
        >>> v_loc, v_agg = torch.tensor([1.0, 1.0, 2.0]), torch.tensor([3.0, 1.0, 0.0])
        >>> attention_weights(v_loc, v_agg, torch.tensor([10, 30, 60]), first_round=False).tolist()
        [0.5, 0.25, 0.25]
        >>> [round(a, 4) for a in attention_weights(None, None, torch.tensor([10, 30, 60]), True).tolist()]
        [0.1, 0.3, 0.6]
    """
    for name, value in (("v_loc", v_loc), ("v_agg", v_agg)):
        if value is not None and value.shape != num_samples.shape:
            raise ValueError(
                f"Expected {name} of shape {tuple(num_samples.shape)} like num_samples, got {tuple(value.shape)}."
            )
    if first_round:
        counts = num_samples.to(torch.promote_types(num_samples.dtype, torch.float32))
        return counts / counts.sum()
    normalised = [v / v.sum() for v in (v_agg, v_loc) if v is not None]  # Eq. 12
    if not normalised:
        raise ValueError("After the first round attention_weights needs v_loc (LPM), v_agg (APM) or both.")
    return torch.stack(normalised).mean(dim=0)  # Eq. 13


def aggregate_prototypes(
    prototypes: Tensor,
    counts: Tensor,
    previous: Tensor | None = None,
    previous_seen: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Count-weighted aggregate prototypes (Eq. 10) with carry-over of unseen classes (D2).

    p_agg[c] = Σ_k n_k[c] p_k[c] / n_agg[c], with n_agg[c] = Σ_k n_k[c]. A class that no client has this
    round (n_agg[c] = 0, where Eq. 10 is 0/0) keeps ``previous[c]`` if it was seen before, else 0.

    Args:
        prototypes: ``[K, C, D]`` (normalised) client prototypes.
        counts: ``[K, C]`` client class counts.
        previous: ``[C, D]`` aggregate prototypes of the previous round.
        previous_seen: ``[C]`` bool, the classes ``previous`` holds; given together with ``previous``.

    Returns:
        ``([C, D] aggregate prototypes, [C] total counts n_agg of this round, [C] bool seen so far)``.
        The seen mask is the presence flag of the aggregate for the next round's APM.

    Raises:
        ValueError: when only one of ``previous`` and ``previous_seen`` is given.

    Example:
        >>> prototypes = torch.tensor([[[1.0, 1.0], [2.0, 0.0]], [[3.0, 3.0], [0.0, 0.0]]])
        >>> counts = torch.tensor([[1, 0], [3, 0]])  # nobody has class 1 this round
        >>> p_agg, n_agg, seen = aggregate_prototypes(
        ...     prototypes, counts, previous=torch.tensor([[9.0, 9.0], [7.0, 8.0]]),
        ...     previous_seen=torch.tensor([True, True]))
        >>> p_agg.tolist(), n_agg.tolist(), seen.tolist()
        ([[2.5, 2.5], [7.0, 8.0]], [4, 0], [True, True])
    """
    if (previous is None) != (previous_seen is None):
        raise ValueError("Pass previous and previous_seen together: the mask says which previous rows hold.")
    dtype = torch.promote_types(prototypes.dtype, torch.float32)
    weights = counts.to(dtype)  # [K, C]
    n_agg = counts.sum(dim=0)  # [C]
    present = n_agg > 0
    weighted_sum = (weights.unsqueeze(-1) * prototypes.to(dtype)).sum(dim=0)  # [C, D]
    p_agg = weighted_sum / torch.where(present, weights.sum(dim=0), 1.0).unsqueeze(-1)
    seen = present
    if previous is not None and previous_seen is not None:
        carried = torch.where(previous_seen.unsqueeze(-1), previous.to(dtype), 0.0)
        p_agg = torch.where(present.unsqueeze(-1), p_agg, carried)
        seen = present | previous_seen
    return p_agg, n_agg, seen


def aggregate_mean_margin(p_agg: Tensor, n_agg: Tensor) -> Tensor:
    """Aggregate mean margin AMM, reconstructed as fedlight decision D6 (analysis metric, Sec. 5).

    AMM = (1 / |C′|) Σ_{c ∈ C′} (d⁻[c] − d⁺[c]) with p_i = p_j = p_agg, the *unnormalised* aggregate
    prototypes, and C′ = {c : n_agg[c] > 0}. Then d⁺ = 0 and AMM is the mean distance between the
    prototypes of two different present classes; it is 0 when |C′| ≤ 1.

    Why a reconstruction: Eq. 15 applied as written (:func:`aggregate_mean_margin_as_written`) gives the
    bounded μ of Eq. 7 with d⁺ = 0, i.e. 1 for every present class, while Table 4 reports AMM values such as
    2.38 and 8.68 that the bounded ratio cannot reach. The unbounded margin d⁻ − d⁺ on p (Eq. 15 uses p, not
    p̂) can, and it rises as the classes separate, which Sec. 5 reads AMM as measuring.

    Args:
        p_agg: ``[C, D]`` unnormalised aggregate prototypes.
        n_agg: ``[C]`` aggregate counts (or presence flags).

    Returns:
        Scalar AMM.

    Example:
        >>> p_agg = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]])  # pairwise distances 3, 4, 5
        >>> round(aggregate_mean_margin(p_agg, torch.tensor([1, 1, 1])).item(), 4)
        4.0
    """
    present = n_agg > 0  # [C]: C′
    d_plus, d_minus, num_present = _margin_distances(p_agg, p_agg, present)
    total = torch.where(present, d_minus - d_plus, 0.0).sum()
    return torch.where(num_present > 1, total / num_present.clamp(min=1), 0.0).squeeze(-1)


def aggregate_mean_margin_as_written(p_agg: Tensor, n_agg: Tensor) -> Tensor:
    """Aggregate mean margin exactly as Eq. 15 writes it; degenerate, kept to document D6.

    μ̄ = (1 / |C|) Σ_{c ∈ C} μ(p_agg[c], p_agg), with μ the bounded margin of Eq. 7 and μ = 0 outside C′ (D2).
    Comparing p_agg with itself gives d⁺ = 0, so μ = 1 for every present class when |C′| > 1 (unless two
    prototypes coincide) and μ̄ = |C′| / |C| whatever the model. Use :func:`aggregate_mean_margin` for the
    Table 4 / Fig. 3 analysis.

    Args:
        p_agg: ``[C, D]`` aggregate prototypes.
        n_agg: ``[C]`` aggregate counts (or presence flags).

    Returns:
        Scalar μ̄.

    Example:
        >>> p_agg = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
        >>> round(aggregate_mean_margin_as_written(p_agg, torch.tensor([1, 1, 1])).item(), 4)
        1.0
    """
    return semantic_prototype_margin(p_agg, p_agg, n_agg, n_agg).mean(dim=-1)
