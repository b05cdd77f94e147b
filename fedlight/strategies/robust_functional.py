"""Byzantine-robust aggregators: pure functions of the round's ``[K, P]`` client states.

Every aggregator here is translation-equivariant (distances and order statistics do not change when the
same vector is added to every row), so it gives the same W^{t+1} whether it is fed the states θ_k or the
updates Δ_k = θ_k − W^t with W^t added back.

- coordinate-wise median and β-trimmed mean: Yin, Chen, Ramchandran & Bartlett, *Byzantine-Robust
  Distributed Learning: Towards Optimal Statistical Rates*, ICML 2018 (Eqs. 3 and 4);
- Krum and Multi-Krum: Blanchard, El Mhamdi, Guerraoui & Stainer, *Machine Learning with Adversaries:
  Byzantine Tolerant Gradient Descent*, NeurIPS 2017 (Sec. 4);
- Bulyan: El Mhamdi, Guerraoui & Rouault, *The Hidden Vulnerability of Distributed Learning in
  Byzantium*, ICML 2018 (Sec. 4).

Distances are taken in fp64, exactly (no ``‖a‖² + ‖b‖² − 2ab`` expansion). Equal Krum scores are broken by
the states themselves: the state first in lexicographic order of its values wins (:func:`content_first`), so a
selection, and the aggregate, do not depend on the order in which the clients arrive. Krum and Bulyan are split
into a selection from the ``[K, K]`` distances and a combination of the selected rows, so that both can run over
column blocks of the states (squared distances add up over blocks; the combinations are coordinate-wise).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

#: Chooses one row among tied candidates (``[t]`` row indices, t ≥ 2) and returns its index.
TieBreak = Callable[[torch.Tensor], int]


def row_sum(rows: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``[P]``: Σ_k w_k · rows[k] of ``[K, P]`` rows (w_k = 1 without ``weights``), added one row after another.

    torch's reductions choose their summation order by the tensor's shape, so a column summed alone or among
    others could differ in its last bit; adding whole rows makes every coordinate's sum the same whatever the
    number of columns, and aggregating states in column blocks then gives the same bits as in one block.

    >>> row_sum(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([0.5, 2.0])).tolist()
    [6.5, 9.0]
    """
    total = torch.zeros_like(rows[0])
    for k, row in enumerate(rows):
        total += row if weights is None else weights[k] * row
    return total


def coordinate_median(states: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise median (Yin et al. 2018, Eq. 3); with an even K, the mean of the two middle values.

    Args:
        states: ``[K, P]`` client states.

    >>> coordinate_median(torch.tensor([[1.0, 10.0], [2.0, -4.0], [9.0, 0.0], [4.0, 1.0]])).tolist()
    [3.0, 0.5]
    """
    k = states.shape[0]
    assert k >= 1, "the median of no state"
    ordered = states.sort(dim=0).values
    return 0.5 * (ordered[(k - 1) // 2] + ordered[k // 2])


def trimmed_mean(states: torch.Tensor, beta: float) -> torch.Tensor:
    """The coordinate-wise β-trimmed mean (Yin et al. 2018, Eq. 4).

    In every coordinate, the ⌊βK⌋ largest and the ⌊βK⌋ smallest values are dropped and the remaining
    K − 2⌊βK⌋ averaged. β = 0 is the plain mean.

    Args:
        states: ``[K, P]`` client states.
        beta: β ∈ [0, 1/2), the fraction trimmed from each end.

    >>> trimmed_mean(torch.tensor([[1.0, 10.0], [2.0, -4.0], [9.0, 0.0], [4.0, 1.0]]), 0.25).tolist()
    [3.0, 0.5]
    """
    assert 0.0 <= beta < 0.5, f"trimmed mean needs β in [0, 1/2), got {beta}"
    k = states.shape[0]
    trim = int(beta * k)
    ordered = states.sort(dim=0).values
    return row_sum(ordered[trim : k - trim]) / (k - 2 * trim)


def squared_distances(states: torch.Tensor) -> torch.Tensor:
    """``[K, K]`` fp64 squared Euclidean distances between rows.

    >>> squared_distances(torch.tensor([[0.0, 0.0], [3.0, 4.0]])).tolist()
    [[0.0, 25.0], [25.0, 0.0]]
    """
    rows = states.double()
    # one row at a time: [K, P] of memory, and exact differences rather than ‖a‖² + ‖b‖² − 2ab
    return torch.stack([(rows - row).square().sum(dim=1) for row in rows])


def krum_scores(distances: torch.Tensor, f: int) -> torch.Tensor:
    """Krum's scores (Blanchard et al. 2017): s(i) = Σ_{j ∈ N_i} ‖V_i − V_j‖², N_i the K − f − 2 nearest others.

    Never fewer than one neighbour (as Flower's Krum): over none every score would be 0, and the choice among
    equal zeros would say nothing about the states. That happens in Bulyan's last picks, where fewer than f + 3
    states remain.

    Args:
        distances: ``[K, K]`` squared distances (:func:`squared_distances`).
        f: the number of Byzantine clients tolerated; max(1, K − f − 2) neighbours are summed (0 when K = 1).

    Returns:
        ``[K]`` fp64 scores; lower means more central.

    Points 0, 1, 2, 10 on a line with f = 1 (one neighbour each): 1, 1, 1, 64; with f = 2 still one each.

    >>> points = torch.tensor([[0.0], [1.0], [2.0], [10.0]])
    >>> krum_scores(squared_distances(points), f=1).tolist(), krum_scores(squared_distances(points), f=2).tolist()
    ([1.0, 1.0, 1.0, 64.0], [1.0, 1.0, 1.0, 64.0])
    """
    k = distances.shape[0]
    assert k >= 1, "Krum scores of no state"
    neighbours = min(max(1, k - f - 2), k - 1)
    others = distances.masked_fill(torch.eye(k, dtype=torch.bool, device=distances.device), float("inf"))
    return others.sort(dim=1).values[:, :neighbours].sum(dim=1)


def content_first(blocks: Iterable[torch.Tensor]) -> int:
    """The position of the row first in lexicographic order of its values, the rows given as ``[t, c]`` column
    blocks from left to right (the first of identical rows).

    Only the columns up to the first that tells the rows apart are compared, so rows that differ in their first
    value cost one column.

    >>> content_first([torch.tensor([[2.0, 1.0], [1.0, 9.0], [1.0, 3.0]])])
    2
    >>> content_first([torch.tensor([[1.0], [1.0]]), torch.tensor([[5.0], [4.0]])])  # told apart in the 2nd block
    1
    """
    alive = None
    for block in blocks:
        alive = torch.arange(block.shape[0]) if alive is None else alive
        rows, start = block[alive.to(block.device)], 0
        while len(alive) > 1:
            differs = (rows[:, start:] != rows[:1, start:]).any(dim=0)  # [c − start]
            if not bool(differs.any()):
                break
            column = start + int(differs.nonzero()[0])
            smallest = (rows[:, column] == rows[:, column].min()).cpu()
            alive, rows, start = alive[smallest], rows[smallest.to(rows.device)], column + 1
        if len(alive) == 1:
            break
    assert alive is not None, "content_first of no row"
    return int(alive[0])


def rows_in_content_order(states: torch.Tensor) -> TieBreak:
    """A tie-break for :func:`multi_krum_select` and :func:`bulyan_select`: among tied rows of ``[K, P]``
    ``states``, the one first in lexicographic order of its values (:func:`content_first`)."""
    return lambda rows: int(rows[content_first([states[rows.to(states.device)]])])


def ranked(scores: torch.Tensor, tie_break: TieBreak | None = None) -> torch.Tensor:
    """``[K]`` row indices by increasing score; equal scores in the order ``tie_break`` picks them (repeatedly,
    among the rows of the tie not yet placed), or lowest row first without one.

    >>> ranked(torch.tensor([3.0, 1.0, 1.0, 0.0]), tie_break=lambda rows: int(rows.max())).tolist()
    [3, 2, 1, 0]
    """
    order = scores.argsort(stable=True)
    if tie_break is None:
        return order
    ordered, values, start = [], scores[order], 0
    while start < len(order):
        stop = start + int((values[start:] == values[start]).sum())  # the run of equal scores from start
        tied = order[start:stop]
        while len(tied) > 1:
            first = tie_break(tied)
            ordered.append(first)
            tied = tied[tied != first]
        ordered += tied.tolist()
        start = stop
    return torch.tensor(ordered, device=scores.device)


def multi_krum_select(distances: torch.Tensor, f: int, m: int = 1, tie_break: TieBreak | None = None) -> torch.Tensor:
    """The ``m`` rows with the lowest Krum scores, lowest first, from ``[K, K]`` distances; equal scores in the
    order of ``tie_break`` (:func:`rows_in_content_order`), the lower row first without one.

    >>> multi_krum_select(squared_distances(torch.tensor([[0.0], [1.0], [2.0], [3.0], [10.0]])), f=1, m=3)
    tensor([1, 2, 0])
    """
    k = distances.shape[0]
    assert k > 2 * f + 2, f"Krum needs K > 2f + 2, got K = {k}, f = {f}"
    assert 1 <= m <= k, f"Multi-Krum averages 1 ≤ m ≤ K states, got m = {m}, K = {k}"
    return ranked(krum_scores(distances, f), tie_break)[:m]


def admissible_f(k: int, f: int, aggregator: str) -> int | None:
    """The largest f' ≤ ``f`` that ``k`` states admit: Krum and Multi-Krum need K > 2f' + 2 (Blanchard et al.
    2017), Bulyan K ≥ 4f' + 3 (El Mhamdi et al. 2018); ``None`` when not even f' = 0 is admitted (K < 3).

    >>> admissible_f(7, 1, "bulyan"), admissible_f(6, 1, "bulyan"), admissible_f(5, 2, "krum")
    (1, 0, 1)
    >>> admissible_f(2, 0, "krum") is None
    True
    """
    largest = (k - 3) // 4 if aggregator == "bulyan" else (k - 3) // 2
    return None if largest < 0 else min(f, largest)


def weighted_mean(states: torch.Tensor, weights: torch.Tensor | Sequence[float] | None = None) -> torch.Tensor:
    """``[P]``: the mean of ``[K, P]`` rows, uniform or with non-negative ``weights`` (normalised here).

    >>> weighted_mean(torch.tensor([[0.0, 4.0], [3.0, 10.0]]), [1.0, 2.0]).tolist()
    [2.0, 8.0]
    """
    if weights is None:
        return row_sum(states) / states.shape[0]
    weights = torch.as_tensor(weights, dtype=states.dtype, device=states.device)
    return row_sum(states, weights / weights.sum())


def multi_krum(
    states: torch.Tensor, f: int, m: int = 1, weights: torch.Tensor | Sequence[float] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-Krum (Blanchard et al. 2017, Sec. 4): the average of the ``m`` states with the lowest Krum scores.

    ``m = 1`` is Krum: the single most central state. Blanchard et al. average the selected states
    uniformly; with ``weights`` (e.g. n_k) they are averaged with those weights instead.

    Args:
        states: ``[K, P]`` client states, K > 2f + 2.
        f: the number of Byzantine clients tolerated.
        m: how many states to average, 1 ≤ m ≤ K.
        weights: ``[K]`` optional non-negative weights of the rows.

    Returns:
        ``([P] aggregate, [m] selected rows in order of score)``.

    Points 0, 1, 2, 3, 10 with f = 1 score 5, 2, 2, 5, 113 (two neighbours each):

    >>> points = torch.tensor([[0.0], [1.0], [2.0], [3.0], [10.0]])
    >>> multi_krum(points, f=1, m=1)
    (tensor([1.]), tensor([1]))
    >>> multi_krum(points, f=1, m=3)
    (tensor([1.]), tensor([1, 2, 0]))
    """
    selected = multi_krum_select(squared_distances(states), f, m, rows_in_content_order(states))
    chosen_weights = None if weights is None else torch.as_tensor(weights, dtype=states.dtype)[selected]
    return weighted_mean(states[selected], chosen_weights), selected


def bulyan_select(distances: torch.Tensor, f: int, tie_break: TieBreak | None = None) -> torch.Tensor:
    """Bulyan's selection (El Mhamdi et al. 2018, Sec. 4): θ = K − 2f times, the Krum winner among the rows not
    yet selected (scores recomputed on what remains, over at least one neighbour: :func:`krum_scores`). Equal
    scores go to ``tie_break``'s choice (:func:`rows_in_content_order`), the lower row without one. Returns the
    ``[θ]`` rows in order of selection.

    >>> points = torch.tensor([[0.0], [1.0], [2.0], [3.0], [4.0], [5.0], [100.0]])
    >>> sorted(bulyan_select(squared_distances(points), f=1).tolist())
    [0, 1, 2, 3, 4]
    """
    k = distances.shape[0]
    assert k >= 4 * f + 3, f"Bulyan needs K ≥ 4f + 3, got K = {k}, f = {f}"
    remaining = torch.arange(k, device=distances.device)
    selected = []
    for _ in range(k - 2 * f):
        scores = krum_scores(distances[remaining][:, remaining], f)
        best = (scores == scores.min()).nonzero().squeeze(1)  # positions in remaining of the lowest score
        pick = int(best[0]) if tie_break is None or len(best) == 1 else _position(remaining, tie_break, best)
        selected.append(int(remaining[pick]))
        remaining = torch.cat([remaining[:pick], remaining[pick + 1 :]])
    return torch.tensor(selected, device=distances.device)


def _position(remaining: torch.Tensor, tie_break: TieBreak, tied: torch.Tensor) -> int:
    """``tie_break`` among ``tied`` positions of ``remaining``, as a position of ``remaining``."""
    chosen = tie_break(remaining[tied])
    return int((remaining == chosen).nonzero()[0])


def bulyan_trimmed_mean(chosen: torch.Tensor, f: int) -> torch.Tensor:
    """Bulyan's aggregation (El Mhamdi et al. 2018, Sec. 4): in every coordinate, the mean of the β = θ − 2f values
    of the ``[θ, P]`` selected states closest to their median.

    >>> bulyan_trimmed_mean(torch.tensor([[0.0], [1.0], [2.0], [3.0], [40.0]]), f=1).tolist()
    [2.0]
    """
    beta = chosen.shape[0] - 2 * f
    median = coordinate_median(chosen)
    closest = (chosen - median).abs().argsort(dim=0, stable=True)[:beta]  # [β, P]
    return row_sum(chosen.gather(0, closest)) / beta


def bulyan(states: torch.Tensor, f: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bulyan (El Mhamdi et al. 2018, Sec. 4) over Krum.

    1. Selection: θ = K − 2f times, the Krum winner among the states not yet selected (scores recomputed
       on what remains) joins the selection set S (:func:`bulyan_select`).
    2. Aggregation: in every coordinate, the β = θ − 2f values of S closest to S's median are averaged
       (:func:`bulyan_trimmed_mean`).

    Args:
        states: ``[K, P]`` client states, K ≥ 4f + 3.
        f: the number of Byzantine clients tolerated.

    Returns:
        ``([P] aggregate, [θ] selected rows in order of selection)``.

    With f = 1 and seven states, the outlier at 100 is never selected and the two extremes of the
    remaining five are trimmed in each coordinate:

    >>> points = torch.tensor([[0.0], [1.0], [2.0], [3.0], [4.0], [5.0], [100.0]])
    >>> aggregate, selected = bulyan(points, f=1)
    >>> aggregate.tolist(), sorted(selected.tolist())
    ([2.0], [0, 1, 2, 3, 4])
    """
    selected = bulyan_select(squared_distances(states), f, rows_in_content_order(states))
    return bulyan_trimmed_mean(states[selected], f), selected
