"""What scripts, tests and the hooks' context read of a run through :class:`~fedlight.engine.FederatedTrainer`.

The trainer keeps a run in its settings and three objects: :class:`~fedlight.engine.setup.RunInputs` (what the run
is made of), :class:`~fedlight.engine.setup.RunPieces` (the pieces that run its rounds) and
:class:`~fedlight.engine.run_state.RunProgress` (where it stands). :class:`RunView` names their parts as read-only
attributes of the trainer, as :class:`~fedlight.context.RunContext` names them for hooks.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np
    import torch

    from fedlight.bank import ModelBank
    from fedlight.clients.base import FederatedClient
    from fedlight.data.datamodule import FederatedDataModule
    from fedlight.engine.aggregation import Aggregation
    from fedlight.engine.config import LoggingSettings, TrainerSettings
    from fedlight.engine.evaluation import Evaluator
    from fedlight.engine.fits import RoundFits
    from fedlight.engine.local_fit import LocalTraining
    from fedlight.engine.loggers import RunLoggers
    from fedlight.engine.model import GlobalModel
    from fedlight.engine.run_state import RunProgress
    from fedlight.engine.setup import RunInputs, RunPieces
    from fedlight.engine.streams import RandomStreams
    from fedlight.plans import ClientPlan
    from fedlight.state import FlatState
    from fedlight.strategies.base import Strategy


class RunView:
    """Read-only names for the parts of a run, over the attributes below that the trainer sets.

    What the run is made of and the pieces that run it exist once ``fit``, ``validate`` or ``test`` has set the run
    up; reading them before raises. Where the run stands (:class:`RunProgress`) exists from the start.
    """

    settings: TrainerSettings
    streams: RandomStreams
    inputs: RunInputs | None
    pieces: RunPieces | None
    progress: RunProgress

    def _inputs(self) -> RunInputs:
        if self.inputs is None:
            raise RuntimeError("FederatedTrainer: the run is not set up yet; fit, validate or test sets it up.")
        return self.inputs

    def _pieces(self) -> RunPieces:
        if self.pieces is None:
            raise RuntimeError("FederatedTrainer: the run is not set up yet; fit, validate or test sets it up.")
        return self.pieces

    # -- the run's settings ----------------------------------------------------------------------------
    @property
    def rounds(self) -> int:
        """T, the number of rounds."""
        return self.settings.loop.rounds

    @property
    def name(self) -> str:
        """The run's name: its folder's and its W&B run's."""
        return self.settings.logging.name

    @property
    def logging(self) -> LoggingSettings:
        """Where the run writes, and its loggers."""
        return self.settings.logging

    # -- what the run is made of (RunInputs) -----------------------------------------------------------
    @property
    def model(self) -> GlobalModel:
        """The resident module and W^t."""
        return self._inputs().model

    @property
    def datamodule(self) -> FederatedDataModule:
        """The federated data."""
        return self._inputs().datamodule

    @property
    def strategy(self) -> Strategy:
        """The aggregation rule."""
        return self._inputs().strategy

    @property
    def config(self) -> dict | None:
        """The resolved configuration (None for a run started from Python)."""
        return self._inputs().config

    @property
    def described(self) -> dict | None:
        """The configuration checkpoints store."""
        return self._inputs().described

    @property
    def data_fingerprint(self) -> dict[str, str] | None:
        """Digests of the partition and the samples."""
        return self._inputs().data_fingerprint

    # -- what a script reads of the model, named as the hooks' RunContext names it --------------------
    @property
    def global_state(self) -> torch.Tensor:
        """W^t, the ``[P]`` fp32 federated state of the global model (the bank's global member)."""
        return self.model.global_state

    def global_module(self) -> FederatedClient:
        """The resident module with W^t loaded, in eval mode."""
        return self.model.evaluation_module()

    @property
    def module(self) -> FederatedClient:
        """The resident client module."""
        return self.model.module

    @property
    def layout(self) -> FlatState:
        """Its federated layout."""
        return self.model.layout

    @property
    def bank(self) -> ModelBank:
        """The model bank; its global member is W^t."""
        return self.model.bank

    @property
    def global_integers(self) -> dict[str, torch.Tensor]:
        """W^t's integer buffers."""
        return self.model.integers

    # -- the random streams ----------------------------------------------------------------------------
    @property
    def round_rng(self) -> Callable[[int], np.random.Generator]:
        """Round t's server-side generator."""
        return self.streams.round_rng

    @property
    def strategy_rng(self) -> Callable[[int], np.random.Generator]:
        """Round t's generator of the rule."""
        return self.streams.strategy_rng

    @property
    def client_seed(self) -> Callable[[int, int], int]:
        """The seed of client k in round t."""
        return self.streams.client_seed

    # -- the pieces that run its rounds (RunPieces) ------------------------------------------------------
    @property
    def training(self) -> LocalTraining:
        """The local training of one client."""
        return self._pieces().training

    @property
    def fits(self) -> RoundFits:
        """A round's local fits on this process."""
        return self._pieces().fits

    @property
    def aggregation(self) -> Aggregation:
        """W^{t+1} from the round's sums or gathered states."""
        return self._pieces().aggregation

    @property
    def evaluator(self) -> Evaluator:
        """The global model's evaluation."""
        return self._pieces().evaluator

    @property
    def loggers(self) -> RunLoggers:
        """metrics.csv, W&B and the Lightning loggers."""
        return self._pieces().loggers

    @property
    def gather_peak_nbytes(self) -> int:
        """The last round's largest block of gathered client states."""
        return self.aggregation.gather_peak_nbytes

    @property
    def aggregation_nbytes(self) -> int:
        """The last round's sums and W^t."""
        return self.fits.aggregation_nbytes

    # -- where it stands (RunProgress) -------------------------------------------------------------------
    @property
    def round(self) -> int:
        """Rounds done; the round in progress while one runs."""
        return self.progress.round

    @property
    def history(self) -> list[dict[str, float]]:
        """Every round's scalar metrics."""
        return self.progress.history

    @property
    def plans(self) -> list[ClientPlan]:
        """The round's clients."""
        return self.progress.plans

    @property
    def run_dir(self) -> Path | None:
        """The run folder (None before it exists, and for runs that write none)."""
        return self.progress.run_dir

    @property
    def wandb_id(self) -> str | None:
        """The W&B run id, kept by a resumed run."""
        return self.progress.wandb_id
