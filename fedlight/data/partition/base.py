"""The partitioner interface: which samples of the pool each client holds.

A partitioner sees only labels (and natural client ids, where a dataset has them), never inputs, so
the same protocol applies to any dataset. It returns one sorted ``int64`` index array per client,
pointing into the pool that :meth:`~fedlight.data.base.FederatedDataset.load_train` returned.

Example:
    >>> import numpy as np
    >>> from fedlight.data.partition import KClasses
    >>> targets = np.array([0, 0, 1, 1, 2, 2])
    >>> parts = KClasses(num_clients=3, classes_per_client=2)(targets, 3, np.random.default_rng(0))
    >>> [np.unique(targets[part]).tolist() for part in parts]
    [[0, 1], [1, 2], [0, 2]]
    >>> validate_partition(parts, num_samples=6, cover=True)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

import numpy as np

from fedlight.errors import ConfigError

FLAG = "--data.partitioner.init_args"


class Partitioner(ABC):
    """Splits a labelled pool into per-client index sets.

    Subclasses implement :meth:`split`; their constructors hold the protocol's knobs, typed and documented so
    that YAML and ``--help`` can set them under ``--data.partitioner.init_args``. A partitioner that follows the
    samples' natural client ids sets :attr:`uses_groups`; the others never see them.
    """

    #: whether the partition follows the samples' natural client ids (``groups``)
    uses_groups: ClassVar[bool] = False

    def __call__(
        self,
        targets: np.ndarray,
        num_classes: int,
        rng: np.random.Generator,
        groups: np.ndarray | None = None,
    ) -> list[np.ndarray]:
        """Partitions the pool.

        Args:
            targets: ``[N]`` integer class label of every sample in the pool.
            num_classes: Number of classes ``C``; labels lie in ``[0, C)``.
            rng: The only source of randomness, so that one seed gives one partition.
            groups: ``[N]`` natural client id of every sample, or ``None``.

        Returns:
            One sorted ``int64`` array of pool indices per client; the arrays are disjoint.
        """
        return self.split(targets, num_classes, rng, groups if self.uses_groups else None)

    @abstractmethod
    def split(
        self, targets: np.ndarray, num_classes: int, rng: np.random.Generator, groups: np.ndarray | None
    ) -> list[np.ndarray]:
        """The partition of :meth:`__call__`; ``groups`` is ``None`` unless :attr:`uses_groups`."""


def check_settings(problems: list[str], **minimums: tuple[float, float]) -> None:
    """Raises one :class:`ConfigError` with ``problems`` and every setting below its minimum
    (``name=(value, minimum)``), or returns when there are none.

    >>> check_settings([], num_clients=(10, 1))
    >>> check_settings(["Expected alpha > 0, got 0."], num_clients=(0, 1))
    Traceback (most recent call last):
    fedlight.errors.ConfigError: Expected --data.partitioner.init_args.num_clients >= 1, got 0.
    Expected alpha > 0, got 0.
    """
    below = [f"Expected {FLAG}.{name} >= {low}, got {value}." for name, (value, low) in minimums.items() if value < low]
    if below or problems:
        raise ConfigError(*below, *problems)


def sorted_indices(parts: Iterable[Iterable[int] | np.ndarray]) -> list[np.ndarray]:
    """Turns per-client index collections into the sorted ``int64`` arrays partitioners return."""
    return [np.sort(np.asarray(part, dtype=np.int64)) for part in parts]


def validate_partition(parts: list[np.ndarray], num_samples: int, cover: bool = False) -> None:
    """Checks that a partition is well formed, reporting every problem at once.

    Args:
        parts: One index array per client, as a :class:`Partitioner` returns.
        num_samples: Size ``N`` of the pool the indices point into.
        cover: Also require every sample of the pool to belong to some client.

    Raises:
        ValueError: If an array is not sorted ``int64``, an index is out of ``[0, N)``, a sample
            belongs to two clients, or (with ``cover``) a sample belongs to none.
    """
    problems = []
    for client, part in enumerate(parts):
        if part.dtype != np.int64 or part.ndim != 1:
            problems.append(f"client {client} has a {part.ndim}-d {part.dtype} array, not 1-d int64")
        elif np.any(np.diff(part) < 0):
            problems.append(f"client {client}'s indices are not sorted")
        if part.size and (part.min() < 0 or part.max() >= num_samples):
            problems.append(f"client {client} has indices outside [0, {num_samples})")
    if not problems:
        owners = np.bincount(np.concatenate([*parts, np.empty(0, np.int64)]), minlength=num_samples)
        if np.any(owners > 1):
            problems.append(f"{int(np.sum(owners > 1))} samples belong to more than one client")
        if cover and np.any(owners == 0):
            problems.append(f"{int(np.sum(owners == 0))} of {num_samples} samples belong to no client")
    if problems:
        raise ValueError("Invalid partition: " + "; ".join(problems) + ".")
