"""Power-law client sizes over consecutive class pairs: FedProx's MNIST protocol (Li et al., 2020)

FedProx (``data/mnist/generate_niid.py``) gives user ``u`` the digits ``l = (u + j) mod 10`` for
``j < 2``: first 5 samples of each, read sequentially from the class, then ``props[l, u // 10, j]``
more, where ``props ~ LogNormal(0, 2)`` of shape ``[10, 100, 2]`` is normalised per digit and scaled
by the digit's remaining samples. A draw that would overrun its class is skipped, which is why the
protocol uses only about 61–69k of MNIST's 70k images.

Here ``C``, the number of users, the classes per user and the base share are parameters, so the same
protocol runs on small pools (e.g. 100 users with 2 base samples on scikit-learn's 1,797 digits).
"""

from __future__ import annotations

import math

import numpy as np

from fedlight.data.partition.base import FLAG, Partitioner, check_settings, sorted_indices
from fedlight.errors import ConfigError


class PowerLaw(Partitioner):
    """FedProx's MNIST partition: ``k`` consecutive classes per client, log-normal amounts of each.

    Client ``u`` holds classes ``l = (u + j) mod C`` for ``j < k``. It first receives
    ``base_samples`` of each, then ``int(props[l, u // C, j])`` more, with
    ``props ~ LogNormal(0, sigma)`` of shape ``[C, ceil(K / C), k]``. ``props`` is normalised per
    class over the entries some client reads (all of them when ``K`` is a multiple of ``C``, as in
    FedProx) and scaled by the samples of the class left after the first phase. Samples are taken
    from each class in pool order; a draw that would overrun its class is skipped, so the partition
    does not cover the pool.

    Args:
        num_clients: Number of clients ``K`` (FedProx: 1000).
        classes_per_client: Number ``k`` of consecutive classes each client holds (FedProx: 2).
        base_samples: Samples of each of its classes every client receives before the power-law
            phase (FedProx: 5).
        sigma: Standard deviation of the log-normal amounts; larger is more skewed (FedProx: 2).
    """

    def __init__(
        self,
        num_clients: int = 1000,
        classes_per_client: int = 2,
        base_samples: int = 5,
        sigma: float = 2.0,
    ) -> None:
        problems = []
        if base_samples < 1:
            problems.append(
                f"Expected {FLAG}.base_samples >= 1, got {base_samples}; it guarantees that every client holds each "
                "of its classes."
            )
        check_settings(
            problems, num_clients=(num_clients, 1), classes_per_client=(classes_per_client, 1), sigma=(sigma, 0)
        )
        self.num_clients = num_clients
        self.classes_per_client = classes_per_client
        self.base_samples = base_samples
        self.sigma = sigma

    def split(
        self, targets: np.ndarray, num_classes: int, rng: np.random.Generator, groups: np.ndarray | None
    ) -> list[np.ndarray]:
        num_clients, k, base = self.num_clients, self.classes_per_client, self.base_samples
        if k > num_classes:
            raise ConfigError(
                f"Expected --data.partitioner.init_args.classes_per_client <= {num_classes} (the number of "
                f"classes), got {k}; lower classes_per_client."
            )
        members = [np.flatnonzero(targets == c) for c in range(num_classes)]
        class_sizes = np.array([m.size for m in members])
        held = (np.arange(num_clients)[:, None] + np.arange(k)) % num_classes  # [K, k]
        base_total = base * np.bincount(held.ravel(), minlength=num_classes)  # [C]
        short = np.flatnonzero(base_total > class_sizes)
        if short.size:
            detail = ", ".join(f"class {c} has {class_sizes[c]} but needs {base_total[c]}" for c in short)
            raise ConfigError(
                f"The pool is too small for PowerLaw to give each of its {num_clients} clients {base} samples "
                f"of each of its {k} classes ({detail}); lower --data.partitioner.init_args.num_clients "
                "or --data.partitioner.init_args.base_samples."
            )

        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        pointer = np.zeros(num_classes, dtype=np.int64)
        for u in range(num_clients):
            for c in held[u]:
                parts[u].append(members[c][pointer[c] : pointer[c] + base])
                pointer[c] += base

        num_blocks = math.ceil(num_clients / num_classes)
        props = rng.lognormal(0.0, self.sigma, size=(num_classes, num_blocks, k))
        # entry [l, g, j] is read by client g·C + (l − j) mod C, which need not exist when C ∤ K
        reader = (
            np.arange(num_blocks)[None, :, None] * num_classes
            + (np.arange(num_classes)[:, None, None] - np.arange(k)) % num_classes
        )
        props = np.where(reader < num_clients, props, 0.0)
        total = props.sum(axis=(1, 2), keepdims=True)
        # classes no client holds (K < C) have no readable entry and stay all zero
        props = np.divide(props, total, out=np.zeros_like(props), where=total > 0)
        props *= (class_sizes - base_total)[:, None, None]
        for u in range(num_clients):
            for j, c in enumerate(held[u]):
                amount = int(props[c, u // num_classes, j])
                if pointer[c] + amount <= class_sizes[c]:
                    parts[u].append(members[c][pointer[c] : pointer[c] + amount])
                    pointer[c] += amount
        return sorted_indices(np.concatenate(shares) for shares in parts)
