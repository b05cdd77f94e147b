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

import warnings
from typing import TYPE_CHECKING, Any, Literal

import torch

from fedlight.errors import ConfigError
from fedlight.gather import StateChunks
from fedlight.plans import ClientPlan, ClientUpdate
from fedlight.strategies import robust_functional as R
from fedlight.strategies.base import Strategy
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
            need K > 2f + 2 (Krum) or K ≥ 4f + 3 (Bulyan) clients, checked at set-up against the clients that
            train each round. When the engine leaves clients out of a round (non-finite, outsized or failed), the
            remaining K' states are aggregated with the largest f' ≤ f that K' admits; the clients left out count
            among the f, so only an f' below f less their number is warned about, and with too few states even for
            f' = 0 their coordinate-wise median is taken, with a warning (``docs/robustness.md``).
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
        self._trained = 0  # clients that train in the current round: those not aggregated were left out

    @property
    def gather_states(self) -> bool:
        return True

    def check_round_size(self, sampled: int, trained: int) -> list[str]:
        """Krum's K > 2f + 2 and Bulyan's K ≥ 4f + 3 over the clients that train each round."""
        problems = self.rule.check_round_size(sampled, trained)
        needed = {"krum": 2 * self.f + 3, "multi_krum": 2 * self.f + 3, "bulyan": 4 * self.f + 3}.get(self.aggregator)
        if needed is not None and trained < needed:
            name = "Bulyan" if self.aggregator == "bulyan" else "Krum"
            bound = "4f + 3" if self.aggregator == "bulyan" else "2f + 3"
            problems.append(
                f"{name} with --strategy.init_args.f={self.f} needs at least {bound} = {needed} clients per round, but "
                f"{trained} train each round (--trainer.clients_per_round, less the stragglers the rule drops). "
                f"Raise --trainer.clients_per_round or lower f."
            )
        return problems

    def on_round_start(self, context: RunContext, round_idx: int, plans: list[ClientPlan]) -> None:
        self._trained = sum(not plan.dropped for plan in plans)
        self.rule.on_round_start(context, round_idx, plans)

    def aggregate_chunks(
        self, global_state: torch.Tensor, states: StateChunks, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        weights = effective_weights(self.rule, updates)
        left_out = max(self._trained - len(updates), 0)  # non-finite, outsized or failed: counted among f
        aggregate = self.robust_aggregate(states, weights, left_out)
        self._selected = [updates[i].client for i in self._selected]
        return self.rule.server_update(global_state, aggregate.to(global_state), updates)

    def robust_aggregate(
        self, states: StateChunks | torch.Tensor, weights: torch.Tensor, left_out: int = 0
    ) -> torch.Tensor:
        """The aggregator over the ``[K, P]`` states (in memory or in blocks); rows it selects are left in
        ``_selected`` (as row indices).

        Krum and Bulyan tolerate the largest f' ≤ f that K admits. ``left_out`` clients were removed by the engine
        before (non-finite, outsized, failed) and count among the f: a warning is given only when f' < f − left_out,
        or when not even f' = 0 is admitted and the coordinate-wise median is taken instead.
        """
        states = StateChunks.of(states) if isinstance(states, torch.Tensor) else states
        k = states.num_clients
        self._selected = []
        if self.aggregator == "median":
            return states.apply(R.coordinate_median)
        if self.aggregator == "trimmed_mean":
            return states.apply(lambda block: R.trimmed_mean(block, self.beta))
        f = R.admissible_f(k, self.f, self.aggregator)
        if f is None or f < self.f - left_out:
            name = "Bulyan" if self.aggregator == "bulyan" else "Krum"
            instead = "their coordinate-wise median" if f is None else f"f = {f}, the largest that {k} admit"
            warnings.warn(
                f"{name} with --strategy.init_args.f={self.f} cannot aggregate the {k} clients left in this round "
                f"({left_out} left out by the engine count among f); it takes {instead}.",
                stacklevel=2,
            )
        if f is None:
            return states.apply(R.coordinate_median)
        if self.aggregator == "bulyan":
            selected = R.bulyan_select(squared_distances(states), f, rows_in_content_order(states))
            aggregate = states.rows(selected).apply(lambda chosen: R.bulyan_trimmed_mean(chosen, f))
        else:
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
