"""Round callbacks that are not aggregation rules."""

from fedlight.callbacks.amm import AggregateMeanMargin
from fedlight.callbacks.backbone_feature_cache import BackboneFeatureCache
from fedlight.callbacks.base import CallbackFailed, RoundCallback
from fedlight.callbacks.entropy_maps import EntropyMaps
from fedlight.callbacks.feature_discrepancy import FeatureDiscrepancy
from fedlight.callbacks.gradient_dissimilarity import GradientDissimilarity
from fedlight.callbacks.latent_saliency import LatentSaliency
from fedlight.callbacks.partition_summary import PartitionSummary
from fedlight.callbacks.per_image_scores import PerImageScores
from fedlight.callbacks.tsne import FeatureTSNE

__all__ = [
    "AggregateMeanMargin",
    "BackboneFeatureCache",
    "CallbackFailed",
    "EntropyMaps",
    "FeatureDiscrepancy",
    "FeatureTSNE",
    "GradientDissimilarity",
    "LatentSaliency",
    "PartitionSummary",
    "PerImageScores",
    "RoundCallback",
]
