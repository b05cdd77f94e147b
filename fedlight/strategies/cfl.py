"""CFL: Sattler, Müller & Samek, *Clustered Federated Learning: Model-Agnostic Distributed Multitask Optimization
Under Privacy Constraints*, IEEE Transactions on Neural Networks and Learning Systems, 2020 (arXiv 1910.01991),
Algorithms 1 and 2.

Clients whose data follow different distributions pull one model in different directions. CFL starts with a single
cluster of every client, trains every cluster with FedAvg on a model of its own, and splits a cluster in two once its
FedAvg has converged while some of its clients have not (Algorithm 2). After every round, with Δθ_i = θ_i − θ_c the
parameter update of client i of cluster c and Δθ_c = Σ_i w_i Δθ_i / Σ_i w_i the cluster's,

    ‖Δθ_c‖ < ε1        (the cluster is near a stationary point of its clients' joint risk)
    max_i ‖Δθ_i‖ > ε2  (yet some of its clients are far from a stationary point of their own)

bipartitions c by the cosine similarities α_ij = ⟨Δθ_i, Δθ_j⟩ / (‖Δθ_i‖ ‖Δθ_j‖) into the halves c1, c2 of smallest
largest cross similarity α_cross^max = max_{i∈c1, j∈c2} α_ij. Algorithm 1 finds them by merging groups of clients in
order of decreasing similarity until two remain, which is single-linkage agglomerative clustering
(:func:`optimal_bipartition`, with :mod:`scipy.cluster.hierarchy`). The split is made when

    γ_max < √((1 − α_cross^max) / 2),

the paper's condition for the bipartition to separate clients of different distributions when every client's
empirical risk gradient is off from its true one by at most the fraction γ_max of its norm (γ_max = 0, the default,
splits whenever the norms say so).

Each cluster's model is a member of the engine's :class:`~fedlight.bank.ModelBank` (``cluster_layers = "all"``): a
client starts from its cluster's model, which becomes the FedAvg of the cluster's clients of the round. The bank
holds ``max_clusters`` members; a split that needs one more is not made (counted in ``cfl/splits_refused``). The
half holding the cluster's lowest-numbered client keeps its member, the other takes the lowest free one, a copy of
the cluster's model. Every client's held-out samples are scored by its cluster's model (``clients/routed/<metric>``),
the number CFL is about; the global model the engine scores is the mean of the round's cluster models.

Choices and departures:

- The round in which a cluster splits is still averaged over the whole cluster, Δθ_c being the update whose norm
  the criterion tests (Algorithm 2); both halves start from that model. The authors' code
  (``felisat/clustered-federated-learning``) already averages the two halves apart in that round.
- Algorithm 2 has every client compute an update in every round. A cluster is tested only in a round in which every
  one of its clients trained, so with fewer clients per round than clients the first cluster never splits (set-up
  warns). Nothing places a client that joins the federation after a split: every client belongs to a cluster from
  the first round.
- The authors' code averages updates uniformly (``weighting: uniform``), bipartitions by complete linkage
  (``linkage: complete``), which need not reach Algorithm 1's optimum, splits only after round 20
  (``warmup_rounds: 20``) and only clusters of more than two clients (``min_split_size: 3``). Its ε1 = 0.4 and
  ε2 = 1.6 (for its EMNIST CNN) are the defaults here; the paper leaves ε1 and ε2 to the task.
- Updates are over parameters only, not BatchNorm running statistics (the authors' code reads ``named_parameters``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from fedlight.errors import ConfigError
from fedlight.strategies.fedavg import FedAvg
from fedlight.strategies.parameters import ParameterMask

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientPlan, ClientUpdate

Linkage = Literal["single", "complete"]
#: columns of the clients' updates read at once for their Gram matrix, so that its fp64 copies stay small
GRAM_BLOCK = 1 << 20


def optimal_bipartition(
    similarity: np.ndarray | torch.Tensor | Sequence[Sequence[float]], linkage: Linkage = "single"
) -> tuple[list[int], list[int]]:
    """Splits n ≥ 2 clients in two by their pairwise similarities (CFL's Algorithm 1 with ``single`` linkage).

    Agglomerative clustering on the distances 1 − α_ij, stopped at two groups. With single linkage, which merges the
    groups holding the most similar pair first, the halves minimise the largest cross similarity
    max_{i∈c1, j∈c2} α_ij (Algorithm 1); complete linkage is the authors' code's choice.

    Args:
        similarity: ``[n, n]`` α, symmetric, e.g. cosine similarities of the clients' updates.
        linkage: ``single`` or ``complete``.

    Returns:
        The two halves as sorted positions, the one holding position 0 first.

    >>> optimal_bipartition([[1.0, 0.9, -0.8], [0.9, 1.0, -0.7], [-0.8, -0.7, 1.0]])
    ([0, 1], [2])
    """
    from scipy.cluster.hierarchy import linkage as agglomerate
    from scipy.cluster.hierarchy import to_tree
    from scipy.spatial.distance import squareform

    alpha = np.asarray(similarity, dtype=np.float64)
    assert alpha.ndim == 2 and alpha.shape[0] == alpha.shape[1] >= 2, f"expected [n, n] with n ≥ 2, got {alpha.shape}"
    distance = np.clip(1.0 - (alpha + alpha.T) / 2, 0.0, None)  # [n, n], symmetric and ≥ 0 despite rounding
    np.fill_diagonal(distance, 0.0)
    root = to_tree(agglomerate(squareform(distance, checks=False), method=linkage))
    first, second = sorted(sorted(node.pre_order()) for node in (root.get_left(), root.get_right()))
    return first, second


def update_gram(updates: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[n, n]`` fp64 inner products ⟨Δθ_i, Δθ_j⟩ of n ``[P]`` updates, read ``GRAM_BLOCK`` columns at a time.

    >>> update_gram([torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0])]).tolist()
    [[5.0, 1.0], [1.0, 10.0]]
    """
    numel = updates[0].numel()
    gram = torch.zeros(len(updates), len(updates), dtype=torch.float64)
    for start in range(0, numel, GRAM_BLOCK):
        block = torch.stack([u[start : start + GRAM_BLOCK].double().cpu() for u in updates])  # [n, c]
        gram += block @ block.T
    return gram


class CFL(ParameterMask, FedAvg):
    """FedAvg within clusters of clients, a cluster split in two by the cosine similarity of its clients' updates once
    its mean update is short and one of its clients' is long (Algorithm 2).

    Args:
        eps1: ε1 > 0; a cluster whose (weighted) mean parameter update is shorter has converged (0.4, the authors'
            code's value for its EMNIST CNN).
        eps2: ε2 > 0; a converged cluster splits when one of its clients' updates is longer (1.6, the authors' code's).
        gamma_max: γ_max ∈ [0, 1), the relative error of the clients' empirical risk gradients the split must
            tolerate: it is made only when γ_max < √((1 − α_cross^max)/2). 0 always splits.
        linkage: ``single`` finds Algorithm 1's optimal bipartition; ``complete`` is the authors' code's.
        warmup_rounds: rounds before any split (0 in Algorithm 2; 20 in the authors' code).
        min_split_size: the fewest clients a cluster splits with (2 in Algorithm 2; 3 in the authors' code).
        max_clusters: the clusters the bank holds, each a whole model on the training device; no split past it.
        weighting: ``samples`` weighs a cluster's clients by n_k (FedAvg), ``uniform`` alike (the authors' code).
        route_clients: score every client's held-out samples with its cluster's model (``clients/routed/*``).
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``. Algorithm 2 trains every client in
            every round (``--trainer.clients_per_round`` = the number of clients).
    """

    cluster_layers = "all"
    default_sampling = "uniform"

    def __init__(
        self,
        eps1: float = 0.4,
        eps2: float = 1.6,
        gamma_max: float = 0.0,
        linkage: Linkage = "single",
        warmup_rounds: int = 0,
        min_split_size: int = 2,
        max_clusters: int = 8,
        weighting: Literal["samples", "uniform"] = "samples",
        route_clients: bool = True,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        for name, value in (("eps1", eps1), ("eps2", eps2)):
            if not value > 0:
                problems.append(f"Expected --strategy.init_args.{name} > 0, got {value}; it compares update norms.")
        if not 0.0 <= gamma_max < 1.0:
            problems.append(f"Expected --strategy.init_args.gamma_max in [0, 1), got {gamma_max}; 0 always splits.")
        if warmup_rounds < 0:
            problems.append(f"Expected --strategy.init_args.warmup_rounds >= 0, got {warmup_rounds}.")
        if min_split_size < 2:
            problems.append(
                f"Expected --strategy.init_args.min_split_size >= 2, got {min_split_size}: a split needs two clients."
            )
        if max_clusters < 2:
            problems.append(
                f"Expected --strategy.init_args.max_clusters >= 2, got {max_clusters}; one cluster is FedAvg."
            )
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.eps1, self.eps2, self.gamma_max, self.linkage = eps1, eps2, gamma_max, linkage
        self.warmup_rounds, self.min_split_size, self.max_clusters = warmup_rounds, min_split_size, max_clusters
        self.weighting = weighting
        self.routed_splits = ("clients",) if route_clients else ()
        self.assignment: list[int] = []  # the cluster of every client; empty before the first fit
        self.splits: list[list[int]] = []  # [round, cluster, new cluster] of every split
        self.refused = 0  # splits not made for want of a free bank member
        self._num_clients: int | None = None
        self._start: torch.Tensor | None = None  # θ_c [P] the client in its fit started from

    # -- set-up ---------------------------------------------------------------------------------------
    def check(self, module: Any, datamodule: Any) -> list[str]:
        self._num_clients = datamodule.num_clients
        return super().check(module, datamodule)

    def check_round_size(self, sampled: int, trained: int) -> list[str]:
        """Warns when a round cannot hold every client: a cluster is tested only when all of its clients trained."""
        if self._num_clients is not None and trained < self._num_clients:
            warnings.warn(
                f"CFL tests a cluster for a split only in a round where all of its clients train, but rounds train "
                f"{trained} of {self._num_clients} clients: the first cluster (every client) will never split. Set "
                f"--trainer.clients_per_round={self._num_clients}, as Algorithm 2 does.",
                stacklevel=2,
            )
        return []

    def on_fit_start(self, context: RunContext) -> None:
        num_clients = context.datamodule.num_clients
        if not self.assignment:
            self.assignment = [0] * num_clients
        assert len(self.assignment) == num_clients, (
            f"the checkpoint's CFL clusters name {len(self.assignment)} clients, the partition has {num_clients}"
        )
        self.cache_parameter_mask(context)

    def num_clusters(self) -> int:
        return self.max_clusters

    def client_cluster(self, client: int) -> int:
        return self.assignment[client] if self.assignment else 0

    def route(self, context: RunContext, batch: Any, split: str) -> torch.Tensor:
        """A held-out sample's client (the batch's third element) decides its cluster."""
        clients = batch[2]
        if not self.assignment:
            return torch.zeros_like(clients)
        return torch.tensor(self.assignment, device=clients.device)[clients]

    # -- clients --------------------------------------------------------------------------------------
    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        self._start = context.layout.flatten(module)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """Sends Δθ_i = θ_i − θ_c over the parameters."""
        assert self._start is not None, "CFL: on_client_fit_start did not run"
        delta = context.layout.flatten(module) - self._start
        update.payload["cfl_update"] = delta[self.parameter_mask(delta.device)].float().cpu()
        self._start = None

    def client_weights(self, update: ClientUpdate) -> Sequence[float]:
        return (float(update.num_samples) if self.weighting == "samples" else 1.0,)

    # -- server ---------------------------------------------------------------------------------------
    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """Tests every cluster whose clients all trained, and splits those that converged without their clients.

        Runs after the round's aggregation, so the bank already holds every cluster's new model; a new half takes a
        copy of it. Logs the clusters, the round's splits and the largest mean and client update norms (what ε1 and
        ε2 are compared with).
        """
        by_cluster: dict[int, list[ClientUpdate]] = {}
        for update in sorted(updates, key=lambda u: u.client):
            by_cluster.setdefault(self.assignment[update.client], []).append(update)
        splits, mean_norms, client_norms = 0, [], []
        for cluster, present in sorted(by_cluster.items()):
            gram = update_gram([u.payload.pop("cfl_update") for u in present])  # [n, n]
            weights = torch.tensor([u.weights[0] for u in present], dtype=torch.float64)
            weights = weights / weights.sum()
            norms = gram.diagonal().clamp_min(0).sqrt()  # ‖Δθ_i‖
            mean_norm = float((weights @ gram @ weights).clamp_min(0).sqrt())  # ‖Δθ_c‖
            mean_norms.append(mean_norm)
            client_norms.append(float(norms.max()))
            members = [k for k, c in enumerate(self.assignment) if c == cluster]
            if not (
                round_idx + 1 > self.warmup_rounds
                and len(present) == len(members) >= self.min_split_size
                and mean_norm < self.eps1
                and float(norms.max()) > self.eps2
            ):
                continue
            alpha = gram / torch.outer(norms, norms).clamp_min(1e-30)  # α_ij, cosine similarities
            kept, moved = optimal_bipartition(alpha.numpy(), self.linkage)
            cross = float(alpha[kept][:, moved].max())  # α_cross^max
            if not self.gamma_max < math.sqrt(max(1.0 - cross, 0.0) / 2):
                continue
            free = next((c for c in range(self.max_clusters) if c not in self.assignment), None)
            if free is None:
                self.refused += 1
                continue
            for position in moved:
                self.assignment[present[position].client] = free
            context.bank.clusters[free] = context.bank.clusters[cluster]
            self.splits.append([round_idx + 1, cluster, free])
            splits += 1
        return {
            "cfl/clusters": float(len(set(self.assignment))),
            "cfl/splits": float(splits),
            "cfl/splits_refused": float(self.refused),
            "cfl/mean_update_norm": max(mean_norms),
            "cfl/client_update_norm": max(client_norms),
        }

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The cluster of every client and the splits so far (the clusters' models are the bank's)."""
        return {
            "assignment": list(self.assignment),
            "splits": [list(split) for split in self.splits],
            "refused": self.refused,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.assignment = [int(c) for c in state["assignment"]]
        self.splits = [[int(v) for v in split] for split in state["splits"]]
        self.refused = int(state["refused"])
