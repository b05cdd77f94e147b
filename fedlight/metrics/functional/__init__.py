"""Functional twins of fedlight's metrics: pure tensor maths, doctested.

MO-FedProto's prototypes, margins, attention and AMM live in :mod:`.prototypes`; the MMD behind FFD in
:mod:`.mmd`.
"""

from fedlight.metrics.functional.mmd import maximum_mean_discrepancy, median_heuristic
from fedlight.metrics.functional.prototypes import (
    aggregate_mean_margin,
    aggregate_mean_margin_as_written,
    aggregate_prototypes,
    attention_weights,
    class_feature_sums,
    class_prototypes,
    client_deviation,
    minmax_normalize,
    prototypes_from_sums,
    semantic_prototype_margin,
)

__all__ = [
    "aggregate_mean_margin",
    "aggregate_mean_margin_as_written",
    "aggregate_prototypes",
    "attention_weights",
    "class_feature_sums",
    "class_prototypes",
    "client_deviation",
    "maximum_mean_discrepancy",
    "median_heuristic",
    "minmax_normalize",
    "prototypes_from_sums",
    "semantic_prototype_margin",
]
