"""FedCC: Charalambous et al., *Federated Unsupervised Semantic Segmentation* (FUSS), Sec. 4.3.

Clients of FUSS learn centroids M_k (``[n, D]``) that cluster their codes. Averaging them row by row, as
FedAvg does, assumes that row i means the same cluster on every client, which nothing enforces: rows
that drifted to different concepts average into a centroid of neither. FedCC pools the clients' final
local centroids (Eq. 14, ``[K·n, D]``) and clusters them into n global centroids, either by k-means (Eq. 15,
FedCC-kMeans) or by greedy maximin selection (Eq. 16, FedCC-Maximin); the result replaces M in the
aggregate. Everything else (the head, the linear probe) is the usual weighted average.

What the server does, as in the official code (``my_app`` of ``train_fed_*.py``):

- weights: the client's number of batches, ceil(n_k / B) (``weighted_*``), or uniform 1/K;
- the aggregate W^{t+1}: the weighted average of every federated entry, with M replaced by the FedCC
  centroids (or kept as the average for plain FedAvg, ``centroids: average``);
- k-means: scikit-learn's ``KMeans(n, random_state=42, n_init=10)`` on the raw rows; maximin: from the first
  pooled row (client 0, row 0) on the raw rows. Both take an option to L2-normalise first.

Table 4's ablation of what clients take from the server (``aggregated``):

- ``all`` (W+E+C): every client starts round t + 1 from W^{t+1};
- ``encoder`` (E): clients start from W^{t+1} but keep their own last centroids (the code's ``encoder`` mode
  copies every key but the centroids);
- ``centroids`` (C): clients keep their own last head and probe and take only the server's centroids.

A controlled test of the misaligned case (``misaligned_start``): each client's first local fit starts from
M with its rows in an order of its own, a permutation drawn from the run's seed and the client's index, as if
the clients had already learnt their clusters in different orders. Eqs. 19–20 say FedAvg and FedCC agree
when the rows are aligned; this makes them not aligned, without changing anything else.

In every mode the model the server holds, evaluates and checkpoints is the same object: the full weighted
average with the FedCC centroids substituted. In modes E and C that is a model no client trains from,
which is what the paper's Table 4 scores. A client that has not trained yet starts from W^t.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from fedlight.errors import ConfigError
from fedlight.plans import ClientPlan, ClientUpdate
from fedlight.strategies.base import Strategy
from fedlight.strategies.functional import kmeans_centroids, maximin_select

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext

CentroidRule = Literal["average", "kmeans", "maximin"]


class FedCC(Strategy):
    """FUSS's server: batch-weighted averaging with the centroids clustered across clients.

    Args:
        centroids: ``maximin`` (FedCC-Maximin, the default of the official code and of Table 2's "+FedCC"),
            ``kmeans`` (FedCC-kMeans) or ``average`` (FedAvg's row-by-row average).
        weighting: ``batches`` weighs client k by its batches per epoch, ceil(n_k / B); ``uniform`` by 1.
        aggregated: what clients take from the server: ``all``, ``encoder`` (all but the centroids) or
            ``centroids`` (only the centroids); Table 4's W+E+C, E and C rows.
        centroid_key: the state entry holding M.
        normalize: L2-normalise the pooled centroids before clustering (they are assigned by cosine).
        kmeans_seed: ``random_state`` of k-means (42).
        kmeans_n_init: k-means restarts (10).
        maximin_start: the pooled row maximin starts from (0, the code's), or ``random`` (the paper's),
            drawn from the round's strategy stream.
        misaligned_start: start each client's first fit from M with its rows permuted (a permutation per
            client, from the run's seed); the misaligned case of FUSS's Eqs. 19–20, for controlled comparisons.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` keeps them.
        sampling: how clients are drawn when fewer than all take part; ``null`` is ``uniform``.
    """

    default_tolerate_stragglers = True
    default_sampling = "uniform"

    def __init__(
        self,
        centroids: CentroidRule = "maximin",
        weighting: Literal["batches", "uniform"] = "batches",
        aggregated: Literal["all", "encoder", "centroids"] = "all",
        centroid_key: str = "centroids.clusters",
        normalize: bool = False,
        kmeans_seed: int = 42,
        kmeans_n_init: int = 10,
        maximin_start: int | Literal["random"] = 0,
        misaligned_start: bool = False,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        if maximin_start != "random" and (not isinstance(maximin_start, int) or maximin_start < 0):
            raise ConfigError(f"Expected --strategy.init_args.maximin_start ≥ 0 or 'random', got {maximin_start!r}.")
        self.centroids, self.weighting, self.aggregated = centroids, weighting, aggregated
        self.centroid_key, self.normalize = centroid_key, normalize
        self.kmeans_seed, self.kmeans_n_init, self.maximin_start = kmeans_seed, kmeans_n_init, maximin_start
        self.misaligned_start = misaligned_start
        self.started: set[int] = set()  # clients that have fitted once (misaligned_start permutes only the first)
        self.own_centroids: dict[int, torch.Tensor] = {}  # client → [n, D] its last local M (mode E)
        self.last_client_centroids: dict[int, torch.Tensor] = {}  # client → [n, D] of the last round (any mode)
        self.own_states: dict[int, torch.Tensor] = {}  # client → [P] its last local state (mode C)
        self._mask: torch.Tensor | None = None  # [P] bool, M's entries in the flat state
        self._batch_size = 1
        self._centroid_dim = 1
        self._rng: np.random.Generator | None = None

    # -- set-up ---------------------------------------------------------------------------------------
    def on_fit_start(self, context: RunContext) -> None:
        self._mask = context.layout.mask([self.centroid_key])
        if not bool(self._mask.any()):
            raise ConfigError(
                f"{type(self).__name__} clusters the entry {self.centroid_key!r}, which the model's federated state "
                "lacks. Use fedlight.clients.UnsupervisedSegmentationClient or set --strategy.init_args.centroid_key."
            )
        self._batch_size = context.datamodule.batch_size
        if self.misaligned_start:
            self._centroid_dim = context.module.get_parameter(self.centroid_key).shape[-1]

    def on_round_start(self, context: RunContext, round_idx: int, plans: list[ClientPlan]) -> None:
        self._rng = context.strategy_rng(round_idx)

    # -- client side ----------------------------------------------------------------------------------
    def initial_state(self, context: RunContext, plan: ClientPlan, global_state: torch.Tensor) -> torch.Tensor:
        mask = self._mask.to(global_state.device)
        if self.misaligned_start and plan.client not in self.started:
            state = global_state.clone()
            rows = global_state[mask].view(-1, self._centroid_dim)  # [n, D]
            order = np.random.default_rng([context.seed, plan.client]).permutation(len(rows))
            state[mask] = rows[torch.as_tensor(order, device=rows.device)].flatten()
            return state
        if self.aggregated == "encoder" and plan.client in self.own_centroids:
            state = global_state.clone()
            state[mask] = self.own_centroids[plan.client].flatten().to(state)
            return state
        if self.aggregated == "centroids" and plan.client in self.own_states:
            state = self.own_states[plan.client].to(global_state).clone()
            state[mask] = global_state[mask]
            return state
        return global_state

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """Sends the client's final local centroids (and, in mode C, its state, which it keeps)."""
        update.payload["centroids"] = module.get_parameter(self.centroid_key).detach().float().cpu().clone()
        if self.aggregated == "centroids":
            update.payload["state"] = context.layout.flatten(module).cpu()

    def client_weights(self, update: ClientUpdate) -> tuple[float, ...]:
        if self.weighting == "uniform":
            return (1.0,)
        return (float(math.ceil(update.num_samples / self._batch_size)),)  # batches per epoch

    # -- server side ----------------------------------------------------------------------------------
    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """The weighted average with M replaced by the FedCC centroids of the pooled client centroids."""
        if self.centroids == "average":
            return aggregate
        pooled = torch.cat([u.payload["centroids"] for u in updates])  # [K·n, D], Eq. 14, in client order
        new = self.cluster(pooled, num_clusters=updates[0].payload["centroids"].shape[0])
        aggregate = aggregate.clone()
        aggregate[self._mask.to(aggregate.device)] = new.flatten().to(aggregate)
        return aggregate

    def cluster(self, pooled: torch.Tensor, num_clusters: int) -> torch.Tensor:
        """n global centroids ``[n, D]`` from the pooled ``[K·n, D]`` (Eq. 15 or 16)."""
        if self.centroids == "kmeans":
            return kmeans_centroids(pooled, num_clusters, self.kmeans_seed, self.kmeans_n_init, self.normalize)
        rows = torch.nn.functional.normalize(pooled, dim=1) if self.normalize else pooled
        start = self.maximin_start
        if start == "random":
            rng = self._rng if self._rng is not None else np.random.default_rng(0)
            start = int(rng.integers(len(pooled)))
        return maximin_select(rows, num_clusters, start)

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """Keeps what clients hold on to in modes E and C, and every client's last centroids (for pictures)."""
        self.last_client_centroids = {update.client: update.payload["centroids"] for update in updates}
        self.started.update(update.client for update in updates)
        for update in updates:
            if self.aggregated == "encoder":
                self.own_centroids[update.client] = update.payload["centroids"]
            elif self.aggregated == "centroids":
                self.own_states[update.client] = update.payload.pop("state")
        return {}

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "own_centroids": {k: v.clone() for k, v in self.own_centroids.items()},
            "own_states": {k: v.clone() for k, v in self.own_states.items()},
            "started": sorted(self.started),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.own_centroids = {int(k): v.clone() for k, v in state.get("own_centroids", {}).items()}
        self.own_states = {int(k): v.clone() for k, v in state.get("own_states", {}).items()}
        self.started = {int(k) for k in state.get("started", [])}
