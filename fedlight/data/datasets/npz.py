"""Your own arrays as a federated dataset: a NumPy ``.npz`` file with inputs, targets and client ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.errors import ConfigError


class NpzDataset(FederatedDataset):
    """Reads ``inputs`` ``[N, ...]``, ``targets`` ``[N]`` and optionally ``groups`` ``[N]`` from an ``.npz``.

    Save one with ``numpy.savez(path, inputs=x, targets=y, groups=client_ids)``. With ``groups`` the
    ``Natural`` partitioner gives one client per id; without, choose a partitioner. A file with ``groups`` under
    another partitioner (one that a base config chose, say) is refused at set-up rather than silently split
    anew: choose ``Natural`` to keep the ids as clients, or set ``ignore_groups``.

    Args:
        path: the ``.npz`` file.
        num_classes: number of classes; by default ``max(targets) + 1``.
        ignore_groups: leave the file's ``groups`` unused and let ``--data.partitioner`` split the samples.
    """

    def __init__(self, path: str, num_classes: int | None = None, ignore_groups: bool = False) -> None:
        self.path = Path(path)
        self.ignore_groups = ignore_groups
        if not self.path.is_file():
            raise ConfigError(
                f"--data.dataset.init_args.path={self.path} does not exist. Save your arrays there with "
                "numpy.savez(path, inputs=x, targets=y, groups=client_ids), or point the flag at the file."
            )
        with _open(self.path) as arrays:
            missing = {"inputs", "targets"} - set(arrays.files)
            if missing:
                raise ConfigError(
                    f"{self.path} lacks the arrays {sorted(missing)}; it has {sorted(arrays.files)}. "
                    "Save it with numpy.savez(path, inputs=x, targets=y)."
                )
            lengths = {name: len(arrays[name]) for name in ("inputs", "targets", "groups") if name in arrays.files}
            if len(set(lengths.values())) > 1:
                found = ", ".join(f"{len_} {name}" for name, len_ in lengths.items())
                raise ConfigError(
                    f"--data.dataset.init_args.path={self.path} holds {found}: every sample needs one of each. "
                    "Save arrays of one length with numpy.savez(path, inputs=x, targets=y, groups=client_ids)."
                )
            targets = arrays["targets"]
            if not (np.issubdtype(targets.dtype, np.integer) or targets.dtype == bool):
                numeric = np.issubdtype(targets.dtype, np.number)
                fractional = int((targets != np.round(targets)).sum()) if numeric else len(targets)
                raise ConfigError(
                    f"--data.dataset.init_args.path={self.path} holds targets of dtype {targets.dtype}, not integer "
                    f"class labels ({fractional} of {len(targets)} values are not whole numbers); they would be "
                    "truncated. Save them as integers: numpy.savez(path, inputs=x, targets=y.astype(numpy.int64), ...)."
                )
            self.has_groups = "groups" in arrays.files and not ignore_groups
            self.input_shape = tuple(arrays["inputs"].shape[1:])
            self.num_classes = num_classes if num_classes is not None else int(arrays["targets"].max()) + 1

    def load_train(self) -> LabelledTensors:
        with _open(self.path) as arrays:
            groups = arrays["groups"] if self.has_groups else None
            return LabelledTensors(
                torch.from_numpy(arrays["inputs"]).float(), torch.from_numpy(arrays["targets"]).long(), groups
            )

    def partition_problems(self, partitioner: Any) -> list[str]:
        """``[problem]`` when the file's client ids would be left unused by ``partitioner``."""
        if not self.has_groups or partitioner.uses_groups:
            return []
        return [
            f"--data.dataset.init_args.path={self.path} holds each sample's client id (groups), but "
            f"--data.partitioner={type(partitioner).__name__} splits the samples itself and would ignore them. Use "
            "--data.partitioner=fedlight.data.partition.Natural for one client per id, or set "
            "--data.dataset.init_args.ignore_groups=true to partition anew."
        ]


def _open(path: Path) -> Any:
    """``numpy.load`` of an ``.npz``, or a ConfigError naming the file when it is not one (a text file, a bare
    ``.npy``, a truncated archive)."""
    try:
        arrays = np.load(path)
    except Exception as err:  # numpy's and zipfile's errors differ by what the file holds instead
        raise ConfigError(
            f"--data.dataset.init_args.path={path} is not a readable .npz archive ({type(err).__name__}: {err}). "
            "Save your arrays with numpy.savez(path, inputs=x, targets=y, groups=client_ids)."
        ) from None
    if not isinstance(arrays, np.lib.npyio.NpzFile):
        raise ConfigError(
            f"--data.dataset.init_args.path={path} holds a single array, not an .npz archive of named arrays. Save "
            "them with numpy.savez(path, inputs=x, targets=y, groups=client_ids)."
        )
    return arrays
