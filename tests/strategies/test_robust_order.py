"""Property: every robust aggregator gives the same aggregate whatever the order of the clients.

Integer-valued states make ties everywhere (equal Krum scores, equal distances to a median) and keep every sum
exact, so any difference between orders comes from how a rule breaks ties, not from rounding.
"""

import itertools

import numpy as np
import pytest
import torch

from fedlight.gather import StateChunks
from fedlight.strategies import RobustAggregation

AGGREGATORS = {
    "median": {},
    "trimmed_mean": {"beta": 0.2},
    "krum": {"f": 1},
    "multi_krum": {"f": 1},
    "multi_krum_m3": {"f": 1, "m": 3},
    "bulyan": {"f": 1},
}


def tie_heavy_states(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seven clients with small integer coordinates (many equal distances) and integer weights."""
    generator = torch.Generator().manual_seed(seed)
    states = torch.randint(0, 4, (7, 3), generator=generator).float()
    weights = torch.randint(1, 4, (7,), generator=generator).double()
    return states, weights


CASES = {
    # the outlier first and last: with no neighbour left to score, Bulyan's last pick used to be the lowest row
    "outlier_first": (torch.tensor([[100.0], [1.0], [2.0], [3.0], [4.0], [5.0], [6.0]]), torch.ones(7).double()),
    "evenly_spaced": (torch.arange(7.0).view(7, 1), torch.tensor([1.0, 2, 1, 2, 1, 2, 1]).double()),
    **{f"lattice_{seed}": tie_heavy_states(seed) for seed in range(4)},
}


def permutations(k: int, count: int, seed: int = 0) -> list[list[int]]:
    """The identity, its reverse, every rotation, and ``count`` permutations drawn at random."""
    rng = np.random.default_rng(seed)
    fixed = [list(range(k)), list(range(k))[::-1]] + [list(np.roll(range(k), r)) for r in range(1, k)]
    return fixed + [rng.permutation(k).tolist() for _ in range(count)]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("aggregator", list(AGGREGATORS))
@pytest.mark.parametrize("width", [None, 1])
def test_the_aggregate_does_not_depend_on_the_order_of_the_clients(case, aggregator, width):
    states, weights = CASES[case]
    kwargs = dict(AGGREGATORS[aggregator])
    rule = RobustAggregation(aggregator=aggregator.removesuffix("_m3"), **kwargs)
    reference = rule.robust_aggregate(states, weights)
    selected = sorted(states[rule._selected].tolist())  # the selected states, as a multiset
    for order in permutations(len(states), count=60):
        permuted = states[order]
        chunks = permuted if width is None else StateChunks.of(permuted, width=width)
        aggregate = rule.robust_aggregate(chunks, weights[order])
        torch.testing.assert_close(aggregate, reference, rtol=0, atol=0, msg=f"order {order}")
        assert sorted(permuted[rule._selected].tolist()) == selected, f"order {order}"


def test_every_order_of_the_outlier_case_gives_three():
    states, weights = CASES["outlier_first"]
    rule = RobustAggregation(aggregator="bulyan", f=1)
    for order in itertools.permutations(range(7)):
        assert rule.robust_aggregate(states[list(order)], weights).item() == 3.0
        assert 100.0 not in states[list(order)][rule._selected].flatten().tolist()
