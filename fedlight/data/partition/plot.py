"""The per-client class counts of a partition, and their scatter plot (Fig. 4 of the FedSLS paper).

Fig. 4 draws one dot per (client, class) pair that holds samples, at x = client id and y = class, with an
area that grows with the number of samples; lower Dirichlet α gives sparser, more uneven columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def class_counts(parts: Sequence[np.ndarray], targets: np.ndarray, num_classes: int) -> np.ndarray:
    """Returns ``[K, C]`` int64: how many samples of each class every client holds.

    >>> class_counts([np.array([0, 1, 2]), np.array([3])], np.array([0, 0, 1, 1]), 2).tolist()
    [[2, 1], [0, 1]]
    """
    return np.stack([np.bincount(targets[part], minlength=num_classes) for part in parts]).astype(np.int64)


def plot_class_counts(counts: np.ndarray, title: str | None = None, max_area: float = 60.0, ax: Any = None) -> Any:
    """Draws Fig. 4's scatter of ``counts`` ``[K, C]``: a dot per non-empty (client, class), area ∝ count.

    Args:
        counts: per-client class counts (:func:`class_counts`).
        title: the axes' title (e.g. ``Dir(α = 0.05)``).
        max_area: marker area (points²) of the largest count.
        ax: a matplotlib ``Axes`` to draw on; a new figure when ``None``.

    Returns:
        The matplotlib ``Figure``. matplotlib is only needed here (``pip install matplotlib``).
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, counts.shape[0] / 12), max(2.5, counts.shape[1] / 4)))
    clients, classes = np.nonzero(counts)
    areas = max_area * counts[clients, classes] / max(int(counts.max()), 1)
    ax.scatter(clients, classes, s=areas, color="tab:red", alpha=0.6, linewidths=0)
    ax.set_xlabel("client id")
    ax.set_ylabel("class")
    ax.set_xlim(-1, counts.shape[0])
    ax.set_ylim(-1, counts.shape[1])
    if title:
        ax.set_title(title)
    return ax.figure
