"""Metric values as loggers and checkpoints keep them: plain floats.

>>> import torch
>>> scalar_metrics({"test/acc": torch.tensor(0.5), "round": 3, "per_client": torch.ones(2), "flag": True})
{'test/acc': 0.5, 'round': 3.0}
"""

from __future__ import annotations

from typing import Any


def scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Scalar metrics only, as plain floats (NaN kept: it is information)."""
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out
