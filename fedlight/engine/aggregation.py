"""Aggregation: W^{t+1} from the round's streamed sums, or from the gathered client states.

Most rules are "weights from payloads, then one weighted sum": the clients' states were added into
:class:`~fedlight.bank.RoundSums` as they finished (fp64, all-reduced once), and the rule's channel
coefficients, the bank's clusters and the rule's server update turn them into W^{t+1}. Rules that need every
state (median, Krum, FedAtt) read the round's ``[K, P]`` states in blocks of columns within
``--trainer.gather_budget_mb`` (:mod:`fedlight.gather`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from fedlight.gather import ClientStates

if TYPE_CHECKING:
    from fedlight.bank import ModelBank, RoundSums
    from fedlight.plans import ClientUpdate
    from fedlight.strategies.base import Strategy


class Aggregation:
    """The round's aggregation under ``strategy``, for a process of rank ``rank``.

    Args:
        strategy: the rule (weights, server update, or a gathering aggregator).
        gather_budget: the most memory, in bytes, one gathered block of states may take.
        rank: this process.
    """

    def __init__(self, strategy: Strategy, gather_budget: int, rank: int) -> None:
        self.strategy = strategy
        self.budget = gather_budget
        self.rank = rank
        #: bytes of the largest block of gathered client states the last round read
        self.gather_peak_nbytes = 0
        self._warned_whole_states = False

    def streamed(self, bank: ModelBank, sums: RoundSums, aggregated: list[ClientUpdate]) -> torch.Tensor:
        """W^{t+1}: the rule's weighted average, cluster entries per cluster, then the server update."""
        strategy = self.strategy
        aggregate = sums.average(strategy.channel_coefficients())  # Σ_j c_j S_j / Z_j, [P]
        aggregate = bank.absorb(aggregate, sums.cluster_averages(), strategy.reset_unsampled_clusters)
        return strategy.server_update(bank.global_state, aggregate, aggregated)

    def gathered(
        self, global_state: torch.Tensor, states: ClientStates, aggregated: list[ClientUpdate]
    ) -> torch.Tensor:
        """W^{t+1} of a rule that gathers states, reading them in blocks within the budget."""
        chunks = states.chunks([u.client for u in aggregated], global_state, self.budget, self.rank)
        new_state = self.strategy.aggregate_chunks(global_state, chunks, aggregated)
        self.gather_peak_nbytes = chunks.peak_nbytes
        one_column = chunks.num_clients * global_state.element_size()  # the smallest block there is
        whole = chunks.width < chunks.numel and chunks.peak_nbytes > max(self.budget, one_column)
        if whole and not self._warned_whole_states:
            self._warned_whole_states = True
            warnings.warn(
                f"{type(self.strategy).__name__} read the round's {chunks.num_clients} client states whole "
                f"({chunks.peak_nbytes / 2**20:.0f} MiB), beyond --trainer.gather_budget_mb="
                f"{self.budget / 2**20:g}: it does not aggregate by blocks of columns.",
                stacklevel=1,
            )
        return new_state
