"""What scripts, tests and the hooks' context read of a run through :class:`~fedlight.engine.FederatedTrainer`.

The trainer keeps a run in its settings and three objects: :class:`~fedlight.engine.setup.RunInputs` (what the run
is made of), :class:`~fedlight.engine.setup.RunPieces` (the pieces that run its rounds) and
:class:`~fedlight.engine.run_state.RunProgress` (where it stands). :class:`RunView` names their parts as read-only
attributes of the trainer, as :class:`~fedlight.context.RunContext` names them for hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from fedlight.clients.base import FederatedClient
    from fedlight.engine.config import TrainerSettings
    from fedlight.engine.run_state import RunProgress
    from fedlight.engine.setup import RunInputs, RunPieces
    from fedlight.engine.streams import RandomStreams


def _part(owner: str, name: str, doc: str) -> property:
    """A read-only view of ``self.<owner>.<name>``, None while ``owner`` is (before a run is set up)."""
    return property(lambda self: getattr(getattr(self, owner), name, None), doc=doc)


class RunView:
    """Read-only names for the parts of a run, over the attributes below that the trainer sets."""

    settings: TrainerSettings
    streams: RandomStreams
    inputs: RunInputs | None
    pieces: RunPieces | None
    progress: RunProgress

    @property
    def rounds(self) -> int:
        """T, the number of rounds."""
        return self.settings.loop.rounds

    @property
    def name(self) -> str:
        """The run's name: its folder's and its W&B run's."""
        return self.settings.logging.name

    @property
    def global_state(self) -> torch.Tensor:
        """W^t, the ``[P]`` fp32 federated state of the global model (the bank's global member)."""
        return self.model.global_state

    def global_module(self) -> FederatedClient:
        """The resident module with W^t loaded, in eval mode."""
        return self.model.evaluation_module()

    # What a script reads of a run, named as the hooks' RunContext names it.
    module = property(lambda self: self.model.module, doc="The resident client module.")
    layout = property(lambda self: self.model.layout, doc="Its federated layout.")
    bank = property(lambda self: self.model.bank, doc="The model bank; its global member is W^t.")
    global_integers = property(lambda self: self.model.integers, doc="W^t's integer buffers.")
    round_rng = property(lambda self: self.streams.round_rng, doc="Round t's server-side generator.")
    strategy_rng = property(lambda self: self.streams.strategy_rng, doc="Round t's generator of the rule.")
    client_seed = property(lambda self: self.streams.client_seed, doc="The seed of client k in round t.")
    gather_peak_nbytes = property(
        lambda self: self.aggregation.gather_peak_nbytes, doc="The last round's largest block."
    )
    aggregation_nbytes = property(lambda self: self.fits.aggregation_nbytes, doc="The last round's sums and W^t.")
    logging = property(lambda self: self.settings.logging, doc="Where the run writes, and its loggers.")

    # What the run is made of (RunInputs).
    model = _part("inputs", "model", "The resident module and W^t (:class:`~fedlight.engine.model.GlobalModel`).")
    datamodule = _part("inputs", "datamodule", "The federated data.")
    strategy = _part("inputs", "strategy", "The aggregation rule.")
    config = _part("inputs", "config", "The resolved configuration (None for a run started from Python).")
    described = _part("inputs", "described", "The configuration checkpoints store.")
    data_fingerprint = _part("inputs", "data_fingerprint", "Digests of the partition and the samples.")
    # The pieces that run its rounds (RunPieces).
    training = _part("pieces", "training", "The local training of one client.")
    fits = _part("pieces", "fits", "A round's local fits on this process.")
    aggregation = _part("pieces", "aggregation", "W^{t+1} from the round's sums or gathered states.")
    evaluator = _part("pieces", "evaluator", "The global model's evaluation.")
    run_loggers = _part("pieces", "loggers", "metrics.csv, W&B and the Lightning loggers.")
    # Where it stands (RunProgress).
    round = _part("progress", "round", "Rounds done; the round in progress while one runs.")
    history = _part("progress", "history", "Every round's scalar metrics.")
    round_plans = _part("progress", "plans", "The round's clients.")
    run_dir = _part("progress", "run_dir", "The run folder (None before it exists, and for runs that write none).")
    wandb_id = _part("progress", "wandb_id", "The W&B run id, kept by a resumed run.")
