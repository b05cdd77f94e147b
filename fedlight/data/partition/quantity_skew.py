"""Quantity skew: clients differ in how many samples they hold, each a uniform draw from the pool.

Two families of sizes, the labels then following the pool's mix on every client:

* NIID-Bench's quantity-based skew (Li et al., 2022, "Federated Learning on Non-IID Data Silos",
  ``partition == "iid-diff-quantity"``): proportions ``q ~ Dir(β·1_K)``, redrawn until every client's
  ``q_k · N`` is at least 10, then the shuffled pool is cut at ``int(cumsum(q) · N)``.
* Flower Datasets' deterministic ``SizePartitioner`` schemes (``LinearPartitioner``, ``SquarePartitioner``,
  ``ExponentialPartitioner``): client ``i`` (``i = 0 … K−1``) gets ``f(i + 1)`` units with ``f(x) = x``,
  ``x²`` or ``eˣ``; its size is ``int(N · f(i + 1) / Σ_j f(j + 1))``, rounded down, and the samples this
  leaves over go to the last, largest client. Flower cuts the (shuffled) dataset into consecutive pieces of
  those sizes; here the pool is shuffled with the partition's RNG and cut the same way.
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np

from fedlight.data.partition.base import FLAG, Partitioner, check_settings, sorted_indices
from fedlight.errors import ConfigError


def flower_sizes(units: np.ndarray, num_samples: int) -> np.ndarray:
    """Client sizes proportional to ``units``, rounded as Flower's ``SizePartitioner`` rounds them.

    Every size is ``int(N · u_k / Σ u)`` (rounded down); the remainder goes to the last client.

    >>> flower_sizes(np.array([1.0, 2.0, 3.0, 4.0]), 100).tolist()
    [10, 20, 30, 40]
    >>> flower_sizes(np.array([1.0, 2.0, 3.0]), 100).tolist()  # 16.67, 33.33, 50 → 16, 33, 50 + 1
    [16, 33, 51]
    """
    sizes = (units / units.sum() * num_samples).astype(np.int64)
    sizes[-1] += num_samples - sizes.sum()
    return sizes


class DirichletSizes(Partitioner):
    """NIID-Bench's quantity-based skew: client proportions from ``Dir(β·1_K)``, labels uniform.

    Args:
        num_clients: Number of clients ``K``.
        beta: Concentration ``β`` of the size proportions; lower means more unequal sizes (NIID-Bench: 0.5).
        min_size: The proportions are redrawn until every ``q_k · N`` reaches this (NIID-Bench: 10).
        max_retries: Draws to try before giving up.
    """

    def __init__(self, num_clients: int = 10, beta: float = 0.5, min_size: int = 10, max_retries: int = 1000) -> None:
        problems = []
        if not beta > 0:
            problems.append(f"Expected {FLAG}.beta > 0, got {beta}. Lower beta means more unequal client sizes.")
        check_settings(problems, num_clients=(num_clients, 1), min_size=(min_size, 1), max_retries=(max_retries, 1))
        self.num_clients = num_clients
        self.beta = beta
        self.min_size = min_size
        self.max_retries = max_retries

    def split(
        self, targets: np.ndarray, num_classes: int, rng: np.random.Generator, groups: np.ndarray | None
    ) -> list[np.ndarray]:
        num_samples = len(targets)
        if self.min_size * self.num_clients > num_samples:
            raise ConfigError(
                f"{self.num_clients} clients of at least {self.min_size} samples need more than the pool's "
                f"{num_samples}; lower {FLAG}.min_size or num_clients."
            )
        order = rng.permutation(num_samples)
        for _ in range(self.max_retries):
            proportions = rng.dirichlet(np.full(self.num_clients, self.beta))  # q, [K]
            if np.min(proportions * num_samples) >= self.min_size:
                cuts = (np.cumsum(proportions) * num_samples).astype(np.int64)[:-1]
                return sorted_indices(np.split(order, cuts))
        raise ConfigError(
            f"No Dirichlet(beta={self.beta}) draw in {self.max_retries} gave every one of {self.num_clients} "
            f"clients at least {self.min_size} samples; raise {FLAG}.beta or max_retries, or lower min_size or "
            "num_clients."
        )


class _FlowerSizes(Partitioner):
    """Flower's deterministic size schemes: client ``i`` gets ``∝ f(i + 1)`` samples, drawn uniformly.

    Args:
        num_clients: Number of clients ``K``; client ``K − 1`` is the largest.
    """

    def __init__(self, num_clients: int = 10) -> None:
        check_settings([], num_clients=(num_clients, 1))
        self.num_clients = num_clients

    @staticmethod
    @abstractmethod
    def units(ids: np.ndarray) -> np.ndarray:
        """``f``: the relative size of the clients with 1-based ids ``ids``."""

    def sizes(self, num_samples: int) -> np.ndarray:
        """``[K]`` client sizes for a pool of ``num_samples``; refuses a setting that leaves a client empty."""
        ids = np.linspace(start=1, stop=self.num_clients, num=self.num_clients)  # 1 … K, as Flower counts
        sizes = flower_sizes(self.units(ids), num_samples)
        if sizes.min() < 1:
            raise ConfigError(
                f"{type(self).__name__} gives client 0 only {sizes[0]} of the pool's {num_samples} samples "
                f"with {FLAG}.num_clients={self.num_clients}; lower num_clients."
            )
        return sizes

    def split(
        self, targets: np.ndarray, num_classes: int, rng: np.random.Generator, groups: np.ndarray | None
    ) -> list[np.ndarray]:
        sizes = self.sizes(len(targets))
        return sorted_indices(np.split(rng.permutation(len(targets)), np.cumsum(sizes)[:-1]))


class LinearSizes(_FlowerSizes):
    """Flower's ``LinearPartitioner``: client ``i`` holds ``∝ i + 1`` samples, drawn uniformly from the pool."""

    @staticmethod
    def units(ids: np.ndarray) -> np.ndarray:
        return ids


class SquareSizes(_FlowerSizes):
    """Flower's ``SquarePartitioner``: client ``i`` holds ``∝ (i + 1)²`` samples, drawn uniformly from the pool."""

    @staticmethod
    def units(ids: np.ndarray) -> np.ndarray:
        return np.square(ids)


class ExponentialSizes(_FlowerSizes):
    """Flower's ``ExponentialPartitioner``: client ``i`` holds ``∝ e^(i + 1)`` samples, drawn uniformly from the
    pool."""

    @staticmethod
    def units(ids: np.ndarray) -> np.ndarray:
        return np.exp(ids)
