"""What a dataset gives fedlight: labelled tensors, optionally with natural client ids.

Datasets are small classes with typed constructors so that YAML can choose them with
``class_path``/``init_args``. Partitioning into clients is not their job: that is a
:class:`~fedlight.data.partition.Partitioner`'s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LabelledTensors:
    """Inputs and integer labels held in memory.

    Attributes:
        inputs: ``[N, ...]`` float32 inputs.
        targets: ``[N]`` int64 class labels.
        groups: ``[N]`` natural client id of every sample (writer, user, city), or ``None``
            when the dataset has no natural split.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    groups: np.ndarray | None = None

    def __post_init__(self) -> None:
        assert self.inputs.shape[0] == self.targets.shape[0], (
            f"{self.inputs.shape[0]} inputs but {self.targets.shape[0]} targets"
        )
        assert self.groups is None or len(self.groups) == len(self.targets), (
            f"{len(self.groups)} group ids for {len(self.targets)} samples"
        )

    def __len__(self) -> int:
        return int(self.targets.shape[0])


class FederatedDataset(ABC):
    """A labelled dataset that fedlight partitions over clients.

    Subclasses set ``num_classes`` and ``input_shape`` (one sample, without the batch axis) and
    implement :meth:`load_train`; :meth:`load_test` returns a separate global test set when the
    dataset has one. Without one, the union of the clients' held-out splits is the global test set,
    as in the FedProx and prototype-margin papers.
    """

    num_classes: int
    input_shape: tuple[int, ...]

    @abstractmethod
    def load_train(self) -> LabelledTensors:
        """Returns the pool that is partitioned over clients."""

    def load_test(self) -> LabelledTensors | None:
        """Returns a separate global test set, or ``None`` when the dataset has none."""
        return None
