"""fedlight: federated learning of vision models on PyTorch Lightning and Fabric.

The names a script needs are here, imported when first used (so that ``fedlight --help`` starts without torch)::

    import fedlight

    trainer = fedlight.FederatedTrainer(rounds=10, clients_per_round=5)
    data = fedlight.FederatedDataModule(fedlight.data.Digits(), fedlight.data.partition.PowerLaw())
    trainer.fit(fedlight.clients.ClassificationClient(10, (1, 8, 8), model="cnn"), data, fedlight.strategies.FedAvg())
    weights = fedlight.read_weights("runs/fedavg/version_0/checkpoints/last.ckpt")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name → the module that defines it. Base classes stay in their packages (``fedlight.clients.FederatedClient``,
#: ``fedlight.strategies.Strategy``), where configs and ``--help`` name them.
_NAMES = {
    "FederatedTrainer": "fedlight.engine.trainer",
    "FederatedDataModule": "fedlight.data.datamodule",
    "ConfigError": "fedlight.errors",
    "read_weights": "fedlight.checkpoint",
    "create_model": "fedlight.models.registry",
    "list_models": "fedlight.models.registry",
}
#: the subpackages and modules a user reaches through ``fedlight.<name>``
_MODULES = ("callbacks", "checkpoint", "cli", "clients", "data", "metrics", "models", "strategies")

__all__ = [
    "ConfigError",
    "FederatedDataModule",
    "FederatedTrainer",
    "__version__",
    "callbacks",
    "checkpoint",
    "cli",
    "clients",
    "create_model",
    "data",
    "list_models",
    "metrics",
    "models",
    "read_weights",
    "strategies",
]

if TYPE_CHECKING:
    from fedlight import callbacks, checkpoint, cli, clients, data, metrics, models, strategies
    from fedlight.checkpoint import read_weights
    from fedlight.data.datamodule import FederatedDataModule
    from fedlight.engine.trainer import FederatedTrainer
    from fedlight.errors import ConfigError
    from fedlight.models.registry import create_model, list_models


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(f"fedlight.{name}")
    else:
        raise AttributeError(f"module 'fedlight' has no attribute {name!r}")
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
