"""``fedlight sweep``: the sweep files of ``conf/sweeps/`` run locally, without a W&B server, on Optuna.

A sweep file is W&B's format (``method``, ``metric``, ``parameters``, ``command``), so the same file serves
``wandb sweep`` and this command. Each trial is one ``fedlight fit`` (run in this process) of the file's command
with the trial's swept values appended, named after those values (``lr=0.01-seed_everything=1``) and written
under ``<root>/<sweep>/``; it logs to the trackers its configuration names, its W&B run grouped by the sweep.
``grid`` walks the grid (Optuna's ``GridSampler``), ``random`` draws independently (``RandomSampler``) and
``bayes`` proposes from the trials so far (``TPESampler``, a tree-structured Parzen estimator).

The trials live in an Optuna database (SQLite by default, ``<root>/<sweep>/sweep.db``; any SQLAlchemy URL, such as
a PostgreSQL server's, for several machines). Running the command again continues the sweep, and several
processes given the same ``--storage`` work on it together. Every running trial writes a heartbeat; a trial whose
process was killed is marked failed once its heartbeat is ``2 × --heartbeat`` seconds old, and queued again with
the same values, and its run continues from its last checkpoint. A run stopped by Ctrl-C or SIGTERM is queued
again in the same way. A trial that failed for another reason stays failed (``--retry_failed`` queues it again).
At the end, a table of the trials: state, metric, values, run folder.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlight.errors import ConfigError, RunInterrupted, error_line
from fedlight.sweep_file import METHODS, SweepFile

DESCRIPTION = (
    "Run a sweep file of conf/sweeps/ (grid, random or bayes) locally on an Optuna database, without a W&B server; "
    "run it again to continue, or in several processes with the same --storage. Further --key=value flags go to "
    "every trial."
)


def flag(key: str, value: Any) -> str:
    """``--key=value`` as jsonargparse reads it (``true``, ``null``, numbers and text as written).

    >>> flag("trainer.rounds", 3), flag("a.b", True), flag("a.c", None), flag("strategy.class_path", "x.Y")
    ('--trainer.rounds=3', '--a.b=true', '--a.c=null', '--strategy.class_path=x.Y')
    """
    text = json.dumps(value) if value is None or isinstance(value, bool) else str(value)
    return f"--{key}={text}"


def trial_name(values: dict[str, Any]) -> str:
    """A run name from a trial's swept values: each key by its last part (more where two keys share it), each
    class path by its class, joined by ``-``.

    >>> trial_name({"model.init_args.optimizer.init_args.lr": 0.01, "seed_everything": 1})
    'lr=0.01-seed_everything=1'
    >>> trial_name({"strategy.class_path": "fedlight.strategies.FedProx", "strategy.init_args.mu": 0.1})
    'class_path=FedProx-mu=0.1'
    """
    parts = {key: key.split(".") for key in values}
    short = {}
    for key, pieces in parts.items():
        depth = 1
        while depth < len(pieces) and any(other != key and parts[other][-depth:] == pieces[-depth:] for other in parts):
            depth += 1
        short[key] = ".".join(pieces[-depth:])
    words = []
    for key, value in values.items():
        text = str(value)
        if isinstance(value, str) and "." in text and text.replace(".", "").replace("_", "").isalnum():
            text = text.rsplit(".", 1)[-1] if not _is_number(text) else text
        words.append(f"{short[key]}={text}".replace("/", "_").replace(" ", ""))
    return "-".join(words)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments, on its own parser and on the ``fedlight`` parser's ``sweep`` subcommand."""
    parser.add_argument("sweep_file", help="a W&B sweep file, e.g. conf/sweeps/digits_fedavg_lr.yaml")
    parser.add_argument("--method", choices=METHODS, help="overrides the file's method")
    parser.add_argument(
        "--storage",
        help="the Optuna database URL shared by every process of the sweep (default: sqlite:///<root>/<sweep>/sweep.db)",
    )
    parser.add_argument("--study", help="the sweep's name in the database and its runs' folder (default: file stem)")
    parser.add_argument("--root", default="runs", help="where the sweep's runs go: <root>/<sweep>/<trial> (runs)")
    parser.add_argument(
        "--trials", type=int, help="trials of a random or bayes sweep in all (default: the file's run_cap)"
    )
    parser.add_argument("--seed", type=int, help="seed of the random and bayes draws (each process its own)")
    parser.add_argument(
        "--heartbeat", type=int, default=10, help="seconds between a running trial's heartbeats; a trial silent for "
        "twice as long is taken as killed and queued again (default 10)",
    )  # fmt: skip
    parser.add_argument("--retry_failed", action="store_true", help="queue the trials that failed again")


@dataclass
class Sweep:
    """One process's part of a sweep: the file, the study in the database, and the trials' common flags."""

    file: SweepFile
    root: Path
    extra: list[str]
    study: Any  # optuna.Study
    #: runs one ``fedlight`` command (``fit …``) and returns its last round's metrics: the command line's ``run``
    run: Callable[[list[str]], dict[str, float]]

    def objective(self, trial: Any) -> float:
        """Runs one trial's fedlight run (continuing its checkpoint, if an earlier attempt left one)."""
        values = {key: suggest(trial, key, spec) for key, spec in self.file.swept.items()}
        if self.file.method == "grid" and self.taken_earlier(trial.number, values):
            import optuna

            # Two processes that asked for a trial at once may be handed the same point of the grid.
            raise optuna.TrialPruned(f"{values} is another trial's point of the grid")
        name = trial_name(values)
        run_root = self.root / self.file.name
        trial.set_user_attr("run", str(run_root / name))
        args = [
            *self.file.command,
            f"--trainer.default_root_dir={run_root}",
            f"--trainer.name={name}",
            f"--trainer.wandb_group={self.study.study_name}",
            *self.extra,
            *(flag(key, value) for key, value in {**self.file.fixed, **values}.items()),
        ]
        checkpoint = last_checkpoint(run_root / name)
        if checkpoint is not None:
            args.append(f"--ckpt_path={checkpoint}")
        else:
            for stale in remove_attempts_without_checkpoint(run_root / name):
                print(f"fedlight sweep: trial {trial.number}: removed {stale}, an attempt stopped before its first "
                      "checkpoint (nothing in it to continue)", file=sys.stderr)  # fmt: skip
        print(f"fedlight sweep: trial {trial.number}, {name}", file=sys.stderr)
        try:
            metrics = self.run(args)
        except RunInterrupted:
            trial.set_user_attr("interrupted", True)
            raise
        except SystemExit as stop:  # the command refused the trial's flags (a usage error): the trial failed
            raise self.failed(trial, ConfigError(f"fedlight refused the trial's flags (exit {stop.code}).")) from None
        except Exception as err:
            raise self.failed(trial, err) from None
        value = metrics.get(self.file.metric)
        if value is None or not math.isfinite(value):
            known = ", ".join(sorted(metrics)) or "none"
            trial.set_user_attr("no_metric", True)
            raise self.failed(
                trial,
                ConfigError(
                    f"the run {name} logged no finite {self.file.metric} (the sweep's metric.name) in its last "
                    f"round; it logged: {known}."
                ),
            )
        return float(value)

    @staticmethod
    def failed(trial: Any, err: Exception) -> Exception:
        """Records why ``trial`` failed, on one line, for the table and the console; returns ``err`` to raise."""
        reason = error_line(err).removeprefix("ConfigError: ")
        trial.set_user_attr("error", reason)
        print(f"fedlight sweep: trial {trial.number} failed: {reason}", file=sys.stderr)
        return err

    def taken_earlier(self, number: int, values: dict[str, Any]) -> bool:
        """Whether an earlier trial with the same values is complete, running or queued."""
        from optuna.trial import TrialState

        alive = (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)
        return any(
            t.number < number and t.state in alive and t.params == values for t in self.study.get_trials(deepcopy=False)
        )


def suggest(trial: Any, key: str, spec: dict[str, Any]) -> Any:
    """The trial's value of one swept parameter (W&B's distributions in Optuna's terms)."""
    if "values" in spec:
        return trial.suggest_categorical(key, spec["values"])
    low, high, distribution = spec["min"], spec["max"], spec["distribution"]
    if distribution == "int_uniform":
        return trial.suggest_int(key, int(low), int(high))
    if distribution == "log_uniform":  # W&B: min and max are natural logarithms of the bounds
        return trial.suggest_float(key, math.exp(low), math.exp(high), log=True)
    return trial.suggest_float(key, float(low), float(high), log=distribution == "log_uniform_values")


def last_checkpoint(run_root: Path) -> Path | None:
    """The newest ``version_<n>/checkpoints/last.ckpt`` of a trial's run folder, if an attempt wrote one."""
    found = [
        v / "checkpoints" / "last.ckpt"
        for v in run_root.glob("version_*")
        if v.name.split("_")[1].isdigit() and (v / "checkpoints" / "last.ckpt").is_file()
    ]
    return max(found, key=lambda p: int(p.parent.parent.name.split("_")[1]), default=None)


def remove_attempts_without_checkpoint(run_root: Path) -> list[Path]:
    """Removes the ``version_<n>`` folders of a trial that hold no checkpoint and that no live process writes (its
    run lock is free): attempts killed before their first checkpoint, which the trial's next attempt starts over,
    and which would otherwise lie beside its run as if they were runs. Returns them."""
    from fedlight.engine.rundir import RunLock

    removed = []
    for version in sorted(run_root.glob("version_*")):
        if not version.is_dir() or (version / "checkpoints" / "last.ckpt").is_file():
            continue
        lock = RunLock(version)
        try:
            lock.acquire()
        except ConfigError:  # another process is writing it
            continue
        try:
            shutil.rmtree(version)
        finally:
            lock.release()
        removed.append(version)
    return removed


def open_study(file: SweepFile, storage: str, name: str, heartbeat: int, seed: int | None) -> Any:
    """The sweep's Optuna study in ``storage``, created on first use; killed trials are queued again."""
    try:
        import optuna
    except ImportError as error:
        raise ConfigError(
            "fedlight sweep runs on Optuna, which is not installed. Fix: pip install 'fedlight[sweep]'."
        ) from error
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    # ERROR: a failed trial's reason is printed on one line by the sweep, not as Optuna's warning with a traceback
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    if heartbeat < 1:
        raise ConfigError(f"Expected --heartbeat ≥ 1 second, got {heartbeat}.")
    samplers = {
        "grid": lambda: optuna.samplers.GridSampler({k: s["values"] for k, s in file.swept.items()}, seed=seed),
        "random": lambda: optuna.samplers.RandomSampler(seed=seed),
        "bayes": lambda: optuna.samplers.TPESampler(seed=seed),
    }
    # Creating a database's tables and a study is not atomic: processes that start one new sweep together would
    # race on the schema ("table studies already exists"), so they take turns (on a SQLite file, a lock beside it).
    with _one_at_a_time(storage):
        try:
            database = RDBStorage(
                storage, heartbeat_interval=heartbeat, grace_period=2 * heartbeat,
                heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(),
            )  # fmt: skip
        except Exception as error:  # SQLAlchemy's own errors, for an unknown scheme or an unreachable server
            raise ConfigError(f"--storage {storage} cannot be opened as an Optuna database: {error}") from error
        return optuna.create_study(
            storage=database, study_name=name, sampler=samplers[file.method](), load_if_exists=True,
            direction="maximize" if file.maximize else "minimize",
        )  # fmt: skip


@contextlib.contextmanager
def _one_at_a_time(storage: str) -> Iterator[None]:
    """Holds ``<database>.lock`` exclusively for a SQLite URL (POSIX ``flock``); other servers order their own
    transactions."""
    try:
        import fcntl
    except ImportError:  # Windows: start the processes of a new sweep one after another
        fcntl = None
    if fcntl is None or not storage.startswith("sqlite:///"):
        yield
        return
    lock = Path(storage.removeprefix("sqlite:///") + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def requeue(study: Any, trial: Any) -> None:
    """Queues a failed trial again with the same values, as Optuna does for a killed one."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    RetryHeartbeatStaleTrialCallback()(study, trial)


def counted(trials: list[Any]) -> list[Any]:
    """Each trial's latest attempt (the trials that no later attempt retried), without those dropped as another
    trial's point of the grid."""
    from optuna.trial import TrialState

    retried = {number for t in trials for number in t.system_attrs.get("retry_history", [])}
    return [t for t in trials if t.number not in retried and t.state != TrialState.PRUNED]


def work(sweep: Sweep, budget: int, heartbeat: int) -> None:
    """Runs trials until the sweep has ``budget`` of them, waiting for those running elsewhere to end."""
    from optuna.storages import fail_stale_trials
    from optuna.trial import TrialState

    study = sweep.study
    while True:
        fail_stale_trials(study)  # a killed trial is queued again with its values
        trials = counted(study.get_trials(deepcopy=False))
        states = [t.state for t in trials]
        if TrialState.WAITING in states or len(trials) < budget:
            try:
                study.optimize(sweep.objective, n_trials=1, catch=(Exception,))
            except RunInterrupted:
                for trial in counted(study.get_trials(deepcopy=False)):
                    if trial.state == TrialState.FAIL and trial.user_attrs.get("interrupted"):
                        requeue(study, trial)
                raise
            if any(t.state == TrialState.FAIL and t.user_attrs.get("no_metric") for t in counted(study.get_trials())):
                # every other trial would spend its compute on a run that cannot be ranked
                raise ConfigError(
                    f"A trial logged no {sweep.file.metric} (the sweep's metric.name), so no trial can be ranked: "
                    "the sweep stops. Name a value the runs log (their metrics.csv columns, e.g. test/acc)."
                )
        elif TrialState.RUNNING in states:  # in another process, or in one that was killed (then it goes stale)
            time.sleep(heartbeat)
        else:
            return


def summary(sweep: Sweep) -> str:
    """The trials as a Markdown table, best first among the complete ones."""
    from optuna.trial import TrialState

    trials = counted(sweep.study.get_trials(deepcopy=False))
    complete = sorted(
        (t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.value, reverse=sweep.file.maximize
    )
    others = [t for t in trials if t.state != TrialState.COMPLETE]
    keys = list(sweep.file.swept)
    header = ["trial", "state", sweep.file.metric, *keys, "run", "why it failed"]
    lines = [
        f"Sweep {sweep.study.study_name} ({sweep.file.method}, {sweep.file.metric} to "
        f"{'maximize' if sweep.file.maximize else 'minimize'}): {len(complete)} of {len(trials)} trials complete.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for t in [*complete, *others]:
        value = f"{t.value:.4g}" if t.value is not None else "–"
        cells = [str(t.number), t.state.name.lower(), value, *(str(t.params.get(k, "–")) for k in keys)]
        reason = t.user_attrs.get("error", "–") if t.state == TrialState.FAIL else "–"
        lines.append("| " + " | ".join([*cells, t.user_attrs.get("run", "–"), reason.replace("|", "/")]) + " |")
    return "\n".join(lines)


def main(argv: list[str], run: Callable[[list[str]], dict[str, float]]) -> None:
    """``fedlight sweep SWEEP_FILE [options] [--key=value …]``, each trial a ``run(["fit", …])``."""
    parser = argparse.ArgumentParser(prog="fedlight sweep", description=DESCRIPTION)
    add_arguments(parser)
    options, extra = parser.parse_known_args(argv)
    unknown = [arg for arg in extra if not arg.startswith("--")]
    if unknown:
        raise ConfigError(f"fedlight sweep passes --key=value flags to every trial; {' '.join(unknown)} is not one.")
    file = SweepFile.read(Path(options.sweep_file), options.method)
    budget = file.budget(options.trials)
    name = options.study or file.name
    root = Path(options.root)
    storage = options.storage
    if storage is None:
        (root / name).mkdir(parents=True, exist_ok=True)
        storage = f"sqlite:///{(root / name / 'sweep.db').resolve()}"
    file = dataclasses.replace(file, name=name)
    study = open_study(file, storage, name, options.heartbeat, options.seed)
    sweep = Sweep(file, root, extra, study, run)
    if options.retry_failed:
        from optuna.trial import TrialState

        for trial in counted(study.get_trials(deepcopy=False)):
            if trial.state == TrialState.FAIL:
                requeue(study, trial)
    print(f"fedlight sweep: {name}, {file.method}, {budget} trials in {storage}", file=sys.stderr)
    try:
        work(sweep, budget, options.heartbeat)
    finally:
        print(summary(sweep))
    from optuna.trial import TrialState

    failed = [t for t in counted(study.get_trials(deepcopy=False)) if t.state == TrialState.FAIL]
    if failed:
        raise ConfigError(
            f"{len(failed)} trial(s) of the sweep failed (the table gives each reason); fix the cause and run the "
            "same command with --retry_failed to run them again."
        )
