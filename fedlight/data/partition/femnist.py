"""Log-normal users over consecutive classes: FedProx's FEMNIST protocol (Li et al., 2020)

FedProx (``litian96/FedProx:data/nist/data/my_sample.py``) draws ``n_u = LogNormal(4, 1) + 5`` for each
of 200 users and gives user ``u`` ``max(⌊n_u / k⌋, 2)`` samples of each of the ``k`` classes
``(u + j) mod 10``, ``j < k``, read from the shuffled class through a per-class pointer. Two
departures from that code, both following the papers:

- ``k = 5`` classes per user, as the FedProx paper and the prototype-margin paper state (the code has
  ``CLASS_PER_USER = 3``);
- the pointer wraps to the start of its class only when the next block would overrun the class. The
  code's test is inverted: it resets whenever the block *fits*, so every user read its block from the
  start of the class and users shared most of their samples.
"""

from __future__ import annotations

import numpy as np

from fedlight.data.partition.base import Partitioner, check_settings, sorted_indices
from fedlight.errors import ConfigError

# FedProx's constants: the log-normal's mean (of the log) and the least samples per held class.
_LOG_MEAN = 4.0
_MIN_PER_CLASS = 2


class FEMNISTPartition(Partitioner):
    """FedProx's FEMNIST partition: ``k`` consecutive classes per user, ``max(⌊n_u / k⌋, 2)`` samples of each.

    User ``u`` draws ``n_u = LogNormal(4, sigma) + base`` and holds classes ``(u + j) mod C``,
    ``j < k``. Each class is shuffled once and read in order by a cyclic pointer that wraps to the
    start only when the next block would overrun the class. The partition is disjoint unless a class
    wraps: then the users after the wrap reuse samples of earlier users, as in FedProx. With 4000
    images per class and FedProx's 200 users, about 1,830 are read per class on average (18,340 in
    all; the FedProx paper reports 18,345), so wrapping takes an extreme draw. Samples beyond the
    pointers belong to no user.

    Args:
        num_clients: Number of users (FedProx: 200).
        classes_per_client: Number ``k`` of consecutive classes each user holds (FedProx paper: 5).
        sigma: Standard deviation of ``log n_u``; larger means more unequal users (FedProx: 1).
        base: Constant added to every ``n_u`` (FedProx: 5).
    """

    def __init__(
        self,
        num_clients: int = 200,
        classes_per_client: int = 5,
        sigma: float = 1.0,
        base: int = 5,
    ) -> None:
        check_settings(
            [],
            num_clients=(num_clients, 1),
            classes_per_client=(classes_per_client, 1),
            sigma=(sigma, 0),
            base=(base, 0),
        )
        self.num_clients = num_clients
        self.classes_per_client = classes_per_client
        self.sigma = sigma
        self.base = base

    def split(
        self, targets: np.ndarray, num_classes: int, rng: np.random.Generator, groups: np.ndarray | None
    ) -> list[np.ndarray]:
        k = self.classes_per_client
        if k > num_classes:
            raise ConfigError(
                f"Expected --data.partitioner.init_args.classes_per_client <= {num_classes} (the number of "
                f"classes), got {k}; lower classes_per_client."
            )
        # FedProx shuffles every class before drawing the sizes
        members = [rng.permutation(np.flatnonzero(targets == c)) for c in range(num_classes)]
        sizes = rng.lognormal(_LOG_MEAN, self.sigma, self.num_clients) + self.base  # n_u
        per_class = np.maximum((sizes / k).astype(np.int64), _MIN_PER_CLASS)  # ⌊n_u / k⌋, at least 2
        held = (np.arange(self.num_clients)[:, None] + np.arange(k)) % num_classes  # [K, k]

        too_big = [(u, c) for u in range(self.num_clients) for c in held[u] if per_class[u] > members[c].size]
        if too_big:
            u, c = too_big[0]
            raise ConfigError(
                f"FEMNISTPartition drew {per_class[u]} samples of class {c} for client {u}, but the class has only "
                f"{members[c].size} ({len(too_big)} such draws in all); lower --data.partitioner.init_args.sigma "
                "or base, or use a larger pool."
            )

        pointer = np.zeros(num_classes, dtype=np.int64)
        parts = []
        for u in range(self.num_clients):
            shares = []
            for c in held[u]:
                if pointer[c] + per_class[u] > members[c].size:  # only an overrun wraps
                    pointer[c] = 0
                shares.append(members[c][pointer[c] : pointer[c] + per_class[u]])
                pointer[c] += per_class[u]
            parts.append(np.concatenate(shares))
        return sorted_indices(parts)
