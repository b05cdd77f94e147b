"""Partitioners: which samples of a dataset's pool each client holds."""

from fedlight.data.partition.base import Partitioner, sorted_indices, validate_partition
from fedlight.data.partition.dirichlet import Dirichlet
from fedlight.data.partition.dirichlet_power_law import DirichletPowerLaw
from fedlight.data.partition.femnist import FEMNISTPartition
from fedlight.data.partition.flower import FlowerPartitioner
from fedlight.data.partition.iid import IID
from fedlight.data.partition.inner_dirichlet import InnerDirichlet
from fedlight.data.partition.k_classes import KClasses
from fedlight.data.partition.natural import Natural
from fedlight.data.partition.power_law import PowerLaw
from fedlight.data.partition.quantity_skew import DirichletSizes, ExponentialSizes, LinearSizes, SquareSizes
from fedlight.data.partition.shards import Shards

__all__ = [
    "IID",
    "Dirichlet",
    "DirichletPowerLaw",
    "DirichletSizes",
    "ExponentialSizes",
    "FEMNISTPartition",
    "FlowerPartitioner",
    "InnerDirichlet",
    "KClasses",
    "LinearSizes",
    "Natural",
    "Partitioner",
    "PowerLaw",
    "Shards",
    "SquareSizes",
    "sorted_indices",
    "validate_partition",
]
