"""Byzantine-robust aggregation around any rule: the rule's clients, a robust aggregate, the rule's server step.

The round's client states are gathered (``gather_states``) and combined by one of

- ``median``, ``trimmed_mean``: Yin et al., *Byzantine-Robust Distributed Learning: Towards Optimal
  Statistical Rates*, ICML 2018 (coordinate-wise median, β-trimmed mean);
- ``krum``, ``multi_krum``: Blanchard et al., *Machine Learning with Adversaries: Byzantine Tolerant
  Gradient Descent*, NeurIPS 2017 (the state with the lowest score s(i) = Σ_{K−f−2 nearest} ‖θ_i − θ_j‖²,
  or the average of the m lowest);
- ``bulyan``: El Mhamdi et al., *The Hidden Vulnerability of Distributed Learning in Byzantium*, ICML 2018
  (K − 2f Krum selections, then a coordinate-wise trimmed mean around their median),

in place of the rule's weighted average; the rule's :meth:`~Strategy.server_update` (FedAvgM's momentum,
FedAU's…) then takes the robust aggregate. Every client-side hook is the rule's, so ``RobustAggregation(rule=
FedProx(mu=0.01), aggregator="median")`` trains FedProx clients and aggregates them by their median. The maths
is in :mod:`fedlight.strategies.robust_functional`; all aggregators are translation-equivariant, so states and
updates θ_k − W^t give the same W^{t+1}.

Every aggregator works on column blocks of the gathered states (:class:`~fedlight.strategies.base.StateChunks`),
so the engine never holds more than one ``[K, c]`` block of all clients (``--trainer.gather_budget_mb``): the
median and the trimmed mean are coordinate-wise; Krum and Multi-Krum sum the ``[K, K]`` squared distances over
the blocks in a first pass, select, and average the selected rows block by block in a second; Bulyan selects
from the same distances and trims coordinate-wise in its second pass. The median and the trimmed mean give the
same bits in any number of blocks; the distances' fp64 sums depend on the blocks only in their last bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch

from fedlight.errors import ConfigError
from fedlight.strategies import robust_functional as R
from fedlight.strategies.base import ClientUpdate, StateChunks, Strategy
from fedlight.strategies.fedavg import FedAvg
from fedlight.strategies.wrapper import RuleWrapper, effective_weights

if TYPE_CHECKING:
    from fedlight.context import RunContext

Aggregator = Literal["median", "trimmed_mean", "krum", "multi_krum", "bulyan"]


class RobustAggregation(RuleWrapper):
    """A rule whose weighted average is replaced by a Byzantine-robust aggregator.

    Args:
        rule: the wrapped rule (client hooks, weights, server update, state); ``null`` is FedAvg. It must not
            gather states itself (wrap an :class:`~fedlight.strategies.Attack` around this class, not inside).
        aggregator: ``median`` or ``trimmed_mean`` (Yin et al. 2018), ``krum`` or ``multi_krum`` (Blanchard et
            al. 2017), ``bulyan`` (El Mhamdi et al. 2018).
        beta: β ∈ [0, 1/2) of ``trimmed_mean``: the fraction of values dropped at each end of every coordinate.
        f: the number of Byzantine clients per round that ``krum``, ``multi_krum`` and ``bulyan`` tolerate; they
            need K > 2f + 2 (Krum) or K ≥ 4f + 3 (Bulyan) aggregated clients.
        m: how many lowest-scoring states ``multi_krum`` averages (with the rule's weights, n_k for FedAvg);
            ``null`` is K − f.
    """

    def __init__(
        self,
        rule: Strategy | None = None,
        aggregator: Aggregator = "median",
        beta: float = 0.1,
        f: int = 1,
        m: int | None = None,
    ) -> None:
        rule = FedAvg() if rule is None else rule
        problems = []
        if rule.gather_states:
            problems.append(
                f"--strategy.init_args.rule {type(rule).__name__} gathers states itself; RobustAggregation replaces "
                "the weighted average of a rule that does not. Put an Attack around RobustAggregation, not inside."
            )
        if not 0.0 <= beta < 0.5:
            problems.append(f"Expected --strategy.init_args.beta (β) in [0, 1/2), got {beta}; 0.1 trims 10 % per end.")
        if f < 0:
            problems.append(f"Expected --strategy.init_args.f ≥ 0 Byzantine clients per round, got {f}.")
        if m is not None and m < 1:
            problems.append(f"Expected --strategy.init_args.m ≥ 1 states for Multi-Krum to average, or null, got {m}.")
        if problems:
            raise ConfigError(*problems)
        super().__init__(rule)
        self.aggregator = aggregator
        self.beta = beta
        self.f = f
        self.m = m
        self._selected: list[int] = []  # clients Krum, Multi-Krum or Bulyan selected in the last round

    @property
    def gather_states(self) -> bool:
        return True

    def aggregate_chunks(
        self, global_state: torch.Tensor, states: StateChunks, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        weights = effective_weights(self.rule, updates)
        aggregate = self.robust_aggregate(states, weights)
        self._selected = [updates[i].client for i in self._selected]
        return self.rule.server_update(global_state, aggregate.to(global_state), updates)

    def robust_aggregate(self, states: StateChunks | torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The aggregator over the ``[K, P]`` states (in memory or in blocks); rows it selects are left in
        ``_selected`` (as row indices)."""
        states = StateChunks.of(states) if isinstance(states, torch.Tensor) else states
        k, f = states.num_clients, self.f
        self._selected = []
        if self.aggregator == "median":
            return states.apply(R.coordinate_median)
        if self.aggregator == "trimmed_mean":
            return states.apply(lambda block: R.trimmed_mean(block, self.beta))
        if self.aggregator == "bulyan":
            if k < 4 * f + 3:
                raise ConfigError(
                    f"Bulyan with --strategy.init_args.f={f} needs at least 4f + 3 = {4 * f + 3} aggregated clients, "
                    f"got {k}. Raise --trainer.clients_per_round or lower f."
                )
            selected = R.bulyan_select(squared_distances(states), f, rows_in_content_order(states))
            aggregate = states.rows(selected).apply(lambda chosen: R.bulyan_trimmed_mean(chosen, f))
        else:
            if k <= 2 * f + 2:
                raise ConfigError(
                    f"Krum with --strategy.init_args.f={f} needs more than 2f + 2 = {2 * f + 2} aggregated clients, "
                    f"got {k}. Raise --trainer.clients_per_round or lower f."
                )
            m = 1 if self.aggregator == "krum" else min(self.m or k - f, k)
            selected = R.multi_krum_select(squared_distances(states), f, m, rows_in_content_order(states))
            chosen_weights = weights[selected.cpu()]
            aggregate = states.rows(selected).apply(
                lambda chosen: R.weighted_mean(chosen, chosen_weights.to(chosen.dtype))
            )
        self._selected = selected.tolist()
        return aggregate

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """The rule's metrics, and for selecting aggregators the selected clients (count and histogram)."""
        metrics = dict(self.rule.on_round_end(context, round_idx, updates))
        if self._selected:
            metrics["robust/clients_selected"] = float(len(self._selected))
        if len(self._selected) > 1:  # a W&B histogram; a single id would be logged as a scalar
            metrics["robust/selected"] = torch.tensor(self._selected)
        return metrics


def rows_in_content_order(states: StateChunks) -> R.TieBreak:
    """Among tied rows, the state first in lexicographic order of its values, read block by block and only as far
    as the first column that tells the tied states apart (:func:`~robust_functional.content_first`)."""
    return lambda rows: int(rows[R.content_first(block for _, block in states.rows(rows))])


def squared_distances(states: StateChunks) -> torch.Tensor:
    """``[K, K]`` fp64 squared distances between the states: the sum of every block's (one pass over the blocks)."""
    total = torch.zeros(states.num_clients, states.num_clients, dtype=torch.float64)
    for _, block in states:
        total = total.to(block.device) + R.squared_distances(block)
    return total
