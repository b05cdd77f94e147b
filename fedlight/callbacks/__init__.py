"""Round callbacks that are not aggregation rules."""

from fedlight.callbacks.base import RoundCallback

__all__ = ["RoundCallback"]
