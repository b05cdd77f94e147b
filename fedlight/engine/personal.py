"""Personal evaluation: for personalised rules, every client scored with its own model on its own held-out split.

A personalised rule (FedBN, FedPer, FedRep, Ditto) gives each client a model of its own: W^t with the client's
local entries (its BatchNorm, its head), or a personal model it keeps (Ditto's v_k). Beside the global model's
``clients/<metric>``, every evaluation then logs ``clients/personal/<metric>``: each client's held-out split
scored by its own model (``Strategy.personal_state``), with the same per-client values and spread over the
clients (``_per_client``, ``_min``, ``_p10``, ``_std``). A client that has not trained yet would start from W^t
with its slots' initial values, and is scored with that model.

Process r scores the clients r, r + world_size, …; the metric's per-client sufficient statistics are summed over
processes, so every process gets the same numbers whatever the number of processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torchmetrics import Metric

from fedlight.engine.evaluation import merged
from fedlight.engine.loggers import client_spread
from fedlight.metrics.scalars import scalar_metrics

if TYPE_CHECKING:
    from lightning.fabric import Fabric

    from fedlight.context import RunContext
    from fedlight.data.datamodule import FederatedDataModule
    from fedlight.engine.model import GlobalModel
    from fedlight.strategies.base import Strategy

PREFIX = "clients/personal/"


class PersonalEvaluator:
    """Scores every client's own model on its held-out split.

    Args:
        model: the resident module, W^t and the clients' own states.
        datamodule: the held-out splits.
        strategy: the rule, which says what a client's own model is.
        context: what the rule's ``personal_state`` receives.
        fabric: precision, the processes and their all-reduce.
    """

    def __init__(
        self,
        model: GlobalModel,
        datamodule: FederatedDataModule,
        strategy: Strategy,
        context: RunContext,
        fabric: Fabric,
    ) -> None:
        self.model, self.datamodule, self.strategy = model, datamodule, strategy
        self.context, self.fabric = context, fabric
        self.precision = fabric.strategy.precision
        self._metric: Metric | None = None

    def applies(self) -> bool:
        """Whether the run's rule is personalised and its clients hold out data to score."""
        store, data = self.model.client_states, self.datamodule
        return self.strategy.personalised and store is not None and len(data.held_out_index) > 0

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """``clients/personal/*``: the clients' own models on their held-out splits (empty if not personalised)."""
        if not self.applies():
            return {}
        model, data, store, precision = self.model, self.datamodule, self.model.client_states, self.precision
        module, fabric = model.module, self.fabric
        if self._metric is None:
            self._metric = module.evaluation_metric(data.num_eval_groups).to(fabric.device)
        metric = self._metric
        metric.reset()
        global_state = model.global_state
        for client in range(fabric.global_rank, min(data.num_eval_groups, data.num_clients), fabric.world_size):
            own = store.values(client, global_state)
            state = self.strategy.personal_state(self.context, client, own, store.load_into(own, global_state))
            model.load(state).eval()
            for batch_idx, (x, y) in enumerate(data.client_batches(client, "held_out")):
                group = torch.full((len(y),), client, dtype=torch.int64, device=y.device)
                with precision.forward_context():
                    metric.update(**module.validation_step(precision.convert_input((x, y, group)), batch_idx))
        model.load()  # W^t again, for whatever reads the resident module next
        computed = merged(metric)
        result = {**scalar_metrics(computed), **client_spread(computed)}
        return {f"{PREFIX}{key}": value for key, value in result.items()}
