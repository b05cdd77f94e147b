"""Aggregation rules, one per file; :class:`Strategy` documents the hooks."""

from fedlight.strategies.base import ClientPlan, ClientUpdate, Strategy
from fedlight.strategies.fedavg import FedAvg

__all__ = ["ClientPlan", "ClientUpdate", "FedAvg", "Strategy"]
