"""Round callbacks that are not aggregation rules."""

from fedlight.callbacks.amm import AggregateMeanMargin
from fedlight.callbacks.base import RoundCallback
from fedlight.callbacks.feature_discrepancy import FeatureDiscrepancy
from fedlight.callbacks.gradient_dissimilarity import GradientDissimilarity
from fedlight.callbacks.partition_summary import PartitionSummary

__all__ = [
    "AggregateMeanMargin",
    "FeatureDiscrepancy",
    "GradientDissimilarity",
    "PartitionSummary",
    "RoundCallback",
]
