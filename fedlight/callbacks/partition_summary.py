"""Statistics and a Fig. S1-like picture of the run's partition, saved and logged before the first round.

MO-FedProto, supplementary Fig. S1: for the Pascal VOC partition, how many clients hold
each class, how many clients hold a given number of classes, and the class mix of 30 random clients.
The callback reads the partition the data module drew (every client's training and held-out samples)
and writes ``<run_dir>/partition_summary.png`` and ``partition_summary.json`` (the counts and the size
statistics, e.g. the coefficient of variation Table 1's 66.7 ± 25.7 implies, 0.39); the picture also
goes to W&B as the image ``data/partition``. Each class has its colour of the run
(:func:`~fedlight.callbacks.figures.class_colours`), the one the t-SNE and the entropy maps give it.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import numpy as np

from fedlight.callbacks.base import RoundCallback
from fedlight.callbacks.figures import class_colours, matplotlib_problem
from fedlight.data.partition.summary import partition_statistics, plot_partition_summary

if TYPE_CHECKING:
    from fedlight.context import RunContext

log = logging.getLogger(__name__)


class PartitionSummary(RoundCallback):
    """Saves and logs the partition's statistics at the start of ``fit``.

    Args:
        max_clients: clients shown in the class-mix panel, drawn at random (Fig. S1: 30).
        class_names: names of the partition labels; ``null`` takes the dataset's ``partition_classes``
            (Pascal VOC's and the scenes' name them), else the label numbers.
    """

    def __init__(self, max_clients: int = 30, class_names: list[str] | None = None) -> None:
        self.max_clients = max_clients
        self.class_names = class_names

    def check(self, module, datamodule) -> list[str]:
        return matplotlib_problem("fedlight.callbacks.PartitionSummary")

    def on_fit_start(self, context: RunContext) -> None:
        """Counts, draws and logs the partition (rank 0)."""
        if context.rank != 0 or context.run_dir is None:
            return
        data = context.datamodule
        if data.centralized:
            log.info("PartitionSummary: skipped, a centralized run trains one client on every training split.")
            return
        labels = data.pool.partition_labels()
        held_out, groups = data.held_out_index.cpu().numpy(), data.held_out_group.cpu().numpy()
        parts = [np.concatenate([ix.cpu().numpy(), held_out[groups == k]]) for k, ix in enumerate(data.client_train)]
        names = list(self.class_names or getattr(data.dataset, "partition_classes", ()))
        # as many colours as the run's other figures use, so that a class looks the same in all of them
        num_classes = max(int(labels.max()) + 1, len(names), data.num_classes)
        names += [str(c) for c in range(len(names), num_classes)]
        stats = partition_statistics(labels, parts, num_classes)
        path = context.run_dir / "partition_summary.png"
        colours = class_colours(num_classes)
        plot_partition_summary(stats, path, names, colours, self.max_clients, title=context.name)
        summary = stats.summary()
        record = {"summary": summary, "class_names": names, "counts": stats.counts.tolist()}
        (context.run_dir / "partition_summary.json").write_text(json.dumps(record, indent=1))
        context.log_images({"data/partition": [str(path)]}, step=0)
