"""Client task modules: LightningModules the trainer reuses for every client."""

from fedlight.clients.base import FederatedClient, OptimizerCallable
from fedlight.clients.classification import ClassificationClient

__all__ = ["ClassificationClient", "FederatedClient", "OptimizerCallable"]
