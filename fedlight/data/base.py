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

from fedlight.errors import ConfigError


@dataclass
class LabelledTensors:
    """Inputs and integer labels, held in memory or read on demand.

    Attributes:
        inputs: ``[N, ...]`` float32 inputs, or a :class:`LazySamples` that reads them batch by batch.
        targets: ``[N]`` int64 class labels, or ``[N, H, W]`` int64 label maps for dense tasks (255 is
            void), or a :class:`LazySamples` of them.
        groups: ``[N]`` natural client id of every sample (writer, user, city), or ``None``
            when the dataset has no natural split.
        labels: ``[N]`` one class per sample for partitioners, when ``targets`` are not that (label maps:
            the image's object class; a coarsened label set: the fine class, so both variants share one
            partition). ``None``: partitioners read ``targets``.
        train_reader: reads training batches of ``(input, target)`` pairs with augmentations drawn per
            sample as they are read, in place of indexing ``inputs`` and ``targets``; ``None``: training
            batches are indexed like every other batch. Evaluation and client-data passes always index.
    """

    inputs: torch.Tensor | LazySamples
    targets: torch.Tensor | LazySamples
    groups: np.ndarray | None = None
    labels: np.ndarray | None = None
    train_reader: PairedSamples | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.inputs.shape[0] != self.targets.shape[0]:
            problems.append(f"{self.inputs.shape[0]} inputs but {self.targets.shape[0]} targets")
        if self.groups is not None and len(self.groups) != len(self.targets):
            problems.append(f"{len(self.groups)} group ids for {len(self.targets)} samples")
        if self.labels is not None and len(self.labels) != len(self.targets):
            problems.append(f"{len(self.labels)} partition labels for {len(self.targets)} samples")
        if self.train_reader is not None and len(self.train_reader) != len(self.targets):
            problems.append(f"a training reader of {len(self.train_reader)} samples for {len(self.targets)}")
        if problems:
            raise ConfigError(
                f"The --data dataset gives {'; '.join(problems)}: every sample needs one input, one target"
                " (and one group id or partition label where given). Fix the arrays the dataset reads."
            )

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    def partition_labels(self) -> np.ndarray:
        """``[N]`` int64: the one class per sample that partitioners split by."""
        if self.labels is not None:
            return np.asarray(self.labels, dtype=np.int64)
        if not (isinstance(self.targets, torch.Tensor) and self.targets.ndim == 1):
            raise ConfigError(
                "The --data dataset gives dense or lazily read targets but no LabelledTensors.labels: a partitioner "
                "needs one class per sample. Set labels in the dataset's load_train, or use the Natural partitioner."
            )
        return self.targets.cpu().numpy()

    def to(self, device: torch.device | str) -> LabelledTensors:
        """Moves resident tensors to ``device``; lazy sources stay where they read from."""

        def move(data: torch.Tensor | LazySamples) -> torch.Tensor | LazySamples:
            return data.to(device) if isinstance(data, torch.Tensor) else data

        return LabelledTensors(move(self.inputs), move(self.targets), self.groups, self.labels, self.train_reader)


class LazySamples(ABC):
    """Samples read on demand, for pools that do not fit in memory (e.g. Pascal VOC's JPEGs).

    Indexing with a ``[B]`` int64 index tensor returns the ``[B, ...]`` stacked batch on the CPU, like
    indexing a resident tensor, so :class:`~fedlight.data.FederatedDataModule` serves both alike and
    moves each batch to the training device as it is read.
    """

    shape: tuple[int, ...]  #: ``(N, ...)``, the shape the stacked pool would have

    @abstractmethod
    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        """Returns the samples at ``index`` ``[B]``, stacked into ``[B, ...]``."""

    def __len__(self) -> int:
        return self.shape[0]


class PairedSamples(ABC):
    """Training samples read as ``(input, target)`` pairs, augmented per sample as they are read.

    For pools whose images differ in size: a random crop must cut each image and its label map alike before
    the batch can stack, so it cannot wait for a :class:`~fedlight.data.transforms.BatchTransform`. The
    draws come from the client's generator, so a run's crops are fixed by its seed like every other
    augmentation.
    """

    @abstractmethod
    def read(self, index: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the augmented samples at ``index`` ``[B]`` as stacked ``([B, ...], [B, ...])`` on the CPU."""

    @abstractmethod
    def __len__(self) -> int:
        """Samples in the pool."""


class FederatedDataset(ABC):
    """A labelled dataset that fedlight partitions over clients.

    Subclasses set ``num_classes`` and ``input_shape`` (one sample, without the batch axis) and
    implement :meth:`load_train`; :meth:`load_test` returns a separate global test set when the
    dataset has one. Without one, the union of the clients' held-out splits is the global test set,
    as in the FedProx and prototype-margin papers. A dataset that knows its classes' names sets
    ``class_names``, one per class in label order; per-class scores and figure legends then use them.
    """

    num_classes: int
    input_shape: tuple[int, ...]
    #: the names of classes 0…C−1; None: the classes are known by their numbers only
    class_names: tuple[str, ...] | None = None
    #: Whether the training samples carry real labels; False for unlabelled clients whose label maps are all
    #: void (LADD's CrossCity split), so that options that read training labels can be refused at set-up.
    train_labels: bool = True
    #: Whether ``targets`` are real values (a regression) rather than class labels; otherwise float targets are
    #: refused at set-up instead of being truncated to classes.
    float_targets: bool = False

    @abstractmethod
    def load_train(self) -> LabelledTensors:
        """Returns the pool that is partitioned over clients."""

    def load_test(self) -> LabelledTensors | None:
        """Returns a separate global test set, or ``None`` when the dataset has none."""
        return None
