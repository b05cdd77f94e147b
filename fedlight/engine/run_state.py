"""What a checkpoint holds of a run, and whether a checkpoint belongs to the run that would load it.

``checkpoints/last.ckpt`` keeps the whole run state: the global model (W^t, integer buffers, frozen parts,
clusters), the strategy's and callbacks' states, the torch generator, the round, the metric history, the W&B
run id and the runs of the other trackers, the partition's sizes and digests, and the resolved configuration.
Randomness is derived from the seed and the round (:mod:`fedlight.engine.streams`), so nothing else is needed
for a resumed run to end with exactly the numbers of an uninterrupted one.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedlight import checkpoint as ckpt_io
from fedlight.engine.console import counted
from fedlight.engine.stopping import round_start
from fedlight.errors import ConfigError, RunInterrupted

if TYPE_CHECKING:
    from lightning.fabric import Fabric

    from fedlight.data.datamodule import FederatedDataModule
    from fedlight.engine.model import GlobalModel
    from fedlight.engine.rundir import RunFolder
    from fedlight.engine.stopping import StopRequest
    from fedlight.plans import ClientPlan
    from fedlight.strategies.base import Strategy


@dataclass
class RunProgress:
    """Where a run stands; rank 0's is what a checkpoint keeps with the model and the states."""

    #: rounds done; the round in progress while one runs
    round: int = 0
    #: every round's scalar metrics
    history: list[dict[str, float]] = field(default_factory=list)
    #: the round's clients, for hooks that look at K^t (e.g. MMD over K^t)
    plans: list[ClientPlan] = field(default_factory=list)
    #: the run folder, once claimed (None for a run that writes none)
    run_dir: Path | None = None
    wandb_id: str | None = None
    #: ``trainer.rounds`` of the checkpoint that was loaded, if it says
    planned_rounds: int | None = None
    #: the round that ``checkpoints/last.ckpt`` holds, once this run wrote it
    saved_round: int | None = None
    #: the lock on the run folder (rank 0), released when the run ends
    folder: RunFolder | None = None
    #: the run's stop request, looked at between clients
    stop: StopRequest | None = None
    #: how a stop request ended the run, raised once its processes are done
    interrupted: RunInterrupted | None = None

    def load(self, state: dict[str, Any], *, model: GlobalModel, strategy: Strategy, callbacks: list[Any]) -> None:
        """Loads a checkpoint into the model, the strategy, the callbacks and torch's generator
        (:func:`load_run_state`), and takes its round, history and W&B run id."""
        self.round, self.history, self.wandb_id = load_run_state(
            state, model=model, strategy=strategy, callbacks=callbacks
        )

    def restore(self, state: dict[str, Any], *, model: GlobalModel, strategy: Strategy, callbacks: list[Any]) -> None:
        """Takes back a state this run wrote (:meth:`load`), the clusters of its model bank included."""
        self.load(state, model=model, strategy=strategy, callbacks=callbacks)
        if model.bank.num_clusters and state["bank"] is not None:
            model.bank.load_state_dict(state["bank"])


def run_state(
    progress: RunProgress,
    *,
    model: GlobalModel,
    strategy: Strategy,
    num_samples: list[int],
    data_fingerprint: dict[str, str] | None,
    described: dict[str, Any] | None,
    seed: int,
    callbacks: list[Any],
    tracker_runs: list[dict[str, Any] | None],
) -> dict[str, Any]:
    """The checkpoint of a run that has done ``progress.round`` rounds."""
    return {
        "format": ckpt_io.FORMAT,
        "round": progress.round,
        "seed": seed,
        **model.state_dict(),
        "strategy": {"class": type(strategy).__qualname__, "state": strategy.state_dict()},
        "callbacks": [callback.state_dict() for callback in callbacks],
        "torch_rng": torch.get_rng_state(),
        "history": progress.history,
        "wandb_id": progress.wandb_id,
        "tracker_runs": tracker_runs,
        "num_samples": num_samples,
        "data_fingerprint": data_fingerprint,
        "config": described,
        "run_dir": None if progress.run_dir is None else str(progress.run_dir.resolve()),
    }


def check_checkpoint(
    state: dict[str, Any],
    *,
    model: GlobalModel,
    datamodule: FederatedDataModule,
    data_fingerprint: dict[str, str],
    strategy: Strategy,
    seed: int,
    config: dict[str, Any] | None,
    evaluating: bool,
) -> None:
    """Refuses a checkpoint of another run, listing every difference. Evaluating it needs only the same model and
    strategy: data, evaluation and training settings may differ."""
    problems = model.checkpoint_problems(state)
    if not evaluating and state["num_samples"] != datamodule.num_samples.tolist():
        problems.append("its clients' sample counts differ from this --data partition")
    else:
        saved = state.get("data_fingerprint") or {}  # absent in checkpoints written before fingerprints
        if saved.get("partition", data_fingerprint["partition"]) != data_fingerprint["partition"]:
            problems.append("its clients hold other samples than this --data partition gives them")
        if saved.get("samples", data_fingerprint["samples"]) != data_fingerprint["samples"]:
            problems.append("the contents of the --data samples changed since it was written (same sizes)")
    strategy_class = type(strategy).__qualname__
    if state["strategy"]["class"] != strategy_class:
        problems.append(f"it was trained with strategy {state['strategy']['class']}, not {strategy_class}")
    if not evaluating and state["seed"] != seed:
        problems.append(f"it was trained with seed_everything={state['seed']}, not {seed}")
    if not evaluating and state["config"] is not None and config is not None:
        problems += ckpt_io.config_differences(state["config"], config)
    if problems:
        raise ConfigError(
            "The checkpoint passed as --ckpt_path belongs to another configuration:",
            *(f"  - {p}" for p in problems),
            "Resume with the configuration and data that wrote it (its run directory holds config.yaml); only "
            "trainer.rounds, logging, evaluation/checkpoint cadence, devices, start method and memory layout "
            "may change.",
        )


def load_run_state(
    state: dict[str, Any], *, model: GlobalModel, strategy: Strategy, callbacks: list[Any]
) -> tuple[int, list[dict[str, float]], str]:
    """Loads a checkpoint into the model, the strategy, the callbacks and torch's generator; returns its round,
    history and W&B run id."""
    model.load_state_dict(state)
    strategy.load_state_dict(state["strategy"]["state"])
    for callback, callback_state in zip(callbacks, state.get("callbacks", []), strict=False):
        callback.load_state_dict(callback_state)
    torch.set_rng_state(state["torch_rng"])
    return int(state["round"]), list(state["history"]), state["wandb_id"]


#: Marks a configuration described from the objects of a run started from Python (no command line resolved it).
PYTHON_ORIGIN = {"origin": "python"}


def python_config(trainer_args: dict[str, Any], seed: int, model: Any, datamodule: Any, strategy: Any) -> dict:
    """The configuration of a run started from Python, in the command line's layout, as far as the objects tell:
    the trainer's arguments exactly; for the model, the data and the rule, their class and every constructor
    argument kept under its own name as a plain value. Checkpoints store it so that a resume with other settings
    is refused (:func:`fedlight.checkpoint.config_differences` compares what both sides know).

    >>> from fedlight.strategies import FedProx
    >>> python_config({"rounds": 3}, 0, None, None, FedProx(mu=0.1))["strategy"]["init_args"]["mu"]
    0.1
    """
    return {
        **PYTHON_ORIGIN,
        "seed_everything": seed,
        "trainer": {k: v for k, v in ((k, _plain(v)) for k, v in trainer_args.items()) if v is not _UNKNOWN},
        "model": _plain(model),
        "data": _plain(datamodule, with_class=False),
        "strategy": _plain(strategy),
    }


_UNKNOWN = object()  # a value with no plain description (a tensor, a lambda), left out


def _plain(value: Any, with_class: bool = True, depth: int = 0) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Path):
        return str(value)
    if depth > 4:
        return _UNKNOWN
    if isinstance(value, list | tuple):
        if len(value) > 1000:  # a dataset's file list: the data's fingerprint covers it
            return _UNKNOWN
        items = [_plain(v, depth=depth + 1) for v in value]
        return _UNKNOWN if any(v is _UNKNOWN for v in items) else items
    if isinstance(value, dict):
        items = {str(k): _plain(v, depth=depth + 1) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not _UNKNOWN}
    if isinstance(value, functools.partial):  # an optimizer given as partial(torch.optim.SGD, lr=…)
        return {"class_path": _qualified(value.func), "init_args": _plain(value.keywords, depth=depth + 1)}
    if inspect.isroutine(value) or inspect.isclass(value):  # a lambda or function: no plain description
        return _UNKNOWN
    if type(value).__module__ in ("torch", "numpy") or type(value).__module__.startswith(("torch.", "numpy.")):
        return _UNKNOWN
    try:
        parameters = inspect.signature(type(value).__init__).parameters
    except (TypeError, ValueError):
        return _UNKNOWN
    arguments, attributes = {}, getattr(value, "__dict__", {})
    for name, parameter in parameters.items():
        if name == "self" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if name in attributes:
            described = _plain(attributes[name], depth=depth + 1)
            if described is not _UNKNOWN:
                arguments[name] = described
    return {"class_path": _qualified(type(value)), "init_args": arguments} if with_class else arguments


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def drop_round(
    round_idx: int,
    start_state: bytes | None,
    progress: RunProgress,
    restore: Callable[[dict[str, Any]], None],
    fabric: Fabric,
) -> RunInterrupted:
    """Drops round ``round_idx`` after a stop request met between its clients: nothing of it is aggregated, and
    ``last.ckpt`` holds the state the round started from (:func:`round_start`), which this process takes back, so
    that a resume repeats the round exactly (``restore``: :meth:`RunProgress.restore` into the run's model, rule and
    callbacks). Returns the error that ends the run."""
    path = progress.run_dir / "checkpoints" / ckpt_io.LAST
    if fabric.global_rank == 0:
        restore(round_start(start_state, path))
    fabric.barrier()
    progress.round = progress.saved_round = round_idx
    name = progress.stop.requested or "SIGTERM"  # no name here: another process received the signal
    return RunInterrupted(name, path.absolute(), round_idx, saved=True, dropped=True)


def rounds_left(ckpt_path: str | Path, state: dict[str, Any], rounds: int) -> bool:
    """Whether a resume from ``state`` has rounds to run under ``--trainer.rounds``; refuses one whose checkpoint
    holds more rounds than that."""
    done = int(state["round"])
    if done > rounds:
        raise ConfigError(
            f"--ckpt_path {ckpt_path} holds {counted(done, 'round')}, more than --trainer.rounds={rounds}: there "
            f"is nothing to resume. Pass --trainer.rounds above {done} to continue the run, or score it with "
            "fedlight validate / test."
        )
    return done < rounds


def planned_rounds(state: dict[str, Any]) -> int | None:
    """``trainer.rounds`` of the configuration a checkpoint was written with, if it holds one."""
    return ((state.get("config") or {}).get("trainer") or {}).get("rounds")
