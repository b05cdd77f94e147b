"""FUSS's Table 3 on the offline twin of its CocoStuff-27 split, over seeds, with paired differences.

Each row is a ``fedlight fit`` of ``conf/fuss/twin_cocostuff/<row>.yaml`` (18 clients drawn by dominant label with
Dir(0.5) proportions, the street twin's images, backbone and rates; see ``base.yaml``), one process at a time with
one thread, seeded by ``--seed_everything``: the seed redraws the scenes, the split and the training. Reported per
row: the Hungarian-matched test mIoU after the last round (``test/miou``; the Local-only row scores each client's
own model on the test cities, ``test/personal/miou``), its mean ± sample std over seeds, and the paired
differences the paper's Table 3 is about: each rule with FedCC against the same rule without, and every row
against FedAvg (``benchmarks/paired.py``: mean ± standard error, resolved when beyond two standard errors).

    python benchmarks/fuss/cocostuff_twin.py --seeds 0 1 2
    python benchmarks/fuss/cocostuff_twin.py --rows fedavg fedavg_fedcc --seeds 0 1 2 3 4

Runs go to ``--out`` (default ``runs/fuss/cocostuff_twin``); a row whose ``metrics.csv`` has its last round is
read again rather than rerun, so an interrupted benchmark continues.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from paired import paired  # noqa: E402

CONFIGS = REPO / "conf/fuss/twin_cocostuff"
ROWS = ["centralized", "local_only", "fedavg", "fedavg_fedcc", "fedprox", "fedprox_fedcc", "moon", "moon_fedcc"]
#: the paper's Table 3 (CocoStuff-27, mIoU %), quoted for the shape; Local-only is not in the paper's Table 3
PAPER = {
    "centralized": 25.41, "fedavg": 24.69, "fedavg_fedcc": 25.39, "fedprox": 22.39, "fedprox_fedcc": 24.38,
    "moon": 24.69, "moon_fedcc": 23.15,
}  # fmt: skip
PAIRS = [("fedavg", "fedavg_fedcc"), ("fedprox", "fedprox_fedcc"), ("moon", "moon_fedcc")]


def score(row: str, metrics: Path) -> float | None:
    """The row's score after its last round, in %, or None when the run did not finish."""
    if not metrics.exists():
        return None
    with metrics.open() as file:
        rows = [r for r in csv.DictReader(file) if r.get("test/miou") or r.get("test/personal/miou")]
    if not rows:
        return None
    key = "test/personal/miou" if row == "local_only" else "test/miou"
    value = rows[-1].get(key)
    return None if not value else 100 * float(value)


def run(row: str, seed: int, out: Path) -> tuple[float, float]:
    """Fits ``row`` at ``seed`` unless done; returns its score and the run's wall seconds (0 when read back)."""
    root = out / f"seed{seed}"
    metrics = root / row / "version_0" / "metrics.csv"
    if (done := score(row, metrics)) is not None:
        return done, 0.0
    command = [
        sys.executable, "-m", "fedlight", "fit", "--config", str(CONFIGS / f"{row}.yaml"),
        f"--seed_everything={seed}", f"--trainer.default_root_dir={root}", f"--trainer.name={row}",
        "--trainer.logger=csv", "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    value = score(row, metrics)
    if value is None:
        raise SystemExit(f"{row}, seed {seed}: no test score in {metrics}")
    return value, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=ROWS, choices=ROWS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=REPO / "runs/fuss/cocostuff_twin")
    args = parser.parse_args()
    scores: dict[str, dict[int, float]] = {row: {} for row in args.rows}
    for seed in args.seeds:  # every row of a seed before the next seed, so a stopped run leaves whole seeds
        for row in args.rows:
            scores[row][seed], seconds = run(row, seed, args.out)
            took = f" ({seconds:.0f} s)" if seconds else " (read back)"
            print(f"seed {seed}  {row:<14} {scores[row][seed]:6.2f}{took}", flush=True)
    print(f"\nseeds {' '.join(map(str, args.seeds))}; test mIoU % after the last round")
    print(f"{'row':<14} {'paper':>6}  {'mean ± std':>14}  per seed")
    for row in args.rows:
        values = [scores[row][s] for s in args.seeds]
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        paper = f"{PAPER[row]:6.2f}" if row in PAPER else f"{'–':>6}"
        per_seed = " ".join(f"{v:.2f}" for v in values)
        print(f"{row:<14} {paper}  {statistics.fmean(values):6.2f} ± {spread:5.2f}  {per_seed}")
    print("\npaired differences (mean ± standard error over seeds)")
    pairs = [p for p in PAIRS if p[0] in scores and p[1] in scores]
    pairs += [("fedavg", row) for row in args.rows if row != "fedavg" and "fedavg" in scores]
    for base, other in dict.fromkeys(pairs):
        result = paired([scores[other][s] - scores[base][s] for s in args.seeds])
        paper = f"  (paper {PAPER[other] - PAPER[base]:+.2f})" if base in PAPER and other in PAPER else ""
        print(f"  {other} − {base}: {result}{paper}")


if __name__ == "__main__":
    main()
