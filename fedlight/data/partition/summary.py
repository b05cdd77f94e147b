"""What a partition gives each client: class counts, classes per client, clients per class, size spread.

MO-FedProto's Fig. S1 shows, for each α of the Pascal VOC partition, (1) how many clients hold each
class, (2) how many clients hold a given number of classes and (3) the class mix of 30 random clients.
:func:`partition_statistics` computes the numbers and :func:`partition_figure` draws those three panels
(:func:`plot_partition_summary` into a PNG); :class:`~fedlight.callbacks.PartitionSummary` saves and logs them
at the start of a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass
class PartitionStatistics:
    """Per-client class counts of a partition and the summaries read from them.

    Attributes:
        counts: ``[K, C]`` samples of class c held by client k.
    """

    counts: np.ndarray

    @property
    def sizes(self) -> np.ndarray:
        """``[K]`` samples per client n_k."""
        return self.counts.sum(axis=1)

    @property
    def classes_per_client(self) -> np.ndarray:
        """``[K]`` number of classes each client holds."""
        return (self.counts > 0).sum(axis=1)

    @property
    def clients_per_class(self) -> np.ndarray:
        """``[C]`` number of clients holding each class."""
        return (self.counts > 0).sum(axis=0)

    @property
    def dominant_share(self) -> np.ndarray:
        """``[K]`` share of each client's most frequent class (1 for a single-class client)."""
        return self.counts.max(axis=1) / np.maximum(self.sizes, 1)

    def summary(self) -> dict[str, float]:
        """Scalar summaries: the sizes' mean, std and coefficient of variation, mean classes per client, …"""
        sizes = self.sizes.astype(np.float64)
        return {
            "clients": float(len(sizes)),
            "samples": float(sizes.sum()),
            "size_mean": float(sizes.mean()),
            "size_std": float(sizes.std()),
            "size_cv": float(sizes.std() / sizes.mean()),
            "classes_per_client_mean": float(self.classes_per_client.mean()),
            "dominant_share_mean": float(self.dominant_share.mean()),
        }


def partition_statistics(labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int) -> PartitionStatistics:
    """Counts each client's samples per class.

    Args:
        labels: ``[N]`` class of every sample of the pool.
        parts: one index array per client into the pool.
        num_classes: number of classes C.

    Returns:
        The :class:`PartitionStatistics`.

    Example:
        >>> stats = partition_statistics(np.array([0, 0, 1, 2, 2, 2]), [np.array([0, 1, 2]), np.array([3, 4, 5])], 3)
        >>> stats.counts.tolist(), stats.classes_per_client.tolist(), stats.clients_per_class.tolist()
        ([[2, 1, 0], [0, 0, 3]], [2, 1], [1, 1, 1])
    """
    counts = np.stack([np.bincount(labels[part], minlength=num_classes) for part in parts])
    return PartitionStatistics(counts=counts.astype(np.int64))


def partition_figure(
    stats: PartitionStatistics,
    class_names: Sequence[str],
    colors: np.ndarray,
    max_clients: int = 30,
    seed: int = 0,
    title: str = "",
) -> Figure:
    """Fig. S1's three panels for one partition, as a matplotlib figure.

    Counts (clients, classes on a client) are integers, so their axes tick at integers only.

    Args:
        stats: the partition's statistics.
        class_names: ``[C]`` names of the classes.
        colors: ``[C, 3]`` or ``[C, 4]`` RGB(A) colour of each class in [0, 1].
        max_clients: clients shown in the class-mix panel, drawn at random (Fig. S1: 30).
        seed: seed of that draw.
        title: the figure's title (e.g. the α of the partition).
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    held = np.flatnonzero(stats.counts.sum(axis=0) > 0)  # the classes the pool has (no background in VOC labels)
    figure = Figure(figsize=(16, 4.2), layout="tight")
    left, middle, right = figure.subplots(1, 3)
    left.bar(range(len(held)), stats.clients_per_class[held], color=colors[held], edgecolor="black")
    left.set_xticks(range(len(held)), [class_names[c] for c in held], rotation=70, fontsize=7)
    left.set_ylabel("clients holding the class")
    left.set_title("clients per class")

    most = int(stats.classes_per_client.max())
    histogram = np.bincount(stats.classes_per_client, minlength=most + 1)[1:]
    middle.bar(range(1, most + 1), histogram, color="tab:blue")
    middle.set_xlabel("classes on a client")
    middle.set_ylabel("clients")
    middle.set_title("clients by number of classes")
    for axis in (left.yaxis, middle.xaxis, middle.yaxis):
        axis.set_major_locator(MaxNLocator(integer=True))

    rng = np.random.default_rng(seed)
    shown = np.sort(rng.choice(len(stats.counts), size=min(max_clients, len(stats.counts)), replace=False))
    shares = stats.counts[shown] / np.maximum(stats.sizes[shown], 1)[:, None]  # [K', C]
    bottom = np.zeros(len(shown))
    for c in held:
        right.bar(range(len(shown)), shares[:, c], bottom=bottom, color=colors[c], width=0.9)
        bottom += shares[:, c]
    right.set_xticks(range(len(shown)), [str(k) for k in shown], rotation=90, fontsize=6)
    right.set_xlabel("client")
    right.set_ylabel("class share")
    right.set_title(f"class mix of {len(shown)} random clients")

    summary = stats.summary()
    figure.suptitle(
        f"{title}  {summary['clients']:.0f} clients, {summary['samples']:.0f} samples, "
        f"{summary['size_mean']:.1f} ± {summary['size_std']:.1f} per client (CV {summary['size_cv']:.2f})".strip()
    )
    return figure


def plot_partition_summary(
    stats: PartitionStatistics,
    path: str | Path,
    class_names: Sequence[str],
    colors: np.ndarray,
    max_clients: int = 30,
    seed: int = 0,
    title: str = "",
) -> Path:
    """Draws :func:`partition_figure` into a PNG at ``path`` and returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partition_figure(stats, class_names, colors, max_clients, seed, title).savefig(path, dpi=110)
    return path
