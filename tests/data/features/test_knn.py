import numpy as np
import pytest
import torch

from fedlight.data.features.knn import knn_indices, sample_neighbours


def test_lists_rank_by_a_direct_cosine_computation():
    features = np.random.default_rng(0).normal(size=(40, 12))
    normed = features / np.linalg.norm(features, axis=1, keepdims=True)
    cosine = normed @ normed.T
    lists = knn_indices(torch.from_numpy(features), k=6, chunk_size=7).numpy()  # chunks of 7 rows
    assert (lists[:, 0] == np.arange(40)).all()
    for i in range(40):
        others = np.argsort(-np.where(np.arange(40) == i, -np.inf, cosine[i]), kind="stable")[:5]
        assert lists[i, 1:].tolist() == others.tolist()


def test_self_stays_rank_zero_among_duplicates():
    features = torch.tensor([[1.0, 0.0], [2.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # rows 0–2 point the same way
    lists = knn_indices(features, k=3)
    assert lists[:, 0].tolist() == [0, 1, 2, 3]
    assert sorted(lists[1, 1:].tolist()) == [0, 2]


def test_partners_are_drawn_uniformly_from_ranks_one_to_num_neighbors():
    knn = torch.tensor([[0, 5, 6, 7], [1, 8, 9, 7]])
    generator = torch.Generator().manual_seed(0)
    draws = sample_neighbours(knn, torch.zeros(6000, dtype=torch.int64), num_neighbors=2, generator=generator)
    counts = torch.bincount(draws, minlength=10)
    assert counts[[0, 7]].sum() == 0  # never self, never rank 3
    assert counts[5].item() / 6000 == pytest.approx(0.5, abs=0.03)
    assert sample_neighbours(knn, torch.tensor([1, 0]), num_neighbors=1).tolist() == [8, 5]


def test_draws_follow_the_generator():
    knn = knn_indices(torch.randn(20, 4), k=5)
    index = torch.arange(20)
    first = sample_neighbours(knn, index, 3, torch.Generator().manual_seed(3))
    second = sample_neighbours(knn, index, 3, torch.Generator().manual_seed(3))
    assert torch.equal(first, second)
