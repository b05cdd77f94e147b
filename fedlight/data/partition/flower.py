"""Any partitioner of Flower Datasets (``flwr-datasets``) applied to a fedlight dataset's pool

Flower Datasets ships partitioners that fedlight has no counterpart for (``PathologicalPartitioner``,
``ContinuousPartitioner``, ``DistributionPartitioner``, ``GroupedNaturalIdPartitioner``, …) and researchers who
come from Flower know their settings by heart. A Flower partitioner splits a Hugging Face ``datasets.Dataset``;
this bridge hands it one that holds only the pool's labels (column ``label``), the samples' natural client ids
where the dataset has them (column ``client_id``) and each sample's position in the pool, and reads back each
partition's positions, so that the result is the index sets a fedlight partitioner returns.

Flower's partitioners draw from a seed of their own (``seed=42`` by default). Unless ``kwargs`` sets ``seed``,
the bridge draws it from the run's partition generator, so one ``--seed_everything`` gives one partition as it
does for fedlight's own partitioners. Needs the optional extra: ``pip install "fedlight[flower-datasets]"``.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import numpy as np

from fedlight.data.partition.base import FLAG, Partitioner, sorted_indices
from fedlight.errors import ConfigError

#: the columns of the dataset a Flower partitioner sees
LABEL, CLIENT_ID, POSITION = "label", "client_id", "fedlight_position"


class FlowerPartitioner(Partitioner):
    """Runs a Flower Datasets partitioner on the pool's labels.

    Args:
        partitioner: the Flower partitioner's class: a name from ``flwr_datasets.partitioner``
            (``DirichletPartitioner``) or a full import path.
        kwargs: its constructor's arguments, as Flower documents them; partition by ``label`` (the class) or
            ``client_id`` (the natural client id). Without ``seed``, the run's generator gives one.

    Example (YAML)::

        data:
          partitioner:
            class_path: fedlight.data.partition.FlowerPartitioner
            init_args:
              partitioner: PathologicalPartitioner
              kwargs: {num_partitions: 20, partition_by: label, num_classes_per_partition: 2}
    """

    uses_groups = True

    def __init__(self, partitioner: str, kwargs: dict[str, Any] | None = None) -> None:
        self.partitioner, self.kwargs = partitioner, dict(kwargs or {})
        self._class = flower_class(partitioner)
        try:
            inspect.signature(self._class).bind(**self.kwargs)
        except TypeError as error:
            raise ConfigError(
                f"{FLAG}.kwargs does not fit {self._class.__name__}: {error}. Its arguments: "
                f"{inspect.signature(self._class)}."
            ) from None
        self.num_clients = self.kwargs.get("num_partitions")

    def split(
        self, targets: np.ndarray, num_classes: int, rng: np.random.Generator, groups: np.ndarray | None
    ) -> list[np.ndarray]:
        from datasets import Dataset

        kwargs = dict(self.kwargs)
        if "seed" in inspect.signature(self._class).parameters and "seed" not in kwargs:
            kwargs["seed"] = int(rng.integers(2**31 - 1))
        by = kwargs.get("partition_by")
        if by == CLIENT_ID and groups is None:
            raise ConfigError(
                f"{FLAG}.kwargs.partition_by is {CLIENT_ID}, but this dataset has no natural client ids; "
                f"partition by {LABEL} instead."
            )
        if by is not None and by not in (LABEL, CLIENT_ID):
            raise ConfigError(
                f"Expected {FLAG}.kwargs.partition_by to be {LABEL} (the class) or {CLIENT_ID} (the natural "
                f"client id), got {by!r}: the pool's dataset has only those columns."
            )
        columns = {LABEL: np.asarray(targets, dtype=np.int64), POSITION: np.arange(len(targets), dtype=np.int64)}
        if groups is not None:
            columns[CLIENT_ID] = np.asarray(groups)
        partitioner = self._class(**kwargs)
        partitioner.dataset = Dataset.from_dict(columns)
        parts = [
            np.asarray(partitioner.load_partition(k)[POSITION], dtype=np.int64)
            for k in range(partitioner.num_partitions)
        ]
        self.num_clients = len(parts)
        return sorted_indices(parts)


def flower_class(name: str) -> type:
    """The partitioner class ``name`` names, with an error that says how to install Flower Datasets."""
    try:
        module = importlib.import_module("flwr_datasets.partitioner")
    except ImportError:
        raise ConfigError(
            f"{FLAG}.partitioner={name} needs Flower Datasets, which is not installed: "
            'pip install "fedlight[flower-datasets]" (or flwr-datasets).'
        ) from None
    if "." not in name:
        found = getattr(module, name, None)
    else:
        path, _, attribute = name.rpartition(".")
        try:
            found = getattr(importlib.import_module(path), attribute, None)
        except ImportError:
            found = None
    if not (isinstance(found, type) and issubclass(found, module.Partitioner)):
        names = sorted(n for n in dir(module) if n.endswith("Partitioner") and n != "Partitioner")
        raise ConfigError(
            f"{FLAG}.partitioner={name} is not a Flower Datasets partitioner; one of: {', '.join(names)}."
        )
    return found
