"""Round callbacks: work between rounds that is not aggregation (analyses, pictures, probes).

A callback implements only the hooks it needs. ``on_round_end`` receives the round's metrics before
they are logged and may add to them: scalars go to ``metrics.csv`` and W&B, 1-D tensors to W&B as
histograms. Stateful callbacks implement ``state_dict``/``load_state_dict`` (tensors, numbers,
strings and containers of them) and are checkpointed with the run.

A callback with requirements (a segmentation client, penultimate features, matplotlib) states them in
:meth:`~RoundCallback.check`, which the trainer calls at set-up, before a run folder exists or a client trains,
so a callback that cannot run fails at once instead of after the last round. An exception raised by a hook
during the rounds does not lose them: the trainer writes the checkpoint of the rounds done and raises
:class:`CallbackFailed`, which names the callback and the checkpoint to resume from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from fedlight.clients.base import FederatedClient
    from fedlight.context import RunContext
    from fedlight.data.datamodule import FederatedDataModule


class RoundCallback:
    """No-op hooks fired by the trainer on every rank, with the run's :class:`~fedlight.context.RunContext` first."""

    def check(self, module: FederatedClient, datamodule: FederatedDataModule) -> list[str]:
        """Why this callback cannot run with ``module`` and ``datamodule`` (set up), one sentence per problem
        naming the callback and the fix; empty when it can. Called at set-up, before the run folder is created."""
        return []

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


class CallbackFailed(RuntimeError):
    """A round callback raised during the rounds, after the trainer saved the rounds done.

    Attributes:
        callback: the class name of the callback that raised, and ``hook`` the hook it raised in.
        checkpoint: the checkpoint to resume from (``None`` when no round was saved).
        round: the rounds it holds.
    """

    def __init__(self, callback: str, hook: str, error: str, checkpoint: Path | None, round: int | None) -> None:
        self.callback, self.hook, self.error, self.checkpoint, self.round = callback, hook, error, checkpoint, round
        super().__init__(f"{callback}.{hook} failed with {error}; {saved_rounds(checkpoint, round)}.")

    def __reduce__(self):  # crosses from a forked rank 0 to the process that launched it
        return type(self), (self.callback, self.hook, self.error, self.checkpoint, self.round)


def saved_rounds(checkpoint: Path | None, round: int | None) -> str:
    """Where the rounds a failed callback leaves behind are saved, and how to go on from them."""
    if checkpoint is None or round is None:
        return "no round was saved"
    return (
        f"the {round} round(s) done are saved in {checkpoint}: fix the callback or remove it from "
        f"--trainer.callbacks, then resume with --ckpt_path {checkpoint}"
    )


def features_problem(owner: str, module: FederatedClient) -> list[str]:
    """``[problem]`` when ``module.net`` lacks ``forward_features`` and ``num_features`` (the penultimate features
    that prototypes, t-SNE and MMD read), else ``[]``."""
    net = getattr(module, "net", None)
    if net is not None and hasattr(net, "forward_features") and hasattr(net, "num_features"):
        return []
    has = f"its network {type(net).__name__}" if net is not None else "it has no 'net'"
    return [
        f"{owner} reads the penultimate features of the client's network (module.net.forward_features and "
        f"num_features), but --model is {type(module).__name__} and {has} has none. Use a registered network "
        "(fedlight.clients.ClassificationClient or SegmentationClient), give your own network forward_features and "
        f"num_features, or remove {owner}."
    ]
