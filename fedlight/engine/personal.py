"""Personal evaluation: for personalised rules, every client scored with its own model on its own held-out split.

A personalised rule (FedBN, FedPer, FedRep, Ditto) gives each client a model of its own: W^t with the client's
local entries (its BatchNorm, its head), or a personal model it keeps (Ditto's v_k). Beside the global model's
``clients/<metric>``, every evaluation then logs ``clients/personal/<metric>``: each client's held-out split
scored by its own model (``Strategy.personal_state``), with the same per-client values and spread over the
clients (``_per_client``, ``_min``, ``_p10``, ``_std``). A client that has not trained yet would start from W^t
with its slots' initial values, and is scored with that model.

A rule that sets ``personal_test`` (Local-only) also has every client's own model scored on the whole global test
set, each with a metric of its own (for unsupervised segmentation, its own Hungarian match): ``test/personal/<m>``
is the unweighted mean of the clients' scores, beside the same per-client values and spread. That mean over
clients is the definition of such a row, not an approximation of a pooled score.

Process r scores the clients r, r + world_size, …; the metric's per-client sufficient statistics are summed over
processes, so every process gets the same numbers whatever the number of processes. On the test set every process
scores every client on its share of the test batches, and the metric sums the shares.
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
TEST_PREFIX = "test/personal/"


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
        self._test_metric: Metric | None = None

    def applies(self) -> bool:
        """Whether the run's rule is personalised and its clients hold out data to score."""
        store, data = self.model.client_states, self.datamodule
        return self.strategy.personalised and store is not None and len(data.held_out_index) > 0

    def evaluate(self) -> dict[str, Any]:
        """``clients/personal/*``: the clients' own models on their held-out splits, and, for a rule that sets
        ``personal_test``, ``test/personal/*`` on the global test set (empty if not personalised)."""
        scores = self._held_out() if self.applies() else {}
        if self.tests_own_models():
            scores.update(self._test())
        return scores

    def tests_own_models(self) -> bool:
        """Whether the rule has its clients' own models scored on a separate global test set."""
        strategy = self.strategy
        personal = strategy.personalised and strategy.personal_test and self.model.client_states is not None
        return personal and self.datamodule.test is not None

    def _own_model(self, client: int) -> None:
        """Loads client ``client``'s own model into the resident module, in eval mode."""
        model, store = self.model, self.model.client_states
        own = store.values(client, model.global_state)
        model.load(self.strategy.personal_state(self.context, client, own, store.load_into(own, model.global_state)))
        model.module.eval()

    @torch.no_grad()
    def _held_out(self) -> dict[str, Any]:
        model, data, precision = self.model, self.datamodule, self.precision
        module, fabric = model.module, self.fabric
        if self._metric is None:
            self._metric = module.evaluation_metric(data.num_eval_groups).to(fabric.device)
        metric = self._metric
        metric.reset()
        for client in range(fabric.global_rank, min(data.num_eval_groups, data.num_clients), fabric.world_size):
            self._own_model(client)
            for batch_idx, (x, y) in enumerate(data.client_batches(client, "held_out")):
                group = torch.full((len(y),), client, dtype=torch.int64, device=y.device)
                with precision.forward_context():
                    metric.update(**module.validation_step(precision.convert_input((x, y, group)), batch_idx))
        model.load()  # W^t again, for whatever reads the resident module next
        computed = merged(metric)
        result = {**scalar_metrics(computed), **client_spread(computed)}
        return {f"{PREFIX}{key}": value for key, value in result.items()}

    @torch.no_grad()
    def _test(self) -> dict[str, Any]:
        """``test/personal/*``: every client's own model on the global test set, scored alone, and the mean over
        the clients of each scalar metric."""
        data, precision, fabric, module = self.datamodule, self.precision, self.fabric, self.model.module
        if self._test_metric is None:
            self._test_metric = module.evaluation_metric(1).to(fabric.device)
        metric = self._test_metric
        per_client: dict[str, list[float]] = {}
        for client in range(data.num_clients):
            self._own_model(client)
            metric.reset()
            for batch_idx, batch in enumerate(data.test_batches()):
                if batch_idx % fabric.world_size == fabric.global_rank:
                    with precision.forward_context():
                        metric.update(**module.validation_step(precision.convert_input(batch), batch_idx))
            for key, value in scalar_metrics(merged(metric)).items():
                per_client.setdefault(key, []).append(value)
        self.model.load()  # W^t again
        values = {key: torch.tensor(scores, dtype=torch.float64) for key, scores in per_client.items()}
        result = {key: v.mean().item() for key, v in values.items()}  # (1/K) Σ_k s_k
        result.update(client_spread({f"group_{key}": v for key, v in values.items()}))
        return {f"{TEST_PREFIX}{key}": value for key, value in result.items()}
