"""Class-wise Dirichlet label skew: MOON's ``noniid-labeldir`` partition (Li et al., 2021)

MOON (``utils.py:partition_data``), followed by FedSLS, splits every class separately: its samples
are shuffled and cut at the cumulative proportions ``p ~ Dir(α·1_K)``, after zeroing the proportion of
any client that already holds ``N / K`` samples. The whole draw is repeated until every client holds
at least ``min_size`` samples.
"""

from __future__ import annotations

import numpy as np

from fedlight.data.partition.base import FLAG, Partitioner, check_settings, sorted_indices
from fedlight.errors import ConfigError

_MAX_DRAWS_PER_BATCH = 256


class Dirichlet(Partitioner):
    """MOON's Dirichlet label-skew partition; it covers the whole pool.

    Args:
        num_clients: Number of clients ``K``.
        alpha: Concentration ``α`` of the per-class ``Dir(α·1_K)`` proportions; lower means more
            heterogeneous clients (FedSLS: 0.05, 0.1, 0.5).
        min_size: Every client must hold at least this many samples; the draw is repeated until it
            does (MOON: 10).
        max_retries: Draws to try before giving up. Small α with few classes needs many: CIFAR-10
            over 100 clients at α = 0.05 keeps about one draw in 20,000 (a few seconds), so raise
            this to 100000 there.
    """

    def __init__(
        self,
        num_clients: int = 100,
        alpha: float = 0.5,
        min_size: int = 10,
        max_retries: int = 1000,
    ) -> None:
        problems = []
        if not alpha > 0:
            problems.append(f"Expected {FLAG}.alpha > 0, got {alpha}. Lower alpha means more heterogeneous clients.")
        check_settings(problems, num_clients=(num_clients, 1), min_size=(min_size, 0), max_retries=(max_retries, 1))
        self.num_clients = num_clients
        self.alpha = alpha
        self.min_size = min_size
        self.max_retries = max_retries

    def split(
        self, targets: np.ndarray, num_classes: int, rng: np.random.Generator, groups: np.ndarray | None
    ) -> list[np.ndarray]:
        num_samples = len(targets)
        if self.min_size * self.num_clients > num_samples:
            raise ConfigError(
                f"{self.num_clients} clients of at least {self.min_size} samples need more than the pool's "
                f"{num_samples}; lower --data.partitioner.init_args.min_size or num_clients."
            )
        class_sizes = np.bincount(targets, minlength=num_classes)
        counts, num_tried, batch = None, 0, 1
        while counts is None and num_tried < self.max_retries:
            # batches double, so an easy draw costs one pass and a hard one few Python loops
            draws = self._draw_counts(class_sizes, min(batch, self.max_retries - num_tried), rng)
            kept = np.flatnonzero(draws.sum(axis=1).min(axis=1) >= self.min_size)
            if kept.size:
                counts = draws[kept[0]]  # [C, K]
            num_tried += len(draws)
            batch = min(2 * batch, _MAX_DRAWS_PER_BATCH)
        if counts is None:
            raise ConfigError(
                f"No Dirichlet(alpha={self.alpha}) draw in {self.max_retries} gave every one of "
                f"{self.num_clients} clients at least {self.min_size} samples; lower "
                "--data.partitioner.init_args.min_size or num_clients (or raise alpha or max_retries)."
            )
        parts: list[list[np.ndarray]] = [[] for _ in range(self.num_clients)]
        for c in range(num_classes):
            shuffled = rng.permutation(np.flatnonzero(targets == c))
            for client, share in enumerate(np.split(shuffled, np.cumsum(counts[c])[:-1])):
                parts[client].append(share)
        return sorted_indices(np.concatenate(shares) for shares in parts)

    def _draw_counts(self, class_sizes: np.ndarray, num_draws: int, rng: np.random.Generator) -> np.ndarray:
        """Independent passes of MOON's loop over classes, as ``[num_draws, C, K]`` sample counts.

        Only the counts decide whether a draw is kept, and the class indices are shuffled
        independently of them, so retries skip the shuffling and run many at once.
        """
        num_samples = class_sizes.sum()
        num_clients = self.num_clients
        counts = np.zeros((num_draws, class_sizes.size, num_clients), dtype=np.int64)
        sizes = np.zeros((num_draws, num_clients), dtype=np.int64)
        for c, class_size in enumerate(class_sizes):
            if class_size == 0:
                continue
            # a client with its fair share N/K already gets no more, which caps the largest clients;
            # some client is always below it while samples remain
            open_clients = sizes < num_samples / num_clients
            proportions = np.zeros((num_draws, num_clients))
            # tiny α can underflow every open client's share to 0: draw those again
            while (empty := proportions.sum(axis=1) == 0).any():
                redrawn = rng.dirichlet(np.full(num_clients, self.alpha), size=int(empty.sum()))
                proportions[empty] = redrawn * open_clients[empty]
            proportions /= proportions.sum(axis=1, keepdims=True)
            cuts = (np.cumsum(proportions, axis=1) * class_size).astype(np.int64)  # [draws, K]
            counts[:, c] = np.diff(cuts, axis=1, prepend=0)
            counts[:, c, -1] += class_size - cuts[:, -1]  # MOON's last split takes the rest
            sizes += counts[:, c]
        return counts
