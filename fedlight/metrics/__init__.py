"""Metrics of fedlight: torchmetrics ``Metric`` subclasses and their functional twins."""

from fedlight.metrics import functional
from fedlight.metrics.classification import GroupedClassification

__all__ = ["GroupedClassification", "functional"]
