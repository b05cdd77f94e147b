"""Each client's class counts n_{k,c} over its training split: what rules for label skew (FedLC, FedRoD) calibrate
their clients' losses with.

A client knows its own labels, so the counts never leave it; they are read from the partitioned data once, when a
run starts (a resumed run reads the same partition, which the checkpoint's data fingerprint guards).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fedlight.errors import ConfigError

if TYPE_CHECKING:
    from fedlight.data.datamodule import FederatedDataModule


def label_count_problems(rule: str, datamodule: Any) -> list[str]:
    """Why ``rule`` cannot count the classes of ``datamodule``'s clients (set up), one sentence; empty when it can.

    The counts need one integer class per training sample, held in memory: a classification dataset.
    """
    targets = getattr(getattr(datamodule, "pool", None), "targets", None)
    if isinstance(targets, torch.Tensor) and targets.ndim == 1 and not targets.is_floating_point():
        return []
    found = type(targets).__name__ if not isinstance(targets, torch.Tensor) else f"{targets.dtype} [{targets.ndim}-d]"
    return [
        f"{rule} calibrates each client's loss with its class counts, which need one integer class per training "
        f"sample (a classification dataset), but --data's targets are {found}. Choose a classification --data, or "
        "another rule."
    ]


def client_class_counts(datamodule: FederatedDataModule) -> torch.Tensor:
    """``[K, C]`` int64 on the CPU: n_{k,c}, the samples of class c in client k's training split.

    Raises:
        ConfigError: when the data has no integer class per sample (:func:`label_count_problems`).

    >>> from types import SimpleNamespace
    >>> data = SimpleNamespace(
    ...     pool=SimpleNamespace(targets=torch.tensor([0, 2, 2, 1, 0])), num_classes=3,
    ...     client_train=[torch.tensor([0, 1, 2]), torch.tensor([3, 4])],
    ... )
    >>> client_class_counts(data).tolist()
    [[1, 0, 2], [1, 1, 0]]
    """
    problems = label_count_problems("This rule", datamodule)
    if problems:
        raise ConfigError(*problems)
    targets = datamodule.pool.targets.cpu()
    num_classes = datamodule.num_classes
    return torch.stack(
        [torch.bincount(targets[indices.cpu()], minlength=num_classes) for indices in datamodule.client_train]
    ).long()
