"""Lightning loggers given by class path (TensorBoard, MLflow, W&B, …) as the trackers of a run.

A run logs every round to each tracker with the round as the step, and its resolved configuration as the
tracker's hyper-parameters when the tracker's run is created. The checkpoint keeps what names each tracker's run
(TensorBoard's version folder, MLflow's run id, W&B's run id); a resumed run hands it back to a tracker whose
configuration left that choice to the logger, so the curves go on in the same run. Lightning's loggers accept
these only in their constructors, and the run's identity is known only after the first run wrote it, so it is
set on the new instance before its first use, here and nowhere else. Other loggers start a new run on resume.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.fabric.loggers import Logger

from fedlight.engine import rundir

#: the folder name Lightning's TensorBoardLogger takes when given none
LIGHTNING_DEFAULT_NAME = "lightning_logs"
#: the attribute that names a logger's run, for each kind of Lightning logger that can continue one
RUN_ATTRIBUTES = {"TensorBoardLogger": "_version", "MLFlowLogger": "_run_id", "WandbLogger": "_id"}


def kind(logger: Logger) -> str | None:
    """The Lightning class among ``logger``'s bases that can continue a run (``TensorBoardLogger``, …), if any."""
    for cls in type(logger).__mro__:
        if cls.__name__ in RUN_ATTRIBUTES:
            return cls.__name__
    return None


def run_identity(logger: Logger) -> dict[str, Any] | None:
    """``{"class": kind, "run": id}`` naming the run ``logger`` writes, for a checkpoint; None when the logger
    cannot continue a run or has not started one. Reading it starts no run."""
    name = kind(logger)
    if name == "TensorBoardLogger":
        run = logger.version  # the next free version folder, found without creating it
        if run is not None:  # its folder is <save_dir>/<name>/<version>: both are needed to find it again
            return {"class": name, "run": run, "name": logger.name}
    elif name == "WandbLogger":
        run = logger.version  # the started run's id, else the configured one
    elif name == "MLFlowLogger":
        run = logger._run_id  # set once the first round created the run
    else:
        return None
    return None if run is None else {"class": name, "run": run}


def continue_run(logger: Logger, identity: dict[str, Any] | None) -> bool:
    """Points a fresh ``logger`` at the run that ``identity`` names, unless its configuration names a run of its own
    (a ``version``, ``run_id`` or ``id``); returns whether it now continues that run."""
    name = kind(logger)
    if identity is None or name is None or identity.get("class") != name:
        return False
    attribute = RUN_ATTRIBUTES[name]
    if getattr(logger, attribute) is not None:
        return False
    setattr(logger, attribute, identity["run"])
    if name == "TensorBoardLogger" and "name" in identity and logger._name == LIGHTNING_DEFAULT_NAME:
        logger._name = identity["name"]
    if name == "WandbLogger":  # handed to wandb.init at the first logged round
        logger._wandb_init.update(id=identity["run"], resume="allow")
    return True


def name_run(logger: Logger, name: str) -> None:
    """Names the run that ``logger`` will create after the fedlight run, where its configuration named none: an MLflow
    or W&B run, and TensorBoard's folder (``<save_dir>/<name>/version_<n>`` instead of ``lightning_logs``)."""
    if kind(logger) == "TensorBoardLogger" and logger._name == LIGHTNING_DEFAULT_NAME:
        logger._name = name
    elif kind(logger) == "MLFlowLogger" and logger._run_name is None:
        logger._run_name = name
    elif kind(logger) == "WandbLogger" and logger._wandb_init.get("name") is None:
        logger._wandb_init["name"] = logger._name = name


def hyperparameters(config: dict[str, Any]) -> dict[str, Any]:
    """The resolved configuration as flat hyper-parameters, ``trainer.rounds: 50``, values other than numbers,
    strings and booleans written as text (trackers take scalars).

    >>> hyperparameters({"trainer": {"rounds": 5, "logger": ["csv"]}, "seed_everything": 0})
    {'trainer.rounds': 5, 'trainer.logger': "['csv']", 'seed_everything': 0}
    """
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif value is None or isinstance(value, bool | int | float | str):
            flat[prefix] = "null" if value is None else value
        else:
            flat[prefix] = str(value)

    walk("", config)
    return flat


def folder_problems_of(loggers: Sequence[Any]) -> list[str]:
    """The Lightning loggers' folders (``save_dir``) that could not be written, found at set-up rather than when
    the first round is logged, after its training."""
    problems = []
    for logger in loggers:
        folder = getattr(logger, "save_dir", None) if isinstance(logger, Logger) else None
        if isinstance(folder, str | Path) and "://" not in str(folder):
            flag = f"--trainer.logger {type(logger).__name__}'s save_dir"
            problems += rundir.folder_problems(Path(folder), flag, "a folder for its files")
    return problems
