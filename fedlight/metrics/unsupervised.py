"""Hungarian-matched mIoU and pixel accuracy of unsupervised segmentation, from one accumulated histogram."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

from fedlight.metrics.functional.segmentation import confusion_matrix, mean_iou, pixel_accuracy
from fedlight.metrics.functional.unsupervised import cluster_histogram, matched_scores
from fedlight.metrics.segmentation import iou_keys


class UnsupervisedSegmentation(Metric):
    """Scores of cluster maps after matching clusters one-to-one to classes (STEGO's and FUSS's evaluation).

    The state is the ``[K, C]`` histogram of (cluster, true class) over valid pixels; it sums across
    batches, clients and processes, and ``compute`` makes one Hungarian match for everything seen (see
    :mod:`fedlight.metrics.functional.unsupervised` for the formulas).

    Args:
        num_clusters: number of clusters K the model predicts.
        num_classes: number of true classes C.
        ignore_index: label of void pixels, which count nowhere.

    >>> metric = UnsupervisedSegmentation(num_clusters=2, num_classes=2)
    >>> metric.update(torch.tensor([[1, 1, 0, 0]]), torch.tensor([[0, 0, 1, 255]]))
    >>> out = metric.compute()
    >>> out["miou"].item(), out["acc"].item(), out["assignment"].tolist()
    (1.0, 1.0, [1, 0])
    """

    full_state_update = False

    def __init__(self, num_clusters: int, num_classes: int, ignore_index: int = 255, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_clusters, self.num_classes, self.ignore_index = num_clusters, num_classes, ignore_index
        histogram = torch.zeros(num_clusters, num_classes, dtype=torch.float64)  # [K, C]
        self.add_state("histogram", default=histogram, dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Adds ``preds`` (``[B, H, W]`` clusters or ``[B, K, H, W]`` scores) against ``target`` ``[B, H, W]``."""
        clusters = preds.argmax(dim=1) if preds.ndim == target.ndim + 1 else preds
        self.histogram += cluster_histogram(clusters, target, self.num_clusters, self.num_classes, self.ignore_index)

    def compute(self) -> dict[str, Tensor]:
        return matched_scores(self.histogram)


class ProbedUnsupervisedSegmentation(Metric):
    """FUSS's two evaluations in one pass: the clusters (Hungarian-matched) and a supervised linear probe.

    The cluster scores (``miou``, ``acc`` and each class's IoU, ``iou_<class>``) are the unsupervised result; the
    probe's (``linear/miou``, ``linear/acc``) come from a 1×1 classifier trained on detached codes with ground-truth
    labels, which STEGO reports as a separate, supervised measure of the codes. Both states are sums: a ``[K, C]``
    cluster×class histogram and a ``[C, C]`` confusion matrix.

    Args:
        num_clusters: number of clusters K.
        num_classes: number of true classes C.
        ignore_index: label of void pixels.
        class_names: the names of the classes, which name their IoU (:func:`~fedlight.metrics.segmentation.iou_keys`);
            None numbers them.

    >>> metric = ProbedUnsupervisedSegmentation(num_clusters=2, num_classes=2)
    >>> target = torch.tensor([[0, 0, 1, 1]])
    >>> metric.update(clusters=torch.tensor([[1, 1, 0, 0]]), linear=torch.tensor([[0, 1, 1, 1]]), target=target)
    >>> out = metric.compute()
    >>> out["miou"].item(), out["linear/acc"].item(), round(out["linear/miou"].item(), 4)
    (1.0, 0.75, 0.5833)
    """

    full_state_update = False

    def __init__(
        self,
        num_clusters: int,
        num_classes: int,
        ignore_index: int = 255,
        class_names: Sequence[str] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.num_clusters, self.num_classes, self.ignore_index = num_clusters, num_classes, ignore_index
        self.iou_keys = iou_keys(num_classes, class_names)
        histogram = torch.zeros(num_clusters, num_classes, dtype=torch.float64)  # [K, C]
        confmat = torch.zeros(num_classes, num_classes, dtype=torch.float64)  # [C, C], rows: true class
        self.add_state("histogram", default=histogram, dist_reduce_fx="sum")
        self.add_state("confmat", default=confmat, dist_reduce_fx="sum")

    def update(self, clusters: Tensor, linear: Tensor, target: Tensor) -> None:
        """Adds cluster and probe predictions ``[B, H, W]`` against ``target`` ``[B, H, W]``."""
        self.histogram += cluster_histogram(clusters, target, self.num_clusters, self.num_classes, self.ignore_index)
        self.confmat += confusion_matrix(linear, target, self.num_classes, self.ignore_index)[0]

    def compute(self) -> dict[str, Tensor]:
        scores = matched_scores(self.histogram)
        return {
            "miou": scores["miou"],
            "acc": scores["acc"],
            "linear/miou": mean_iou(self.confmat),
            "linear/acc": pixel_accuracy(self.confmat),
            **dict(zip(self.iou_keys, scores["iou"], strict=True)),
        }
