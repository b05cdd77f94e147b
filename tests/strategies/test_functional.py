import numpy as np
import pytest
import torch
from scipy import stats

from fedlight.strategies.functional import sample_clients, straggler_plan, weighted_average


def test_weighted_average_matches_hand_computation():
    states = torch.tensor([[1.0, 0.0, -2.0], [3.0, 4.0, 2.0], [0.0, 8.0, 6.0]])
    # weights 1, 2, 5 → (1·s0 + 2·s1 + 5·s2) / 8
    expected = torch.tensor([(1 + 6 + 0) / 8, (0 + 8 + 40) / 8, (-2 + 4 + 30) / 8])
    torch.testing.assert_close(weighted_average(states, [1.0, 2.0, 5.0]), expected)


def test_weighted_average_is_invariant_to_client_order_and_weight_scale():
    states, weights = torch.randn(5, 7), torch.rand(5) + 0.1
    perm = torch.randperm(5)
    torch.testing.assert_close(weighted_average(states, weights), weighted_average(states[perm], 3 * weights[perm]))


def test_proportional_sampling_frequencies_follow_sample_counts():
    # One client per draw: the first draw of sampling without replacement is exactly ∝ n_k.
    sizes = np.array([10, 20, 30, 40])
    rng = np.random.default_rng(0)
    draws = np.concatenate([sample_clients(sizes, 1, rng) for _ in range(4000)])
    observed = np.bincount(draws, minlength=4)
    expected = 4000 * sizes / sizes.sum()
    assert stats.chisquare(observed, expected).pvalue > 0.01


def test_uniform_sampling_ignores_sample_counts():
    sizes = np.array([1, 1, 1, 1000])
    rng = np.random.default_rng(1)
    draws = np.concatenate([sample_clients(sizes, 1, rng, proportional=False) for _ in range(4000)])
    assert stats.chisquare(np.bincount(draws, minlength=4), np.full(4, 1000.0)).pvalue > 0.01


def test_sampling_without_replacement_returns_distinct_sorted_clients():
    drawn = sample_clients(np.arange(1, 31), 10, np.random.default_rng(2))
    assert len(set(drawn.tolist())) == 10 and (np.diff(drawn) > 0).all()


@pytest.mark.parametrize(
    ("k", "fraction", "stragglers"), [(10, 0.0, 0), (10, 0.5, 5), (10, 0.8, 8), (10, 1.0, 10), (3, 0.5, 1)]
)
def test_straggler_count_follows_fedprox_rounding(k, fraction, stragglers):
    # FedProx keeps round(k·(1 − δ)) clients active; the rest are stragglers.
    mask, _ = straggler_plan(k, fraction, 20, np.random.default_rng(0))
    assert mask.sum() == stragglers == k - round(k * (1 - fraction))


def test_straggler_epochs_are_uniform_on_one_to_f_minus_one():
    rng = np.random.default_rng(3)
    partial = np.concatenate([epochs[mask] for mask, epochs in (straggler_plan(10, 0.8, 5, rng) for _ in range(2000))])
    assert partial.min() == 1 and partial.max() == 4  # never 0 (decision D4), never F
    assert stats.chisquare(np.bincount(partial, minlength=5)[1:]).pvalue > 0.01
    full = np.concatenate([epochs[~mask] for mask, epochs in (straggler_plan(10, 0.5, 5, rng) for _ in range(50))])
    assert (full == 5).all()


def test_single_epoch_stragglers_run_that_epoch():
    mask, epochs = straggler_plan(10, 0.5, 1, np.random.default_rng(0))
    assert mask.sum() == 5 and (epochs == 1).all()
