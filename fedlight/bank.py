"""The server's global state as a bank: one global model plus each cluster's own copy of some entries.

Most rules keep one global model W^t. Rules with cluster-specific layers (LADD's cluster-specific
BatchNorm, backbone or classifier; Shenaj et al., WACV 2023, Sec. 3.3) keep, for every cluster c, its own
values θ_c of a group of entries, while the other entries are shared by all clients:

- a client of cluster c starts from W^t with the cluster entries replaced by θ_c;
- shared entries average over every aggregated client of the round, weighted as the rule says;
- θ_c averages over the round's clients of cluster c only; a cluster with no aggregated client keeps θ_c
  (the paper's reading), or, with ``reset_unsampled_clusters``, restarts from the global model's values
  (what the official code does, because its per-cluster dictionaries start from the global model);
- the global model's cluster entries are the unweighted mean of the θ_c of the clusters that took part.

:class:`RoundSums` streams the round's weighted sums while clients finish (no client state is held past
its own fit, so memory does not grow with the number of clients), in fp64, and packs every sum into one
buffer for a single all-reduce across processes.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

import torch
from torch import nn

from fedlight.errors import ConfigError
from fedlight.state import FlatState

#: Named parameter groups of :func:`cluster_entry_names` (the groups of LADD's Table 7).
GROUPS = ("bn", "backbone", "classifier", "all")
_BACKBONE_NAMES = ("backbone", "encoder", "features")
_CLASSIFIER_NAMES = ("classifier", "decoder", "segmentation_head", "head")


def cluster_entry_names(module: nn.Module, layout: FlatState, groups: str | Sequence[str]) -> list[str]:
    """The federated entries that a clustered rule keeps per cluster.

    Args:
        module: the client module.
        layout: its federated layout.
        groups: one or several of ``bn`` (every BatchNorm's weight, bias and running statistics), ``backbone``
            (every convolution and linear layer under a submodule named ``backbone``, ``encoder`` or
            ``features``), ``classifier`` (every convolution and linear layer under ``classifier``, ``decoder``,
            ``segmentation_head`` or ``head``; not the head's BatchNorms), ``all``, or glob patterns over
            state-dict keys (``net.classifier.*``).

    Raises:
        ConfigError: when a group matches no federated entry.

    >>> net = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))
    >>> cluster_entry_names(net, FlatState(net), "bn")
    ['1.weight', '1.bias', '1.running_mean', '1.running_var']
    """
    groups = [groups] if isinstance(groups, str) else list(groups)
    federated = layout.names
    chosen: set[str] = set()
    for group in groups:
        if group == "all":
            matched = set(federated)
        elif group == "bn":
            matched = _entries_of(module, lambda name, sub: isinstance(sub, nn.modules.batchnorm._BatchNorm))
        elif group == "backbone":
            matched = _entries_of(module, lambda name, sub: _is_weight_layer(sub) and _under(name, _BACKBONE_NAMES))
        elif group == "classifier":
            matched = _entries_of(module, lambda name, sub: _is_weight_layer(sub) and _under(name, _CLASSIFIER_NAMES))
        else:
            matched = {name for name in federated if fnmatch.fnmatchcase(name, group)}
        matched &= set(federated)
        if not matched:
            raise ConfigError(
                f"The cluster-specific layer group {group!r} (--strategy.init_args.cluster_layers) matches no "
                f"federated entry of {type(module).__name__}. Use one of {', '.join(GROUPS)} or a glob pattern over "
                f"its state-dict keys, e.g. {federated[0]!r}."
            )
        chosen |= matched
    return [name for name in federated if name in chosen]


def _is_weight_layer(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.conv._ConvNd | nn.Linear)


def _under(name: str, parents: tuple[str, ...]) -> bool:
    return any(part in parents for part in name.split("."))


def _entries_of(module: nn.Module, chosen) -> set[str]:
    names = set()
    for prefix, sub in module.named_modules():
        if chosen(prefix, sub):
            names.update(f"{prefix}.{key}" if prefix else key for key in sub.state_dict())
    return names


class ModelBank:
    """W^t and the clusters' own values θ_c of the cluster entries.

    Args:
        global_state: ``[P]`` fp32, the global model W^t.
        cluster_mask: ``[P]`` bool, the cluster entries (``None``: no clusters).
        num_clusters: C, the number of clusters.

    >>> bank = ModelBank(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([False, True, False]), 2)
    >>> bank.clusters.tolist()  # every θ_c starts from W^0
    [[2.0], [2.0]]
    >>> bank.clusters[1] = 5.0
    >>> bank.member(1).tolist(), bank.member(None).tolist()
    ([1.0, 5.0, 3.0], [1.0, 2.0, 3.0])
    """

    def __init__(self, global_state: torch.Tensor, cluster_mask: torch.Tensor | None = None, num_clusters: int = 0):
        self.global_state = global_state
        if cluster_mask is None or num_clusters == 0:
            self.index = torch.zeros(0, dtype=torch.long, device=global_state.device)
            self.clusters = torch.zeros(0, 0, dtype=global_state.dtype, device=global_state.device)
        else:
            self.index = cluster_mask.to(global_state.device).nonzero().squeeze(1)  # [P_c]
            self.clusters = global_state[self.index].repeat(num_clusters, 1)  # θ_c, [C, P_c]

    @property
    def num_clusters(self) -> int:
        return self.clusters.shape[0]

    def member(self, cluster: int | None) -> torch.Tensor:
        """The model a client of ``cluster`` starts from (W^t itself for ``None`` or without clusters)."""
        if cluster is None or self.num_clusters == 0:
            return self.global_state
        state = self.global_state.clone()
        state[self.index] = self.clusters[cluster]
        return state

    def absorb(self, aggregate: torch.Tensor, cluster_averages: dict[int, torch.Tensor], reset: bool) -> torch.Tensor:
        """Updates θ_c from the round's per-cluster averages; returns ``aggregate`` with the global cluster entries.

        Args:
            aggregate: ``[P]`` the average over all aggregated clients (its cluster entries are replaced).
            cluster_averages: cluster → ``[P_c]`` average of its aggregated clients.
            reset: a cluster without clients restarts from W^t's cluster entries instead of keeping θ_c.
        """
        if self.num_clusters == 0 or not cluster_averages:
            return aggregate
        previous = self.global_state[self.index]
        for cluster in range(self.num_clusters):
            if cluster in cluster_averages:
                self.clusters[cluster] = cluster_averages[cluster]
            elif reset:
                self.clusters[cluster] = previous
        aggregate = aggregate.clone()
        aggregate[self.index] = torch.stack(list(cluster_averages.values())).mean(dim=0)
        return aggregate

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"clusters": self.clusters.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        clusters = state["clusters"]
        assert clusters.shape == self.clusters.shape, (
            f"the checkpoint's bank holds {tuple(clusters.shape)} cluster values, this run {tuple(self.clusters.shape)}"
        )
        self.clusters = clusters.to(self.clusters)


class RoundSums:
    """The weighted sums of one round, streamed as clients finish.

    ``Σ_k w_kj θ_k`` and ``Σ_k w_kj`` for each of the rule's m weight channels over all entries, and, with
    clusters, ``Σ_{k∈c} w_k θ_k[cluster entries]`` and ``Σ_{k∈c} w_k`` for every cluster c. Summed in fp64:
    products of fp32 states and sample counts are exact there, so the sum does not depend on the order of
    clients or on their spread over processes (in fp32 it would by an ulp, which small-batch SGD amplifies
    into visibly different models within a few rounds).

    Args:
        numel: P, the federated entries.
        channels: m, the rule's weight channels.
        device: where the sums live.
        cluster_index: ``[P_c]`` positions of the cluster entries (``None``: no clusters).
        num_clusters: C.
    """

    def __init__(
        self,
        numel: int,
        channels: int,
        device: torch.device,
        cluster_index: torch.Tensor | None = None,
        num_clusters: int = 0,
    ) -> None:
        self.dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no fp64
        self.weighted = torch.zeros(channels, numel, dtype=self.dtype, device=device)  # [m, P]
        self.total = torch.zeros(channels, dtype=self.dtype, device=device)  # [m]
        size = 0 if cluster_index is None else len(cluster_index)
        self.cluster_index = cluster_index
        self.cluster_weighted = torch.zeros(num_clusters, size, dtype=self.dtype, device=device)  # [C, P_c]
        self.cluster_total = torch.zeros(num_clusters, dtype=self.dtype, device=device)  # [C]

    @property
    def nbytes(self) -> int:
        """Bytes held by the sums."""
        return sum(t.nbytes for t in (self.weighted, self.total, self.cluster_weighted, self.cluster_total))

    def add(self, state: torch.Tensor, weights: Sequence[float], cluster: int | None = None) -> None:
        """Adds one client's ``[P]`` state with its m weights (and, if it has one, to its cluster's sums)."""
        w = torch.tensor(weights, dtype=self.dtype, device=self.weighted.device)
        wide = state.to(self.dtype)
        self.weighted.addmm_(w[:, None], wide[None, :])  # Σ_k w_kj θ_k
        self.total += w
        if cluster is not None and self.cluster_index is not None:
            self.cluster_weighted[cluster].add_(wide[self.cluster_index], alpha=float(w[0]))
            self.cluster_total[cluster] += w[0]

    def all_reduce(self, all_reduce) -> None:
        """Sums every buffer over processes with one call of ``all_reduce(tensor) → tensor``."""
        parts = [self.weighted, self.total, self.cluster_weighted, self.cluster_total]
        packed = all_reduce(torch.cat([t.reshape(-1) for t in parts]))
        offset = 0
        for t in parts:
            t.copy_(packed[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def average(self, coefficients: Sequence[float]) -> torch.Tensor:
        """``Σ_j c_j S_j / Z_j`` over the channels, as a ``[P]`` fp32 state."""
        assert bool((self.total > 0).all()), f"aggregation weights sum to {self.total.tolist()}"
        c = torch.tensor(coefficients, dtype=self.dtype, device=self.weighted.device)
        return ((c / self.total) @ self.weighted).float()

    def cluster_averages(self) -> dict[int, torch.Tensor]:
        """Cluster → ``[P_c]`` fp32 average of its clients, for the clusters that had any."""
        return {
            c: (self.cluster_weighted[c] / self.cluster_total[c]).float()
            for c in range(len(self.cluster_total))
            if self.cluster_total[c] > 0
        }
