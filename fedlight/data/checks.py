"""Checks of a dataset's samples when the data are set up: labels in range, integer labels, finite inputs.

A label outside ``[0, C)`` in one client's held-out split would otherwise end a run in evaluation with an
``IndexError`` (or never, when that client is not sampled), float labels would be truncated to classes, and NaN
inputs would train to nothing and exit 0. Every problem is reported with the dataset, the number of samples and
the clients (and splits) that hold them.

Cost: tensors held in memory are read once, in blocks of about 16 M values (one pass over the pool, a small share
of one round's work, and no copy of it). Lazily read samples (JPEGs, PNG masks) are not read at set-up: their label maps
are checked as each batch is read (:meth:`SampleChecks.check_read`), so a bad mask stops the run with the same
message, naming the sample, the first time it is read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fedlight.errors import ConfigError

#: The label of void pixels in dense targets (``LabelledTensors.targets``), counted nowhere.
VOID = 255
#: Values read at once when a resident tensor is checked: bounds the temporary masks (16 Mi booleans).
CHUNK_VALUES = 2**24


def _chunks(data: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``data`` split along samples into blocks of about :data:`CHUNK_VALUES` values (at least one sample)."""
    per_sample = max(1, data[0].numel()) if len(data) else 1
    return data.split(max(1, CHUNK_VALUES // per_sample))


def describe_dataset(dataset: Any) -> str:
    """The dataset as the user named it: ``--data.dataset`` NpzDataset (path=…).

    >>> class Npz: path = "a.npz"
    >>> describe_dataset(Npz())
    '--data.dataset Npz (path=a.npz)'
    """
    where = [f"{name}={getattr(dataset, name)}" for name in ("path", "root") if getattr(dataset, name, None)]
    return f"--data.dataset {type(dataset).__name__}" + (f" ({', '.join(where)})" if where else "")


def bad_labels(targets: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, list[int]]:
    """``[N]`` bool: the samples holding a label outside ``[0, C)`` (and, in dense targets, not :data:`VOID`);
    and up to five of the bad values, smallest first.

    >>> mask, values = bad_labels(torch.tensor([0, -1, 2, 3]), 3)
    >>> mask.tolist(), values
    ([False, True, False, True], [-1, 3])
    >>> bad_labels(torch.tensor([[[0, 255]], [[7, 1]]]), 3)[0].tolist()  # void is allowed in label maps
    [False, True]
    """
    masks, values = [], set()
    for block in _chunks(targets):
        wrong = (block < 0) | (block >= num_classes)
        if block.ndim > 1:
            wrong &= block != VOID
            masks.append(wrong.flatten(1).any(dim=1))
        else:
            masks.append(wrong)
        if len(values) < 5 and bool(wrong.any()):
            values.update(block[wrong].unique()[:5].tolist())
    mask = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
    return mask.cpu(), sorted(values)[:5]


def non_finite(inputs: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: the samples with a NaN or ±Inf input value.

    >>> non_finite(torch.tensor([[0.0, 1.0], [float("nan"), 0.0]])).tolist()
    [False, True]
    """
    if not inputs.is_floating_point():
        return torch.zeros(len(inputs), dtype=torch.bool)
    masks = [~block.reshape(len(block), -1).isfinite().all(dim=1) for block in _chunks(inputs)]
    return torch.cat(masks).cpu() if masks else torch.zeros(0, dtype=torch.bool)


class SampleChecks:
    """Checks the pool and the test set of a set-up data module, and later the label maps read lazily.

    Args:
        dataset: the ``--data.dataset`` object (named in messages; ``float_targets`` allows real-valued targets).
        num_classes: C.
        clients: the partition, each client's training and held-out pool indices, to name who holds a sample.
    """

    def __init__(
        self, dataset: Any, num_classes: int, clients: Sequence[tuple[np.ndarray, np.ndarray]], pool_size: int
    ) -> None:
        self.where = describe_dataset(dataset)
        self.num_classes = num_classes
        self.float_targets = bool(getattr(dataset, "float_targets", False))
        self.owner = np.full(pool_size, -1, dtype=np.int64)  # client·2 + (0 training, 1 held out); −1: unused
        for client, (train, held_out) in enumerate(clients):
            self.owner[train] = 2 * client
            self.owner[held_out] = 2 * client + 1

    def problems(self, pool: Any, test: Any | None) -> list[str]:
        """Every problem of the pool's and the test set's resident tensors, one sentence each."""
        problems = self._of(pool, "pool")
        if test is not None:
            problems += self._of(test, "test")
        return problems

    def check_read(self, targets: torch.Tensor, index: torch.Tensor | slice, part: str) -> None:
        """Refuses a batch of lazily read targets with a label outside ``[0, C)`` or void, naming its samples."""
        mask, values = bad_labels(targets, self.num_classes)
        if bool(mask.any()):
            positions = torch.arange(index.start, index.stop) if isinstance(index, slice) else index.cpu()
            raise ConfigError(self._labels_message(positions[mask].numpy(), values, part, targets.ndim > 1, read=True))

    # -- messages ---------------------------------------------------------------------------------------------
    def _of(self, data: Any, part: str) -> list[str]:
        problems = []
        targets, inputs = data.targets, data.inputs
        if isinstance(targets, torch.Tensor):
            if targets.is_floating_point() or targets.is_complex():
                if not self.float_targets:
                    fractional = int((targets != targets.round()).sum()) if targets.is_floating_point() else -1
                    problems.append(
                        f"{self.where} gives {self._part(part)} targets of dtype {targets.dtype}, not integer class "
                        f"labels ({fractional} of {targets.numel()} values are not whole numbers); they would be "
                        "truncated. Give the dataset integer labels (int64)."
                    )
            else:
                mask, values = bad_labels(targets, self.num_classes)
                if bool(mask.any()):
                    problems.append(
                        self._labels_message(mask.nonzero().squeeze(1).numpy(), values, part, targets.ndim > 1)
                    )
        if isinstance(inputs, torch.Tensor):
            mask = non_finite(inputs)
            if bool(mask.any()):
                problems.append(
                    f"{self.where} gives {int(mask.sum())} {self._part(part)} samples with NaN or Inf inputs"
                    f"{self._holders(mask.nonzero().squeeze(1).numpy(), part)}. They would train to NaN; fix or drop "
                    "them in the data."
                )
        return problems

    def _labels_message(self, positions: np.ndarray, values: list[int], part: str, dense: bool, read=False) -> str:
        allowed = f"[0, {self.num_classes})" + (f" or {VOID} (void)" if dense else "")
        how = " (found as they were read)" if read else ""
        return (
            f"{self.where} gives {len(positions)} {self._part(part)} samples with labels outside {allowed}, e.g. "
            f"{', '.join(map(str, values))}{how}{self._holders(positions, part)}. Fix the labels, or the dataset's "
            "number of classes."
        )

    @staticmethod
    def _part(part: str) -> str:
        return "test-set" if part == "test" else "pool"

    def _holders(self, positions: np.ndarray, part: str) -> str:
        """``: 2 in client 4's held-out split, 1 in client 7's training split`` (samples of the partition only)."""
        if part == "test":
            shown = ", ".join(map(str, positions[:5])) + (" …" if len(positions) > 5 else "")
            return f" (test-set samples {shown})"
        owners = Counter(int(o) for o in self.owner[positions] if o >= 0)
        unused = int((self.owner[positions] < 0).sum())
        listed = [
            f"{count} in client {owner // 2}'s {'held-out' if owner % 2 else 'training'} split"
            for owner, count in sorted(owners.items())[:4]
        ]
        if len(owners) > 4:
            listed.append(f"… ({len(owners)} splits in all)")
        if unused:
            listed.append(f"{unused} in no client")
        return ": " + ", ".join(listed)
