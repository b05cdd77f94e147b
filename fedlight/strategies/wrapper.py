"""A strategy that wraps another: the base of the compositions (robust aggregation, attacks, DP).

:class:`RuleWrapper` forwards every hook to the wrapped ``rule``, so a subclass overrides only the hooks its
concept changes and the rule's client-side maths (FedProx's proximal term, MOON's contrastive loss), payloads,
weights, server update and state stay the rule's. In YAML the rule is a nested ``class_path``/``init_args``::

    strategy:
      class_path: fedlight.strategies.RobustAggregation
      init_args:
        aggregator: median
        rule:
          class_path: fedlight.strategies.FedProx
          init_args: {mu: 0.01}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedlight.gather import StateChunks
from fedlight.plans import ClientPlan, ClientUpdate
from fedlight.strategies import robust_functional as R
from fedlight.strategies.base import Strategy, traceable_loss

if TYPE_CHECKING:
    from lightning import LightningModule
    from torch import nn

    from fedlight.client_state import Slot
    from fedlight.context import RunContext


def effective_weights(rule: Strategy, updates: list[ClientUpdate]) -> torch.Tensor:
    """``[K]`` fp64 weights whose normalised average is the rule's own aggregate of the clients' states.

    A rule with channels j, weights w_kj and coefficients c_j aggregates Σ_j c_j Σ_k w_kj θ_k / Σ_k w_kj, the
    average with weights ω_k = Σ_j c_j w_kj / Σ_k' w_k'j (which sum to Σ_j c_j = 1). Also records every
    update's ``weights``, as the engine's weighted-sum path does.

    Args:
        rule: the aggregation rule.
        updates: the round's aggregated updates (payloads in hand).
    """
    for update in updates:
        update.weights = tuple(float(w) for w in rule.client_weights(update))
    raw = torch.tensor([u.weights for u in updates], dtype=torch.float64)  # [K, channels]
    totals = raw.sum(dim=0)
    assert bool((totals > 0).all()), f"{type(rule).__name__} gave a channel no positive weight: {raw.tolist()}"
    coefficients = torch.tensor(rule.channel_coefficients(), dtype=torch.float64)
    return (raw / totals) @ coefficients


class RuleWrapper(Strategy):
    """Forwards every hook to ``rule``; subclasses override what they change.

    Args:
        rule: the wrapped aggregation rule; its straggler and sampling settings are the wrapper's.
    """

    def __init__(self, rule: Strategy) -> None:
        self.rule = rule  # no super().__init__: straggler and sampling settings are the rule's

    # -- settings read by the engine ------------------------------------------------------------------
    @property
    def tolerate_stragglers(self) -> bool:
        return self.rule.tolerate_stragglers

    @property
    def sampling(self) -> str:
        return self.rule.sampling

    @property
    def weight_channels(self) -> int:
        return self.rule.weight_channels

    @property
    def personalised(self) -> bool:  # type: ignore[override]
        return self.rule.personalised

    @property
    def gather_states(self) -> bool:
        return self.rule.gather_states

    @property
    def cluster_layers(self) -> Any:
        return self.rule.cluster_layers

    @property
    def reset_unsampled_clusters(self) -> bool:
        return self.rule.reset_unsampled_clusters

    @property
    def routed_splits(self) -> tuple[str, ...]:
        return self.rule.routed_splits

    # -- hooks ----------------------------------------------------------------------------------------
    def sample_clients(self, num_samples: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
        return self.rule.sample_clients(num_samples, k, rng)

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        return self.rule.check(module, datamodule)

    def check_round_size(self, sampled: int, trained: int) -> list[str]:
        return self.rule.check_round_size(sampled, trained)

    def on_fit_start(self, context: RunContext) -> None:
        self.rule.on_fit_start(context)

    def client_state_slots(self, context: RunContext) -> Mapping[str, Slot]:
        return self.rule.client_state_slots(context)

    def personal_state(
        self, context: RunContext, client: int, values: Mapping[str, torch.Tensor], start: torch.Tensor
    ) -> torch.Tensor:
        return self.rule.personal_state(context, client, values, start)

    def on_round_start(self, context: RunContext, round_idx: int, plans: list[ClientPlan]) -> None:
        self.rule.on_round_start(context, round_idx, plans)

    def initial_state(self, context: RunContext, plan: ClientPlan, global_state: torch.Tensor) -> torch.Tensor:
        return self.rule.initial_state(context, plan, global_state)

    def client_teachers(self, context: RunContext, plan: ClientPlan) -> Mapping[str, nn.Module]:
        return self.rule.client_teachers(context, plan)

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        self.rule.on_client_fit_start(context, module, plan)

    @traceable_loss
    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.rule.training_loss(module, batch, outputs)

    def loss_is_traceable(self) -> bool:
        return super().loss_is_traceable() and self.rule.loss_is_traceable()

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        self.rule.on_client_fit_end(context, module, update)

    def client_weights(self, update: ClientUpdate) -> Sequence[float]:
        return self.rule.client_weights(update)

    def channel_coefficients(self) -> Sequence[float]:
        return self.rule.channel_coefficients()

    def transform_batch(self, context: RunContext, client: int, batch: Any) -> Any:
        return self.rule.transform_batch(context, client, batch)

    def aggregate_states(
        self, global_state: torch.Tensor, states: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """:meth:`aggregate_chunks` of states in memory, in one block."""
        return self.aggregate_chunks(global_state, StateChunks.of(states), updates)

    def aggregate_chunks(
        self, global_state: torch.Tensor, states: StateChunks, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """The rule's own aggregate of gathered states: its :meth:`aggregate_chunks` if it gathers states itself,
        else its weighted average (:func:`effective_weights`, block by block) followed by its server update. A
        wrapper that gathers states for a rule that does not (an attack that reads the honest updates) ends with
        this."""
        if self.rule.gather_states:
            return self.rule.aggregate_chunks(global_state, states, updates)
        weights = effective_weights(self.rule, updates)
        aggregate = states.apply(lambda block: R.row_sum(block, weights.to(block)))  # the weights sum to Σ_j c_j = 1
        return self.rule.server_update(global_state, aggregate.to(global_state), updates)

    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        return self.rule.server_update(global_state, aggregate, updates)

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        return self.rule.on_round_end(context, round_idx, updates)

    def num_clusters(self) -> int:
        return self.rule.num_clusters()

    def client_cluster(self, client: int) -> int:
        return self.rule.client_cluster(client)

    def route(self, context: RunContext, batch: Any, split: str) -> torch.Tensor:
        return self.rule.route(context, batch, split)

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The rule's state under ``rule``; subclasses add their own keys."""
        return {"rule": self.rule.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rule.load_state_dict(state.get("rule", {}))
