"""``FederatedTrainer``: the round loop on Fabric, read top to bottom in :meth:`FederatedTrainer._rounds`.

One round::

    plan       sample K^t (strategy), mark the δ-fraction of stragglers, drop or keep them
    local fit  on each rank, its share of the clients, one after another or vectorised, on one resident module
    aggregate  weighted sums of the states as they finish (per cluster for clustered rules) → one all-reduce
               → the strategy's server update; or the gathered states, for rules that need them all
    evaluate   every ``eval_every`` rounds: the clients' held-out splits (all, or a sample of ``eval_clients``)
               and the global test set
    log        metrics.csv, W&B and Lightning loggers, the round (counted from 1) as the step
    checkpoint every ``checkpoint_every`` rounds, at the end and when SIGINT/SIGTERM asked to stop, atomically

The trainer keeps the signature and the loop; each concern is a piece of :mod:`fedlight.engine` that owns its
state and receives only what it needs: the set-up of a run (:mod:`~fedlight.engine.setup`: its inputs, pieces
and progress), the local fits (:mod:`~fedlight.engine.fits`, :mod:`~fedlight.engine.local_fit`,
:mod:`~fedlight.engine.batched`), aggregation, evaluation, the run state in a checkpoint, failure guards,
processes, the run folder, the console and the loggers. Strategies and round callbacks see the run through a
:class:`~fedlight.context.RunContext`, passed as their hooks' first argument.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any, Literal

from lightning.fabric.loggers import Logger

from fedlight import checkpoint as ckpt_io
from fedlight.callbacks.base import RoundCallback
from fedlight.clients.base import FederatedClient
from fedlight.context import RunContext
from fedlight.data.datamodule import FederatedDataModule
from fedlight.engine.config import CompileMode, LoggerName, Precision, StartMethod, WandbMode
from fedlight.engine.console import RunConsole, counted
from fedlight.engine.evaluation import format_scores
from fedlight.engine.fits import round_counts, round_plans
from fedlight.engine.guards import RoundAbandoned, disk_full
from fedlight.engine.hooks import Failure, call_callbacks, callback_error
from fedlight.engine.launch import run_fabric
from fedlight.engine.local_fit import all_finite
from fedlight.engine.model import GlobalModel
from fedlight.engine.run import Run
from fedlight.engine.run_state import drop_round, run_state
from fedlight.engine.setup import RunSetup, adopted, trainer_settings
from fedlight.engine.stopping import StopRequest, serialised, stopped_at_once
from fedlight.engine.streams import RandomStreams
from fedlight.errors import RunInterrupted
from fedlight.metrics.scalars import scalar_metrics
from fedlight.strategies.base import Strategy


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
        eval_clients: whose held-out splits an evaluation scores (``clients/*``): ``all`` clients, or a sample of
            this many clients (an integer) or of this fraction of them (a float in (0, 1], rounded up), drawn
            uniformly among the clients with held-out data from a random stream of the round's own, so a run is
            reproducible from its seed and a resumed run scores the same clients. With a million users, scoring
            them all every round would cost more than the round's training; a sample keeps the evaluation's cost
            flat in the population. ``clients/evaluated`` then counts the clients scored. The global test set is
            always scored whole; a dataset without one (whose global test set is the union of the held-out splits)
            scores every client whatever this says.
        full_eval_every: with ``eval_clients`` a sample, score every client's split after every this many rounds
            (0: only after the last round, which always scores every client).
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
        logger: where per-round metrics go besides the progress bar, one or a list: ``csv`` (``metrics.csv`` in the
            run folder), ``wandb`` (configured by the ``wandb_*`` arguments below), and any Lightning logger by
            ``class_path`` and ``init_args``, e.g. ``lightning.pytorch.loggers.TensorBoardLogger`` with
            ``save_dir``, or ``lightning.pytorch.loggers.MLFlowLogger`` with ``tracking_uri`` (``pip install
            'fedlight[tensorboard]'`` or ``'fedlight[mlflow]'``). Each gets every round's scalars with the round as
            the step, and the resolved configuration as hyper-parameters when its run is created. A resumed run
            continues the TensorBoard version folder, the MLflow run and the W&B run it wrote before, unless the
            logger's own ``version``, ``run_id`` or ``id`` says otherwise; other loggers start a new run.
        wandb_project: W&B project; unset, ``WANDB_PROJECT`` or else ``fedlight``.
        wandb_entity: W&B user or team that owns the run; unset, ``WANDB_ENTITY`` or else your default entity.
        wandb_mode: ``offline`` needs no account or network (upload later with ``wandb sync``); unset,
            ``WANDB_MODE`` or else ``offline``. ``WANDB_MODE=disabled`` turns W&B off whatever this says.
        wandb_group: W&B group, to see runs together (e.g. the seeds of one table row).
        wandb_tags: W&B tags of the run, for filtering in the W&B interface.
        wandb_notes: a longer description of the run, shown in W&B. ``fedlight fit`` adds a sentence naming the
            settings a command changes in a paper's row (``conf/<paper>/``): such a run is not the paper's setting.
        enable_progress_bar: show progress over rounds and over the clients of a round.
        callbacks: round callbacks (:class:`~fedlight.callbacks.RoundCallback`): analyses and pictures
            between rounds, each with its own cadence; what they add to a round's metrics is logged.
        seed: the run's seed, from which every random stream is derived. By default the seed that
            ``lightning.seed_everything`` set (the command line's ``seed_everything``), else 0.
        client_batching: train up to this many of a process's clients of a round together, as one vectorised
            model. ``auto`` vectorises only where the speed benchmarks measured it faster (on a GPU; on a CPU,
            models without convolutions whose first round's Σ steps / max steps over its clients reaches 8, or
            2 with ``compile_batched``), as many clients as fit in 1 GiB of stacked parameters, gradients and
            optimizer state, and says on the console which path runs and why; an int K always vectorises.
            Each client keeps its own batches, optimizer state and step count; results equal sequential
            training up to float rounding. Rounds that cannot be vectorised (BatchNorm, active dropout,
            schedulers, strategies with client-side hooks) run sequentially, said once in the log.
        compile_batched: compile the vectorised step with ``torch.compile`` (with ``client_batching`` only).
            One graph per stack size (padded to a power of two) is compiled in the first rounds, several
            seconds each on a CPU, after which a step of K clients costs a fraction of K plain steps; it pays
            for runs of many rounds. Results equal the uncompiled ones up to float rounding.
        compile_steps: compile each client step with ``torch.compile``, once per run for every client: ``true``
            (torch's default mode), ``reduce-overhead`` (CUDA graphs on a GPU, for many small steps),
            ``max-autotune`` or ``max-autotune-no-cudagraphs``. With one SGD, Adam or AdamW optimizer and no
            scheduler the whole step (forward, loss, backward and update) is one graph; otherwise the forward
            pass and loss are compiled and the backward pass and optimizer stay eager; the console says which.
            The first steps pay the compilation (seconds). Results equal eager steps up to float rounding (a
            fused graph sums in another order); dropout draws come from the compiler's own generator. ``auto``
            times the run's first fit eagerly and compiles the rest (in torch's default mode) only when the whole
            step can run and the remaining fits would take 10 minutes or more eagerly, long enough to repay
            compiling; the console says which it chose and on what estimate.
        steps_per_call: with ``compile_steps`` and the whole step, run this many consecutive steps of equal-shape
            batches inside one compiled call (the batches stacked), so the cost of entering compiled code is paid
            once per call rather than once per step: on small networks, whose steps take tens of microseconds, that
            cost is a large part of a step. The steps are the same, in the same order; compilation takes longer
            (the graph holds every step of a call). Batches that do not fill a call run in calls of the largest
            powers of two that fit. With ``compile_batched`` and the update in its graph, the vectorised stack
            runs up to this many steps per call while all its clients have full batches and none finishes.
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
            states read them at once whatever the budget, with a warning.
            ``trainer.run.pieces.aggregation.gather_peak_nbytes`` reports the largest block of the last round.
        client_state_budget_mb: for rules that keep per-client state (SCAFFOLD's control variates, FedBN's
            BatchNorm, FedPer's head, Ditto's personal models), the most memory, in MiB, that the clients' states
            kept in memory may take on a process. Every client's state is written to
            ``<run_dir>/client_state/`` after its fit; the most recently used ones stay in memory too, so a run of
            thousands of clients with model-sized states stays within this budget. 0 keeps none in memory.
        keep_client_states: keep every client state file the run writes in ``<run_dir>/client_state/``. By default
            a file is deleted once neither the run's index nor its last two checkpoints name it, so a checkpoint
            copied aside and resumed (``--trainer.rewind=true --ckpt_path <copy>``) after the run went on names
            states that are gone, and the resume is refused. Keeping them all costs one state file per trained client
            per round on disk (SCAFFOLD on ResNet-18: 45 MB × clients per round × rounds).
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
        eval_clients: int | float | Literal["all"] = "all",
        full_eval_every: int = 0,
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
        logger: list[LoggerName | Logger] | LoggerName | Logger | None = ("csv", "wandb"),
        wandb_project: str | None = None,
        wandb_entity: str | None = None,
        wandb_mode: WandbMode | None = None,
        wandb_group: str | None = None,
        wandb_tags: list[str] | None = None,
        wandb_notes: str | None = None,
        enable_progress_bar: bool = True,
        callbacks: list[RoundCallback] | None = None,
        seed: int | None = None,
        client_batching: int | Literal["auto"] | None = None,
        compile_batched: bool = False,
        compile_steps: CompileMode = False,
        steps_per_call: int = 1,
        init_from: str | Path | None = None,
        max_update_ratio: float | None = 1000.0,
        rewind: bool = False,
        gather_budget_mb: float = 1024.0,
        client_state_budget_mb: float = 1024.0,
        keep_client_states: bool = False,
        fail_fast: bool = False,
        rendezvous_timeout: float = 300.0,
    ) -> None:
        #: the arguments as given, described in the checkpoints of runs started from Python
        self.init_args = {name: value for name, value in locals().items() if name != "self"}
        settings = trainer_settings(self.init_args)
        # The command line seeds everything before instantiating anything; PL_GLOBAL_SEED is that seed.
        seed = seed if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
        streams = RandomStreams(seed)
        fabric = run_fabric(settings.processes, callbacks)
        #: the run: its settings, inputs, pieces and progress (:class:`~fedlight.engine.run.Run`)
        self.run = Run(settings, seed, streams, fabric, list(callbacks or []))
        #: what the rule's and callbacks' hooks see of the run
        self.context = RunContext(self.run)
        self.run_setup = RunSetup(self.init_args, settings, seed, fabric, streams, self.run.callbacks, self.context)
        self.console = RunConsole(enabled=False, progress_bar=False)  # fit sets up the run's own

    # -- what a script reads of a run ----------------------------------------------------------------
    @property
    def model(self) -> GlobalModel:
        """The global model: the resident module, its layout, the bank and W^t (once the run is set up)."""
        return self.run.model

    @property
    def global_state(self):
        """W^t, the ``[P]`` fp32 federated state of the global model: what ``fit`` trained."""
        return self.run.model.global_state

    @property
    def history(self) -> list[dict[str, float]]:
        """Every round's scalar metrics, as ``metrics.csv`` holds them."""
        return self.run.progress.history

    @property
    def run_dir(self) -> Path | None:
        """The run folder (None before it exists, and for runs that write none)."""
        return self.run.progress.run_dir

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
        self.run.progress.interrupted = None
        try:
            result = self._in_processes(self._fit, model, datamodule, strategy, ckpt_path, config)
        except KeyboardInterrupt as err:  # a second signal, or one before the rounds began
            if isinstance(err, RunInterrupted):
                raise
            raise stopped_at_once(err, self.run.run_dir) from None
        if self.run.progress.interrupted is not None:
            raise self.run.progress.interrupted
        return result

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

    def _fit(self, model, datamodule, strategy, ckpt_path, config) -> dict[str, float]:
        run = self.run
        try:
            self._setup(model, datamodule, strategy, ckpt_path, config)
            if run.round == run.rounds:
                if run.fabric.global_rank == 0:
                    print(
                        f"fedlight: {ckpt_path} holds all {counted(run.rounds, 'round')}; nothing to resume. Raise "
                        "--trainer.rounds to continue the run."
                    )
                return dict(run.history[-1]) if run.history else {}
            with StopRequest(announce=run.fabric.global_rank == 0) as stop:
                return self._rounds(stop)
        except OSError as err:
            error = disk_full(err, run.run_dir)
            if error is None:
                raise
            raise error from None
        finally:
            if run.progress.folder is not None:
                run.progress.folder.release()

    # -- the rounds ----------------------------------------------------------------------------------
    def _rounds(self, stop: StopRequest) -> dict[str, float]:
        """The rounds from ``run.round`` on, until a stop request: one met while clients train drops the unfinished
        round once the client in training finishes and checkpoints the state the round started from; one met
        later ends the round with a checkpoint.

        A round callback that raises in a round's hooks or at the end does not lose the rounds done: the round
        is logged and checkpointed first, then the run stops with :class:`CallbackFailed` naming the callback
        and the checkpoint (a :class:`ConfigError` stays one, with the checkpoint added).
        """
        run, context = self.run, self.context
        fabric, settings, progress, model, strategy = run.fabric, run.settings, run.progress, run.model, run.strategy
        pieces, callbacks = run.pieces, run.callbacks
        last_ckpt = progress.run_dir / "checkpoints" / ckpt_io.LAST
        progress.stop = stop
        fabric.call("on_fit_start", context)
        strategy.on_fit_start(context)
        model.setup_clusters(strategy)
        memory = settings.memory
        model.setup_client_states(
            strategy, context, progress.run_dir / "client_state", memory.client_state_budget_bytes,
            memory.keep_client_states,
        )  # fmt: skip
        console = self._start_console()
        first = progress.round
        metrics: dict[str, float] = progress.history[-1] if progress.history else {}
        for round_idx in range(progress.round, run.rounds):
            started = time.perf_counter()
            # rank 0's state as the round starts, for a stop that drops it (None: last.ckpt holds it; other ranks)
            keep = fabric.global_rank == 0 and progress.saved_round != round_idx
            start_state = serialised(self._run_state()) if keep else None
            failure = call_callbacks(callbacks, "on_round_start", context, round_idx)
            if failure is not None:
                if progress.round > first:  # the rounds since the last checkpoint
                    self.save_checkpoint(last_ckpt)
                raise self._callback_failure(failure, metrics, progress.round - first)
            try:
                metrics = {"round": float(round_idx + 1), **self._run_round(round_idx)}  # counted from 1
            except RoundAbandoned:  # a stop request met between the round's clients
                restore = functools.partial(progress.restore, model=model, strategy=strategy, callbacks=callbacks)
                progress.interrupted = drop_round(round_idx, start_state, progress, restore, fabric)
                return self._end(metrics, round_idx - first)
            if settings.loop.evaluates_after(round_idx):
                sample = pieces.evaluator.sample(round_idx, run.rounds)  # None: every client's split
                metrics.update(pieces.evaluator.evaluate(clients=True, test=True, sample=sample))
                metrics.update(pieces.personal.evaluate())  # personalised rules: each client's own model
            progress.round = round_idx + 1
            failure = call_callbacks(callbacks, "on_round_end", context, round_idx, metrics)
            metrics["round/time_s"] = time.perf_counter() - started
            metrics = self._log(metrics)
            stopping = stop.agreed(fabric)
            last = progress.round == run.rounds
            if progress.round % settings.loop.checkpoint_every == 0 or last or stopping or failure is not None:
                self.save_checkpoint(last_ckpt)
                progress.saved_round = progress.round
            console.round_end(round_idx, run.rounds, metrics)
            if failure is not None:
                raise self._callback_failure(failure, metrics, progress.round - first)
            if stopping and not last:
                progress.interrupted = RunInterrupted(
                    stop.requested or "SIGINT", last_ckpt.absolute(), progress.round, True
                )
                return self._end(metrics, progress.round - first)
        failure = call_callbacks(callbacks, "on_fit_end", context)
        if failure is not None:
            raise self._callback_failure(failure, metrics, progress.round - first)
        return self._end(metrics, progress.round - first)

    def _run_round(self, round_idx: int) -> dict[str, float]:
        """Plan → local fit → aggregate; returns the round's training metrics."""
        run = self.run
        model, strategy, pieces = run.model, run.strategy, run.pieces
        plans = round_plans(strategy, run.datamodule.num_samples, run.settings.loop, run.streams.round_rng(round_idx))
        run.progress.plans = plans  # for hooks that look at the round's clients (e.g. MMD over K^t)
        strategy.on_round_start(self.context, round_idx, plans)
        updates, sums, states, integers = pieces.fits.run(round_idx, plans, run.progress.stop)
        aggregated = [u for u in updates if u.finite]
        if not aggregated:  # all non-finite or outsized (a round where all failed stopped in the fits)
            raise pieces.guards.none_aggregated(round_idx, updates)
        if strategy.gather_states:
            model.global_state = pieces.aggregation.gathered(model.global_state, states, aggregated)
        else:
            model.global_state = pieces.aggregation.streamed(model.bank, sums, aggregated)
        model.integers.update(integers)
        if not all_finite(model.global_state):
            raise pieces.guards.diverged(round_idx, type(strategy).__name__)
        pieces.guards.warn_failed(round_idx, [u for u in updates if "error" in u.payload], len(updates))
        return {
            **round_counts(plans, updates, aggregated),
            **strategy.on_round_end(self.context, round_idx, aggregated),
        }

    # -- the console and callback failures ------------------------------------------------------------
    def _start_console(self) -> RunConsole:
        """The run's console, with its start line; the local fits show their clients' bar on it."""
        run = self.run
        settings = run.settings
        console = self.console = run.pieces.fits.console = RunConsole(
            run.fabric.global_rank == 0, settings.logging.enable_progress_bar
        )
        run.pieces.training.say = console.print
        console.start(
            name=run.name, run_dir=run.run_dir, seed=run.seed, clients=run.datamodule.num_clients,
            per_round=settings.loop.clients_per_round, first=run.round, rounds=run.rounds,
            strategy=type(run.strategy).__name__,
        )  # fmt: skip
        return console

    def _end(self, metrics: dict[str, float], rounds_run: int) -> dict[str, float]:
        """Ends the run, however it stops: the loggers finish, then the console prints its summary."""
        self.run.pieces.loggers.finish()
        self.console.end(metrics, self.run.run_dir, rounds_run)
        return metrics

    def _callback_failure(self, failure: Failure, metrics: dict[str, float], rounds_run: int) -> Exception:
        """Ends the run whose callback raised after its rounds were saved; returns the error to raise."""
        self._end(metrics, rounds_run)
        return callback_error(failure, self.run.run_dir)

    # -- evaluation only, processes and set-up ---------------------------------------------------------
    def _evaluate_only(self, model, datamodule, strategy, ckpt_path, config, clients: bool) -> dict[str, float]:
        """The global model of ``ckpt_path`` (or as built) scored on every client's held-out split or on the global
        test set, and, on the splits of a personalised rule's run, each client's own model; said by rank 0."""
        self._setup(model, datamodule, strategy, ckpt_path, config, logging=False, evaluating=True)
        run = self.run
        progress, rank = run.progress, run.fabric.global_rank
        run.model.setup_clusters(run.strategy)
        if rank == 0:
            what = "the clients' held-out splits" if clients else "the global test set"
            if ckpt_path is None:
                scored = "the model as built (no --ckpt_path: no round trained)"
            else:
                of = "" if progress.planned_rounds is None else f" of {progress.planned_rounds}"
                scored = f"{ckpt_path}, the global model of round {progress.round}{of}"
            print(f"fedlight: scoring {scored} on {what}")
        metrics = scalar_metrics(run.pieces.evaluator.evaluate(clients=clients, test=not clients))
        if clients and run.strategy.personalised and progress.run_dir is not None:  # and each client's own model
            run.model.setup_client_states(
                run.strategy, self.context, progress.run_dir / "client_state",
                run.settings.memory.client_state_budget_bytes,
            )  # fmt: skip
            metrics.update(scalar_metrics(run.pieces.personal.evaluate()))
        if rank == 0:
            print(format_scores(metrics))
        return metrics

    def _in_processes(self, work, model, datamodule, strategy, *args, **kwargs) -> dict[str, float]:
        """Runs ``work`` on every rank (:class:`~fedlight.engine.launch.Ranks`); where the ranks were forked, this
        process takes over rank 0's outcome, as if the rounds had run here."""

        def outcome(result: dict[str, float]) -> dict[str, Any]:
            progress = self.run.progress
            return {"result": result, "state": self._run_state(), "run_dir": progress.run_dir,
                    "interrupted": progress.interrupted}  # fmt: skip

        result, handed = self.run_setup.ranks.run(lambda: work(model, datamodule, strategy, *args, **kwargs), outcome)
        if handed is not None:
            inputs, progress = adopted(handed, model, datamodule, strategy, self.run.callbacks)
            self.run.bind(inputs, None, progress)
        return result

    def _setup(self, *args: Any, logging: bool = True, evaluating: bool = False) -> None:
        """Sets up the run of ``(model, datamodule, strategy, ckpt_path, config)`` (:class:`RunSetup`)."""
        run = self.run
        inputs, pieces, progress = self.run_setup(
            *args, console=self.console, run_dir=lambda: run.progress.run_dir, logging=logging, evaluating=evaluating
        )
        run.bind(inputs, pieces, progress)

    # -- checkpoints and logs ----------------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path) -> None:
        """Writes the whole run state atomically (rank 0 only)."""
        run = self.run
        if run.fabric.global_rank == 0:
            ckpt_io.save_atomic(self._run_state(), path)
            if run.model.client_states is not None:  # the files no checkpoint names any more
                run.model.client_states.saved()
        run.fabric.barrier()

    def _run_state(self) -> dict[str, Any]:
        run = self.run
        inputs = run.inputs
        return run_state(
            run.progress, model=inputs.model, strategy=inputs.strategy,
            num_samples=inputs.datamodule.num_samples.tolist(), data_fingerprint=inputs.data_fingerprint,
            described=inputs.described, seed=run.seed, callbacks=run.callbacks,
            tracker_runs=run.pieces.loggers.tracker_runs(),
        )  # fmt: skip

    def _log(self, metrics: dict[str, Any]) -> dict[str, float]:
        """Logs one round; returns its scalar metrics, which the history, CSV and checkpoints keep."""
        scalars = scalar_metrics(metrics)
        self.run.history.append(scalars)
        self.run.pieces.loggers.log(scalars, metrics)
        return scalars
