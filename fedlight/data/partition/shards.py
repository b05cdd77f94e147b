"""Pathological non-IID shards: FedAvg's MNIST partition (McMahan et al., AISTATS 2017)

"Communication-Efficient Learning of Deep Networks from Decentralized Data", Sec. 3: sort the data by digit
label, divide it into 200 shards of size 300, and assign each of 100 clients 2 shards, so that most clients
hold examples of only two digits. Here the shard count is ``num_clients × shards_per_client`` and the shards
must all have the same size. Samples of one class are shuffled before the sort, so a shard holds a random
subset of its classes rather than the pool's first ones.
"""

from __future__ import annotations

import numpy as np

from fedlight.data.partition.base import FLAG, Partitioner, check_settings, sorted_indices
from fedlight.errors import ConfigError


class Shards(Partitioner):
    """Sorts the pool by label, cuts it into ``num_clients × shards_per_client`` equal shards and gives each
    client ``shards_per_client`` of them at random.

    Every client holds the same number of samples and at most ``shards_per_client`` contiguous runs of the
    sorted labels, so at most ``shards_per_client`` classes unless a shard straddles a class boundary.

    Args:
        num_clients: Number of clients ``K`` (McMahan et al.: 100).
        shards_per_client: Shards each client receives (McMahan et al.: 2).
        drop_remainder: When the shard count does not divide the pool, leave ``N mod (K · shards_per_client)``
            samples, drawn at random, out of the partition instead of refusing the setting.
    """

    def __init__(self, num_clients: int = 100, shards_per_client: int = 2, drop_remainder: bool = False) -> None:
        check_settings([], num_clients=(num_clients, 1), shards_per_client=(shards_per_client, 1))
        self.num_clients = num_clients
        self.shards_per_client = shards_per_client
        self.drop_remainder = drop_remainder

    def split(
        self, targets: np.ndarray, num_classes: int, rng: np.random.Generator, groups: np.ndarray | None
    ) -> list[np.ndarray]:
        num_samples, num_shards = len(targets), self.num_clients * self.shards_per_client
        remainder = num_samples % num_shards
        if num_shards > num_samples:
            raise ConfigError(
                f"Shards needs at least one sample per shard, but {FLAG}.num_clients × shards_per_client = "
                f"{num_shards} exceeds the pool's {num_samples} samples; lower num_clients or shards_per_client."
            )
        if remainder and not self.drop_remainder:
            raise ConfigError(
                f"Shards cuts the pool's {num_samples} samples into {FLAG}.num_clients × shards_per_client = "
                f"{num_shards} equal shards, which leaves {remainder} over; choose num_clients and "
                f"shards_per_client whose product divides {num_samples}, or set {FLAG}.drop_remainder=true to "
                f"leave {remainder} random samples out."
            )
        kept = rng.permutation(num_samples)[: num_samples - remainder]
        by_label = kept[np.argsort(targets[kept], kind="stable")]  # [N - r], labels ascending, shuffled within
        shards = by_label.reshape(num_shards, -1)  # [K·s, N // (K·s)]
        owned = rng.permutation(num_shards).reshape(self.num_clients, self.shards_per_client)  # [K, s]
        return sorted_indices(shards[row].ravel() for row in owned)
