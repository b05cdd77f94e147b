"""Partitioners: which samples of a dataset's pool each client holds."""

from fedlight.data.partition.base import Partitioner, sorted_indices, validate_partition
from fedlight.data.partition.dirichlet import Dirichlet
from fedlight.data.partition.dirichlet_power_law import DirichletPowerLaw
from fedlight.data.partition.femnist import FEMNISTPartition
from fedlight.data.partition.k_classes import KClasses
from fedlight.data.partition.natural import Natural
from fedlight.data.partition.power_law import PowerLaw

__all__ = [
    "Dirichlet",
    "DirichletPowerLaw",
    "FEMNISTPartition",
    "KClasses",
    "Natural",
    "Partitioner",
    "PowerLaw",
    "sorted_indices",
    "validate_partition",
]
