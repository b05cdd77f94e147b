"""One run of a :class:`~fedlight.engine.FederatedTrainer`, as a typed object: its settings, what it is made of,
the pieces that run its rounds and where it stands.

The trainer holds one :class:`Run` for its lifetime and the hooks' :class:`~fedlight.context.RunContext` is bound to
it, not to the trainer. Its parts, each with one spelling:

=================  ==============================================================================================
``settings``       the trainer's settings, grouped by the piece that reads them (:mod:`~fedlight.engine.config`)
``seed``           the run's seed; ``streams`` the random streams derived from it
``fabric``         the processes and the device; ``callbacks`` the round callbacks
``inputs``         :class:`~fedlight.engine.setup.RunInputs`: the global model, the data, the rule, the configuration
``pieces``         :class:`~fedlight.engine.setup.RunPieces`: local training, fits, aggregation, evaluation, loggers
``progress``       :class:`~fedlight.engine.run_state.RunProgress`: the round, the history, the round's plans, the
                   run folder
=================  ==============================================================================================

``inputs`` and ``pieces`` exist once ``fit``, ``validate`` or ``test`` has set the run up; reading either before
raises. ``progress`` exists from the start (round 0, no folder). The properties below are the names the round loop
and scripts read most, each a shortcut to one of these parts.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlight.engine.run_state import RunProgress

if TYPE_CHECKING:
    from lightning.fabric import Fabric

    from fedlight.data.datamodule import FederatedDataModule
    from fedlight.engine.config import TrainerSettings
    from fedlight.engine.model import GlobalModel
    from fedlight.engine.setup import RunInputs, RunPieces
    from fedlight.engine.streams import RandomStreams
    from fedlight.plans import ClientPlan
    from fedlight.strategies.base import Strategy


class Run:
    """A trainer's run: fixed parts given once, and the inputs, pieces and progress of each set-up.

    Args:
        settings: the trainer's settings.
        seed: the run's seed.
        streams: the random streams of the seed.
        fabric: the processes and the device.
        callbacks: the round callbacks.
    """

    def __init__(
        self, settings: TrainerSettings, seed: int, streams: RandomStreams, fabric: Fabric, callbacks: list[Any]
    ) -> None:
        self.settings = settings
        self.seed = seed
        self.streams = streams
        self.fabric = fabric
        self.callbacks = callbacks
        self.progress = RunProgress()
        self._inputs: RunInputs | None = None
        self._pieces: RunPieces | None = None

    def bind(self, inputs: RunInputs, pieces: RunPieces | None, progress: RunProgress) -> None:
        """Holds a set-up run (``pieces`` None: a run whose rounds ran in forked processes and were handed back)."""
        self._inputs, self._pieces, self.progress = inputs, pieces, progress

    @property
    def inputs(self) -> RunInputs:
        """What the run is made of."""
        if self._inputs is None:
            raise RuntimeError("FederatedTrainer: the run is not set up yet; fit, validate or test sets it up.")
        return self._inputs

    @property
    def pieces(self) -> RunPieces:
        """The engine's pieces that run its rounds."""
        if self._pieces is None:
            raise RuntimeError(
                "FederatedTrainer: the run's pieces do not exist in this process: fit, validate or test sets them up "
                "(a run whose rounds ran in forked processes hands back its results, not its pieces)."
            )
        return self._pieces

    @property
    def set_up(self) -> bool:
        """Whether the run has inputs (``fit``, ``validate`` or ``test`` set it up, or handed it back)."""
        return self._inputs is not None

    # -- the settings read most --------------------------------------------------------------------------
    @property
    def rounds(self) -> int:
        """T, the number of rounds."""
        return self.settings.loop.rounds

    @property
    def name(self) -> str:
        """The run's name: its folder's and its W&B run's."""
        return self.settings.logging.name

    # -- what it is made of --------------------------------------------------------------------------------
    @property
    def model(self) -> GlobalModel:
        """The resident module, its layout, the bank and W^t."""
        return self.inputs.model

    @property
    def datamodule(self) -> FederatedDataModule:
        return self.inputs.datamodule

    @property
    def strategy(self) -> Strategy:
        return self.inputs.strategy

    @property
    def config(self) -> dict | None:
        """The resolved configuration (None for a run started from Python)."""
        return self.inputs.config

    # -- where it stands ---------------------------------------------------------------------------------
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
