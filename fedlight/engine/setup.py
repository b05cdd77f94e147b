"""Set-up: the trainer's settings, checks and preparation of a run's data and checkpoint, and the pieces of a run.

What a run needs from outside (the data, ``--trainer.init_from``, ``--ckpt_path``) is looked at here, so that a
bad value stops the run with one message before anything is written. :class:`RunSetup` sets up each run of a
trainer as three objects, each built from narrow inputs: :class:`RunInputs` (what the run is made of),
:class:`RunPieces` (the engine's pieces that run its rounds) and :class:`~fedlight.engine.run_state.RunProgress`
(where it stands, from :func:`start_progress`).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.loggers import Logger

from fedlight import checkpoint as ckpt_io
from fedlight.engine import trackers
from fedlight.engine.aggregation import Aggregation
from fedlight.engine.config import (
    BatchingSettings,
    EvaluationSettings,
    GuardSettings,
    LoggingSettings,
    MemorySettings,
    ProcessSettings,
    RoundSettings,
    TrainerSettings,
)
from fedlight.engine.console import RunConsole
from fedlight.engine.evaluation import Evaluator
from fedlight.engine.fits import RoundFits
from fedlight.engine.guards import FailureGuards
from fedlight.engine.launch import Ranks, missing_launcher, resolve_threads
from fedlight.engine.local_fit import LocalTraining
from fedlight.engine.loggers import RunLoggers, wandb_login_problems
from fedlight.engine.model import GlobalModel, load_outside_weights, prepare_module, probe_forward, trains_batchnorm
from fedlight.engine.personal import PersonalEvaluator
from fedlight.engine.run_state import RunProgress, check_checkpoint, planned_rounds, python_config, rounds_left
from fedlight.engine.rundir import RunFolder, check_root, recorded_run_dir
from fedlight.errors import ConfigError
from fedlight.state import FlatState

if TYPE_CHECKING:
    from lightning.fabric import Fabric

    from fedlight.clients.base import FederatedClient
    from fedlight.context import RunContext
    from fedlight.data.datamodule import FederatedDataModule
    from fedlight.engine.streams import RandomStreams
    from fedlight.strategies.base import Strategy

log = logging.getLogger(__name__)


def trainer_settings(arguments: dict[str, Any]) -> TrainerSettings:
    """The settings of ``FederatedTrainer``'s arguments, grouped by piece; every problem with them, and with what
    they need around them (a multi-node launcher, a W&B login, a writable root folder), raised as one error."""
    a = SimpleNamespace(**arguments)
    loggers = (a.logger,) if isinstance(a.logger, str | Logger) else tuple(a.logger or ())
    settings = TrainerSettings(
        loop=RoundSettings(
            rounds=a.rounds, clients_per_round=a.clients_per_round, local_epochs=a.local_epochs,
            local_steps=a.local_steps, straggler_fraction=a.straggler_fraction, eval_every=a.eval_every,
            checkpoint_every=a.checkpoint_every,
        ),
        processes=ProcessSettings(
            accelerator=a.accelerator, devices=a.devices, num_nodes=a.num_nodes, start_method=a.start_method,
            precision=a.precision, threads=a.threads, channels_last=a.channels_last,
            rendezvous_timeout=a.rendezvous_timeout,
        ),
        evaluation=EvaluationSettings(eval_clients=a.eval_clients, full_eval_every=a.full_eval_every),
        batching=BatchingSettings(
            client_batching=a.client_batching, compile_batched=a.compile_batched, compile_steps=a.compile_steps,
            steps_per_call=a.steps_per_call,
        ),
        guards=GuardSettings(max_update_ratio=a.max_update_ratio, fail_fast=a.fail_fast),
        memory=MemorySettings(
            gather_budget_mb=a.gather_budget_mb, client_state_budget_mb=a.client_state_budget_mb,
            keep_client_states=a.keep_client_states,
        ),
        logging=LoggingSettings(
            default_root_dir=Path(a.default_root_dir), name=a.name, loggers=loggers, wandb_project=a.wandb_project,
            wandb_entity=a.wandb_entity, wandb_mode=a.wandb_mode, wandb_group=a.wandb_group, wandb_tags=a.wandb_tags,
            wandb_notes=a.wandb_notes, enable_progress_bar=a.enable_progress_bar,
        ),
    )  # fmt: skip
    problems = [
        *settings.problems(),
        *missing_launcher(a.num_nodes, a.devices),
        *wandb_login_problems(list(loggers), a.wandb_mode),
        *check_root(Path(a.default_root_dir), a.name),
        *trackers.folder_problems_of(loggers),
    ]
    if problems:
        raise ConfigError(*problems)
    return settings


def check_init_from(init_from: Path | None, ckpt_path: str | Path | None) -> None:
    """``--trainer.init_from`` must exist when a run starts from it. Checked when the run starts, not when the
    trainer is built: a stage's config is valid before its source run exists."""
    if ckpt_path is None and init_from is not None and not init_from.is_file():
        raise ConfigError(
            f"--trainer.init_from {init_from} does not exist. Pass a checkpoint of an earlier run "
            "(<run_dir>/checkpoints/last.ckpt) or a file holding a state_dict; run the stage that writes it first."
        )


def prepare_data(
    datamodule: FederatedDataModule, clients_per_round: int, device: torch.device
) -> tuple[FederatedDataModule, dict[str, str]]:
    """The partitioned data on ``device`` and the digests of the partition and the samples, taken before the move
    (``checkpoint.data_fingerprint``, checked on resume)."""
    datamodule.setup()
    if clients_per_round > datamodule.num_clients:
        raise ConfigError(
            f"--trainer.clients_per_round={clients_per_round} exceeds the {datamodule.num_clients} clients of the "
            "partition. Lower it, or raise the number of clients of --data."
        )
    fingerprint = ckpt_io.data_fingerprint(datamodule)
    if datamodule.test is not None and len(datamodule.held_out_index) == 0:
        log.info("--data.test_fraction=0 holds nothing out: only the global test set is evaluated.")
    return datamodule.to(device), fingerprint


def check_round_size(strategy: Any, clients_per_round: int, straggler_fraction: float) -> None:
    """The rule's own bounds on the clients that train each round (Krum's K > 2f + 2, Bulyan's K ≥ 4f + 3):
    ``clients_per_round``, less the ``round(K·δ)`` stragglers a rule that does not tolerate them drops."""
    trained = clients_per_round
    if not strategy.tolerate_stragglers:
        trained = round(clients_per_round * (1.0 - straggler_fraction))  # as straggler_plan draws them
    problems = strategy.check_round_size(clients_per_round, trained)
    if trained == 0:
        problems.append(
            f"--trainer.straggler_fraction={straggler_fraction} makes all {clients_per_round} clients of a round "
            f"stragglers, which {type(strategy).__name__} drops: no client would ever be aggregated. Lower it, or set "
            "--strategy.init_args.tolerate_stragglers=true."
        )
    if problems:
        raise ConfigError(*problems)


@dataclass
class RunInputs:
    """What a set-up run is made of (or what the processes forked for it handed back, :meth:`adopted`)."""

    #: the resident client module and the global model W^t
    model: GlobalModel
    #: the federated data, partitioned, on the training device
    datamodule: FederatedDataModule
    strategy: Strategy
    #: the resolved configuration of the command line, or None for a run started from Python
    config: dict[str, Any] | None
    #: the configuration checkpoints store: ``config``, or the one described from the objects of a Python run
    described: dict[str, Any] | None
    #: digests of the partition and the samples (``checkpoint.data_fingerprint``), checked on resume
    data_fingerprint: dict[str, str] | None

    @classmethod
    def prepared(
        cls,
        model: FederatedClient,
        datamodule: FederatedDataModule,
        strategy: Strategy,
        config: dict[str, Any] | None,
        describe: Callable[[], dict[str, Any]],
        *,
        fabric: Fabric,
        settings: TrainerSettings,
        callbacks: Sequence[Any],
        init_from: Path | None,
        resuming: bool,
        evaluating: bool,
    ) -> RunInputs:
        """The data set up and the module prepared for the rule and the callbacks, each checked; ``describe`` gives
        the configuration of a run started from Python."""
        loop = settings.loop
        # What must come from outside the run (the data, pretrained weights) is gathered before either is used,
        # so that a machine missing both hears of both in one message, before the run folder exists.
        problems = []
        try:
            data, fingerprint = prepare_data(datamodule, loop.clients_per_round, fabric.device)
        except ConfigError as err:
            problems += err.problems
        if not resuming:  # a checkpoint brings its own weights
            try:
                load_outside_weights(model, init_from)
            except ConfigError as err:
                problems += err.problems
        if problems:
            raise ConfigError(*problems)
        described = config if config is not None else describe()
        users = () if evaluating else (strategy, *callbacks)  # evaluation runs neither rule nor callbacks
        module = prepare_module(model, data, users, fabric, settings.processes.channels_last)
        if not data.drop_last and trains_batchnorm(module.module):
            data.min_last_batch = 2  # an epoch's last batch of one sample is left out rather than failing its client
        if not evaluating:
            check_round_size(strategy, loop.clients_per_round, loop.straggler_fraction)
            probe_forward(module.module, data, fabric)
        return cls(module, data, strategy, config, described, fingerprint)

    @classmethod
    def adopted(
        cls, model: FederatedClient, datamodule: FederatedDataModule, strategy: Strategy, state: dict[str, Any]
    ) -> RunInputs:
        """The run whose rank 0 handed back its run state ``state`` from forked processes, on this process's CPU;
        loading ``state`` (:meth:`RunProgress.load`) puts W^T into ``model``."""
        described = state["config"]
        config = None if (described or {}).get("origin") == "python" else described
        module = GlobalModel(model, FlatState(model, getattr(model, "frozen_modules", ())), torch.device("cpu"))
        return cls(module, datamodule, strategy, config, described, state.get("data_fingerprint"))


class RunPieces:
    """The engine's pieces that run the rounds of a set-up run, each given only what it needs.

    Args:
        inputs: the run.
        context: what the rule's and callbacks' hooks see of the run.
        fabric: the processes and the device.
        streams: the random streams of the run's seed.
        settings: the trainer's settings.
        console: where the local fits show their clients' bar (replaced when the rounds start).
        run_dir: gives the run folder once it exists (None before, and for runs that write none).
        evaluating: only scoring the global model: every client's split is scored.
    """

    def __init__(
        self,
        inputs: RunInputs,
        context: RunContext,
        fabric: Fabric,
        streams: RandomStreams,
        settings: TrainerSettings,
        console: RunConsole,
        run_dir: Callable[[], Path | None],
        evaluating: bool = False,
    ) -> None:
        model, data, strategy, rank = inputs.model, inputs.datamodule, inputs.strategy, fabric.global_rank
        guards, batching = settings.guards, settings.batching
        self.training = LocalTraining(
            model,
            data,
            strategy,
            context,
            fabric,
            streams,
            settings.loop,
            batching.compile_steps,
            batching.steps_per_call,
        )
        self.guards = FailureGuards(guards, run_dir, rank)
        self.fits = RoundFits(self.training, self.guards, batching, fabric, console, guards.fail_fast)
        self.aggregation = Aggregation(strategy, settings.memory.gather_budget_bytes, rank)
        evaluation = EvaluationSettings() if evaluating else settings.evaluation
        self.evaluator = Evaluator(model, data, strategy, context, fabric, evaluation, streams)
        self.personal = PersonalEvaluator(model, data, strategy, context, fabric)
        self.loggers = RunLoggers(settings.logging, rank)


def start_progress(
    inputs: RunInputs,
    callbacks: list[Any],
    fabric: Fabric,
    seed: int,
    ckpt_path: str | Path | None,
    *,
    rounds: int,
    folder: RunFolder,
    loggers: RunLoggers | None,
    evaluating: bool,
) -> RunProgress:
    """Where a run starts: at round 0, or where the checkpoint at ``ckpt_path`` left it (checked against the run
    first), in its run folder.

    With ``loggers`` (a run of rounds), rank 0 claims and locks a new folder in ``folder``, or the one a resume
    continues, and the loggers start; a resume with no rounds left gets no folder, and its files are left alone.
    Without (scoring only), the run folder is the one the checkpoint records, if any.
    """
    # A W&B sweep agent names the run it launched; otherwise the run gets a fresh id.
    progress = RunProgress(wandb_id=os.environ.get("WANDB_RUN_ID") or uuid.uuid4().hex[:8])
    state = None
    if ckpt_path is not None:
        state = ckpt_io.load(ckpt_path, keys=ckpt_io.RUN_KEYS)
        check_checkpoint(
            state, model=inputs.model, datamodule=inputs.datamodule, data_fingerprint=inputs.data_fingerprint,
            strategy=inputs.strategy, seed=seed, config=inputs.described, evaluating=evaluating,
        )  # fmt: skip
        progress.load(state, model=inputs.model, strategy=inputs.strategy, callbacks=callbacks)
        progress.planned_rounds = planned_rounds(state)
        if loggers is not None and not rounds_left(ckpt_path, state, rounds):
            return progress
    run_dir = None
    if fabric.global_rank == 0:
        if loggers is not None:
            progress.folder = folder
            run_dir = folder.resumed(Path(ckpt_path), state) if state is not None else folder.new()
        elif state is not None:
            run_dir = recorded_run_dir(Path(ckpt_path), state)
    progress.run_dir = fabric.broadcast(run_dir)
    progress.wandb_id = fabric.broadcast(progress.wandb_id)
    if loggers is not None:
        recorded = None if state is None else state.get("tracker_runs")
        try:
            loggers.start(progress.run_dir, inputs.config, progress.history, progress.wandb_id, recorded)
        except BaseException:
            folder.release()  # the caller never gets the progress that holds it
            raise
    return progress


def adopted(
    outcome: dict[str, Any],
    model: FederatedClient,
    datamodule: FederatedDataModule,
    strategy: Strategy,
    callbacks: list[Any],
) -> tuple[RunInputs, RunProgress]:
    """Rank 0's outcome of forked processes, taken over by the process that forked them: W^T in ``model``, the
    history, the strategy's and callbacks' states, as if the rounds had run here."""
    state = outcome["state"]
    inputs = RunInputs.adopted(model, datamodule, strategy, state)
    progress = RunProgress(run_dir=outcome["run_dir"], interrupted=outcome["interrupted"])
    progress.load(state, model=inputs.model, strategy=strategy, callbacks=callbacks)
    inputs.model.load()
    return inputs, progress


class RunSetup:
    """Sets up the runs of one trainer: starts its processes, then builds each run's inputs, pieces and progress.

    Args:
        arguments: the trainer's arguments as given (``init_from``, ``rewind`` and ``threads`` are read here, and
            all of them describe a run started from Python in its checkpoints).
        settings: the trainer's settings.
        seed: the run's seed.
        fabric: the processes and the device.
        streams: the random streams of the seed.
        callbacks: the round callbacks.
        context: what the rule's and callbacks' hooks see of the run.
    """

    def __init__(
        self,
        arguments: dict[str, Any],
        settings: TrainerSettings,
        seed: int,
        fabric: Fabric,
        streams: RandomStreams,
        callbacks: list[Any],
        context: RunContext,
    ) -> None:
        self.arguments, self.settings, self.seed = arguments, settings, seed
        self.fabric, self.streams, self.callbacks, self.context = fabric, streams, callbacks, context
        self.init_from = None if arguments["init_from"] is None else Path(arguments["init_from"])
        self.ranks = Ranks(fabric)
        #: intra-op threads of each process (None: torch's default)
        self.num_threads = resolve_threads(arguments["threads"], fabric.device)
        if self.num_threads is not None:  # the data and the model are built in this process next
            torch.set_num_threads(self.num_threads)

    def __call__(
        self,
        model: FederatedClient,
        datamodule: FederatedDataModule,
        strategy: Strategy,
        ckpt_path: str | Path | None,
        config: dict[str, Any] | None,
        *,
        console: RunConsole,
        run_dir: Callable[[], Path | None],
        logging: bool = True,
        evaluating: bool = False,
    ) -> tuple[RunInputs, RunPieces, RunProgress]:
        """A run (continuing ``ckpt_path`` if given): what it is made of, its pieces and where it stands, in its
        folder. ``run_dir`` gives the folder of the progress returned; ``logging`` false writes no folder (the
        one of ``ckpt_path`` is read), and ``evaluating`` runs neither rule nor callbacks. Its ConfigErrors are
        found by every process alike, and reported by the first."""
        fabric, settings = self.fabric, self.settings
        try:
            check_init_from(self.init_from, ckpt_path)
            self.ranks.launch()
            if self.num_threads is not None:  # after the launcher, which gives each process a share of the cores
                torch.set_num_threads(self.num_threads)
            inputs = RunInputs.prepared(
                model, datamodule, strategy, config,
                lambda: python_config(self.arguments, self.seed, model, datamodule, strategy),
                fabric=fabric, settings=settings, callbacks=self.callbacks, init_from=self.init_from,
                resuming=ckpt_path is not None, evaluating=evaluating,
            )  # fmt: skip
            pieces = RunPieces(inputs, self.context, fabric, self.streams, settings, console, run_dir, evaluating)
            progress = start_progress(
                inputs, self.callbacks, fabric, self.seed, ckpt_path, rounds=settings.loop.rounds,
                folder=RunFolder(settings.logging.default_root_dir / settings.logging.name, self.arguments["rewind"]),
                loggers=pieces.loggers if logging else None, evaluating=evaluating,
            )  # fmt: skip
        except ConfigError as err:
            err.every_process = True
            raise
        return inputs, pieces, progress
