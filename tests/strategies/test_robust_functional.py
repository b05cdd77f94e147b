"""The robust aggregators on hand-built arrays, against values computed by hand."""

import pytest
import torch

from fedlight.strategies.robust_functional import (
    bulyan,
    coordinate_median,
    krum_scores,
    multi_krum,
    squared_distances,
    trimmed_mean,
)

# Five clients, three coordinates; client 4 is an outlier in every coordinate.
STATES = torch.tensor(
    [
        [1.0, 4.0, -1.0],
        [2.0, 0.0, -2.0],
        [3.0, 2.0, 0.0],
        [4.0, 1.0, 3.0],
        [50.0, -40.0, 90.0],
    ]
)


def test_median_by_hand():
    # sorted columns: (1 2 3 4 50), (-40 0 1 2 4), (-2 -1 0 3 90)
    assert coordinate_median(STATES).tolist() == [3.0, 1.0, 0.0]
    # an even K averages the two middle values: (1 2 3 4) → 2.5, (0 1 2 4) → 1.5, (-2 -1 0 3) → -0.5
    assert coordinate_median(STATES[:4]).tolist() == [2.5, 1.5, -0.5]


def test_trimmed_mean_by_hand():
    # β = 0.2 of K = 5: one value dropped at each end of every column
    # (2 3 4), (-40 0 1 2 4) → (0 1 2), (-2 -1 0 3 90) → (-1 0 3)
    assert trimmed_mean(STATES, 0.2).tolist() == pytest.approx([3.0, 1.0, 2.0 / 3.0])
    # β below 1/K drops nothing: the plain mean
    torch.testing.assert_close(trimmed_mean(STATES, 0.1), STATES.mean(dim=0))
    # β = 0.4 of K = 5 drops two per end: the median
    torch.testing.assert_close(trimmed_mean(STATES, 0.4), coordinate_median(STATES))


def test_krum_scores_by_hand():
    # Squared distances among the first four rows:
    #   d01 = 1 + 16 + 1 = 18, d02 = 4 + 4 + 1 = 9, d03 = 9 + 9 + 16 = 34,
    #   d12 = 1 + 4 + 4 = 9,  d13 = 4 + 1 + 25 = 30, d23 = 1 + 1 + 9 = 11;
    # row 4 is at least 47² away from all. f = 1: K − f − 2 = 2 nearest neighbours.
    distances = squared_distances(STATES)
    assert distances[0, 1].item() == 18 and distances[2, 3].item() == 11
    scores = krum_scores(distances, f=1)
    assert scores[:4].tolist() == [9 + 18, 9 + 18, 9 + 9, 11 + 30]
    assert scores[4] > 1000
    # f = 0: three neighbours each
    assert krum_scores(distances, f=0)[:4].tolist() == [9 + 18 + 34, 9 + 18 + 30, 9 + 9 + 11, 11 + 30 + 34]


def test_krum_and_multi_krum_select_by_score():
    # scores 27, 27, 18, 41, >1000: Krum picks row 2; Multi-Krum then rows 0 and 1 (tied, the lower first)
    aggregate, selected = multi_krum(STATES, f=1, m=1)
    assert selected.tolist() == [2] and aggregate.tolist() == STATES[2].tolist()
    aggregate, selected = multi_krum(STATES, f=1, m=3)
    assert selected.tolist() == [2, 0, 1]
    torch.testing.assert_close(aggregate, STATES[[0, 1, 2]].mean(dim=0))
    # weighted: rows 0, 1, 2 with weights 4, 1, 3
    aggregate, _ = multi_krum(STATES, f=1, m=3, weights=[4.0, 1.0, 3.0, 9.0, 9.0])
    torch.testing.assert_close(aggregate, (4 * STATES[0] + STATES[1] + 3 * STATES[2]) / 8)


def test_krum_refuses_too_few_clients():
    with pytest.raises(AssertionError, match="K > 2f"):
        multi_krum(STATES[:4], f=1)


def test_bulyan_with_no_byzantine_client_is_the_mean():
    aggregate, selected = bulyan(STATES, f=0)
    torch.testing.assert_close(aggregate, STATES.mean(dim=0))
    assert sorted(selected.tolist()) == [0, 1, 2, 3, 4]


def test_bulyan_ignores_outliers_and_trims_around_the_median():
    # Seven clients on the diagonal t·(1, −1) for t = 0..5, and one far away; f = 1: θ = 5 are selected
    # (the outlier never), β = 3 values around each coordinate's median are averaged: t ∈ {1, 2, 3}.
    honest = torch.tensor([[t, -t] for t in range(6)], dtype=torch.float32)
    states = torch.cat([honest, torch.tensor([[100.0, 100.0]])])
    aggregate, selected = bulyan(states, f=1)
    assert 6 not in selected.tolist() and len(selected) == 5
    # the first selection is the Krum winner: rows 2 and 3 tie with the lowest score, and row 2 comes first in
    # content order (its first coordinate is smaller)
    assert selected[0].item() == 2
    # picks by hand: 2, 3, 1, 4; then rows 0, 5, 6 remain, each scored over its one nearest neighbour: 0 and 5
    # tie at 2·5² = 50 and row 0 comes first in content order
    assert selected.tolist() == [2, 3, 1, 4, 0]
    torch.testing.assert_close(aggregate, torch.tensor([2.0, -2.0]))


def test_bulyan_refuses_too_few_clients():
    with pytest.raises(AssertionError, match="4f"):
        bulyan(STATES, f=1)


def test_bulyan_scores_every_pick_over_at_least_one_neighbour():
    # K = 7, f = 1: θ = 5 picks. The last pick is among 3 rows, where K − f − 2 = 0 neighbours would give every
    # row a score of 0; with one neighbour (as Flower takes at least one) the outlier scores 94² and is never picked.
    # Picks by hand (scores over 4, 3, 2, 1, 1 neighbours; ties to the row first in content order):
    #   3 (10, tied with 4), 4 (9), 2 (10, tied with 5), 5 (1, tied with 6), 1 (25, tied with 6);
    # the selected values 1..5 have median 3, and β = 3 values around it average to 3.
    for values in ([100.0, 1, 2, 3, 4, 5, 6], [1.0, 2, 3, 4, 5, 6, 100]):
        states = torch.tensor(values).view(7, 1)
        aggregate, selected = bulyan(states, f=1)
        assert sorted(states[selected].flatten().tolist()) == [1.0, 2.0, 3.0, 4.0, 5.0]
        assert aggregate.item() == 3.0


def test_krum_ties_go_to_the_state_first_in_content_order():
    # rows 0 and 1 are mirror images around row 2's neighbourhood: equal scores, whichever comes first
    states = torch.tensor([[4.0, 0.0], [0.0, 0.0], [2.0, 0.0], [2.0, 9.0], [2.0, -9.0]])
    for order in ([0, 1, 2, 3, 4], [1, 0, 2, 3, 4], [4, 3, 2, 1, 0]):
        _, selected = multi_krum(states[order], f=1, m=2)
        assert states[order][selected].tolist() == [[2.0, 0.0], [0.0, 0.0]]
