"""Round callbacks that are not aggregation rules."""

from fedlight.callbacks.amm import AggregateMeanMargin
from fedlight.callbacks.base import RoundCallback
from fedlight.callbacks.feature_discrepancy import FeatureDiscrepancy
from fedlight.callbacks.gradient_dissimilarity import GradientDissimilarity

__all__ = ["AggregateMeanMargin", "FeatureDiscrepancy", "GradientDissimilarity", "RoundCallback"]
