"""Reading what ``fedlight fit`` leaves in ``<root>/<name>/version_<n>/``, shared by the benchmark scripts."""

from __future__ import annotations

import csv
import math
from pathlib import Path


def latest_version(root: Path, name: str) -> Path | None:
    """The newest ``<root>/<name>/version_<n>`` folder, where fedlight put the run's last attempt."""
    versions = [p for p in (root / name).glob("version_*") if p.name.split("_")[1].isdigit()]
    return max(versions, key=lambda p: int(p.name.split("_")[1]), default=None)


def read_metrics(run_dir: Path | None) -> list[dict[str, float]]:
    """The rows of a run's metrics.csv as floats (NaN where a round did not log a column)."""
    path = None if run_dir is None else run_dir / "metrics.csv"
    if path is None or not path.exists():
        return []
    with path.open(newline="") as f:
        return [{k: float(v) if v not in ("", None) else math.nan for k, v in row.items()} for row in csv.DictReader(f)]


def run_options(root: Path, name: str) -> list[str]:
    """What every benchmark's ``fedlight fit`` command ends with: CSV only, its folder and name, no progress bar,
    and ``--ckpt_path`` to resume the run's last attempt when that left a checkpoint."""
    options = [
        "--trainer.logger=csv",
        f"--trainer.default_root_dir={root}",
        f"--trainer.name={name}",
        "--trainer.enable_progress_bar=false",
    ]
    last = latest_version(root, name)
    if last is not None and (last / "checkpoints" / "last.ckpt").exists():
        options.append(f"--ckpt_path={last / 'checkpoints' / 'last.ckpt'}")
    return options
