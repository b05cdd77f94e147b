"""Round callbacks: work between rounds that is not aggregation (analyses, pictures, probes).

A callback implements only the hooks it needs. ``on_round_end`` receives the round's metrics before
they are logged and may add to them: scalars go to ``metrics.csv`` and W&B, 1-D tensors to W&B as
histograms. Stateful callbacks implement ``state_dict``/``load_state_dict`` (tensors, numbers,
strings and containers of them) and are checkpointed with the run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedlight.context import RunContext


class RoundCallback:
    """No-op hooks fired by the trainer on every rank, with the run's :class:`~fedlight.context.RunContext` first."""

    def on_fit_start(self, context: RunContext) -> None:
        """Called once before the first round of ``fit`` (also after a resume)."""

    def on_round_start(self, context: RunContext, round_idx: int) -> None:
        """Called before round ``round_idx`` samples its clients; ``context.global_state`` is W^t."""

    def on_round_end(self, context: RunContext, round_idx: int, metrics: dict[str, Any]) -> None:
        """Called after aggregation and evaluation, before logging; may add entries to ``metrics``."""

    def on_fit_end(self, context: RunContext) -> None:
        """Called once after the last round."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`."""
