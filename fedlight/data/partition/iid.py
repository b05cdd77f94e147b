"""Uniform random split into clients of (near-)equal sizes: NIID-Bench's ``homo`` partition (Li et al., 2022)

NIID-Bench ("Federated Learning on Non-IID Data Silos: An Experimental Study", ``partition_data``) shuffles the
pool and cuts it into ``K`` consecutive pieces with ``np.array_split``, so sizes differ by at most one and every
client's label mix follows the pool's. Flower's ``IidPartitioner`` and FL-bench's ``--iid`` split the same way.
"""

from __future__ import annotations

import numpy as np

from fedlight.data.partition.base import FLAG, Partitioner, check_settings, sorted_indices
from fedlight.errors import ConfigError


class IID(Partitioner):
    """Shuffles the pool and deals it into ``num_clients`` pieces whose sizes differ by at most one.

    Args:
        num_clients: Number of clients ``K``; each holds ``⌊N / K⌋`` or ``⌈N / K⌉`` samples.
    """

    def __init__(self, num_clients: int = 100) -> None:
        check_settings([], num_clients=(num_clients, 1))
        self.num_clients = num_clients

    def split(
        self, targets: np.ndarray, num_classes: int, rng: np.random.Generator, groups: np.ndarray | None
    ) -> list[np.ndarray]:
        if self.num_clients > len(targets):
            raise ConfigError(
                f"Expected {FLAG}.num_clients <= {len(targets)} (the pool's samples), got {self.num_clients}; "
                "lower num_clients so that every client holds a sample."
            )
        return sorted_indices(np.array_split(rng.permutation(len(targets)), self.num_clients))
