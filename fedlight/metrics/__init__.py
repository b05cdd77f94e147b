"""Metrics of fedlight: torchmetrics ``Metric`` subclasses and their functional twins."""

from fedlight.metrics import functional
from fedlight.metrics.classification import GroupedClassification
from fedlight.metrics.segmentation import GroupedSegmentation
from fedlight.metrics.unsupervised import ProbedUnsupervisedSegmentation, UnsupervisedSegmentation

__all__ = [
    "GroupedClassification",
    "GroupedSegmentation",
    "ProbedUnsupervisedSegmentation",
    "UnsupervisedSegmentation",
    "functional",
]
