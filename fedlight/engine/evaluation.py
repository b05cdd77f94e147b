"""Evaluation of the global model on the clients' held-out splits and on the global test set.

Batches are spread over processes and the metric states (sufficient statistics) are summed, so every process
gets the same numbers. When the dataset has no separate test set, the global test set is the union of the
held-out splits and one pass serves both. A clustered rule that routes a split also gets ``routed/<metric>``:
every sample scored by the bank member the rule routes it to. With ``--data.test_groups`` the test set's pass also
gives each of its groups' scores (``test/<group>/<metric>``, ``test/group_mean/<metric>``; :func:`group_scores`).

With ``--trainer.eval_clients`` the clients' splits of most evaluations are those of a sample of the clients,
drawn from the run's evaluation stream of the round, so that a round's cost does not grow with the population;
every ``full_eval_every`` rounds and after the last one, every client is scored. The global test set is always
scored whole. ``fedlight validate`` and ``test`` score a checkpoint's global model without rounds (the trainer's
``_evaluate_only``).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torchmetrics import Metric

from fedlight.engine.config import EvaluationSettings
from fedlight.engine.loggers import client_spread
from fedlight.errors import error_line
from fedlight.metrics.scalars import scalar_metrics

if TYPE_CHECKING:
    from lightning.fabric import Fabric

    from fedlight.context import RunContext
    from fedlight.data.datamodule import FederatedDataModule
    from fedlight.engine.model import GlobalModel
    from fedlight.engine.streams import RandomStreams
    from fedlight.strategies.base import Strategy


class Evaluator:
    """Scores W^t (and, for routed splits, the bank's members) with the module's own evaluation metric.

    Args:
        model: the resident module and the global model.
        datamodule: the held-out splits and the test set.
        strategy: the rule, which routes samples to bank members when it keeps clusters.
        context: what the rule's ``route`` receives.
        fabric: precision, the processes and their all-reduce.
        settings: how many clients a round's evaluation samples (default: all of them, every time).
        streams: the run's random streams, whose evaluation stream draws the sample.
    """

    def __init__(
        self,
        model: GlobalModel,
        datamodule: FederatedDataModule,
        strategy: Strategy,
        context: RunContext,
        fabric: Fabric,
        settings: EvaluationSettings | None = None,
        streams: RandomStreams | None = None,
    ) -> None:
        self.model, self.datamodule, self.strategy = model, datamodule, strategy
        self.context, self.fabric = context, fabric
        self.settings, self.streams = settings or EvaluationSettings(), streams
        self.precision = fabric.strategy.precision
        self._metrics: dict[tuple[int, bool], Metric] = {}
        self._scorable: np.ndarray | None = None  # the clients that have held-out data, found once
        if self.settings.eval_clients != "all" and datamodule.test is None and fabric.global_rank == 0:
            warnings.warn(
                f"--trainer.eval_clients={self.settings.eval_clients} samples nothing: this dataset has no separate "
                "test set, so the global test set is every client's held-out split; every evaluation scores them all.",
                stacklevel=2,
            )

    def sample(self, round_idx: int, rounds: int) -> torch.Tensor | None:
        """The clients (sorted indices, on the device) whose held-out splits the evaluation after round
        ``round_idx`` scores, drawn uniformly without replacement among the clients that have held-out data from
        the round's evaluation stream; ``None`` when it scores every client."""
        data = self.datamodule
        if not self.settings.sampled(round_idx, rounds) or data.test is None:
            return None
        scorable = self._scorable_clients()
        count = self.settings.count(len(scorable))
        if count >= len(scorable):
            return None
        assert self.streams is not None, "a sampled evaluation draws from the run's streams"
        chosen = self.streams.evaluation_rng(round_idx).choice(scorable, size=count, replace=False)
        return torch.from_numpy(np.sort(chosen)).to(data.held_out_group.device)

    @torch.no_grad()
    def evaluate(self, clients: bool, test: bool, sample: torch.Tensor | None = None) -> dict[str, Any]:
        """W^t's metrics on the clients' held-out splits (``clients/*``) and/or the global test set (``test/*``).

        With ``sample`` (sorted client indices, from :meth:`sample`), ``clients/*`` are over those clients' splits
        only (``<metric>_per_client`` is NaN for the others) and ``clients/evaluated`` counts them.
        """
        data = self.datamodule
        self.model.evaluation_module()
        metrics: dict[str, Any] = {}
        shared_pass = data.test is None
        if clients and not shared_pass and len(data.held_out_index) == 0:
            clients = False  # --data.test_fraction=0: the clients keep every sample, only the test set is evaluated
        if test and shared_pass:
            sample = None  # the global test set is every held-out split: its pass scores every client too
        if clients or (test and shared_pass):
            result = self._pass(data.held_out_batches(sample), data.num_eval_groups, "clients")
            if clients:
                metrics.update({f"clients/{k}": v for k, v in result.items()})
                if self.settings.eval_clients != "all":
                    metrics["clients/evaluated"] = float(len(self._scorable_clients() if sample is None else sample))
            if test and shared_pass:
                metrics.update({f"test/{k}": v for k, v in result.items() if self._is_test_metric(k)})
        if test and not shared_pass:
            result = self._pass(data.test_batches(by_group=True), data.num_test_groups, "test")
            metrics.update({f"test/{k}": v for k, v in result.items() if self._is_test_metric(k)})
        return metrics

    def _scorable_clients(self) -> np.ndarray:
        """The clients that have held-out data (a client of one sample trains on it and holds none out)."""
        if self._scorable is None:
            groups = self.datamodule.held_out_group.cpu().numpy()
            self._scorable = np.flatnonzero(np.bincount(groups, minlength=self.datamodule.num_eval_groups))
        return self._scorable

    def _is_test_metric(self, key: str) -> bool:
        """``<metric>``, ``routed/<metric>``, ``<group>/<metric>``…: a metric the module reports on the test set."""
        return key.rpartition("/")[2] in self.model.module.test_metrics

    def _metric(self, num_groups: int, routed: bool = False) -> Metric:
        """The module's evaluation metric over ``num_groups`` groups, reset; built once and reused every round."""
        key = (num_groups, routed)
        if key not in self._metrics:  # building a torchmetrics Metric costs more than a small model's pass
            self._metrics[key] = self.model.module.evaluation_metric(num_groups).to(self.fabric.device)
        self._metrics[key].reset()
        return self._metrics[key]

    def _pass(self, batches, num_groups: int, split: Literal["clients", "test"]) -> dict[str, Any]:
        """The global model's metrics over this process's share of ``batches``, summed over processes; for the
        clients' split, also each client's values (``<metric>_per_client``, ``[G]``) and their spread.

        For a clustered rule that routes ``split``, also ``routed/<metric>``: every sample is evaluated by the
        bank member the strategy routes it to (LADD: the cluster nearest to the image's own style), one pass of
        each member over the samples routed to it, into one metric.
        """
        fabric, model, precision, strategy = self.fabric, self.model, self.precision, self.strategy
        module = model.module
        metric = self._metric(num_groups)
        routed = model.bank.num_clusters > 0 and split in strategy.routed_splits
        mine = []  # (batch index, batch, [B] bank member of each sample)
        for batch_idx, batch in enumerate(batches):
            if batch_idx % fabric.world_size != fabric.global_rank:
                continue
            try:
                with precision.forward_context():
                    metric.update(**module.validation_step(precision.convert_input(batch), batch_idx))
            except Exception as err:
                raise EvaluationFailed(self._culprit(batch, batch_idx, split, err)) from err
            if routed:
                mine.append((batch_idx, batch, strategy.route(self.context, batch, split)))
        groups = self.datamodule.test_group_names if split == "test" else ()
        computed = merged(metric)
        result = {**scalar_metrics(computed), **group_scores(computed, groups)}
        if split == "clients":
            result.update(client_spread(computed))  # per-client values and their spread over the clients
        if routed:
            routed_metric = self._metric(num_groups, routed=True)
            for cluster in range(model.bank.num_clusters):
                model.load(model.member(cluster))
                for batch_idx, batch, route in mine:
                    chosen = route == cluster
                    if bool(chosen.any()):
                        part = precision.convert_input(tuple(t[chosen] for t in batch))
                        with precision.forward_context():
                            routed_metric.update(**module.validation_step(part, batch_idx))
            model.load()
            computed = merged(routed_metric)
            routed_result = {**scalar_metrics(computed), **group_scores(computed, groups)}
            result.update({f"routed/{k}": v for k, v in routed_result.items()})
        return result

    def _culprit(self, batch: tuple, batch_idx: int, split: str, err: Exception) -> str:
        """What raised: for the clients' held-out splits, the first client of the batch whose samples raise alone."""
        what = error_line(err)
        if split != "clients":
            return f"Evaluating the global model on the global test set raised in batch {batch_idx} ({what})."
        module, precision = self.model.module, self.precision
        probe = module.evaluation_metric(self.datamodule.num_eval_groups).to(self.fabric.device)
        clients = batch[2].unique().tolist()
        for client in clients:
            part = tuple(t[batch[2] == client] for t in batch)
            try:
                with precision.forward_context():
                    probe.update(**module.validation_step(precision.convert_input(part), batch_idx))
            except Exception:
                return (
                    f"Evaluating the global model on client {client}'s held-out split raised ({what}). Check that "
                    "client's samples (labels within the dataset's classes) or the module's validation_step."
                )
        return f"Evaluating the global model on the held-out splits of clients {clients} raised ({what})."


class EvaluationFailed(RuntimeError):
    """Evaluation raised; the message names the split (and client) whose samples raised."""


def merged(metric: Metric) -> Any:
    """``metric.compute()`` over every process's states. A process that held none of the batches updated nothing
    and contributes zero sums, which is right; torchmetrics would warn that it computes before an update."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"The ``compute`` method of metric .* before the ``update``")
        return metric.compute()


def group_scores(computed: dict[str, Any], names: tuple[str, ...]) -> dict[str, float]:
    """Each group's score by name, from an evaluation metric's output over ``len(names)`` groups.

    For every per-group ``group_<m>`` (``[G]``, NaN for a group without samples): ``<name>/<m>`` for each group, and
    ``group_mean/<m>``, the metric's own ``<m>_mean``: the unweighted mean over the groups that hold samples (the
    mean of the cities' mIoU, not the mIoU of their pooled pixels). Nothing without names.

    >>> computed = {"miou": torch.tensor(0.5), "group_miou": torch.tensor([0.25, 0.75]), "miou_mean": torch.tensor(0.5)}
    >>> group_scores(computed, ("Rio", "Rome"))
    {'Rio/miou': 0.25, 'Rome/miou': 0.75, 'group_mean/miou': 0.5}
    """
    out: dict[str, float] = {}
    if not names:
        return out
    for key, values in computed.items():
        if not key.startswith("group_") or getattr(values, "ndim", 0) != 1:
            continue
        name = key.removeprefix("group_")
        assert len(values) == len(names), f"{key} holds {len(values)} values for the {len(names)} groups {names}"
        out.update({f"{group}/{name}": value for group, value in zip(names, values.tolist(), strict=True)})
        if f"{name}_mean" in computed:
            out[f"group_mean/{name}"] = float(computed[f"{name}_mean"])
    return out


def format_scores(metrics: dict[str, float]) -> str:
    """One ``key  value`` line per metric, the keys aligned.

    >>> print(format_scores({"test/acc": 0.8125, "test/loss": 0.5}))
    test/acc   0.8125
    test/loss  0.5
    """
    width = max(map(len, metrics), default=0)
    return "\n".join(f"{key:<{width}}  {value:.6g}" for key, value in metrics.items())
