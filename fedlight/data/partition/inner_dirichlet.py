"""Given client sizes, Dirichlet class mixes: Flower Datasets' ``InnerDirichletPartitioner``

Flower's partitioner, after FedDyn's (Acar et al., ICLR 2021) unbalanced Dirichlet split, draws one class
prior ``p_k ~ Dir(α)`` per client and fills the clients one sample at a time: pick a client that is not yet
full uniformly at random, then a class from its ``p_k``. A class that has run out is zeroed in every
client's prior and the priors renormalised, so each sample is drawn without replacement and every client
ends with exactly its given size.
"""

from __future__ import annotations

import numpy as np

from fedlight.data.partition.base import FLAG, Partitioner, sorted_indices
from fedlight.errors import ConfigError


class InnerDirichlet(Partitioner):
    """Clients of the given sizes, each filled from its own ``Dir(α)`` class prior until full.

    Args:
        partition_sizes: Samples each client holds; their number is the number of clients. Their sum may be
            below the pool's size, leaving the rest out.
        alpha: Concentration ``α`` of every client's class prior, one value for all classes or one per class;
            lower means more heterogeneous clients.
    """

    def __init__(self, partition_sizes: list[int], alpha: float | list[float] = 0.5) -> None:
        problems = []
        if not partition_sizes or min(partition_sizes) < 1:
            problems.append(
                f"Expected {FLAG}.partition_sizes to list at least one size, all >= 1, got {partition_sizes}."
            )
        if not np.all(np.asarray(alpha, dtype=np.float64) > 0):
            problems.append(f"Expected {FLAG}.alpha > 0, got {alpha}. Lower alpha means more heterogeneous clients.")
        if problems:
            raise ConfigError(*problems)
        self.partition_sizes = list(partition_sizes)
        self.num_clients = len(partition_sizes)
        self.alpha = alpha

    def split(
        self, targets: np.ndarray, num_classes: int, rng: np.random.Generator, groups: np.ndarray | None
    ) -> list[np.ndarray]:
        alpha = np.asarray(self.alpha, dtype=np.float64)
        problems = []
        if alpha.ndim == 0:
            alpha = np.full(num_classes, float(alpha))
        elif alpha.shape != (num_classes,):
            problems.append(
                f"Expected {FLAG}.alpha to be one value or {num_classes} (one per class), got {alpha.size} values."
            )
        if sum(self.partition_sizes) > len(targets):
            problems.append(
                f"Expected {FLAG}.partition_sizes to sum to at most the pool's {len(targets)} samples, got "
                f"{sum(self.partition_sizes)}; lower the sizes."
            )
        if problems:
            raise ConfigError(*problems)

        priors = rng.dirichlet(alpha, size=self.num_clients)  # p_k, [K, C]
        remaining = [list(rng.permutation(np.flatnonzero(targets == c))) for c in range(num_classes)]
        left = np.array(self.partition_sizes)  # samples each client still needs
        parts: list[list[int]] = [[] for _ in range(self.num_clients)]
        open_clients = list(range(self.num_clients))
        while open_clients:
            client = open_clients[rng.integers(len(open_clients))]
            while not remaining[c := rng.choice(num_classes, p=priors[client])]:
                # the class ran out: no client may draw it again
                priors[:, c] = 0.0
                # a tiny α can leave all of a prior's mass on spent classes: fall back to the classes left
                priors[priors.sum(axis=1) == 0] = [bool(members) for members in remaining]
                priors /= priors.sum(axis=1, keepdims=True)
            parts[client].append(remaining[c].pop())
            left[client] -= 1
            if left[client] == 0:
                open_clients.remove(client)
        return sorted_indices(parts)
