"""Pathological label skew: every client holds exactly ``k`` classes.

The "#C = k" partition of McMahan et al. (2017) and Li et al. (2022, "Federated Learning on Non-IID
Data Silos"). Classes are dealt out consecutively, as FedProx's MNIST and FEMNIST protocols do
(client ``u`` holds ``(u + j) mod C`` for ``j < k``), as ``k`` distinct classes drawn at random per
client, or as NIID-Bench's ``noniid-#label{k}`` deals them (``partition_data``): client ``u`` holds class
``u mod C`` and ``k − 1`` other distinct classes drawn at random, so that with ``K ≥ C`` clients every class
has a holder. Each class's samples are then shuffled and split as evenly as possible
(``np.array_split``, as NIID-Bench does) among the clients holding it, so that sizes vary only through
class sizes and holder counts.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from fedlight.data.partition.base import Partitioner, check_settings, sorted_indices
from fedlight.errors import ConfigError


class KClasses(Partitioner):
    """Each client holds exactly ``classes_per_client`` distinct classes, with every sample of a held
    class shared evenly among the clients that hold it.

    With ``assignment="consecutive"`` and ``num_clients`` a multiple of ``C``, every class has the
    same number of holders and the whole pool is used; otherwise samples of classes nobody holds are
    left out.

    Args:
        num_clients: Number of clients.
        classes_per_client: Number ``k`` of distinct classes every client holds.
        assignment: ``"consecutive"``: client ``u`` holds classes ``(u + j) mod C``, ``j < k``
            (FedProx's scheme, independent of the seed); ``"random"``: each client draws ``k``
            distinct classes uniformly from the partition's RNG; ``"niid_bench"``: client ``u`` holds
            ``u mod C`` and draws ``k − 1`` other distinct classes uniformly (NIID-Bench's "#C = k").
    """

    def __init__(
        self,
        num_clients: int,
        classes_per_client: int = 2,
        assignment: Literal["consecutive", "random", "niid_bench"] = "consecutive",
    ) -> None:
        check_settings([], num_clients=(num_clients, 1), classes_per_client=(classes_per_client, 1))
        self.num_clients = num_clients
        self.classes_per_client = classes_per_client
        self.assignment = assignment

    def split(
        self, targets: np.ndarray, num_classes: int, rng: np.random.Generator, groups: np.ndarray | None
    ) -> list[np.ndarray]:
        k = self.classes_per_client
        if k > num_classes:
            raise ConfigError(
                f"Expected --data.partitioner.init_args.classes_per_client <= {num_classes} (the number of "
                f"classes), got {k}; lower classes_per_client."
            )
        if self.assignment == "consecutive":
            held = (np.arange(self.num_clients)[:, None] + np.arange(k)) % num_classes  # [K, k]
        elif self.assignment == "random":
            held = np.stack([rng.choice(num_classes, size=k, replace=False) for _ in range(self.num_clients)])
        else:
            own = np.arange(self.num_clients) % num_classes
            others = [rng.choice(np.delete(np.arange(num_classes), u), size=k - 1, replace=False) for u in own]
            held = np.column_stack([own, np.stack(others)])

        class_sizes = np.bincount(targets, minlength=num_classes)
        holder_counts = np.bincount(held.ravel(), minlength=num_classes)
        short = np.flatnonzero(class_sizes < holder_counts)
        if short.size:
            detail = ", ".join(f"class {c}: {class_sizes[c]} samples for {holder_counts[c]} clients" for c in short)
            raise ConfigError(
                f"KClasses cannot give every client at least one sample of each of its classes ({detail}); "
                f"lower --data.partitioner.init_args.num_clients or classes_per_client."
            )

        parts: list[list[np.ndarray]] = [[] for _ in range(self.num_clients)]
        for c in range(num_classes):
            holders = np.flatnonzero(np.any(held == c, axis=1))
            if holders.size == 0:
                continue
            members = rng.permutation(np.flatnonzero(targets == c))
            for client, share in zip(holders, np.array_split(members, holders.size), strict=True):
                parts[client].append(share)
        return sorted_indices(np.concatenate(shares) for shares in parts)
