"""Unbiased Gaussian MMD² against a direct double-loop NumPy computation."""

import math

import numpy as np
import pytest
import torch

from fedlight.metrics.functional import maximum_mean_discrepancy, median_heuristic


def reference_median(x: np.ndarray, y: np.ndarray) -> float:
    pooled = np.concatenate([x, y])
    distances = [math.dist(pooled[a], pooled[b]) for a in range(len(pooled)) for b in range(a + 1, len(pooled))]
    return float(np.median(distances))


def reference_mmd2(x: np.ndarray, y: np.ndarray, bandwidths: list[float]) -> float:
    """Gretton et al. (2012) Eq. 3, term by term."""

    def kernel(a, b):
        squared = float(np.sum((a - b) ** 2))
        return sum(math.exp(-squared / (2 * sigma**2)) for sigma in bandwidths)

    n, m = len(x), len(y)
    within_x = sum(kernel(x[i], x[j]) for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    within_y = sum(kernel(y[i], y[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    between = sum(kernel(x[i], y[j]) for i in range(n) for j in range(m)) / (n * m)
    return within_x + within_y - 2 * between


@pytest.fixture
def samples():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 3))
    y = rng.normal(loc=0.7, size=(9, 3))
    return x, y


def test_mmd_hand_example():
    # x = {0, 1}, y = {3, 4}, σ = 1: k_xx = k_yy = e^{-1/2}; cross distances 3, 4, 2, 3
    x, y = torch.tensor([[0.0], [1.0]]), torch.tensor([[3.0], [4.0]])
    expected = 2 * math.exp(-0.5) - 2 * (2 * math.exp(-4.5) + math.exp(-8) + math.exp(-2)) / 4
    assert maximum_mean_discrepancy(x, y, bandwidth=1.0).item() == pytest.approx(expected, rel=1e-6)


def test_median_heuristic_hand_example_and_reference(samples):
    # pooled {(0,0), (3,4), (0,4), (3,0)}: distances 3, 3, 4, 4, 5, 5 → median 4
    x, y = torch.tensor([[0.0, 0.0], [3.0, 4.0]]), torch.tensor([[0.0, 4.0], [3.0, 0.0]])
    assert median_heuristic(x, y).item() == 4.0
    x, y = samples
    assert median_heuristic(torch.tensor(x), torch.tensor(y)).item() == pytest.approx(reference_median(x, y))


@pytest.mark.parametrize("bandwidth", [0.5, 2.0, (0.5, 1.0, 3.0)])
def test_mmd_matches_double_loop_with_given_bandwidth(samples, bandwidth):
    x, y = samples
    bandwidths = [bandwidth] if isinstance(bandwidth, float) else list(bandwidth)
    result = maximum_mean_discrepancy(torch.tensor(x), torch.tensor(y), bandwidth=bandwidth)
    assert result.item() == pytest.approx(reference_mmd2(x, y, bandwidths), rel=1e-9, abs=1e-12)


def test_mmd_median_heuristic_and_multipliers_match_double_loop(samples):
    x, y = samples
    median = reference_median(x, y)
    result = maximum_mean_discrepancy(torch.tensor(x), torch.tensor(y))
    assert result.item() == pytest.approx(reference_mmd2(x, y, [median]), rel=1e-9)
    multiplied = maximum_mean_discrepancy(torch.tensor(x), torch.tensor(y), bandwidth_multipliers=(0.5, 1, 2))
    expected = reference_mmd2(x, y, [0.5 * median, median, 2 * median])
    assert multiplied.item() == pytest.approx(expected, rel=1e-9)


def test_mmd_float32_close_to_float64(samples):
    x, y = samples
    single = maximum_mean_discrepancy(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32))
    assert single.dtype == torch.float32
    assert single.item() == pytest.approx(maximum_mean_discrepancy(torch.tensor(x), torch.tensor(y)).item(), abs=1e-5)


def test_mmd_symmetric_and_permutation_invariant(samples):
    x, y = (torch.tensor(s) for s in samples)
    forward = maximum_mean_discrepancy(x, y)
    torch.testing.assert_close(maximum_mean_discrepancy(y, x), forward)
    generator = torch.Generator().manual_seed(1)
    shuffled = maximum_mean_discrepancy(
        x[torch.randperm(len(x), generator=generator)], y[torch.randperm(len(y), generator=generator)]
    )
    torch.testing.assert_close(shuffled, forward)


def test_mmd_near_zero_for_same_distribution_and_grows_with_shift():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(600, 4, generator=generator)
    same = maximum_mean_discrepancy(x, torch.randn(600, 4, generator=generator))
    small_shift = maximum_mean_discrepancy(x, torch.randn(600, 4, generator=generator) + 0.5)
    large_shift = maximum_mean_discrepancy(x, torch.randn(600, 4, generator=generator) + 2.0)
    assert abs(same.item()) < 0.01
    assert small_shift > 0.05
    assert large_shift > small_shift


def test_mmd_input_errors():
    two = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="at least 2 samples"):
        maximum_mean_discrepancy(torch.zeros(1, 3), two)
    with pytest.raises(ValueError, match="same D"):
        maximum_mean_discrepancy(torch.zeros(4, 2), two)
    with pytest.raises(ValueError, match="explicit bandwidth"):
        maximum_mean_discrepancy(torch.zeros(3, 3), two)
    with pytest.raises(ValueError, match="positive kernel bandwidths"):
        maximum_mean_discrepancy(torch.randn(3, 3), torch.randn(2, 3), bandwidth=(1.0, 0.0))
    with pytest.raises(ValueError, match="bandwidth=None"):
        maximum_mean_discrepancy(torch.randn(3, 3), torch.randn(2, 3), bandwidth=1.0, bandwidth_multipliers=(1.0,))
