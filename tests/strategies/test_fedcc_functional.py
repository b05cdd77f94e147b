import numpy as np
import pytest
import torch

from fedlight.strategies.functional import kmeans_centroids, maximin_select

# Three tight groups far apart, pooled client by client: client k sent rows (a_k, b_k, c_k).
A = [[0.0, 0.0], [0.1, 0.0], [0.0, 0.1]]
B = [[10.0, 0.0], [10.1, 0.0], [10.0, 0.2]]
C = [[0.0, 20.0], [0.1, 20.0], [0.0, 20.3]]
POOLED = torch.tensor([row for k in range(3) for row in (A[k], B[k], C[k])], dtype=torch.float64)


def test_maximin_picks_one_row_per_group_in_a_hand_computed_order():
    # From a0: the farthest row is c2 (20.3 away); then b1, whose nearest pick a0 is 10.1 away (b0: 10, b2: 10.002).
    assert maximin_select(POOLED, 3).tolist() == [A[0], C[2], B[1]]


def test_maximin_start_row_is_the_first_pick():
    assert maximin_select(POOLED, 1, start=4).tolist() == [B[1]]
    # From b1 (row 4): c2 is farthest (√(10.1² + 20.3²)); then the a-row whose nearest pick is farthest:
    # a2, √(10.1² + 0.1²) from b1 (a0: 10.1, a1: 10.0).
    assert maximin_select(POOLED, 3, start=4).tolist() == [B[1], C[2], A[2]]


def test_maximin_returns_copies():
    points = POOLED.clone()
    selected = maximin_select(points, 2)
    selected += 100.0
    torch.testing.assert_close(points, POOLED)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_maximin_pick_maximises_the_distance_to_the_picks_before_it(seed):
    points = np.random.default_rng(seed).normal(size=(30, 5))
    selected = maximin_select(torch.from_numpy(points), 8).numpy()
    for t in range(1, len(selected)):
        # min distance of every pooled row to the first t picks, computed directly
        distances = np.linalg.norm(points[:, None, :] - selected[None, :t, :], axis=-1).min(axis=1)
        picked = np.linalg.norm(selected[t] - selected[:t], axis=-1).min()
        assert picked == pytest.approx(distances.max())


def test_kmeans_recovers_the_group_means():
    centres = sorted(kmeans_centroids(POOLED, 3).tolist())
    expected = sorted(np.mean(group, axis=0).tolist() for group in (A, B, C))
    np.testing.assert_allclose(centres, expected, atol=1e-6)


def test_kmeans_keeps_dtype_and_is_seeded():
    points = torch.randn(40, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    first, second = kmeans_centroids(points, 5, seed=3), kmeans_centroids(points, 5, seed=3)
    assert first.dtype == torch.float32 and first.shape == (5, 6)
    torch.testing.assert_close(first, second)


def test_kmeans_on_normalised_rows_groups_by_direction():
    # Two directions at different radii: by angle the groups are {x-axis rows} and {y-axis rows}.
    points = torch.tensor([[1.0, 0.0], [5.0, 0.0], [0.0, 1.0], [0.0, 7.0]])
    centres = sorted(kmeans_centroids(points, 2, normalize=True).tolist())
    np.testing.assert_allclose(centres, [[0.0, 1.0], [1.0, 0.0]], atol=1e-6)
    # On the raw rows the far point (0, 7) is a cluster of its own.
    assert [0.0, 7.0] in kmeans_centroids(points, 2).tolist()
