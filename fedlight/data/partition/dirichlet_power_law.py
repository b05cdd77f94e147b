"""Pareto client sizes with Dirichlet class mixes: MO-FedProto's Pascal VOC procedure.

Client sizes follow ``n_k ∝ 1 + Pareto(γ)`` (γ = 3 matches the reported coefficient of variation of
0.39), rounded to sum to the pool size ``N``. Each client's class mix is ``q_k ~ Dir(α·p)`` with ``p``
the class prior of the pool (Hsu et al., 2019); the client then draws ``n_k`` samples one by one,
a class from ``q_k`` and an unused sample of that class, with ``q_k`` renormalised over the classes
that still have samples once a class runs out.
"""

from __future__ import annotations

import numpy as np

from fedlight.data.partition.base import FLAG, Partitioner, check_settings, sorted_indices
from fedlight.errors import ConfigError


class DirichletPowerLaw(Partitioner):
    """Heavy-tailed client sizes and ``Dir(α·p)`` label skew; it covers the whole pool.

    Args:
        num_clients: Number of clients ``K`` (MO-FedProto: 100).
        alpha: Concentration ``α`` of the ``Dir(α·p)`` class mixes; lower means more heterogeneous
            clients (MO-FedProto: 0.01, 0.1, 1).
        gamma: Shape ``γ`` of the Pareto size distribution; lower means more unequal sizes.
    """

    def __init__(self, num_clients: int = 100, alpha: float = 1.0, gamma: float = 3.0) -> None:
        problems = []
        if not alpha > 0:
            problems.append(f"Expected {FLAG}.alpha > 0, got {alpha}. Lower alpha means more heterogeneous clients.")
        if not gamma > 0:
            problems.append(f"Expected {FLAG}.gamma > 0, got {gamma}. Lower gamma means more unequal client sizes.")
        check_settings(problems, num_clients=(num_clients, 1))
        self.num_clients = num_clients
        self.alpha = alpha
        self.gamma = gamma

    def split(
        self, targets: np.ndarray, num_classes: int, rng: np.random.Generator, groups: np.ndarray | None
    ) -> list[np.ndarray]:
        num_samples = len(targets)
        if self.num_clients > num_samples:
            raise ConfigError(
                f"{self.num_clients} clients of at least one sample need more than the pool's {num_samples}; "
                "lower --data.partitioner.init_args.num_clients."
            )
        client_sizes = pareto_sizes(num_samples, self.num_clients, self.gamma, rng)
        class_sizes = np.bincount(targets, minlength=num_classes)
        present = np.flatnonzero(class_sizes)
        prior = class_sizes[present] / num_samples  # p, over the classes the pool has
        # drawing "an unused sample of the class" uniformly = reading a shuffled class in order
        members = [rng.permutation(np.flatnonzero(targets == c)) for c in range(num_classes)]
        taken = np.zeros(num_classes, dtype=np.int64)
        parts = []
        for size in client_sizes:
            mix = np.zeros(num_classes)  # q_k
            mix[present] = rng.dirichlet(self.alpha * prior)
            counts = draw_class_counts(size, mix, class_sizes - taken, rng)
            parts.append(np.concatenate([members[c][taken[c] : taken[c] + counts[c]] for c in present]))
            taken += counts
        assert np.array_equal(taken, class_sizes), f"drew {taken.tolist()} of {class_sizes.tolist()}"
        return sorted_indices(parts)


def pareto_sizes(num_samples: int, num_clients: int, gamma: float, rng: np.random.Generator) -> np.ndarray:
    """Client sizes ``n_k ∝ 1 + Pareto(γ)`` that sum to ``num_samples``, each at least 1.

    Largest-remainder rounding keeps the sum exact; clients whose share rounds to 0 take one sample
    each from the currently largest clients.

    Args:
        num_samples: Total ``N`` to distribute; at least ``num_clients``.
        num_clients: Number of clients ``K``.
        gamma: Pareto shape ``γ``.
        rng: Source of the Pareto draws.

    Returns:
        ``[K]`` int64 sizes.
    """
    weights = 1.0 + rng.pareto(gamma, size=num_clients)  # s_k
    quota = num_samples * weights / weights.sum()
    sizes = np.floor(quota).astype(np.int64)
    by_remainder = np.argsort(sizes - quota, kind="stable")
    sizes[by_remainder[: num_samples - sizes.sum()]] += 1
    for client in np.flatnonzero(sizes == 0):
        sizes[np.argmax(sizes)] -= 1
        sizes[client] = 1
    return sizes


def draw_class_counts(size: int, mix: np.ndarray, available: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """How many samples of each class ``size`` sequential draws take, redrawing exhausted classes.

    Drawing one sample at a time from ``mix`` renormalised over the classes with samples left is
    rejection sampling from ``mix``; so a multinomial draw, capped at what is available, followed by
    redrawing the overflow from the classes still open, has the same distribution in a few steps.

    Args:
        size: Number of samples to draw; at most ``available.sum()``.
        mix: ``[C]`` class probabilities ``q_k``.
        available: ``[C]`` samples left of each class.
        rng: Source of the draws.

    Returns:
        ``[C]`` int64 counts, summing to ``size``, each at most ``available``.
    """
    counts = np.zeros_like(available)
    while (missing := size - counts.sum()) > 0:
        open_classes = counts < available
        weights = np.where(open_classes, mix, 0.0)
        if weights.sum() == 0:  # tiny α can leave q_k no mass on the classes still open
            weights = (available - counts).astype(float)
        drawn = rng.multinomial(missing, weights / weights.sum())
        counts += np.minimum(drawn, available - counts)
    return counts
