"""Aggregate mean margin (AMM) of the global model: how far apart its class prototypes lie.

Michieli & Ozay, "Prototype Guided Federated Learning of Visual Feature Representations", Eq. 15, Table 4 and
Fig. 3 (decision D6). The paper compares optimizers by it, so it is measured here on the global
model of any strategy rather than from MO-FedProto's own payload.

After round t, with the new global model W^{t+1} in eval mode and e = E(x) its penultimate features (D5):

- p_k[c] = mean of e over client k's training samples of class c, n_k[c] their count (Eq. 4);
- p_agg[c] = Σ_k n_k[c] p_k[c] / Σ_k n_k[c] over **all** clients (Eq. 10 on unnormalised p), which is the
  pooled class mean, so it is computed from pooled feature sums and counts;
- ``analysis/amm`` = (1/|C′|) Σ_c (d⁻[c] − d⁺[c]) on p_agg, D6's reconstruction: the mean distance between
  the prototypes of two different classes;
- ``analysis/amm_as_written`` = Eq. 15 literally, the bounded margin of p_agg against itself, which is
  |C′|/|C| whatever the model; logged to document D6.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fedlight.callbacks.base import RoundCallback, features_problem
from fedlight.errors import ConfigError
from fedlight.metrics.functional.prototypes import (
    aggregate_mean_margin,
    aggregate_mean_margin_as_written,
    prototypes_from_sums,
)
from fedlight.passes import class_feature_batches

if TYPE_CHECKING:
    from fedlight.context import RunContext


class AggregateMeanMargin(RoundCallback):
    """Logs ``analysis/amm`` (D6) and ``analysis/amm_as_written`` (Eq. 15) of the global model.

    Args:
        every_n_rounds: measure after every this many rounds (and after the last one). One measurement is
            a forward pass of the global model over every client's training split.
    """

    def __init__(self, every_n_rounds: int = 1) -> None:
        if every_n_rounds < 1:
            raise ConfigError(
                f"Expected --trainer.callbacks (fedlight.callbacks.AggregateMeanMargin) init_args.every_n_rounds ≥ 1, "
                f"got {every_n_rounds}. 1 measures after every round."
            )
        self.every_n_rounds = every_n_rounds

    def check(self, module, datamodule) -> list[str]:
        return features_problem("fedlight.callbacks.AggregateMeanMargin", module)

    def on_round_end(self, context: RunContext, round_idx: int, metrics: dict[str, Any]) -> None:
        """Adds the AMM of W^{t+1} to the round's metrics when the round is due."""
        if not context.due(round_idx, self.every_n_rounds):
            return
        sums, counts = _pooled_class_sums(context)
        p_agg = prototypes_from_sums(sums, counts)  # [C, D]
        metrics["analysis/amm"] = aggregate_mean_margin(p_agg, counts).item()
        metrics["analysis/amm_as_written"] = aggregate_mean_margin_as_written(p_agg, counts).item()


@torch.no_grad()
def _pooled_class_sums(context: RunContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class feature sums ``[C, D]`` and counts ``[C]`` of the global model over every client's training data.

    Each process takes every world_size-th client and one all-reduce sums the statistics, so every rank
    returns the same numbers.
    """
    data = context.datamodule
    module = context.global_module()  # W^{t+1}, eval mode
    num_classes, num_features = data.num_classes, module.net.num_features

    def zeros() -> torch.Tensor:  # [C·D + C]: feature sums, then counts
        return torch.zeros(num_classes * (num_features + 1), dtype=torch.float64, device=context.device)

    def client_sums(client: int) -> torch.Tensor:
        packed = zeros()
        for batch_sums, batch_counts in class_feature_batches(context, module, client):
            packed += torch.cat([batch_sums.reshape(-1).double(), batch_counts.double()])
        return packed

    packed = context.sum_over_clients(client_sums, range(data.num_clients), zeros())
    return packed[: num_classes * num_features].view(num_classes, num_features), packed[-num_classes:].long()
