"""Federated data: datasets, partitioners and the ``FederatedDataModule``."""

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.data.datamodule import FederatedDataModule
from fedlight.data.digits import Digits
from fedlight.data.npz import NpzDataset
from fedlight.data.synthetic import Synthetic

__all__ = ["Digits", "FederatedDataModule", "FederatedDataset", "LabelledTensors", "NpzDataset", "Synthetic"]
