"""Natural clients: one per writer, user, city or domain, as LEAF (Caldas et al., 2018) and the
FedProx Synthetic, FEMNIST and CelebA protocols define them.
"""

from __future__ import annotations

import numpy as np

from fedlight.data.partition.base import Partitioner, sorted_indices
from fedlight.errors import ConfigError


class Natural(Partitioner):
    """One client per distinct natural client id, in sorted id order; it covers the whole pool.

    Example:
        >>> import numpy as np
        >>> groups = np.array(["b", "a", "b", "c"])
        >>> Natural()(np.zeros(4, np.int64), 1, np.random.default_rng(0), groups)
        [array([1]), array([0, 2]), array([3])]
    """

    uses_groups = True

    def split(
        self, targets: np.ndarray, num_classes: int, rng: np.random.Generator, groups: np.ndarray | None
    ) -> list[np.ndarray]:
        """One client per id of ``groups``; the labels are not used."""
        if groups is None:
            raise ConfigError(
                "The Natural partitioner needs natural client ids, but the dataset's load_train() returned "
                "groups=None; choose a dataset with natural clients (e.g. Synthetic) or another "
                "--data.partitioner such as Dirichlet."
            )
        _, client_of_sample = np.unique(groups, return_inverse=True)
        order = np.argsort(client_of_sample, kind="stable")
        boundaries = np.flatnonzero(np.diff(client_of_sample[order])) + 1
        return sorted_indices(np.split(order, boundaries))
