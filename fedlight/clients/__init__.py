"""Client task modules: LightningModules the trainer reuses for every client."""

from fedlight.clients.base import FederatedClient, LocalFit, ManualSteps, OptimizerCallable
from fedlight.clients.classification import ClassificationClient
from fedlight.clients.daformer import DAFormerClient
from fedlight.clients.mcd import MCDClient
from fedlight.clients.segmentation import SegmentationClient
from fedlight.clients.self_training import SelfTrainingClient, SourcePretrainingClient
from fedlight.clients.unsupervised import UnsupervisedSegmentationClient

__all__ = [
    "ClassificationClient",
    "DAFormerClient",
    "FederatedClient",
    "LocalFit",
    "MCDClient",
    "ManualSteps",
    "OptimizerCallable",
    "SegmentationClient",
    "SelfTrainingClient",
    "SourcePretrainingClient",
    "UnsupervisedSegmentationClient",
]
