"""Nearest-neighbour lists of a client's images, STEGO's source of positive partners.

STEGO (Hamilton et al. 2022) and FUSS (§5.2) pair every training image with one of its nearest neighbours
in the frozen backbone's feature space. The lists are computed once per client dataset: each image is
described by its backbone tokens mean-pooled over space and L2-normalised, and ranked against the
client's own images by cosine similarity. Training then draws the partner uniformly from ranks
1..``num_neighbors`` (2 in the official configurations, although the FUSS paper speaks of one neighbour).

Rank 0 is always the image itself: its similarity is set above any cosine before ranking, so that exact
duplicates cannot take its place (the official lists rank by raw similarity, which differs only then).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["knn_indices", "sample_neighbours"]


@torch.no_grad()
def knn_indices(features: Tensor, k: int = 30, chunk_size: int = 4096) -> Tensor:
    """The ``k`` most cosine-similar images of every image, itself first: ``[N, k]`` int64.

    Args:
        features: ``[N, D]`` one descriptor per image (mean-pooled backbone features); normalised here.
        k: list length, self included (30 in the official code).
        chunk_size: rows ranked at a time, bounding the memory to ``chunk_size × N`` similarities.

    >>> knn_indices(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.2]]), k=2).tolist()
    [[0, 2], [1, 2], [2, 0]]
    """
    num_images = features.shape[0]
    assert 1 <= k <= num_images, f"cannot list {k} neighbours among {num_images} images"
    normed = F.normalize(features.float(), dim=1)
    lists = []
    for start in range(0, num_images, chunk_size):
        rows = torch.arange(start, min(start + chunk_size, num_images), device=features.device)
        similarity = normed[rows] @ normed.T  # [chunk, N]
        similarity[torch.arange(len(rows)), rows] = 2.0  # above any cosine: self is rank 0
        lists.append(torch.topk(similarity, k, dim=1).indices)
    return torch.cat(lists)


def sample_neighbours(
    knn: Tensor, index: Tensor, num_neighbors: int = 2, generator: torch.Generator | None = None
) -> Tensor:
    """One partner per image of ``index`` ``[B]``, uniform over ranks 1..``num_neighbors`` of its list.

    Args:
        knn: ``[N, k]`` lists from :func:`knn_indices`, ``k > num_neighbors``.
        index: ``[B]`` dataset indices of the anchors.
        num_neighbors: how many of the nearest neighbours are candidates.
        generator: source of the draws.

    >>> sample_neighbours(torch.tensor([[0, 2, 1], [1, 2, 0], [2, 0, 1]]), torch.tensor([2, 0]), 1).tolist()
    [0, 2]
    """
    assert 1 <= num_neighbors < knn.shape[1], f"{num_neighbors} neighbours from lists of {knn.shape[1]} (self first)"
    ranks = torch.randint(1, num_neighbors + 1, index.shape, generator=generator)  # [B]
    return knn[index.long().cpu(), ranks].to(index.device)
