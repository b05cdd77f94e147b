"""Per-round metrics to ``metrics.csv``, to Weights & Biases (offline by default) and to any Lightning logger."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from fedlight.engine import trackers
from fedlight.engine.config import LoggingSettings, WandbMode


class RoundCSV:
    """``metrics.csv`` with one row per round, the round first.

    Rows are appended; when a round brings a metric the header lacks, the file is rewritten with the
    wider header (the round history is small). On resume the file is rewritten from the checkpoint's
    history, so rounds computed after the last checkpoint by a killed run do not appear twice.
    """

    def __init__(self, path: str | Path, history: list[dict[str, float]]) -> None:
        self.path = Path(path)
        self.history = history
        self.columns: list[str] = []
        self._rewrite()

    def log(self, row: dict[str, float]) -> None:
        """Appends ``row``; it must already be the last element of the shared history list."""
        new = [key for key in row if key not in self.columns]
        if new:
            self._rewrite()
            return
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, self.columns).writerow(_csv_row(row))

    def _rewrite(self) -> None:
        columns = ["round"]
        for row in self.history:
            columns += [key for key in row if key not in columns]
        self.columns = columns
        tmp = self.path.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows(map(_csv_row, self.history))
        os.replace(tmp, self.path)


def _csv_row(row: dict[str, float]) -> dict[str, float | int]:
    """A history row as ``metrics.csv`` shows it: the round as the integer it is."""
    return {**row, "round": int(row["round"])} if "round" in row else row


def wandb_logger(
    run_dir: Path,
    name: str,
    run_id: str,
    config: dict[str, Any] | None,
    *,
    project: str | None = None,
    entity: str | None = None,
    mode: WandbMode | None = None,
    group: str | None = None,
    tags: list[str] | None = None,
    notes: str | None = None,
):
    """A Lightning ``WandbLogger`` writing under ``run_dir``, continuing run ``run_id`` if it exists; the W&B run
    starts when the first round is logged.

    W&B's environment variables apply as in any W&B program: ``WANDB_MODE=disabled`` turns W&B off
    whatever the config says, and ``WANDB_MODE``, ``WANDB_PROJECT`` and ``WANDB_ENTITY`` fill in what
    the config leaves unset. The round is the x-axis of every curve
    (``trainer/global_step``), so a resumed run continues its curves where the checkpoint left them.

    Returns:
        The logger, or ``None`` when W&B is disabled.
    """
    mode = resolve_wandb_mode(mode)
    if mode == "disabled":
        return None
    from lightning.pytorch.loggers import WandbLogger

    os.environ.setdefault("WANDB_SILENT", "true")
    # No `offline=True`: Lightning would then set WANDB_MODE in this process's environment for good.
    logger = WandbLogger(
        project=project or os.environ.get("WANDB_PROJECT") or "fedlight",
        # Read here rather than left to wandb: W&B reads its environment once per process, so a second run in
        # the same process (a sweep in a notebook) would otherwise miss a changed WANDB_ENTITY. Unset: the
        # account's default entity.
        entity=entity or os.environ.get("WANDB_ENTITY") or None,
        name=name,
        id=run_id,
        save_dir=str(run_dir),
        mode=mode,
        resume="allow",
        group=group,
        tags=tags,
        notes=notes,
        # Handed to wandb.init, which the logger calls at the first logged round rather than now: a run that is
        # killed before its first round ends, or a resume that has no round left, writes no empty W&B part.
        config=config,
    )
    # Lightning hands wandb.init `anonymous=None` whatever it is given, and W&B (≥ 0.19) warns "The anonymous
    # setting has no effect" for any value, None included, on every run. The setting does nothing, so it is
    # left out of the arguments instead of being passed on.
    logger._wandb_init.pop("anonymous", None)
    return logger


def wandb_login_problems(loggers: list[str], mode: WandbMode | None) -> list[str]:
    """``[problem]`` when the run would log to W&B online without credentials, which W&B reports only after the
    run folder exists, in a long traceback; checked when the trainer is built. Reads the credentials as W&B does
    (``WANDB_API_KEY``, its settings file, ``~/.netrc``) without asking the server."""
    if "wandb" not in loggers or resolve_wandb_mode(mode) != "online":
        return []
    # W&B keeps its settings and credentials per process once it has started, so the question is asked of a new
    # process that sees only this environment (~0.6 s, for online runs only).
    ask = (
        "import inspect, sys, wandb\n"
        "quiet = {'prompt': False} if 'prompt' in inspect.signature(wandb.login).parameters else {}\n"
        "sys.exit(0 if wandb.login(verify=False, **quiet) else 1)"
    )
    env = {**os.environ, "WANDB_MODE": "online", "WANDB_SILENT": "true"}
    asked = subprocess.run([sys.executable, "-c", ask], env=env, capture_output=True, stdin=subprocess.DEVNULL)
    logged_in = asked.returncode == 0
    if logged_in:
        return []
    return [
        "--trainer.wandb_mode=online (or WANDB_MODE=online) logs to the W&B server, but no W&B API key is set up "
        "here. Run `wandb login` or set WANDB_API_KEY; or log offline (--trainer.wandb_mode=offline, the default) "
        "and upload later with `wandb sync`."
    ]


def resolve_wandb_mode(mode: WandbMode | None) -> WandbMode:
    """The W&B mode of a run: ``WANDB_MODE=disabled`` always wins, then ``mode``, then ``WANDB_MODE``, else offline."""
    env = os.environ.get("WANDB_MODE", "").lower()
    if env == "disabled":  # W&B's switch for turning it off in CI and tests
        return "disabled"
    if mode is not None:
        return mode
    # W&B's older spellings of the same modes.
    return {"online": "online", "run": "online", "offline": "offline", "dryrun": "offline"}.get(env, "offline")


def histogram_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """1-D tensors and arrays of ``metrics`` as W&B histograms of their finite values (e.g. FedProto's attention
    weights a^t[k], the clients' accuracies); for per-client values (``…_per_client``), also a table
    ``…_table`` of client and value, so single clients can be looked up."""
    import numpy as np
    import wandb

    out = {}
    for key, value in metrics.items():
        if hasattr(value, "detach"):
            value = value.detach().cpu().numpy()
        if isinstance(value, np.ndarray) and value.ndim == 1 and value.size > 1:
            finite = np.isfinite(value)
            if finite.any():
                out[key] = wandb.Histogram(value[finite])
            if key.endswith(PER_CLIENT):
                name = key.rsplit("/", 1)[-1].removesuffix(PER_CLIENT)
                rows = [[int(client), float(value[client])] for client in np.flatnonzero(finite)]
                out[key.removesuffix(PER_CLIENT) + "_table"] = wandb.Table(columns=["client", name], data=rows)
    return out


#: The suffix of a metric that holds one value per client, ``[G]`` with NaN for a client without held-out data.
PER_CLIENT = "_per_client"


def client_spread(computed: dict[str, Any]) -> dict[str, Any]:
    """How a per-client metric spreads over the clients, from an evaluation metric's output.

    For every ``group_<m>`` of ``computed`` (``[G]``, one value per client, NaN where a client has no held-out
    data): ``<m>_per_client``, the values themselves (a histogram and a table in W&B), and over the clients with
    data ``<m>_min``, ``<m>_p10`` (the 10th percentile, linearly interpolated) and ``<m>_std`` (the population
    standard deviation over clients), scalars beside the existing ``<m>_mean``.
    """
    import torch

    out: dict[str, Any] = {}
    for key, values in computed.items():
        if not key.startswith("group_") or getattr(values, "ndim", 0) != 1:
            continue
        name = key.removeprefix("group_")
        values = values.detach().double().cpu()
        present = values[~values.isnan()]
        out[name + PER_CLIENT] = values.float()
        if len(present):
            out[f"{name}_min"] = present.min().item()
            out[f"{name}_p10"] = torch.quantile(present, 0.1).item()
            out[f"{name}_std"] = present.std(correction=0).item()
    return out


class RunLoggers:
    """The run folder's ``config.yaml``, ``metrics.csv``, W&B run and Lightning loggers, written from rank 0 only.

    Args:
        settings: which loggers and the W&B fields.
        rank: this process; other ranks log nothing.
    """

    def __init__(self, settings: LoggingSettings, rank: int) -> None:
        self.settings = settings
        self.rank = rank
        self._csv: RoundCSV | None = None
        self._wandb: Any = None
        #: the Lightning loggers given by class path, in the order of ``--trainer.logger``
        self.trackers: list[Any] = [logger for logger in settings.loggers if not isinstance(logger, str)]

    def start(
        self,
        run_dir: Path,
        config: dict[str, Any] | None,
        history: list[dict[str, float]],
        wandb_id: str,
        tracker_runs: list[dict[str, Any] | None] | None = None,
    ) -> None:
        """Writes the configuration and opens the loggers; W&B's run itself starts at the first logged round.

        Args:
            tracker_runs: the runs of the Lightning loggers that the checkpoint being resumed recorded
                (:meth:`tracker_runs`); each logger that can, continues its run, and the others start one and
                receive the configuration as hyper-parameters.
        """
        self._csv = self._wandb = None
        if self.rank != 0:
            return
        settings = self.settings
        if config is not None:
            import yaml

            (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        if "csv" in settings.loggers:
            self._csv = RoundCSV(run_dir / "metrics.csv", history)
        if "wandb" in settings.loggers:
            self._wandb = wandb_logger(
                run_dir,
                settings.name,
                wandb_id,
                config,
                project=settings.wandb_project,
                entity=settings.wandb_entity,
                mode=settings.wandb_mode,
                group=settings.wandb_group,
                tags=settings.wandb_tags,
                notes=settings.wandb_notes,
            )
        recorded = list(tracker_runs or [])
        recorded += [None] * (len(self.trackers) - len(recorded))
        for logger, run in zip(self.trackers, recorded, strict=False):
            if trackers.continue_run(logger, run):
                continue  # its run has the hyper-parameters already (MLflow refuses to change them)
            trackers.name_run(logger, settings.name)
            if config is not None:
                logger.log_hyperparams(trackers.hyperparameters(config))

    def tracker_runs(self) -> list[dict[str, Any] | None]:
        """What names each Lightning logger's run, for the checkpoint (None where a logger cannot continue one)."""
        return [trackers.run_identity(logger) for logger in self.trackers] if self.rank == 0 else []

    def log(self, scalars: dict[str, float], metrics: dict[str, Any]) -> None:
        """One round's ``scalars`` (the history row, already appended) and the histograms among ``metrics``."""
        if self.rank != 0:
            return
        step = int(scalars["round"])
        if self._csv is not None:
            self._csv.log(scalars)
        if self._wandb is not None:
            logged = {k: v for k, v in scalars.items() if k != "round"} | histogram_metrics(metrics)
            self._wandb.log_metrics(logged, step=step)
        for logger in self.trackers:
            logger.log_metrics({k: v for k, v in scalars.items() if k != "round"}, step=step)

    def log_images(self, images: dict[str, list[Any]], step: int) -> None:
        """Sends images (file paths, arrays or PIL images) to W&B under their keys, from rank 0; CSV keeps none."""
        if self.rank != 0 or self._wandb is None:
            return
        for key, values in images.items():
            self._wandb.log_image(key=key, images=list(values), step=step)

    def finish(self) -> None:
        if self.rank == 0:
            for logger in self.trackers:
                logger.finalize("success")
        if self._wandb is not None:
            self._wandb.finalize("success")
            import wandb

            wandb.finish()
