"""FedAvg with cluster-specific layers: the aggregation of LADD (Shenaj et al., *Learning Across Domains and
Devices: Style-Driven Source-Free Domain Adaptation in Clustered Federated Learning*, WACV 2023, Sec. 3.3).

Clients are grouped into clusters (LADD clusters them by image style). A group of layers is kept per
cluster: BatchNorm (``bn``), the backbone's convolutions (``backbone``), the head's (``classifier``), or
every entry (``all``); the other entries are shared. Each client starts from its cluster's model; shared
entries take the n_k-weighted average over all of the round's clients, cluster entries the n_k-weighted
average over the round's clients of their cluster (the paper's Eq. 3 per group); the global model's
cluster entries are the unweighted mean of the participating clusters' values. A cluster none of whose
clients took part keeps its values; ``reset_unsampled_clusters`` restarts it from the global model, as
the official code does. The engine's :class:`~fedlight.bank.ModelBank` holds the clusters' values.

This rule takes the client→cluster map as given (a list, or the cluster files LADD ships); the LADD
strategy finds it from the clients' styles. Held-out samples are also scored by their client's cluster
model (``clients/routed/<metric>``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from fedlight.errors import ConfigError
from fedlight.strategies.fedavg import FedAvg

if TYPE_CHECKING:
    from fedlight.context import RunContext
    from fedlight.plans import ClientUpdate


class ClusteredFedAvg(FedAvg):
    """FedAvg whose ``cluster_layers`` are averaged within each cluster of clients.

    Args:
        clusters: the cluster of every client, ``clusters[k]`` for client k, numbered from 0.
        cluster_layers: the entries kept per cluster: ``bn``, ``backbone``, ``classifier``, ``all``, glob
            patterns over state-dict keys, or a list of them (LADD's Table 7).
        reset_unsampled_clusters: a cluster with no client in a round restarts from the global model's values
            (the official code's behaviour) instead of keeping its own (the paper's).
        route_clients: also score every held-out sample with its client's cluster model.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as in LADD.
    """

    default_sampling = "uniform"

    def __init__(
        self,
        clusters: list[int],
        cluster_layers: str | list[str] = "bn",
        reset_unsampled_clusters: bool = False,
        route_clients: bool = True,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        if not clusters or min(clusters) < 0:
            raise ConfigError(
                f"Expected --strategy.init_args.clusters to give every client a cluster number ≥ 0, got {clusters}."
            )
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.clusters = list(clusters)
        self.cluster_layers = cluster_layers
        self.reset_unsampled_clusters = reset_unsampled_clusters
        self.routed_splits = ("clients",) if route_clients else ()
        self._lookup = torch.tensor(self.clusters)  # client → cluster

    def check(self, module: Any, datamodule: Any) -> list[str]:
        """The cluster list against the partition: one cluster per client, no cluster without clients."""
        problems = super().check(module, datamodule)
        num_clients = datamodule.num_clients
        if len(self.clusters) != num_clients:
            problems.append(
                f"--strategy.init_args.clusters names the cluster of {len(self.clusters)} clients, but the partition "
                f"has {num_clients}. Give one cluster number per client."
            )
        empty = sorted(set(range(self.num_clusters())) - set(self.clusters))
        if empty:
            problems.append(
                f"--strategy.init_args.clusters leaves cluster(s) {empty} without clients; number clusters 0, 1, …"
            )
        return problems

    def num_clusters(self) -> int:
        return max(self.clusters) + 1

    def client_cluster(self, client: int) -> int:
        return self.clusters[client]

    def route(self, context: RunContext, batch: Any, split: str) -> torch.Tensor:
        """A held-out sample's client (the batch's third element) decides its cluster."""
        return self._lookup.to(batch[2].device)[batch[2]]

    def on_round_end(self, context: RunContext, round_idx: int, updates: Sequence[ClientUpdate]) -> dict[str, Any]:
        """How many clusters took part in the round."""
        return {"clusters/aggregated": float(len({self.clusters[u.client] for u in updates}))}
