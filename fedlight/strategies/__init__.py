"""Aggregation rules, one per file; :class:`Strategy` documents the hooks."""

from fedlight.strategies.base import ClientPlan, ClientUpdate, Strategy
from fedlight.strategies.fairness import Fairness
from fedlight.strategies.fedatt import FedAtt
from fedlight.strategies.fedavg import FedAvg
from fedlight.strategies.fedproto import FedProto
from fedlight.strategies.fedprox import FedProx

__all__ = ["ClientPlan", "ClientUpdate", "Fairness", "FedAtt", "FedAvg", "FedProto", "FedProx", "Strategy"]
