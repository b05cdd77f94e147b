"""Aggregation rules, one per file; :class:`Strategy` documents the hooks."""

from fedlight.strategies.base import ClientPlan, ClientUpdate, Strategy
from fedlight.strategies.clustered_fedavg import ClusteredFedAvg
from fedlight.strategies.fairness import Fairness
from fedlight.strategies.fedatt import FedAtt
from fedlight.strategies.fedau import FedAU
from fedlight.strategies.fedavg import FedAvg
from fedlight.strategies.fedavgm import FedAvgM
from fedlight.strategies.feddecorr import FedDecorr
from fedlight.strategies.fednova import FedNova
from fedlight.strategies.fedproto import FedProto
from fedlight.strategies.fedprox import FedProx
from fedlight.strategies.fedsl import FedSL
from fedlight.strategies.fedsls import FedSLS
from fedlight.strategies.ladd import LADD
from fedlight.strategies.moon import MOON

__all__ = [
    "LADD",
    "MOON",
    "ClientPlan",
    "ClientUpdate",
    "ClusteredFedAvg",
    "Fairness",
    "FedAU",
    "FedAtt",
    "FedAvg",
    "FedAvgM",
    "FedDecorr",
    "FedNova",
    "FedProto",
    "FedProx",
    "FedSL",
    "FedSLS",
    "Strategy",
]
