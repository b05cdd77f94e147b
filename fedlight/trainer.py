"""``FederatedTrainer``: the round loop on Fabric.

One round, as :meth:`FederatedTrainer._run_round` reads top to bottom::

    plan       sample K^t (strategy), mark the δ-fraction of stragglers, drop or keep them
    local fit  on each rank, its share of the clients, one after another, on one resident module
    aggregate  weighted sums of the states as they finish (per cluster for clustered rules) → one all-reduce
               → the strategy's server update
    evaluate   every ``eval_every`` rounds: the clients' held-out splits and the global test set
    log        metrics.csv and W&B, the round as the step
    checkpoint every ``checkpoint_every`` rounds, at the end and when SIGINT/SIGTERM asked to stop, atomically

Randomness is derived, never carried: the round's sampling draws from a generator seeded by
``(seed, round)`` and each client's shuffling and dropout from ``(seed, round, client)``. Results
therefore do not depend on the order in which clients run or on how many processes run them, and a
resumed run needs only the round number to continue exactly where it stopped.

Strategies and round callbacks see the run through a :class:`~fedlight.context.RunContext`, passed as their
hooks' first argument.
"""

from __future__ import annotations

import errno
import io
import logging
import math
import os
import pickle
import tempfile
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torchmetrics import Metric

from fedlight import checkpoint as ckpt_io
from fedlight.bank import ModelBank, RoundSums, cluster_entry_names
from fedlight.batched import BatchedLocalFit, batching_blocker, optimizer_factory
from fedlight.callbacks.base import CallbackFailed, RoundCallback, saved_rounds
from fedlight.clients.base import FederatedClient, LocalFit
from fedlight.console import RunConsole, counted
from fedlight.context import RunContext
from fedlight.data.datamodule import FederatedDataModule
from fedlight.distributed import ClientParallelStrategy, assign_clients, missing_launcher
from fedlight.errors import ConfigError, RunInterrupted
from fedlight.gather import ClientStates
from fedlight.loggers import (
    RoundCSV,
    client_spread,
    histogram_metrics,
    scalar_metrics,
    wandb_logger,
    wandb_login_problems,
)
from fedlight.rundir import RunLock, check_root, new_version_dir, remove_temporaries
from fedlight.state import FlatState, freeze_modes, freeze_parameters
from fedlight.stopping import StopRequest
from fedlight.strategies.base import ClientPlan, ClientUpdate, Strategy
from fedlight.strategies.functional import straggler_plan

log = logging.getLogger(__name__)

Precision = Literal["32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true", "64-true"]
LoggerName = Literal["csv", "wandb"]
StartMethod = Literal["popen", "fork"]

# Stream tags of the seed sequences, so that round-level and client-level draws never coincide.
_ROUND_STREAM, _CLIENT_STREAM, _STRATEGY_STREAM = 0, 1, 2


class FederatedTrainer:
    """Runs federated rounds of a client module under a strategy.

    Args:
        rounds: number of communication rounds T.
        clients_per_round: clients sampled each round, K' (10 in the papers).
        local_epochs: local epochs F of a client that is not a straggler.
        local_steps: if set, every client runs exactly this many optimizer steps per round instead of
            ``local_epochs`` epochs (FedAU's and FedSLS's I local iterations), drawing full batches from
            successive reshuffled epochs of its data. Needs ``straggler_fraction`` 0.
        straggler_fraction: δ ∈ [0, 1], the share of each round's clients that can only do
            F' ~ UniformInt{1, …, F−1} epochs; the strategy drops or tolerates them.
        eval_every: evaluate the global model every this many rounds (and after the last one).
        checkpoint_every: write ``checkpoints/last.ckpt`` every this many rounds (and after the last one, and
            when SIGINT or SIGTERM stops the run); the one before stays as ``previous.ckpt``.
        accelerator: Fabric accelerator: ``auto`` (as in Lightning: a GPU when one is visible, else the CPU),
            ``cpu``, ``cuda`` or ``mps``.
        threads: torch's intra-op threads in each process. ``auto``: on a CPU, one thread per process (or what
            ``OMP_NUM_THREADS`` says, when it is set), which on 2–16 cores was never far from the fastest setting
            and is many times faster than several threads when another job shares the cores
            (``benchmarks/speed/README.md``); it also gives the same floats on every machine and with any number
            of processes. On a GPU, ``auto`` keeps torch's default. An integer sets that many threads everywhere.
        devices: processes per node; with more than one, each round's clients are spread over them
            (greedy by size) and aggregated with one all-reduce.
        num_nodes: number of nodes (launch with ``torchrun`` or SLURM as for any Fabric program).
        start_method: how the ``devices`` processes of one machine start. ``popen`` (Fabric's ``ddp``) runs
            the command again in every new process, which imports and builds everything anew; ``fork``
            (``ddp_fork``) forks this process once it has imported them, which starts seconds sooner and also
            works in notebooks. With ``fork`` the rounds run in the forked processes and rank 0's results
            (global model, history, strategy and callback states) come back to this one; CUDA must not be
            initialised before the fork. Multi-node launches (``torchrun``, SLURM) use ``popen``.
        precision: Fabric precision applied inside each local step (``bf16-mixed`` autocasts the
            client's forward pass); the global model and aggregation stay in fp32.
        channels_last: keep the model's 4-D weights in channels-last (NHWC) memory layout, as timm's
            ``--channels-last`` does. Convolutions and pooling of small CNNs on CPUs (oneDNN), and most
            convolutions on GPUs under mixed precision, run faster in it; results then differ from the
            default layout by float rounding. Models without 4-D weights are unaffected.
        default_root_dir: where runs go: ``<default_root_dir>/<name>/version_<n>/``.
        name: the experiment's folder name and W&B run name (the command line uses the first config file's name).
        logger: where per-round metrics go besides the progress bar: ``csv`` (``metrics.csv``) and/or
            ``wandb``.
        wandb_project: W&B project; unset, ``WANDB_PROJECT`` or else ``fedlight``.
        wandb_entity: W&B user or team that owns the run; unset, ``WANDB_ENTITY`` or else your default entity.
        wandb_mode: ``offline`` needs no account or network (upload later with ``wandb sync``); unset,
            ``WANDB_MODE`` or else ``offline``. ``WANDB_MODE=disabled`` turns W&B off whatever this says.
        wandb_group: W&B group, to see runs together (e.g. the seeds of one table row).
        wandb_tags: W&B tags of the run, for filtering in the W&B interface.
        wandb_notes: a longer description of the run, shown in W&B.
        enable_progress_bar: show progress over rounds and over the clients of a round.
        callbacks: round callbacks (:class:`~fedlight.callbacks.RoundCallback`): analyses and pictures
            between rounds, each with its own cadence; what they add to a round's metrics is logged.
        seed: the run's seed, from which every random stream is derived. By default the seed that
            ``lightning.seed_everything`` set (the command line's ``seed_everything``), else 0.
        client_batching: train up to this many of a process's clients of a round together, as one vectorised
            model (``auto``: as many as fit in 1 GiB of stacked parameters, gradients and optimizer state).
            Each client keeps its own batches, optimizer state and step count; results equal sequential
            training up to float rounding. Rounds that cannot be vectorised (BatchNorm, active dropout,
            schedulers, strategies with client-side hooks) run sequentially, said once in the log.
        compile_batched: compile the vectorised step with ``torch.compile`` (with ``client_batching`` only).
            One graph per stack size (padded to a power of two) is compiled in the first rounds, several
            seconds each on a CPU, after which a step of K clients costs a fraction of K plain steps; it pays
            for runs of many rounds. Results equal the uncompiled ones up to float rounding.
        init_from: start the run from another run's weights instead of the model's own initialisation: a
            fedlight checkpoint (``<run_dir>/checkpoints/last.ckpt``, e.g. of a centralized source
            pre-training run), a Lightning checkpoint, or a file holding a plain ``state_dict``. Weights only;
            every key of the model must be found and no other key may be present. Ignored when resuming
            (``--ckpt_path`` has its own weights).
        max_update_ratio: a client whose state moved further than this many times ``‖W^t‖ + 1`` from the
            model it started from (‖W_k − W^t‖ > ratio · (‖W^t‖ + 1)) is left out of the aggregate like a client
            with NaN/Inf, with a warning, and counted in ``round/clients_outsized``: such a step comes from a
            diverging local fit (a learning rate far too high), not from data. ``null`` turns the check off.
        rewind: let ``--ckpt_path`` continue a run folder whose own last checkpoint is of a later round; its
            later rounds are then replaced. Without it such a resume is refused, so nothing is lost by mistake.
        gather_budget_mb: for rules that gather every client's state (robust aggregators, FedAtt), the most
            memory, in MiB, that one gathered block of the round's ``[K, P]`` states may take on a process. Each
            process keeps its own clients' states on its CPU; when K × P × 4 bytes exceed the budget, rules that
            work by blocks (the robust aggregators, ALIE and IPM) read the states a block of columns at a time,
            gathered from all processes, so no process holds every client's whole state. Rules that need whole
            states read them at once whatever the budget, with a warning. ``trainer.gather_peak_nbytes`` reports
            the largest block of the last round.
        fail_fast: stop the run when a client's local fit raises an exception. By default such a client is left
            out of the round, counted in ``round/clients_failed``, its traceback written to
            ``<run_dir>/client_errors/round<r>_client<k>.txt`` and a warning printed; the run goes on unless every
            client of a round failed. A ``ConfigError`` always stops the run.
        rendezvous_timeout: seconds a process of a multi-process run waits for the others to join when the run
            starts (the all-reduces of the rounds keep PyTorch's 30 minutes); after it the run stops with an error
            naming the address, port and process count it waited for.
    """

    def __init__(
        self,
        rounds: int = 200,
        clients_per_round: int = 10,
        local_epochs: int = 20,
        local_steps: int | None = None,
        straggler_fraction: float = 0.0,
        eval_every: int = 1,
        checkpoint_every: int = 10,
        accelerator: str = "auto",
        threads: int | Literal["auto"] = "auto",
        devices: int = 1,
        num_nodes: int = 1,
        start_method: StartMethod = "popen",
        precision: Precision = "32-true",
        channels_last: bool = False,
        default_root_dir: str | Path = "runs",
        name: str = "fedlight",
        logger: list[LoggerName] | LoggerName | None = ("csv", "wandb"),
        wandb_project: str | None = None,
        wandb_entity: str | None = None,
        wandb_mode: Literal["offline", "online", "disabled"] | None = None,
        wandb_group: str | None = None,
        wandb_tags: list[str] | None = None,
        wandb_notes: str | None = None,
        enable_progress_bar: bool = True,
        callbacks: list[RoundCallback] | None = None,
        seed: int | None = None,
        client_batching: int | Literal["auto"] | None = None,
        compile_batched: bool = False,
        init_from: str | Path | None = None,
        max_update_ratio: float | None = 1000.0,
        rewind: bool = False,
        gather_budget_mb: float = 1024.0,
        fail_fast: bool = False,
        rendezvous_timeout: float = 300.0,
    ) -> None:
        problems = []
        for flag, value in [
            ("rounds", rounds),
            ("clients_per_round", clients_per_round),
            ("local_epochs", local_epochs),
            ("eval_every", eval_every),
            ("checkpoint_every", checkpoint_every),
            ("devices", devices),
            ("num_nodes", num_nodes),
        ]:
            if value < 1:
                problems.append(f"Expected --trainer.{flag} ≥ 1, got {value}.")
        if local_steps is not None and local_steps < 1:
            problems.append(f"Expected --trainer.local_steps ≥ 1 (or null for epochs), got {local_steps}.")
        if local_steps is not None and straggler_fraction > 0:
            problems.append(
                f"--trainer.local_steps={local_steps} gives every client the same workload, so it cannot be "
                f"combined with --trainer.straggler_fraction={straggler_fraction}; set one of them to its default."
            )
        if not 0.0 <= straggler_fraction <= 1.0:
            problems.append(
                f"Expected --trainer.straggler_fraction (δ) in [0, 1], got {straggler_fraction}. "
                "It is a share of each round's clients: 0.5 means half of them are stragglers."
            )
        if start_method == "fork" and num_nodes > 1:
            problems.append(
                "--trainer.start_method=fork starts the processes of one machine; with "
                f"--trainer.num_nodes={num_nodes}, torchrun or SLURM starts them. Use --trainer.start_method=popen."
            )
        if isinstance(client_batching, int) and client_batching < 1:
            problems.append(f"Expected --trainer.client_batching ≥ 1, 'auto' or null, got {client_batching}.")
        if compile_batched and client_batching is None:
            problems.append(
                "--trainer.compile_batched=true compiles the vectorised step, which only runs with "
                "--trainer.client_batching=K or auto; set that too, or drop compile_batched."
            )
        if max_update_ratio is not None and not max_update_ratio > 0:
            problems.append(
                f"Expected --trainer.max_update_ratio > 0 (or null to accept any update), got {max_update_ratio}."
            )
        if not gather_budget_mb > 0:
            problems.append(
                f"Expected --trainer.gather_budget_mb > 0 (MiB of gathered client states per block), got "
                f"{gather_budget_mb}; the default 1024 holds 10 states of 26 M parameters in one block."
            )
        if threads != "auto" and threads < 1:
            problems.append(f"Expected --trainer.threads ≥ 1 or 'auto', got {threads}.")
        if not rendezvous_timeout > 0:
            problems.append(f"Expected --trainer.rendezvous_timeout > 0 seconds, got {rendezvous_timeout}.")
        problems += missing_launcher(num_nodes, devices)
        problems += wandb_login_problems([logger] if isinstance(logger, str) else list(logger or []), wandb_mode)
        problems += check_root(Path(default_root_dir), name)
        if problems:
            raise ConfigError(*problems)
        self.init_from = None if init_from is None else Path(init_from)
        self.client_batching = client_batching
        self.compile_batched = compile_batched
        self._batching: BatchedLocalFit | str | None = None  # the vectorised fit, or why it cannot run
        self.max_update_ratio = max_update_ratio
        self.rewind = rewind
        self.gather_budget_mb = gather_budget_mb
        self.fail_fast = fail_fast
        self.rendezvous_timeout = rendezvous_timeout
        self.rounds = rounds
        self.clients_per_round = clients_per_round
        self.local_epochs = local_epochs
        self.local_steps = local_steps
        self.straggler_fraction = straggler_fraction
        self.eval_every = eval_every
        self.checkpoint_every = checkpoint_every
        self.channels_last = channels_last
        self.default_root_dir = Path(default_root_dir)
        self.name = name
        self.loggers = [logger] if isinstance(logger, str) else list(logger or [])
        self.wandb_project = wandb_project
        self.wandb_entity = wandb_entity
        self.wandb_mode = wandb_mode
        self.wandb_group = wandb_group
        self.wandb_tags = wandb_tags
        self.wandb_notes = wandb_notes
        self.enable_progress_bar = enable_progress_bar
        # The command line seeds everything before instantiating anything; PL_GLOBAL_SEED is that seed.
        self.seed = seed if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
        strategy = (
            "auto"
            if devices * num_nodes == 1
            else ClientParallelStrategy(start_method=start_method, rendezvous_timeout=rendezvous_timeout)
        )
        self.fabric = Fabric(
            accelerator=accelerator,
            devices=devices,
            num_nodes=num_nodes,
            precision=precision,
            strategy=strategy,
            callbacks=callbacks,
        )
        #: intra-op threads of each process (None: torch's default)
        self.num_threads = resolve_threads(threads, self.fabric.device)
        if self.num_threads is not None:  # the data and the model are built in this process next
            torch.set_num_threads(self.num_threads)
        self.callbacks = list(callbacks or [])
        self.run_dir: Path | None = None
        self.history: list[dict[str, float]] = []
        self.round = 0
        self.round_plans: list[ClientPlan] = []
        self.bank: ModelBank | None = None
        self._pending_bank: dict[str, torch.Tensor] | None = None  # a checkpoint's clusters, until the bank has them
        self._frozen_state: dict[str, torch.Tensor] = {}
        #: bytes of the last round's aggregation buffers: W^t (fp32) and the streamed sums (fp64)
        self.aggregation_nbytes = 0
        #: bytes of the largest block of gathered client states the last round read (rules with gather_states)
        self.gather_peak_nbytes = 0
        self._warned_whole_states = False
        self.context = RunContext(self)
        self.console = RunConsole(enabled=False, progress_bar=False)  # fit sets up the run's own
        self._forked = False  # true inside the processes that start_method=fork created
        self._lock: RunLock | None = None
        self._interrupted: RunInterrupted | None = None
        self._stop: StopRequest | None = None  # the run's stop request, looked at between clients
        self._planned_rounds: int | None = None  # trainer.rounds of the checkpoint that was loaded, if it says
        self._saved_round: int | None = None  # the round that checkpoints/last.ckpt holds, once this run wrote it
        #: digests of the partition and the samples (``checkpoint.data_fingerprint``), checked on resume
        self.data_fingerprint: dict[str, str] | None = None

    @property
    def global_state(self) -> torch.Tensor:
        """W^t, the ``[P]`` fp32 federated state of the global model (the bank's global member)."""
        return self.bank.global_state

    @global_state.setter
    def global_state(self, value: torch.Tensor) -> None:
        self.bank.global_state = value

    # -- public entry points ----------------------------------------------------------------------
    def fit(
        self,
        model: FederatedClient,
        datamodule: FederatedDataModule,
        strategy: Strategy,
        ckpt_path: str | Path | None = None,
        config: dict[str, Any] | None = None,
    ) -> dict[str, float]:
        """Trains for ``rounds`` rounds, or continues the run saved at ``ckpt_path``.

        Args:
            model: the client module; its current weights are the initial global model W^0.
            datamodule: the federated data.
            strategy: the aggregation rule.
            ckpt_path: a ``last.ckpt`` to resume from; the run continues in the run folder the checkpoint records
                (or, for a moved folder, the one around its ``checkpoints/``), which no other process may be
                writing and whose own last checkpoint must not be of a later round (see ``rewind``).
            config: the resolved configuration, saved with checkpoints and sent to the loggers.

        Returns:
            The last round's metrics.

        Raises:
            RunInterrupted: after SIGINT (Ctrl-C) or SIGTERM: the run stopped once the client in training finished,
                dropping the unfinished round (or, for a signal after the round's clients, after that round), and
                wrote a checkpoint (a second signal stops it at once); the exception names the checkpoint.
        """
        self._interrupted = None
        try:
            result = self._in_processes(self._fit, model, datamodule, strategy, ckpt_path, config)
        except KeyboardInterrupt as err:  # a second signal, or one before the rounds began
            if isinstance(err, RunInterrupted):
                raise
            last = (self.run_dir / "checkpoints" / ckpt_io.LAST).absolute() if self.run_dir is not None else None
            saved = ckpt_io.saved_round(last) if last is not None else None
            name = str(err.args[0]) if err.args and str(err.args[0]).startswith("SIG") else "SIGINT"
            raise RunInterrupted(name, last if saved is not None else None, saved, saved=False) from None
        if self._interrupted is not None:
            raise self._interrupted
        return result

    def _fit(self, model, datamodule, strategy, ckpt_path, config) -> dict[str, float]:
        try:
            self._setup(model, datamodule, strategy, ckpt_path, config)
            if self.round == self.rounds:
                if self.fabric.global_rank == 0:
                    print(
                        f"fedlight: {ckpt_path} holds all {counted(self.rounds, 'round')}; nothing to resume. Raise "
                        "--trainer.rounds to continue the run."
                    )
                return dict(self.history[-1]) if self.history else {}
            with StopRequest(announce=self.fabric.global_rank == 0) as stop:
                return self._rounds(stop)
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT) or self.run_dir is None:
                raise
            last = self.run_dir / "checkpoints" / ckpt_io.LAST
            advice = (
                f"the last checkpoint is intact: free space and resume with --ckpt_path {last}"
                if last.is_file()
                else "no checkpoint was written yet: free space and start again"
            )
            raise ConfigError(
                f"No space left on the disk while writing the run's files in {self.run_dir}; {advice}."
            ) from None
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _rounds(self, stop: StopRequest) -> dict[str, float]:
        """The rounds from ``self.round`` on, until a stop request: one met while clients train drops the unfinished
        round once the client in training finishes and checkpoints the state the round started from; one met
        later ends the round with a checkpoint.

        A round callback that raises in a round's hooks or at the end does not lose the rounds done: the round
        is logged and checkpointed first, then the run stops with :class:`CallbackFailed` naming the callback
        and the checkpoint (a :class:`ConfigError` stays one, with the checkpoint added).
        """
        fabric, context = self.fabric, self.context
        last_ckpt = self.run_dir / "checkpoints" / ckpt_io.LAST
        self._stop = stop
        fabric.call("on_fit_start", context)
        self.strategy.on_fit_start(context)
        self._setup_clusters()
        console = self.console = RunConsole(fabric.global_rank == 0, self.enable_progress_bar)
        first = self.round
        console.start(
            name=self.name, run_dir=self.run_dir, seed=self.seed, clients=self.datamodule.num_clients,
            per_round=self.clients_per_round, first=first, rounds=self.rounds, strategy=type(self.strategy).__name__,
        )  # fmt: skip
        metrics: dict[str, float] = self.history[-1] if self.history else {}
        for round_idx in range(self.round, self.rounds):
            started = time.perf_counter()
            start_state = self._round_start_state(round_idx)
            failure = self._call_callbacks("on_round_start", context, round_idx)
            if failure is not None:
                if self.round > first:  # the rounds since the last checkpoint
                    self.save_checkpoint(last_ckpt)
                raise self._callback_failure(failure, metrics, self.round - first)
            try:
                metrics = {"round": float(round_idx + 1), **self._run_round(round_idx)}  # counted from 1
            except _RoundAbandoned:
                return self._abandon(round_idx, start_state, metrics, first)
            last = round_idx == self.rounds - 1
            if (round_idx + 1) % self.eval_every == 0 or last:
                metrics.update(self._evaluate(clients=True, test=True))
            self.round = round_idx + 1
            failure = self._call_callbacks("on_round_end", context, round_idx, metrics)
            metrics["round/time_s"] = time.perf_counter() - started
            metrics = self._log(metrics)
            stopping = self._stop_requested(stop)
            if self.round % self.checkpoint_every == 0 or last or stopping or failure is not None:
                self.save_checkpoint(last_ckpt)
                self._saved_round = self.round
            console.round_end(round_idx, self.rounds, metrics)
            if failure is not None:
                raise self._callback_failure(failure, metrics, self.round - first)
            if stopping and not last:
                console.end(metrics, self.run_dir, self.round - first)
                self._finish_loggers()
                path = (self.run_dir / "checkpoints" / ckpt_io.LAST).absolute()
                self._interrupted = RunInterrupted(stop.requested or "SIGINT", path, self.round, saved=True)
                return metrics
        failure = self._call_callbacks("on_fit_end", context)
        if failure is not None:
            raise self._callback_failure(failure, metrics, self.round - first)
        self._finish_loggers()
        console.end(metrics, self.run_dir, self.round - first)
        return metrics

    def _call_callbacks(self, hook: str, *args: Any) -> tuple[RoundCallback, str, Exception] | None:
        """Calls ``hook`` of every round callback in order; returns the first that raised, its hook and error."""
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if callable(method):
                try:
                    method(*args)
                except Exception as err:
                    return callback, hook, err
        return None

    def _callback_failure(
        self, failure: tuple[RoundCallback, str, Exception], metrics: dict[str, float], rounds_run: int
    ) -> Exception:
        """Ends the run whose callback raised (loggers closed, summary printed) after its rounds were saved;
        returns the error to raise, naming the callback and the checkpoint to resume from."""
        callback, hook, err = failure
        self._finish_loggers()
        self.console.end(metrics, self.run_dir, rounds_run)
        path = (self.run_dir / "checkpoints" / ckpt_io.LAST).absolute() if self.run_dir is not None else None
        saved = ckpt_io.saved_round(path) if path is not None and path.is_file() else None
        if isinstance(err, ConfigError):
            error = ConfigError(*err.problems, f"({type(callback).__name__}: {saved_rounds(path, saved)}.)")
        else:
            error = CallbackFailed(type(callback).__name__, hook, f"{type(err).__name__}: {err}", path, saved)
        error.__cause__ = err
        return error

    def validate(
        self,
        model: FederatedClient,
        datamodule: FederatedDataModule,
        strategy: Strategy,
        ckpt_path: str | Path | None = None,
        config: dict[str, Any] | None = None,
    ) -> dict[str, float]:
        """Evaluates the global model (of ``ckpt_path`` if given) on every client's held-out split."""
        return self._in_processes(self._evaluate_only, model, datamodule, strategy, ckpt_path, config, clients=True)

    def test(
        self,
        model: FederatedClient,
        datamodule: FederatedDataModule,
        strategy: Strategy,
        ckpt_path: str | Path | None = None,
        config: dict[str, Any] | None = None,
    ) -> dict[str, float]:
        """Evaluates the global model (of ``ckpt_path`` if given) on the global test set."""
        return self._in_processes(self._evaluate_only, model, datamodule, strategy, ckpt_path, config, clients=False)

    def _evaluate_only(self, model, datamodule, strategy, ckpt_path, config, clients: bool) -> dict[str, float]:
        self._setup(model, datamodule, strategy, ckpt_path, config, logging=False, evaluating=True)
        self._setup_clusters()
        if self.fabric.global_rank == 0:
            what = "the clients' held-out splits" if clients else "the global test set"
            if ckpt_path is None:
                scored = "the model as built (no --ckpt_path: no round trained)"
            else:
                of = "" if self._planned_rounds is None else f" of {self._planned_rounds}"
                scored = f"{ckpt_path}, the global model of round {self.round}{of}"
            print(f"fedlight: scoring {scored} on {what}")
        return self._report(scalar_metrics(self._evaluate(clients=clients, test=not clients)))

    def _stop_requested(self, stop: StopRequest) -> bool:
        """Whether any process received a stop signal: all of them stop after the same round."""
        requested = stop.requested is not None
        if self.fabric.world_size > 1:
            flag = torch.tensor(float(requested), device=self.fabric.device)
            requested = float(self.fabric.all_reduce(flag, reduce_op="sum")) > 0
            stop.requested = stop.requested or ("SIGTERM" if requested else None)  # another process's signal
        return requested

    def _round_start_state(self, round_idx: int) -> bytes | None:
        """Rank 0's run state as round ``round_idx`` starts, serialised, for a stop that drops the round; None
        when ``last.ckpt`` holds it already (and on other ranks, which write no checkpoint)."""
        if self.fabric.global_rank != 0 or self._saved_round == round_idx:
            return None
        buffer = io.BytesIO()
        torch.save(self._run_state(), buffer)
        return buffer.getvalue()

    def _abandon(self, round_idx: int, start_state: bytes | None, metrics: dict[str, float], first: int):
        """Ends the run in round ``round_idx`` after a stop request met between its clients: the partial round is
        dropped, nothing of it is aggregated, and ``last.ckpt`` holds the state the round started from, which
        this process takes back, so that a resume repeats the round exactly."""
        path = self.run_dir / "checkpoints" / ckpt_io.LAST
        if self.fabric.global_rank == 0:
            if start_state is None:
                state = ckpt_io.load(path)
            else:
                state = torch.load(io.BytesIO(start_state), map_location="cpu", weights_only=True)
                ckpt_io.save_atomic(state, path)
            self._load_run_state(state)
            if self.bank.num_clusters and state["bank"] is not None:
                self.bank.load_state_dict(state["bank"])
        self.fabric.barrier()
        self.round = self._saved_round = round_idx
        self.console.end(metrics, self.run_dir, round_idx - first)
        self._finish_loggers()
        name = self._stop.requested or "SIGTERM"  # no name here: another process received the signal
        self._interrupted = RunInterrupted(name, path.absolute(), round_idx, saved=True, dropped=True)
        return metrics

    # -- processes -----------------------------------------------------------------------------------
    def _in_processes(self, work: Callable[..., dict[str, float]], model, datamodule, strategy, *args, **kwargs):
        """Runs ``work`` on every rank: here (one process, or ``popen``, where this process is rank 0 and
        ``_setup`` starts the others), or in forked processes whose rank-0 outcome this process adopts."""
        if not isinstance(self.fabric.strategy.launcher, _MultiProcessingLauncher) or self._forked:
            return work(model, datamodule, strategy, *args, **kwargs)
        # Rank 0 hands its outcome back through a file: Fabric returns it through a pipe that is read only
        # after the processes exit, so anything over the pipe's buffer (~64 KiB) would never be sent.
        # A Ctrl-C reaches the forked processes too, which end their round and save; this one waits for them.
        with tempfile.TemporaryDirectory(prefix="fedlight-fork-") as folder, StopRequest(announce=False):
            outcome_file = Path(folder) / "outcome.pkl"
            try:
                self.fabric.launch(self._forked_work, outcome_file, work, model, datamodule, strategy, *args, **kwargs)
            except Exception:
                if not outcome_file.is_file():
                    raise
            outcome = pickle.loads(outcome_file.read_bytes())
        if "error" in outcome:  # as the error would have come out of one process
            raise outcome["error"] from None
        self._adopt(outcome, model, datamodule, strategy)
        return outcome["result"]

    def _forked_work(self, fabric: Fabric, outcome_file: Path, work, *args, **kwargs) -> None:
        """``work`` on one forked rank; rank 0 hands its outcome, or the ConfigError that stopped it, back."""
        self._forked = True
        try:
            result = work(*args, **kwargs)
        except ConfigError as err:  # reported once, by the launching process, as a one-process run reports it
            if fabric.global_rank == 0:
                outcome_file.write_bytes(pickle.dumps({"error": err}))
            return
        if fabric.global_rank == 0:
            outcome = {
                "result": result,
                "state": self._run_state(),
                "run_dir": self.run_dir,
                "interrupted": self._interrupted,
            }
            outcome_file.write_bytes(pickle.dumps(outcome))

    def _adopt(self, outcome: dict[str, Any], model, datamodule, strategy) -> None:
        """Takes over rank 0's outcome in the process that forked the ranks: W^T in ``model``, the history,
        the strategy's and callbacks' states, as if the rounds had run here."""
        state = outcome["state"]
        self.datamodule, self.strategy, self.module, self.config = datamodule, strategy, model, state["config"]
        self.precision = self.fabric.strategy.precision
        self.layout = FlatState(model, getattr(model, "frozen_modules", ()))
        self.bank = ModelBank(self.layout.flatten(model))
        self._frozen_state = {}
        self._evaluation_metrics = {}
        self._load_run_state(state)
        self.layout.load(model, self.global_state, self.global_integers)
        self.run_dir = outcome["run_dir"]
        self.data_fingerprint = state.get("data_fingerprint")
        self._interrupted = outcome.get("interrupted")

    # -- set-up ------------------------------------------------------------------------------------
    def _setup(
        self,
        model: FederatedClient,
        datamodule: FederatedDataModule,
        strategy: Strategy,
        ckpt_path: str | Path | None,
        config: dict[str, Any] | None,
        logging: bool = True,
        evaluating: bool = False,
    ) -> None:
        fabric = self.fabric
        if ckpt_path is None and self.init_from is not None and not self.init_from.is_file():
            # checked here, not when the trainer is built: a stage's config is valid before its source run exists
            raise ConfigError(
                f"--trainer.init_from {self.init_from} does not exist. Pass a checkpoint of an earlier run "
                "(<run_dir>/checkpoints/last.ckpt) or a file holding a state_dict; run the stage that writes it first."
            )
        if not self._forked:  # forked processes were launched already
            fabric.launch()
        if self.num_threads is not None:  # after the launcher, which gives each process a share of the cores
            torch.set_num_threads(self.num_threads)
        datamodule.setup()
        if self.clients_per_round > datamodule.num_clients:
            raise ConfigError(
                f"--trainer.clients_per_round={self.clients_per_round} exceeds the {datamodule.num_clients} "
                "clients of the partition. Lower it, or raise the number of clients of --data."
            )
        self.data_fingerprint = ckpt_io.data_fingerprint(datamodule)  # before the pool moves to the device
        self.datamodule = datamodule.to(fabric.device)
        if datamodule.test is not None and len(datamodule.held_out_index) == 0:
            log.info("--data.test_fraction=0 holds nothing out: only the global test set is evaluated.")
        self.strategy = strategy
        self.config = config
        self.precision = fabric.strategy.precision
        if ckpt_path is None:  # weights from outside the run (an ImageNet encoder); a checkpoint has its own
            model.configure_model()
            if self.init_from is not None:
                ckpt_io.load_weights(model, self.init_from)
        model.class_names = datamodule.class_names  # per-class scores are named after the data's classes
        # what the rule and the round callbacks need of the model and data; evaluation runs neither
        _check_model(model, datamodule, () if evaluating else (strategy, *self.callbacks))
        freeze_parameters(model, model.frozen_modules)
        self.module = self.precision.convert_module(model).to(fabric.device)
        if self.channels_last:  # the flat state reads and writes parameters in logical order, whatever their layout
            self.module.to(memory_format=torch.channels_last)
        self.layout = FlatState(self.module, model.frozen_modules)
        self._evaluation_metrics: dict[tuple[int, bool], Metric] = {}
        # W^t: fp32 whatever the compute precision, on the training device.
        self.bank = ModelBank(self.layout.flatten(self.module).to(fabric.device))
        self.global_integers = self.layout.integers(self.module)
        self._frozen_state = self.layout.frozen_state(self.module)
        self._pending_bank = None
        # A W&B sweep agent names the run it launched; otherwise the run gets a fresh id.
        self.wandb_id = os.environ.get("WANDB_RUN_ID") or uuid.uuid4().hex[:8]
        self.round, self.history = 0, []
        state = None
        if ckpt_path is not None:
            state = ckpt_io.load(ckpt_path)
            self._restore(state, evaluating)
            self._planned_rounds = ((state.get("config") or {}).get("trainer") or {}).get("rounds")
            if logging and self.round > self.rounds:
                raise ConfigError(
                    f"--ckpt_path {ckpt_path} holds {counted(self.round, 'round')}, more than "
                    f"--trainer.rounds={self.rounds}: there is nothing to resume. Pass --trainer.rounds above "
                    f"{self.round} to continue the run, or score it with fedlight validate / test."
                )
            if logging and self.round == self.rounds:  # finished: its folder and loggers are left as they are
                self.run_dir = None
                return
        run_dir = None
        if fabric.global_rank == 0:
            if logging:
                run_dir = self._resume_dir(Path(ckpt_path), state) if state is not None else self._new_run_dir()
            elif state is not None:
                run_dir = _recorded_run_dir(Path(ckpt_path), state)
        self.run_dir = fabric.broadcast(run_dir)
        self.wandb_id = fabric.broadcast(self.wandb_id)
        if logging:
            self._setup_loggers()

    def _setup_clusters(self) -> None:
        """Gives the bank its clusters once the strategy knows them (after its ``on_fit_start``)."""
        strategy = self.strategy
        num_clusters = strategy.num_clusters()
        if num_clusters == 0 or self.bank.num_clusters == num_clusters:
            return  # no clusters, or restored from the checkpoint
        problems = []
        if strategy.weight_channels != 1 or strategy.gather_states:
            problems.append(
                f"{type(strategy).__name__} keeps cluster-specific layers, which the engine aggregates for rules "
                "with one weight per client and no gathered states."
            )
        if strategy.cluster_layers is None:
            problems.append(f"{type(strategy).__name__} has {num_clusters} clusters but names no cluster_layers.")
        if problems:
            raise ConfigError(*problems)
        names = cluster_entry_names(self.module, self.layout, strategy.cluster_layers)
        self.bank = ModelBank(self.global_state, self.layout.mask(names), num_clusters)
        if self._pending_bank is not None:
            self.bank.load_state_dict(self._pending_bank)
        log.info("%d clusters keep their own %d of %d entries", num_clusters, len(names), len(self.layout.entries))

    def _new_run_dir(self) -> Path:
        """A fresh ``version_<n>``, claimed and locked (rank 0)."""
        run_dir = new_version_dir(self.default_root_dir / self.name)
        self._lock_run_dir(run_dir)
        return run_dir

    def _resume_dir(self, ckpt_path: Path, state: dict[str, Any]) -> Path:
        """The run folder a resume continues, locked (rank 0): the one the checkpoint belongs to.

        That is the folder recorded in the checkpoint; for a checkpoint that records none, or whose folder
        was moved, the folder around ``checkpoints/``; for a loose copy of a checkpoint, a new folder. A folder
        whose own last checkpoint is of a later round is not rewound unless ``rewind`` says so.
        """
        run_dir = _recorded_run_dir(ckpt_path, state)
        if run_dir is None:
            log.warning("%s belongs to no run folder; the run continues in a new one.", ckpt_path)
            return self._new_run_dir()
        self._lock_run_dir(run_dir)
        try:
            own = run_dir / "checkpoints" / ckpt_io.LAST
            later = None if _same_file(own, ckpt_path) else ckpt_io.saved_round(own)
            if later is not None and later > state["round"] and not self.rewind:
                raise ConfigError(
                    f"--ckpt_path {ckpt_path} holds round {state['round']}, but its run folder {run_dir} has "
                    f"already reached round {later} ({own}); resuming would replace the later rounds. Continue "
                    f"the run with --ckpt_path {own}, or pass --trainer.rewind=true to go back to round "
                    f"{state['round']} on purpose."
                )
        except BaseException:
            self._lock.release()
            self._lock = None
            raise
        return run_dir

    def _lock_run_dir(self, run_dir: Path) -> None:
        lock = RunLock(run_dir)
        lock.acquire()
        self._lock = lock
        remove_temporaries(run_dir)

    def _setup_loggers(self) -> None:
        self._csv = None
        self._wandb = None
        if self.fabric.global_rank != 0:
            return
        if self.config is not None:
            import yaml

            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(self.config, sort_keys=False))
        if "csv" in self.loggers:
            self._csv = RoundCSV(self.run_dir / "metrics.csv", self.history)
        if "wandb" in self.loggers:
            self._wandb = wandb_logger(
                self.run_dir,
                self.name,
                self.wandb_id,
                self.config,
                project=self.wandb_project,
                entity=self.wandb_entity,
                mode=self.wandb_mode,
                group=self.wandb_group,
                tags=self.wandb_tags,
                notes=self.wandb_notes,
            )

    # -- one round -----------------------------------------------------------------------------------
    def _run_round(self, round_idx: int) -> dict[str, float]:
        """Plan → local fit → aggregate; returns the round's training metrics."""
        plans = self._plan(round_idx)
        self.round_plans = plans  # for hooks that look at the round's clients (e.g. MMD over K^t)
        self.strategy.on_round_start(self.context, round_idx, plans)
        updates, sums, states, integers = self._local_fits(round_idx, plans)
        aggregated = [u for u in updates if u.finite]
        if not aggregated:
            warnings.warn(
                f"No client state was aggregated in round {round_idx + 1}; the global model stays as it was.",
                stacklevel=1,
            )
        elif self.strategy.gather_states:
            self.global_state = self._aggregate_gathered(states, aggregated)
        else:
            self.global_state = self._aggregate(sums, aggregated)
        self.global_integers.update(integers)
        if not _all_finite(self.global_state):
            raise self._diverged(round_idx)
        return self._round_metrics(round_idx, plans, updates, aggregated)

    def _aggregate_gathered(self, states: ClientStates, aggregated: list[ClientUpdate]) -> torch.Tensor:
        """W^{t+1} of a rule that gathers states, reading them in blocks within ``gather_budget_mb``."""
        budget = self.gather_budget_mb * 2**20
        chunks = states.chunks([u.client for u in aggregated], self.global_state, budget, self.fabric.global_rank)
        new_state = self.strategy.aggregate_chunks(self.global_state, chunks, aggregated)
        self.gather_peak_nbytes = chunks.peak_nbytes
        one_column = chunks.num_clients * self.global_state.element_size()  # the smallest block there is
        whole = chunks.width < chunks.numel and chunks.peak_nbytes > max(budget, one_column)
        if whole and not self._warned_whole_states:
            self._warned_whole_states = True
            warnings.warn(
                f"{type(self.strategy).__name__} read the round's {chunks.num_clients} client states whole "
                f"({chunks.peak_nbytes / 2**20:.0f} MiB), beyond --trainer.gather_budget_mb={self.gather_budget_mb:g}: "
                "it does not aggregate by blocks of columns.",
                stacklevel=1,
            )
        return new_state

    def _diverged(self, round_idx: int) -> ConfigError:
        last = None if self.run_dir is None else self.run_dir / "checkpoints" / ckpt_io.LAST
        kept = (
            f"the last good checkpoint, {last} (round {ckpt_io.saved_round(last)}), is intact: resume from it"
            if last is not None and last.is_file()
            else "no checkpoint was written yet: start again"
        )
        return ConfigError(
            f"The global model became non-finite (NaN/Inf) in round {round_idx + 1}, after "
            f"{type(self.strategy).__name__}'s aggregation; the run stopped and {kept} with a lower learning "
            "rate (--model.init_args.optimizer) or a lower --trainer.max_update_ratio."
        )

    def _plan(self, round_idx: int) -> list[ClientPlan]:
        """K^t from the strategy and the δ-fraction of stragglers, all drawn from the round's stream."""
        rng = self.round_rng(round_idx)
        clients = self.strategy.sample_clients(self.datamodule.num_samples, self.clients_per_round, rng)
        stragglers, epochs = straggler_plan(len(clients), self.straggler_fraction, self.local_epochs, rng)
        return [
            ClientPlan(int(c), int(e), bool(s), dropped=bool(s) and not self.strategy.tolerate_stragglers)
            for c, e, s in zip(clients, epochs, stragglers, strict=True)
        ]

    def _local_fits(self, round_idx: int, plans: list[ClientPlan]):
        """Trains this process's share of the round's clients and streams their states into the sums.

        Returns every process's updates (sorted by client), the all-reduced sums, for rules that gather states this
        process's clients' states (and which process holds which), and the largest value of each integer buffer
        among the clients.
        """
        fabric, strategy, data, bank = self.fabric, self.strategy, self.datamodule, self.bank
        training = [p for p in plans if not p.dropped]
        costs = [float(data.num_samples[p.client] * p.epochs) for p in training]
        mine = [training[i] for i in assign_clients(costs, fabric.world_size)[fabric.global_rank]]
        sums = RoundSums(self.layout.numel, strategy.weight_channels, fabric.device, bank.index, bank.num_clusters)
        self.aggregation_nbytes = self.global_state.nbytes + sums.nbytes
        integers: dict[str, torch.Tensor] = {}  # the largest value of each integer buffer among clients
        states = ClientStates()  # this process's clients' states, only for rules that gather them
        updates = []
        for update, state in self._client_fits(round_idx, mine):
            updates.append(update)
            if "error" in update.payload:  # its local fit raised: nothing to aggregate
                continue
            if not update.finite:
                warnings.warn(
                    f"Client {update.client} returned a state with NaN/Inf in round {round_idx + 1}; it is left out "
                    "of the aggregate. Lower the learning rate if this repeats.",
                    stacklevel=1,
                )
                continue
            if self._outsized(round_idx, update, state):
                continue
            _merge_max(integers, self.layout.integers(self.module))
            update.weights = tuple(float(w) for w in strategy.client_weights(update))
            if strategy.gather_states:
                states.own[update.client] = state.cpu()
                continue
            sums.add(state, update.weights, self._cluster_of(update.client))

        if fabric.world_size > 1:
            sums.all_reduce(lambda packed: fabric.all_reduce(packed, reduce_op="sum"))
            updates = [u for rank_updates in self.all_gather_objects(updates) for u in rank_updates]
            for rank_integers in self.all_gather_objects(integers):
                _merge_max(integers, rank_integers)
            if strategy.gather_states:  # who holds which state; the states stay where they are
                states.owners = self.all_gather_objects(sorted(states.own))
        updates.sort(key=lambda u: u.client)
        return updates, sums, states, integers

    def _client_fits(self, round_idx: int, plans: list[ClientPlan]) -> Iterator[tuple[ClientUpdate, torch.Tensor]]:
        """Each of ``plans``' update and final state: one client after another, or vectorised in chunks.

        A client whose fit raises yields a failed update and no state (see ``fail_fast``). After a stop request
        no further client starts, and the round is abandoned on every rank (:class:`_RoundAbandoned`).
        """
        chunk = self._batching_chunk(plans)
        if chunk is None:
            groups: Iterator[list[ClientPlan]] = ([plan] for plan in self.console.clients(plans, round_idx))
        else:
            groups = (plans[start : start + chunk] for start in range(0, len(plans), chunk))
        skipped, failures = False, []
        for group in groups:
            if self._stop is not None and self._stop.requested is not None:
                skipped = True  # the clients from this one on would be thrown away with the round
                break
            try:
                if chunk is None:
                    fits = [self._fit_client(round_idx, group[0])]
                else:
                    fits = list(self._fit_clients_batched(round_idx, group))
            except ConfigError:
                raise
            except Exception as err:
                if self.fail_fast:
                    raise
                fits = [self._failed_fit(round_idx, plan, err) for plan in group]
                failures += [update for update, _ in fits]
            yield from fits
        self._check_client_fits(round_idx, skipped, failures, len(plans))

    def _failed_fit(self, round_idx: int, plan: ClientPlan, err: Exception) -> tuple[ClientUpdate, None]:
        """The update of a client whose local fit raised ``err``; its traceback goes to the run folder."""
        if self.run_dir is not None:
            folder = self.run_dir / "client_errors"
            folder.mkdir(parents=True, exist_ok=True)
            text = "".join(traceback.format_exception(err))
            (folder / f"round{round_idx + 1}_client{plan.client}.txt").write_text(text)
        update = ClientUpdate(plan.client, int(self.datamodule.num_samples[plan.client]), plan.epochs, 0, math.nan)
        update.finite = False
        update.payload["error"] = f"{type(err).__name__}: {err}".splitlines()[0]
        return update, None

    def _check_client_fits(self, round_idx: int, skipped: bool, failures: list[ClientUpdate], trained: int) -> None:
        """After this rank's clients: abandons the round on every rank if any rank skipped clients after a stop
        request, and stops the run if every client of the round failed. One all-reduce of three numbers."""
        counts = torch.tensor([float(skipped), float(len(failures)), float(trained)], device=self.fabric.device)
        if self.fabric.world_size > 1:
            counts = self.fabric.all_reduce(counts, reduce_op="sum")
        any_skipped, failed, total = (int(c) for c in counts.tolist())
        if any_skipped:
            raise _RoundAbandoned
        if total and failed == total:
            where = f"; the tracebacks are in {self.run_dir / 'client_errors'}" if self.run_dir is not None else ""
            last = None if self.run_dir is None else self.run_dir / "checkpoints" / ckpt_io.LAST
            kept = (
                f" The last checkpoint, {last}, is intact: resume from it once fixed."
                if last and last.is_file()
                else ""
            )
            raise ConfigError(
                f"Every one of the {total} clients of round {round_idx + 1} failed its local fit{where}. "
                f"Nothing is left to aggregate, so the run stopped.{kept} Pass --trainer.fail_fast=true to stop at "
                "the first failure with its traceback."
            )

    def _batching_chunk(self, plans: list[ClientPlan]) -> int | None:
        """How many clients to vectorise at once, or ``None`` for the sequential loop."""
        if self.client_batching is None or not plans:
            return None
        if self._batching is None:  # decided once per run, on the first round's module and optimizer
            self._train_mode(self.module)
            blocker = batching_blocker(self.module, self.layout, self.strategy, self.module.configure_optimizers())
            if blocker is None:
                self._batching = BatchedLocalFit(self.module, self.layout, self.precision, self.compile_batched)
            else:
                self._batching = blocker
                self.console.print(
                    f"fedlight: --trainer.client_batching: clients train one after another, because {blocker}."
                )
        if isinstance(self._batching, str):
            return None
        if self.client_batching == "auto":  # parameters, gradients and up to two optimizer states, fp32
            return max(1, min(len(plans), 2**30 // (16 * max(self.layout.numel, 1))))
        return self.client_batching

    def _fit_clients_batched(
        self, round_idx: int, plans: list[ClientPlan]
    ) -> Iterator[tuple[ClientUpdate, torch.Tensor]]:
        """The local fits of ``plans`` as one vectorised model; each client draws the batches it would alone."""
        module, strategy = self.module, self.strategy
        starts, batches = [], []
        for plan in plans:
            generator = torch.Generator().manual_seed(self.client_seed(round_idx, plan.client))  # batch order
            start = self.bank.member(self._cluster_of(plan.client))
            starts.append(strategy.initial_state(self.context, plan, start))
            batches.append(list(self._local_batches(plan, generator)))
        self._train_mode(module)
        num_steps = max(len(b) for b in batches)
        module.local_fit = LocalFit(round_idx=round_idx, rounds=self.rounds, num_steps=num_steps)
        make_optimizer = optimizer_factory(module.configure_optimizers())
        results = self._batching.run(starts, batches, make_optimizer)
        for plan, (loss_sum, steps, state) in zip(plans, results, strict=True):
            update = self._client_update(plan, loss_sum, steps)
            update.finite = math.isfinite(update.train_loss) and _all_finite(state)
            yield update, state

    def _outsized(self, round_idx: int, update: ClientUpdate, state: torch.Tensor) -> bool:
        """Whether a finite client state moved too far to be a training step; such a client is left out.

        ‖W_k − W^t‖ > max_update_ratio · (‖W^t‖ + 1), W^t being the bank member the client started from.
        A norm that overflows fp32 is inf, which exceeds any bound.
        """
        if self.max_update_ratio is None:
            return False
        start = self.bank.member(self._cluster_of(update.client))
        bound = self.max_update_ratio * (torch.linalg.vector_norm(start).item() + 1.0)
        norm = torch.linalg.vector_norm(state - start).item()
        if norm <= bound:
            return False
        update.finite = False
        update.payload["update_norm"] = norm
        warnings.warn(
            f"Client {update.client}'s update in round {round_idx + 1} has norm {norm:.3g}, more than "
            f"--trainer.max_update_ratio={self.max_update_ratio:g} × (‖W^t‖ + 1) = {bound:.3g}; it is left out of "
            "the aggregate. Lower the learning rate, or raise --trainer.max_update_ratio if such steps are expected.",
            stacklevel=1,
        )
        return True

    def _aggregate(self, sums: RoundSums, aggregated: list[ClientUpdate]) -> torch.Tensor:
        """W^{t+1}: the rule's weighted average, cluster entries per cluster, then the server update."""
        aggregate = sums.average(self.strategy.channel_coefficients())  # Σ_j c_j S_j / Z_j, [P]
        aggregate = self.bank.absorb(aggregate, sums.cluster_averages(), self.strategy.reset_unsampled_clusters)
        return self.strategy.server_update(self.global_state, aggregate, aggregated)

    def _cluster_of(self, client: int) -> int | None:
        return self.strategy.client_cluster(client) if self.bank.num_clusters else None

    def _round_metrics(self, round_idx, plans, updates, aggregated) -> dict[str, float]:
        outsized = sum("update_norm" in u.payload for u in updates if not u.finite)
        failed = [u for u in updates if "error" in u.payload]
        if failed:
            self._warn_failed(round_idx, failed, len(updates))
        metrics = {
            "round/clients_sampled": float(len(plans)),
            "round/clients_aggregated": float(len(aggregated)),
            "round/clients_dropped": float(sum(p.dropped for p in plans)),
            "round/clients_nonfinite": float(len(updates) - len(aggregated) - outsized - len(failed)),
            "round/clients_outsized": float(outsized),
            "round/clients_failed": float(len(failed)),
        }
        if aggregated:
            sizes = np.array([u.num_samples for u in aggregated], dtype=np.float64)
            losses = np.array([u.train_loss for u in aggregated])
            metrics["train/loss"] = float((sizes * losses).sum() / sizes.sum())
        metrics.update(self.strategy.on_round_end(self.context, round_idx, aggregated))
        return metrics

    def _warn_failed(self, round_idx: int, failed: list[ClientUpdate], trained: int) -> None:
        """One warning per round (rank 0) for the clients whose local fit raised."""
        if self.fabric.global_rank != 0:
            return
        listed = ", ".join(f"client {u.client} ({u.payload['error']})" for u in failed[:3])
        more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        where = "" if self.run_dir is None else f"; tracebacks in {self.run_dir / 'client_errors'}"
        warnings.warn(
            f"{len(failed)} of {trained} clients failed their local fit in round {round_idx + 1} and are left out of "
            f"the aggregate: {listed}{more}{where}. Pass --trainer.fail_fast=true to stop at the first failure.",
            stacklevel=1,
        )

    def _fit_client(self, round_idx: int, plan: ClientPlan) -> tuple[ClientUpdate, torch.Tensor]:
        """Local training of one client on the resident module; returns its update and flat state."""
        module, strategy, context = self.module, self.strategy, self.context
        seed = self.client_seed(round_idx, plan.client)
        _seed_torch(seed, self.fabric.device)  # dropout and any other draw inside the step
        generator = torch.Generator().manual_seed(seed)  # batch order

        start = self.bank.member(self._cluster_of(plan.client))
        self.layout.load(module, strategy.initial_state(context, plan, start), self.global_integers)
        self._train_mode(module)
        num_steps = self.local_steps or plan.epochs * self.datamodule.num_batches(plan.client)
        module.local_fit = LocalFit(round_idx=round_idx, rounds=self.rounds, num_steps=num_steps)
        optimizers, schedulers = _optimizers_and_schedulers(module.configure_optimizers())
        module.teachers = dict(strategy.client_teachers(context, plan))
        try:
            strategy.on_client_fit_start(context, module, plan)
            loss_sum, steps = self._train_steps(
                module, optimizers, schedulers, self._local_batches(plan, generator), strategy.training_loss
            )
            update = self._client_update(plan, loss_sum, steps)
            strategy.on_client_fit_end(context, module, update)
        finally:
            module.teachers = {}
        state = self.layout.flatten(module)
        update.finite = math.isfinite(update.train_loss) and _all_finite(state)
        return update, state

    def _client_update(self, plan: ClientPlan, loss_sum: torch.Tensor, steps: int) -> ClientUpdate:
        """What a client sends back besides its state, from its task-loss sum over ``steps`` steps."""
        return ClientUpdate(
            client=plan.client,
            num_samples=int(self.datamodule.num_samples[plan.client]),
            epochs=plan.epochs,
            num_steps=steps,
            train_loss=loss_sum.item() / max(steps, 1),
        )

    def _train_mode(self, module: FederatedClient) -> None:
        module.train()
        freeze_modes(module, self.layout.frozen_modules)  # frozen parts keep their loaded buffers

    def _train_steps(self, module, optimizers, schedulers, batches, loss_fn) -> tuple[torch.Tensor, int]:
        """The local training loop: every optimizer steps once per batch. Returns the task-loss sum and steps."""
        precision = self.precision
        loss_sum = torch.zeros((), device=self.fabric.device)
        steps = 0
        for batch in batches:
            batch = precision.convert_input(batch)
            with precision.forward_context():
                outputs = module.training_step(batch, steps)
                loss = loss_fn(module, batch, outputs)
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            self.fabric.strategy.backward(loss, module)
            for optimizer in optimizers:
                precision.optimizer_step(optimizer)
            for scheduler in schedulers:
                scheduler.step()  # Lightning's interval="step": once per optimizer step
            loss_sum += outputs["loss"].detach().float()  # the task loss, without strategy terms
            steps += 1
        return loss_sum, steps

    def local_train(self, module: FederatedClient, client: int, epochs: int, seed: int, full_batches: bool) -> int:
        """A client's local training outside the rounds (see :meth:`RunContext.local_train`)."""
        _seed_torch(seed, self.fabric.device)
        generator = torch.Generator().manual_seed(seed)
        self._train_mode(module)
        data = self.datamodule
        full = min(data.batch_size, int(data.num_samples[client]))

        def batches():
            for _ in range(epochs):
                for batch in data.train_batches(client, generator):
                    if not full_batches or len(batch[1]) == full:
                        yield batch

        optimizers, schedulers = _optimizers_and_schedulers(module.configure_optimizers())
        _, steps = self._train_steps(module, optimizers, schedulers, batches(), lambda m, b, out: out["loss"])
        return steps

    def _local_batches(self, plan: ClientPlan, generator: torch.Generator) -> Iterator[Any]:
        """A client's batches of one round: ``plan.epochs`` epochs, or ``local_steps`` full batches, each passed
        through the strategy's ``transform_batch``.

        With ``local_steps``, an epoch's short last batch is skipped, as FedAU's sampler does (a batch of
        one image would also break BatchNorm), unless it is all the client has.
        """
        strategy, context, client = self.strategy, self.context, plan.client
        if self.local_steps is None:
            for _ in range(plan.epochs):
                for batch in self.datamodule.train_batches(client, generator):
                    yield strategy.transform_batch(context, client, batch)
            return
        batch_size = min(self.datamodule.batch_size, int(self.datamodule.num_samples[plan.client]))
        steps = 0
        while True:
            for batch in self.datamodule.train_batches(plan.client, generator):
                if len(batch[1]) < batch_size:
                    continue
                yield strategy.transform_batch(context, client, batch)
                steps += 1
                if steps == self.local_steps:
                    return

    # -- evaluation ----------------------------------------------------------------------------------
    def global_module(self) -> FederatedClient:
        """The resident module with the global model W^t loaded, in eval mode (for evaluation and analyses).

        It is the same module clients train on: the next local fit loads its own state into it.
        """
        self.layout.load(self.module, self.global_state, self.global_integers)
        return self.module.eval()

    @torch.no_grad()
    def _evaluate(self, clients: bool, test: bool) -> dict[str, Any]:
        """Evaluates W^t on the clients' held-out splits and/or the global test set.

        Batches are spread over ranks and the metric states are summed, so every rank gets the same
        numbers. When the dataset has no separate test set, the global test set is the union of the
        held-out splits and one pass serves both.
        """
        data = self.datamodule
        self.global_module()
        metrics: dict[str, Any] = {}
        shared_pass = data.test is None
        if clients and not shared_pass and len(data.held_out_index) == 0:
            clients = False  # --data.test_fraction=0: the clients keep every sample, only the test set is evaluated
        if clients or (test and shared_pass):
            result = self._evaluation_pass(data.held_out_batches(), data.num_eval_groups, "clients")
            if clients:
                metrics.update({f"clients/{k}": v for k, v in result.items()})
            if test and shared_pass:
                metrics.update({f"test/{k}": v for k, v in result.items() if self._is_test_metric(k)})
        if test and not shared_pass:
            result = self._evaluation_pass(data.test_batches(), 1, "test")
            metrics.update({f"test/{k}": v for k, v in result.items() if self._is_test_metric(k)})
        return metrics

    def _is_test_metric(self, key: str) -> bool:
        return key.removeprefix("routed/") in self.module.test_metrics

    def _evaluation_metric(self, num_groups: int, routed: bool = False) -> Metric:
        """The module's evaluation metric over ``num_groups`` groups, reset; built once and reused every round."""
        metrics = self._evaluation_metrics
        key = (num_groups, routed)
        if key not in metrics:  # building a torchmetrics Metric costs more than a small model's pass
            metrics[key] = self.module.evaluation_metric(num_groups).to(self.fabric.device)
        metrics[key].reset()
        return metrics[key]

    def _evaluation_pass(self, batches, num_groups: int, split: Literal["clients", "test"]) -> dict[str, Any]:
        """The global model's metrics over this process's share of ``batches``, summed over processes; for the
        clients' split, also each client's values (``<metric>_per_client``, ``[G]``) and their spread.

        For a clustered rule that routes ``split``, also ``routed/<metric>``: every sample is evaluated by the
        bank member the strategy routes it to (LADD: the cluster nearest to the image's own style), one pass of
        each member over the samples routed to it, into one metric.
        """
        fabric, module, precision, strategy = self.fabric, self.module, self.precision, self.strategy
        metric = self._evaluation_metric(num_groups)
        routed = self.bank.num_clusters > 0 and split in strategy.routed_splits
        mine = []  # (batch index, batch, [B] bank member of each sample)
        for batch_idx, batch in enumerate(batches):
            if batch_idx % fabric.world_size != fabric.global_rank:
                continue
            with precision.forward_context():
                metric.update(**module.validation_step(precision.convert_input(batch), batch_idx))
            if routed:
                mine.append((batch_idx, batch, strategy.route(self.context, batch, split)))
        computed = _merged(metric)
        result = scalar_metrics(computed)
        if split == "clients":
            result.update(client_spread(computed))  # per-client values and their spread over the clients
        if routed:
            routed_metric = self._evaluation_metric(num_groups, routed=True)
            for cluster in range(self.bank.num_clusters):
                self.layout.load(module, self.bank.member(cluster), self.global_integers)
                for batch_idx, batch, route in mine:
                    chosen = route == cluster
                    if bool(chosen.any()):
                        part = precision.convert_input(tuple(t[chosen] for t in batch))
                        with precision.forward_context():
                            routed_metric.update(**module.validation_step(part, batch_idx))
            self.layout.load(module, self.global_state, self.global_integers)
            result.update({f"routed/{k}": v for k, v in scalar_metrics(_merged(routed_metric)).items()})
        return result

    # -- randomness ----------------------------------------------------------------------------------
    def round_rng(self, round_idx: int) -> np.random.Generator:
        """The generator of round ``round_idx``'s server-side draws (sampling, stragglers)."""
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_ROUND_STREAM, round_idx)))

    def strategy_rng(self, round_idx: int) -> np.random.Generator:
        """A generator for a strategy's own server-side draws in round ``round_idx`` (e.g. FedAtt's noise)."""
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_STRATEGY_STREAM, round_idx)))

    def client_seed(self, round_idx: int, client: int) -> int:
        """The seed of client ``client``'s stream in round ``round_idx``."""
        sequence = np.random.SeedSequence(self.seed, spawn_key=(_CLIENT_STREAM, round_idx, client))
        return int(sequence.generate_state(1, dtype=np.uint64)[0] >> 1)

    # -- checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path) -> None:
        """Writes the whole run state atomically (rank 0 only)."""
        if self.fabric.global_rank == 0:
            ckpt_io.save_atomic(self._run_state(), path)
        self.fabric.barrier()

    def _run_state(self) -> dict[str, Any]:
        return {
            "format": ckpt_io.FORMAT,
            "round": self.round,
            "seed": self.seed,
            "global_state": self.layout.to_state_dict(self.global_state, self.global_integers),
            "frozen_state": self._frozen_state,  # once: the same in every round
            "bank": self.bank.state_dict() if self.bank.num_clusters else None,
            "strategy": {"class": type(self.strategy).__qualname__, "state": self.strategy.state_dict()},
            "callbacks": [callback.state_dict() for callback in self.callbacks],
            "torch_rng": torch.get_rng_state(),
            "history": self.history,
            "wandb_id": self.wandb_id,
            "num_samples": self.datamodule.num_samples.tolist(),
            "data_fingerprint": self.data_fingerprint,
            "config": self.config,
            "run_dir": None if self.run_dir is None else str(self.run_dir.resolve()),
        }

    def _restore(self, state: dict[str, Any], evaluating: bool = False) -> None:
        """Checks that a checkpoint belongs to this run, then loads it. Evaluating it needs only the same model
        and strategy: data, evaluation and training settings may differ."""
        problems = []
        saved_layout = [(name, tuple(t.shape)) for name, t in state["global_state"].items() if t.is_floating_point()]
        saved_frozen = sorted(state.get("frozen_state") or {})
        if saved_layout != self.layout.signature() or saved_frozen != sorted(self.layout.frozen_names):
            problems.append("its model has different parameters (names, shapes or frozen parts) than --model")
        if not evaluating and state["num_samples"] != self.datamodule.num_samples.tolist():
            problems.append("its clients' sample counts differ from this --data partition")
        else:
            saved = state.get("data_fingerprint") or {}  # absent in checkpoints written before fingerprints
            if saved.get("partition", self.data_fingerprint["partition"]) != self.data_fingerprint["partition"]:
                problems.append("its clients hold other samples than this --data partition gives them")
            if saved.get("samples", self.data_fingerprint["samples"]) != self.data_fingerprint["samples"]:
                problems.append("the contents of the --data samples changed since it was written (same sizes)")
        strategy_class = type(self.strategy).__qualname__
        if state["strategy"]["class"] != strategy_class:
            problems.append(f"it was trained with strategy {state['strategy']['class']}, not {strategy_class}")
        if not evaluating and state["seed"] != self.seed:
            problems.append(f"it was trained with seed_everything={state['seed']}, not {self.seed}")
        if not evaluating and state["config"] is not None and self.config is not None:
            problems += ckpt_io.config_differences(state["config"], self.config)
        if problems:
            raise ConfigError(
                "The checkpoint passed as --ckpt_path belongs to another configuration:",
                *(f"  - {p}" for p in problems),
                "Resume with the configuration and data that wrote it (its run directory holds config.yaml); only "
                "trainer.rounds, logging, evaluation/checkpoint cadence, devices, start method and memory layout "
                "may change.",
            )
        self._load_run_state(state)

    def _load_run_state(self, state: dict[str, Any]) -> None:
        self.global_state, self.global_integers = self.layout.from_state_dict(state["global_state"])
        self.global_state = self.global_state.to(self.fabric.device)
        frozen = state.get("frozen_state") or {}
        if frozen:
            self.module.load_state_dict(frozen, strict=False)
        self._frozen_state = frozen
        self._pending_bank = state.get("bank")
        self.strategy.load_state_dict(state["strategy"]["state"])
        for callback, callback_state in zip(self.callbacks, state.get("callbacks", []), strict=False):
            callback.load_state_dict(callback_state)
        torch.set_rng_state(state["torch_rng"])
        self.round = int(state["round"])
        self.history = list(state["history"])
        self.wandb_id = state["wandb_id"]

    # -- logging ------------------------------------------------------------------------------------
    def _log(self, metrics: dict[str, Any]) -> dict[str, float]:
        """Logs one round; returns its scalar metrics, which the history, CSV and checkpoints keep."""
        scalars = scalar_metrics(metrics)
        self.history.append(scalars)
        if self.fabric.global_rank != 0:
            return scalars
        if self._csv is not None:
            self._csv.log(scalars)
        if self._wandb is not None:
            logged = {k: v for k, v in scalars.items() if k != "round"} | histogram_metrics(metrics)
            self._wandb.log_metrics(logged, step=int(scalars["round"]))
        return scalars

    def log_images(self, images: dict[str, list[Any]], step: int) -> None:
        """Sends images (file paths, arrays or PIL images) to W&B under their keys, from rank 0; CSV keeps none."""
        if self.fabric.global_rank != 0 or getattr(self, "_wandb", None) is None:
            return
        for key, values in images.items():
            self._wandb.log_image(key=key, images=list(values), step=step)

    def _finish_loggers(self) -> None:
        if getattr(self, "_wandb", None) is not None:
            self._wandb.finalize("success")
            import wandb

            wandb.finish()

    def _report(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.fabric.global_rank == 0:
            width = max(map(len, metrics), default=0)
            for key, value in metrics.items():
                print(f"{key:<{width}}  {value:.6g}")
        return metrics

    def all_gather_objects(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.fabric.world_size
        torch.distributed.all_gather_object(gathered, obj)
        return gathered


class _RoundAbandoned(Exception):
    """Raised on every rank when a stop request ends the local fits of a round before all clients trained."""


def _merged(metric: Metric) -> Any:
    """``metric.compute()`` over every process's states. A process that held none of the batches updated nothing
    and contributes zero sums, which is right; torchmetrics would warn that it computes before an update."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"The ``compute`` method of metric .* before the ``update``")
        return metric.compute()


def _seed_torch(seed: int, device: torch.device) -> None:
    """Seeds the CPU generator and the training device's, the two a client step draws from.

    ``torch.manual_seed`` also queues seeds for every CUDA device, recording a stack trace when CUDA is not
    initialised: ~0.25 ms per call, more than a small client's model load and optimizer together.
    """
    torch.default_generator.manual_seed(seed)
    if device.type != "cpu":
        getattr(torch, device.type).manual_seed(seed)


def resolve_threads(threads: int | Literal["auto"], device: torch.device) -> int | None:
    """The intra-op threads that ``--trainer.threads`` asks of each process, or None for torch's default.

    Read before Lightning's launcher sets ``OMP_NUM_THREADS`` for the processes it starts, so that ``auto``
    follows only the user's own setting.

    >>> resolve_threads(3, torch.device("cpu")), resolve_threads("auto", torch.device("cuda"))
    (3, None)
    """
    if threads != "auto":
        return threads
    if device.type != "cpu":
        return None
    return int(os.environ.get("OMP_NUM_THREADS") or 1)


def _check_model(
    model: FederatedClient, datamodule: FederatedDataModule, users: Sequence[Strategy | RoundCallback] = ()
) -> None:
    """Problems with ``--model`` that would otherwise surface only in the first local fit, after the run folder
    was created: frozen parts that do not exist, optimizer settings the optimizer refuses (a negative lr); and
    what the strategy and the round callbacks (``users``) need of the model and data, their ``check``, which
    would otherwise surface after training, in the round or at the end of the run that first uses it."""
    problems = []
    submodules = dict(model.named_modules())
    unknown = [name for name in model.frozen_modules if name not in submodules]
    if unknown:
        problems.append(
            f"frozen_modules names {unknown}, which are not submodules of {type(model).__name__}; "
            f"its top-level submodules are {[n for n in submodules if n and '.' not in n]}."
        )
    optimizer = getattr(model, "optimizer", None)
    if callable(optimizer) and not isinstance(optimizer, torch.nn.Module):
        try:  # on a stand-in parameter: the model's own are not touched
            optimizer([torch.nn.Parameter(torch.zeros(1))])
        except ValueError as err:  # torch.optim's checks of lr, momentum, betas, weight_decay…
            problems.append(f"--model.init_args.optimizer refuses its settings: {err}. Fix them in the config.")
        except Exception:  # not a params → optimizer callable after all; configure_optimizers decides
            pass
    for user in users:
        problems += user.check(model, datamodule)
    if problems:
        raise ConfigError(*problems)


def _recorded_run_dir(ckpt_path: Path, state: dict[str, Any]) -> Path | None:
    """The run folder a checkpoint belongs to: the one it records if it still exists, else the folder around
    its ``checkpoints/`` (an older checkpoint, or a moved run), else None (a loose copy)."""
    recorded = state.get("run_dir")
    if recorded is not None and Path(recorded).is_dir():
        return Path(recorded)
    ckpt_path = ckpt_path.resolve()
    return ckpt_path.parent.parent if ckpt_path.parent.name == "checkpoints" else None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _all_finite(flat: torch.Tensor) -> bool:
    """Whether a state has no NaN/Inf: its sum in fp64 cannot overflow, so it is finite exactly when all entries are.

    One reduction, several times cheaper than ``torch.isfinite(flat).all()`` on the CPU.
    """
    return math.isfinite(flat.sum(dtype=torch.float64).item())


def _optimizers_and_schedulers(configured: Any) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """The optimizers and per-step schedulers of ``configure_optimizers``'s return, in Lightning's formats.

    An optimizer; ``{"optimizer": ..., "lr_scheduler": scheduler}`` where the scheduler may be wrapped as
    ``{"scheduler": ..., "interval": "step"}``; a list or tuple of either (several optimizers, e.g. a head,
    centroids and a probe each with its own Adam); or ``([optimizers], [schedulers])``. Every optimizer
    steps once per batch. A local fit has no epochs of its own to count, so only per-step schedules are
    accepted.

    >>> sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    >>> optimizers, schedulers = _optimizers_and_schedulers([sgd, {"optimizer": sgd}])
    >>> len(optimizers), schedulers
    (2, [])
    """
    if isinstance(configured, torch.optim.Optimizer):
        return [configured], []
    if isinstance(configured, dict):
        scheduler = configured.get("lr_scheduler")
        if isinstance(scheduler, dict):
            if scheduler.get("interval", "step") != "step":
                raise ConfigError(
                    f"configure_optimizers returned a scheduler with interval={scheduler['interval']!r}; federated "
                    "local fits step schedulers once per optimizer step: use interval='step'."
                )
            scheduler = scheduler["scheduler"]
        return [configured["optimizer"]], [] if scheduler is None else [scheduler]
    if (
        isinstance(configured, tuple)
        and len(configured) == 2
        and all(isinstance(part, list | tuple) for part in configured)
        and all(isinstance(o, torch.optim.Optimizer) for o in configured[0])
    ):  # Lightning's ([optimizers], [schedulers])
        schedulers = [s["scheduler"] if isinstance(s, dict) else s for s in configured[1]]
        return list(configured[0]), schedulers
    if isinstance(configured, list | tuple) and configured:
        optimizers, schedulers = [], []
        for item in configured:
            item_optimizers, item_schedulers = _optimizers_and_schedulers(item)
            optimizers += item_optimizers
            schedulers += item_schedulers
        return optimizers, schedulers
    raise ConfigError(
        f"configure_optimizers returned {type(configured).__name__}; expected an optimizer, a dict with "
        "'optimizer' (and 'lr_scheduler'), or a list of them."
    )


def _merge_max(into: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    """Keeps, for every integer buffer, the largest value seen (``num_batches_tracked`` is copied, not averaged)."""
    for name, value in new.items():
        into[name] = torch.maximum(into[name], value) if name in into else value
