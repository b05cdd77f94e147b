"""STEGO's segmentation head, centroids and correspondence-distillation loss: the local objective of FUSS.

FUSS (*Federated Unsupervised Semantic Segmentation*) trains on every client what STEGO (Hamilton et al.,
*Unsupervised Semantic Segmentation by Distilling Feature Correspondences*, ICLR 2022) trains centrally:
a small head on a frozen backbone (FUSS Eq. 7) and a centroid matrix M (Eq. 5). This module holds those
pieces, independent of how rounds are run:

- :class:`StegoHead`: code = L(drop(f)) + N(drop(f)), a linear 1×1 convolution plus a two-layer 1×1 MLP,
  each branch behind its own ``Dropout2d``. In the official code the branches are ``cluster1`` and
  ``cluster2``; FUSS's FedProx and MOON variants use only the non-linear branch N.
- :class:`ClusterLookup`: M with cosine similarities to the codes and the centroid loss. Eq. 5 of the FUSS
  paper adds an inter-centroid separation term with a trade-off λ; the official code has none, so the
  default is the code's compactness-only loss and the separation is an option (``separation_weight``).
  The loss reads detached codes: it moves only M, never the head.
- :func:`correspondence_loss`: FUSS Eqs. 8–10, in STEGO's form with three pairings (the image with
  itself, with a k-nearest neighbour, with random other images of the batch). The feature correlation F
  is "pointwise"-centred as in the official configurations: for every location of the anchor, the mean
  of F over the paired image's sampled locations is removed and the mean of all of F added back. A pair
  then counts as similar (F > b) when it is more similar than that anchor location is to the paired
  image on average, while the level that b is compared with stays the batch's overall one.

The centroid loss takes whatever codes it is given: the official code gives it the anchors' codes only,
where the paper speaks of the query and support images together.

Negatives come from ``super_perm``: a random permutation of the batch whose fixed points are moved one
place on (mod B). That removes self-pairs but may pair two anchors with one image; a uniform derangement
(a true permutation without fixed points) is offered as an option. Both presets below are the official
configurations' hyper-parameters at full precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlight.errors import ConfigError

__all__ = [
    "STEGO_PRESETS",
    "ClusterLookup",
    "CorrespondenceWeights",
    "StegoHead",
    "correspondence_loss",
    "correspondence_term",
    "feature_correlation",
    "sample_at",
    "sample_coordinates",
    "super_perm",
]


@dataclass(frozen=True)
class CorrespondenceWeights:
    """Weights λ and shifts b of the three pairings of the correspondence loss (FUSS Eq. 10, STEGO's full loss).

    Attributes:
        lambda_self: λ_self, the image with itself (``pos_intra_weight``).
        lambda_knn: λ_knn, the image with a nearest neighbour (``pos_inter_weight``).
        lambda_rand: λ_rand, the image with random images of the batch (``neg_inter_weight``).
        b_self: b_self (``pos_intra_shift``).
        b_knn: b_knn (``pos_inter_shift``).
        b_rand: b_rand (``neg_inter_shift``).
    """

    lambda_self: float
    lambda_knn: float
    lambda_rand: float
    b_self: float
    b_knn: float
    b_rand: float


STEGO_PRESETS: dict[str, CorrespondenceWeights] = {
    "cityscapes": CorrespondenceWeights(
        lambda_self=1.0,
        lambda_knn=0.577453483136995,
        lambda_rand=0.9058762625226623,
        b_self=0.45828472207,
        b_knn=0.1754346515479633,
        b_rand=0.31361241889448443,
    ),
    "cocostuff": CorrespondenceWeights(
        lambda_self=0.1, lambda_knn=1.0, lambda_rand=0.1538476246415498, b_self=0.12, b_knn=0.2, b_rand=1.0
    ),
}


class StegoHead(nn.Module):
    """Projects backbone features ``[B, C_f, h, w]`` to codes ``[B, D, h, w]`` (FUSS Eq. 7).

    Args:
        in_channels: C_f, the backbone's feature width (768 for DINO ViT-B/8).
        dim: D, the code width (70 in FUSS and STEGO).
        dropout: probability of ``Dropout2d`` in front of each branch.
    """

    def __init__(self, in_channels: int = 768, dim: int = 70, dropout: float = 0.1) -> None:
        super().__init__()
        self.linear = nn.Conv2d(in_channels, dim, kernel_size=1)  # L
        self.nonlinear = nn.Sequential(  # N
            nn.Conv2d(in_channels, in_channels, kernel_size=1),
            nn.ReLU(),
            nn.Conv2d(in_channels, dim, kernel_size=1),
        )
        self.linear_dropout = nn.Dropout2d(dropout)
        self.nonlinear_dropout = nn.Dropout2d(dropout)

    def forward(self, features: Tensor) -> Tensor:
        return self.linear(self.linear_dropout(features)) + self.nonlinear(self.nonlinear_dropout(features))


class ClusterLookup(nn.Module):
    """The centroid matrix M ``[n, D]`` and its loss (FUSS Eqs. 3–5), initialised from a standard normal.

    Args:
        num_clusters: n, the number of centroids (27 for Cityscapes and CocoStuff).
        dim: D, the code width.
        separation_weight: λ of Eq. 5's separation term, which we read as the mean cosine similarity of
            distinct centroids; 0 (the official code) leaves it out.
    """

    def __init__(self, num_clusters: int, dim: int, separation_weight: float = 0.0) -> None:
        super().__init__()
        if separation_weight != 0 and num_clusters < 2:
            raise ConfigError(
                f"--model.init_args.separation_weight={separation_weight} pushes distinct centroids apart, but "
                f"--model.init_args.num_clusters={num_clusters} gives fewer than two. Set num_clusters ≥ 2 "
                "(null: one per class) or separation_weight to 0."
            )
        self.clusters = nn.Parameter(torch.randn(num_clusters, dim))
        self.separation_weight = separation_weight

    def forward(self, codes: Tensor) -> Tensor:
        """Cosine similarities ``[B, n, h, w]`` of codes ``[B, D, h, w]`` to the centroids."""
        return torch.einsum("bdhw,nd->bnhw", F.normalize(codes, dim=1), F.normalize(self.clusters, dim=1))

    def loss(self, codes: Tensor) -> Tensor:
        """−mean over pixels of max_n ⟨ẑ, M̂_n⟩ (hard assignment), plus λ · mean_{n≠m} ⟨M̂_n, M̂_m⟩ if λ > 0.

        Args:
            codes: ``[B, D, h, w]``; detached here, so that only M learns from this loss.
        """
        compactness = -self(codes.detach()).max(dim=1).values.mean()
        if self.separation_weight == 0:
            return compactness
        normed = F.normalize(self.clusters, dim=1)
        n = normed.shape[0]
        off_diagonal = (normed @ normed.T).sum() - n  # Σ_{n≠m} cos, the diagonal being n ones
        return compactness + self.separation_weight * off_diagonal / (n * (n - 1))


def super_perm(size: int, generator: torch.Generator | None = None, derangement: bool = False) -> Tensor:
    """Partners ``[size]`` for the negative pairs: never an image itself when ``size ≥ 2``.

    Args:
        size: B, the batch size (≥ 2 when ``derangement``).
        generator: source of randomness.
        derangement: draw a uniform permutation without fixed points (by rejection) instead of moving the
            fixed points of a random permutation one place on, which the official code does.

    >>> super_perm(2).tolist()
    [1, 0]
    """
    device = generator.device if generator is not None else None
    if derangement:
        assert size >= 2, f"a batch of {size} image has no derangement"
        while True:
            perm = torch.randperm(size, generator=generator, device=device)
            if (perm != torch.arange(size, device=device)).all():
                return perm
    perm = torch.randperm(size, generator=generator, device=device)
    perm[perm == torch.arange(size, device=device)] += 1
    return perm % size


def sample_coordinates(
    batch_size: int, samples: int, generator: torch.Generator | None = None, device: torch.device | None = None
) -> Tensor:
    """``[B, S, S, 2]`` sampling points, uniform over [−1, 1]², as ``(x, y)`` in ``grid_sample``'s convention."""
    source = generator.device if generator is not None else device  # a CPU generator may feed a GPU batch
    return (torch.rand(batch_size, samples, samples, 2, generator=generator, device=source) * 2 - 1).to(device)


def sample_at(maps: Tensor, coords: Tensor) -> Tensor:
    """Bilinear values ``[B, C, S, S]`` of ``maps`` ``[B, C, h, w]`` at ``coords`` ``[B, S, S, 2]``.

    ±1 are the centres of the border pixels (``align_corners=True``); points off the map take the border's
    value.
    """
    grid = coords.to(maps.dtype)
    return F.grid_sample(maps, grid, mode="bilinear", padding_mode="border", align_corners=True)


def _correlation(a: Tensor, b: Tensor) -> Tensor:
    """Cosine similarities ``[B, S, S, S', S']`` of every location of ``a`` with every location of ``b``."""
    return torch.einsum("bchw,bcij->bhwij", F.normalize(a, dim=1, eps=1e-10), F.normalize(b, dim=1, eps=1e-10))


@torch.no_grad()
def feature_correlation(feats1: Tensor, feats2: Tensor, pointwise: bool = True) -> Tensor:
    """F of FUSS Eq. 8 ``[B, S, S, S', S']`` from sampled features ``[B, C, S, S]``, without gradient.

    With ``pointwise``, every anchor location's correlations are shifted so that their mean over the
    paired locations equals the mean of the whole tensor.
    """
    correlation = _correlation(feats1, feats2)
    if pointwise:
        global_mean = correlation.mean()
        correlation = correlation - correlation.mean(dim=(3, 4), keepdim=True) + global_mean
    return correlation


def correspondence_term(
    feats1: Tensor,
    feats2: Tensor,
    codes1: Tensor,
    codes2: Tensor,
    shift: float,
    pointwise: bool = True,
    zero_clamp: bool = True,
    stabilize: bool = False,
) -> Tensor:
    """One pairing of FUSS Eq. 10: mean of −clamp(Cc) · (F − b) over all pairs of sampled locations.

    Args:
        feats1: ``[B, C, S, S]`` sampled backbone features of the anchors.
        feats2: ``[B, C, S, S]`` sampled backbone features of their partners.
        codes1: ``[B, D, S, S]`` sampled codes of the anchors.
        codes2: ``[B, D, S, S]`` sampled codes of their partners.
        shift: b, subtracted from F; pairs with F < b are pushed apart.
        pointwise: centre F per anchor location (see :func:`feature_correlation`).
        zero_clamp: clamp Cc at 0 from below, so that codes already dissimilar are not pushed further.
        stabilize: also clamp Cc at 0.8 from above (off in the official configurations).
    """
    fd = feature_correlation(feats1, feats2, pointwise)  # F, Eq. 8
    cd = _correlation(codes1, codes2)  # Cc, Eq. 9
    if zero_clamp or stabilize:
        cd = cd.clamp(min=0.0 if zero_clamp else None, max=0.8 if stabilize else None)
    return -(cd * (fd - shift)).mean()


def correspondence_loss(
    feats: Tensor,
    codes: Tensor,
    feats_knn: Tensor,
    codes_knn: Tensor,
    weights: CorrespondenceWeights,
    samples: int = 11,
    num_negatives: int = 5,
    pointwise: bool = True,
    derangement: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """STEGO's loss: λ_self·L(x, x) + λ_knn·L(x, x_knn) + λ_rand · mean over negatives of L(x, x_perm).

    The anchors are sampled at S×S random points; the self pairing reuses them, while the kNN and random
    partners share a second set of points. Each random partner is the batch reordered by :func:`super_perm`.

    Args:
        feats: ``[B, C, h, w]`` frozen backbone features of the anchors.
        codes: ``[B, D, h, w]`` head outputs of the anchors.
        feats_knn: ``[B, C, h, w]`` features of one nearest neighbour of every anchor.
        codes_knn: ``[B, D, h, w]`` codes of those neighbours.
        weights: λ and b of the three pairings, e.g. ``STEGO_PRESETS["cityscapes"]``.
        samples: S, the side of the grid of sampled points (``feature_samples``, 11).
        num_negatives: random partners per anchor (``neg_samples``, 5).
        pointwise: centre F per anchor location.
        derangement: draw the random partners as derangements instead of with ``super_perm``.
        generator: source of the sampled points and partners.

    Returns:
        The weighted total and its three unweighted terms ``self``, ``knn``, ``rand``.
    """
    batch_size = feats.shape[0]
    coords1 = sample_coordinates(batch_size, samples, generator, feats.device)  # [B, S, S, 2]
    coords2 = sample_coordinates(batch_size, samples, generator, feats.device)
    f, c = sample_at(feats, coords1), sample_at(codes, coords1)  # [B, C, S, S], [B, D, S, S]
    terms = {
        "self": correspondence_term(f, f, c, c, weights.b_self, pointwise),
        "knn": correspondence_term(
            f, sample_at(feats_knn, coords2), c, sample_at(codes_knn, coords2), weights.b_knn, pointwise
        ),
    }
    negatives = []
    for _ in range(num_negatives):
        perm = super_perm(batch_size, generator, derangement).to(feats.device)
        f_neg, c_neg = sample_at(feats[perm], coords2), sample_at(codes[perm], coords2)
        negatives.append(correspondence_term(f, f_neg, c, c_neg, weights.b_rand, pointwise))
    terms["rand"] = torch.stack(negatives).mean()
    total = (
        weights.lambda_self * terms["self"] + weights.lambda_knn * terms["knn"] + weights.lambda_rand * terms["rand"]
    )
    return total, terms
