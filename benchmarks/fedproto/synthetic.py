"""Table 2 (Synthetic row), Table 4 (Synthetic column) and Figs. 2–3 of Michieli & Ozay's prototype-margin paper.

The workload is the paper's Synthetic(1,1) setting: 30 users of FedProx's generator, MLP
60→128→256→10, SGD lr 0.01, F = 20 local epochs, batch 10, 10 clients per round sampled ∝ n_k. For every
seed, the script first trains the centralized reference (``conf/fedproto/synthetic/centralized.yaml``: one
client holding all training splits, one round per epoch), then runs FedAvg, FedProx (μ = 0.1), FedAtt and
MO-FedProto at δ ∈ {0, 50, 80}% stragglers with the analysis callbacks: AMM, gradient dissimilarity and
the MMD between each model's features and the reference's on the round's clients' held-out splits. Every
run is a ``fedlight fit`` subprocess writing ``<out>/runs/<name>/version_<n>/metrics.csv``; a run whose
metrics.csv already has all its rounds is skipped, and one that stopped early resumes from its checkpoint,
so an interrupted benchmark continues where it stopped.

From the runs it writes, beside the paper's numbers:

- ``<out>/table2.md``: final accuracy (%) and loss, mean ± std over seeds × δ (the paper's "mean ± std"
  is over δ), and the per-δ means;
- ``<out>/table4.md``: final AMM μ̄[T] and FFD(A, FedAvg) = 100·(MMD_FedAvg − MMD_A)/MMD_FedAvg, computed
  per (seed, δ) and then averaged;
- ``<out>/curves.png``: per-round accuracy, training loss, gradient dissimilarity, AMM and MMD, mean ± std
  over seeds × δ per method, after a trailing moving average over 10% of the rounds (the paper's smoothing).

Commands (from the repository root)::

    python benchmarks/fedproto/synthetic.py                      # full: 3 seeds × 12 runs of 200 rounds
    python benchmarks/fedproto/synthetic.py --reduced            # CI: 1 seed, δ ∈ {0, 50}, 3 rounds, F = 2
    python benchmarks/fedproto/synthetic.py --seeds 0 --jobs 1   # one seed, one process

The script exits with status 1 when a run failed (its log is ``<out>/logs/<name>.log``); the tables are
still written from the runs that finished.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedlight.callbacks.feature_discrepancy import feature_discrepancy_gain

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from run_files import latest_version, read_metrics, run_options

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf" / "fedproto"
METHODS = {"fedavg": "FedAvg", "fedprox": "FedProx", "fedatt": "FedAtt", "fedproto": "FedProto"}
CENTRALIZED = "centralized"

# The paper's numbers (Michieli & Ozay, Tables 2 and 4, Synthetic): (mean, std) over δ, or one value.
PAPER_ACCURACY = {"fedavg": (72.3, 2.6), "fedprox": (74.8, 1.6), "fedatt": (72.1, 2.7), "fedproto": (78.7, 0.2)}
PAPER_LOSS = {"fedavg": (0.41, 0.06), "fedprox": (0.37, 0.07), "fedatt": (0.36, 0.12), "fedproto": (0.36, 0.02)}
PAPER_CENTRALIZED = {"accuracy": 78.5, "loss": 0.33}  # Table 2's caption
PAPER_AMM = {"fedavg": 0.45, "fedprox": 0.48, "fedproto": 0.63, CENTRALIZED: 0.60}
PAPER_FFD = {"fedprox": 61.9, "fedproto": 64.5}

# metrics.csv columns of the curves and the tables.
ACCURACY, TEST_LOSS, TRAIN_LOSS = "test/acc", "test/loss", "train/loss"
AMM, MMD, GRADIENT_DISSIMILARITY = "analysis/amm", "analysis/mmd", "analysis/gradient_dissimilarity"


@dataclass
class Run:
    """One ``fedlight fit`` of the benchmark: a method at one δ and seed, or a seed's centralized reference."""

    method: str  # a key of METHODS, or CENTRALIZED
    seed: int
    delta: int | None  # % stragglers; None for the centralized reference
    rounds: int
    overrides: list[str] = field(default_factory=list)
    reference: Run | None = None  # the centralized run whose last.ckpt FeatureDiscrepancy compares with

    @property
    def name(self) -> str:
        if self.method == CENTRALIZED:
            return f"{CENTRALIZED}_seed{self.seed}"
        return f"{self.method}_delta{self.delta}_seed{self.seed}"

    @property
    def config(self) -> Path:
        stem = CENTRALIZED if self.method == CENTRALIZED else f"{self.method}_delta{self.delta}"
        return CONF / "synthetic" / f"{stem}.yaml"


# -- running ----------------------------------------------------------------------------------------
def command(run: Run, root: Path) -> list[str]:
    """The ``fedlight fit`` command line of ``run``, resuming its last attempt if that left a checkpoint."""
    args = [sys.executable, "-m", "fedlight", "fit", "--config", str(run.config)]
    args += ["--config", str(CONF / "analysis.yaml")]
    if run.reference is not None:
        reference = latest_version(root, run.reference.name) / "checkpoints" / "last.ckpt"
        callback = {"class_path": "fedlight.callbacks.FeatureDiscrepancy", "init_args": {"reference": str(reference)}}
        args.append(f"--trainer.callbacks+={json.dumps(callback)}")  # appended to analysis.yaml's callbacks
    args += [
        f"--seed_everything={run.seed}",
        f"--trainer.rounds={run.rounds}",
        *run.overrides,
        *run_options(root, run.name),
    ]
    return args


def is_done(run: Run, root: Path) -> bool:
    """Whether the run's last attempt logged all its rounds."""
    return len(read_metrics(latest_version(root, run.name))) >= run.rounds


def run_all(runs: Sequence[Run], out: Path, jobs: int, command=command) -> list[str]:
    """Runs every run that is not done, ``jobs`` at a time, each after its reference; returns the failures.
    ``command(run, root)`` gives a run's command line (another benchmark may pass its own)."""
    root, logs = out / "runs", out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    pending = [run for run in runs if not is_done(run, root)]
    done = {run.name for run in runs} - {run.name for run in pending}
    for name in sorted(done):
        print(f"  skip      {name} (metrics.csv complete)")
    failed: dict[str, str] = {}
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    try:
        while pending or running:
            for run in list(pending):
                needs = run.reference.name if run.reference is not None else None
                if needs in failed:
                    pending.remove(run)
                    failed[run.name] = f"not run: its reference {needs} failed"
                elif len(running) < jobs and (needs is None or needs in done):
                    pending.remove(run)
                    with (logs / f"{run.name}.log").open("w") as log:
                        process = subprocess.Popen(
                            command(run, root), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
                        )
                    running[run.name] = (process, time.perf_counter())
                    print(f"  start     {run.name}")
            for name, (process, started) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[name]
                run = next(r for r in runs if r.name == name)
                seconds = time.perf_counter() - started
                if process.returncode == 0 and is_done(run, root):
                    done.add(name)
                    print(f"  done      {name} in {seconds:.0f} s")
                else:
                    failed[name] = f"exit status {process.returncode}; see {logs / f'{name}.log'}"
                    print(f"  FAILED    {name}: {failed[name]}")
            time.sleep(0.2)
    except BaseException:  # Ctrl-C, or SIGTERM from a CI timeout (see main): stop the runs this started
        for process, _ in running.values():
            process.terminate()
        raise
    return [f"{name}: {why}" for name, why in failed.items()]


# -- statistics ---------------------------------------------------------------------------------------
def final(rows: list[dict[str, float]], key: str) -> float:
    """The last logged (non-NaN) value of a column."""
    values = [row.get(key, math.nan) for row in rows]
    return next((v for v in reversed(values) if not math.isnan(v)), math.nan)


def mean_std(values: Sequence[float]) -> tuple[float, float, int]:
    """Mean and sample standard deviation (ddof = 1, as Table 3's "Avg. ± Std." is) of the finite values."""
    x = np.array([v for v in values if math.isfinite(v)], dtype=np.float64)
    if len(x) == 0:
        return math.nan, math.nan, 0
    return float(x.mean()), float(x.std(ddof=1)) if len(x) > 1 else math.nan, len(x)


def ffd_percent(mmd: float, mmd_fedavg: float) -> float:
    """FFD(A, FedAvg) in percent (Eq. 17); NaN when FedAvg's MMD is 0 or missing, where it is undefined."""
    if not math.isfinite(mmd_fedavg) or mmd_fedavg == 0:
        return math.nan
    return feature_discrepancy_gain(mmd, mmd_fedavg)


def summary(
    rows: dict[str, list[dict[str, float]]], cells: Sequence[Run], key: str, scale: float = 1.0
) -> tuple[float, float, int]:
    """Mean ± std of the runs' final ``key`` (times ``scale``)."""
    return mean_std([scale * final(rows[run.name], key) for run in cells])


def fmt(stats: tuple[float, float, int] | float | None, digits: int) -> str:
    """``mean ± std`` (or a single value), ``–`` when there is nothing."""
    if stats is None:
        return "–"
    if isinstance(stats, float | int):
        return "–" if math.isnan(stats) else f"{stats:.{digits}f}"
    mean, std, _ = stats
    if math.isnan(mean):
        return "–"
    return f"{mean:.{digits}f}" if math.isnan(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def collect(runs: Sequence[Run], root: Path) -> dict[str, list[dict[str, float]]]:
    """Each finished run's rows, cut to its ``rounds`` (a longer earlier run may share the folder)."""
    rows = {}
    for run in runs:
        metrics = read_metrics(latest_version(root, run.name))[: run.rounds]
        if len(metrics) == run.rounds:
            rows[run.name] = metrics
    return rows


def table2(runs: Sequence[Run], rows: dict[str, list[dict[str, float]]], deltas: Sequence[int], header: str) -> str:
    """Table 2's Synthetic row as markdown: ours beside the paper's, then our per-δ means."""
    cells = {m: [r for r in runs if r.method == m and r.name in rows] for m in [*METHODS, CENTRALIZED]}
    lines = [
        f"# Table 2, Synthetic(1,1): final accuracy (%) and loss — {header}",
        "",
        "Ours: mean ± std (ddof = 1) over seeds × δ of the last round's values. Paper: Michieli & Ozay, Table 2 "
        "(mean ± std over δ). The paper's loss is read off Fig. 2's training-loss row, so `train loss` is the "
        "comparable column; `test loss` is the global model's loss on the clients' held-out splits.",
        "",
        "| method | n | accuracy (ours) | accuracy (paper) | train loss (ours) | loss (paper) | test loss (ours) |",
        "|---|---|---|---|---|---|---|",
    ]
    paper = {
        m: (f"{PAPER_ACCURACY[m][0]} ± {PAPER_ACCURACY[m][1]}", f"{PAPER_LOSS[m][0]} ± {PAPER_LOSS[m][1]}")
        for m in METHODS
    }
    paper[CENTRALIZED] = (f"{PAPER_CENTRALIZED['accuracy']}", f"{PAPER_CENTRALIZED['loss']}")
    for method, label in [*METHODS.items(), (CENTRALIZED, "Centralized")]:
        acc = summary(rows, cells[method], ACCURACY, 100.0)
        train, test = summary(rows, cells[method], TRAIN_LOSS), summary(rows, cells[method], TEST_LOSS)
        lines.append(
            f"| {label} | {acc[2]} | {fmt(acc, 1)} | {paper[method][0]} | {fmt(train, 2)} | {paper[method][1]} | "
            f"{fmt(test, 2)} |"
        )
    lines += ["", "Per-δ means over seeds (ours; the paper gives no per-δ numbers for Synthetic):", ""]
    columns = [f"accuracy δ={d}%" for d in deltas] + [f"train loss δ={d}%" for d in deltas]
    lines += ["| method | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for method, label in METHODS.items():
        by_delta = [[r for r in cells[method] if r.delta == d] for d in deltas]
        accs = [summary(rows, at_delta, ACCURACY, 100.0)[0] for at_delta in by_delta]
        losses = [summary(rows, at_delta, TRAIN_LOSS)[0] for at_delta in by_delta]
        lines.append(f"| {label} | " + " | ".join([fmt(a, 1) for a in accs] + [fmt(v, 2) for v in losses]) + " |")
    return "\n".join(lines) + "\n"


def table4(runs: Sequence[Run], rows: dict[str, list[dict[str, float]]], header: str) -> str:
    """Table 4's Synthetic column as markdown: final AMM, MMD and FFD against FedAvg, ours beside the paper's."""
    fedavg = {(r.seed, r.delta): final(rows[r.name], MMD) for r in runs if r.method == "fedavg" and r.name in rows}
    lines = [
        f"# Table 4, Synthetic(1,1): final AMM μ̄[T] and FFD (%) — {header}",
        "",
        "Ours: mean ± std (ddof = 1) over seeds × δ. AMM is decision D6's reconstruction of Eq. 15 (the unnormalised "
        "margin of the aggregate prototypes, i.e. the mean distance between class prototypes), so its scale "
        "need not match the paper's. FFD(A, FedAvg) = 100·(MMD_FedAvg − MMD_A)/MMD_FedAvg is taken per "
        "(seed, δ) against the FedAvg run of the same seed and δ, then averaged. MMD is the last round's mean "
        "over K^t of the MMD between the model's and the seed's centralized model's features (decision D7). "
        "Paper: Michieli & Ozay, Table 4 (– where it has no entry).",
        "",
        "| method | n | AMM (ours) | AMM (paper) | MMD (ours) | FFD % (ours) | FFD % (paper) |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, label in [*METHODS.items(), (CENTRALIZED, "Centralized")]:
        cells = [r for r in runs if r.method == method and r.name in rows]
        amm = summary(rows, cells, AMM)
        if method == CENTRALIZED:
            mmd, ffd = None, None
        else:
            mmd = summary(rows, cells, MMD)
            gains = [ffd_percent(final(rows[r.name], MMD), fedavg.get((r.seed, r.delta), math.nan)) for r in cells]
            ffd = None if method == "fedavg" else mean_std(gains)
        lines.append(
            f"| {label} | {amm[2]} | {fmt(amm, 2)} | {fmt(PAPER_AMM.get(method), 2)} | {fmt(mmd, 4)} | "
            f"{'0 (reference)' if method == 'fedavg' else fmt(ffd, 1)} | {fmt(PAPER_FFD.get(method), 1)} |"
        )
    return "\n".join(lines) + "\n"


# -- curves -------------------------------------------------------------------------------------------------
def moving_average(x: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` logged values (fewer at the start); NaN rounds are skipped."""
    valid = ~np.isnan(x)
    sums = np.cumsum(np.where(valid, x, 0.0))
    counts = np.cumsum(valid)
    sums = sums - np.concatenate([np.zeros(window), sums[:-window]])[: len(x)]
    counts = counts - np.concatenate([np.zeros(window), counts[:-window]])[: len(x)]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def plot_curves(runs: Sequence[Run], rows: dict[str, list[dict[str, float]]], rounds: int, path: Path) -> None:
    """Figs. 2–3 style: per-round curves, mean ± std band over seeds × δ per method, smoothed over 10% of T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [
        (ACCURACY, "accuracy (%)", 100.0),
        (TRAIN_LOSS, "training loss", 1.0),
        (GRADIENT_DISSIMILARITY, "gradient dissimilarity", 1.0),
        (AMM, "AMM μ̄[t] (D6)", 1.0),
        (MMD, "MMD to centralized", 1.0),
    ]
    window = max(1, round(0.1 * rounds))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), constrained_layout=True)
    x = np.arange(1, rounds + 1)
    for ax, (key, title, scale) in zip(axes, panels, strict=True):
        for method, label in METHODS.items():
            curves = [
                moving_average(np.array([row.get(key, math.nan) for row in rows[r.name]]) * scale, window)
                for r in runs
                if r.method == method and r.name in rows
            ]
            if not curves or np.isnan(curves).all():
                continue
            stacked = np.stack(curves)  # [runs, rounds]
            with warnings.catch_warnings():  # rounds where every run is NaN (e.g. not measured) stay NaN
                warnings.simplefilter("ignore", RuntimeWarning)
                mean = np.nanmean(stacked, axis=0)
                std = np.nanstd(stacked, axis=0, ddof=1) if len(curves) > 1 else np.zeros_like(mean)
            (line,) = ax.plot(x, mean, label=label, lw=1.4)
            ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2, lw=0)
        central = [final(rows[r.name], key) * scale for r in runs if r.method == CENTRALIZED and r.name in rows]
        if key in (ACCURACY, AMM) and central and not np.isnan(central).all():
            ax.axhline(float(np.nanmean(central)), color="0.4", ls="--", lw=1, label="centralized (final)")
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Synthetic(1,1): mean ± std over seeds × δ, trailing moving average over {window} round(s)")
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--reduced",
        action="store_true",
        help="CI preset: 1 seed, δ ∈ {0, 50}, 3 rounds, F = 2 local epochs, centralized 2 epochs.",
    )
    parser.add_argument("--seeds", type=int, nargs="+", help="run seeds (default 0 1 2; reduced: 0)")
    parser.add_argument("--deltas", type=int, nargs="+", help="straggler %% δ (default 0 50 80; reduced: 0 50)")
    parser.add_argument("--rounds", type=int, help="federated rounds R (default 200, the paper's T; reduced: 3)")
    parser.add_argument("--local-epochs", type=int, help="local epochs F (default: the configs' 20; reduced: 2)")
    parser.add_argument("--centralized-epochs", type=int, help="epochs of the reference (default 100; reduced: 2)")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each (default 2)")
    parser.add_argument(
        "--client-batching",
        action="store_true",
        help="train each round's clients as one vectorised model (--trainer.client_batching=auto, compiled); "
        "FedProx and FedProto, whose clients run hooks, stay sequential and say so in their logs",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="output folder (default benchmarks/fedproto/out/synthetic, or .../synthetic_reduced with --reduced); "
        "use one folder per size, since a run resumes from the checkpoint it finds there",
    )
    args = parser.parse_args(argv)
    preset = (
        {"seeds": [0], "deltas": [0, 50], "rounds": 3, "local_epochs": 2, "centralized_epochs": 2}
        if args.reduced
        else {"seeds": [0, 1, 2], "deltas": [0, 50, 80], "rounds": 200, "local_epochs": None, "centralized_epochs": 100}
    )
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = Path(__file__).resolve().parent / "out" / ("synthetic_reduced" if args.reduced else "synthetic")
    args.out = args.out.resolve()
    problems = [f"--deltas {d}: the configs exist for 0, 50 and 80" for d in args.deltas if d not in (0, 50, 80)]
    problems += [
        f"--{k.replace('_', '-')} must be ≥ 1" for k in ("rounds", "jobs", "centralized_epochs") if getattr(args, k) < 1
    ]
    if args.local_epochs is not None and args.local_epochs < 1:
        problems.append("--local-epochs must be ≥ 1")
    if problems:
        parser.error("; ".join(problems))
    return args


def plan(args: argparse.Namespace) -> list[Run]:
    """The centralized reference of every seed, then every method × δ of that seed."""
    overrides = [] if args.local_epochs is None else [f"--trainer.local_epochs={args.local_epochs}"]
    if args.client_batching:
        overrides += ["--trainer.client_batching=auto", "--trainer.compile_batched=true"]
    runs = []
    for seed in args.seeds:
        reference = Run(CENTRALIZED, seed, None, args.centralized_epochs)
        runs.append(reference)
        for delta in args.deltas:
            for method in METHODS:
                runs.append(Run(method, seed, delta, args.rounds, overrides, reference))
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.perf_counter()
    runs = plan(args)
    size = (
        f"{'reduced' if args.reduced else 'full'} size: seeds {args.seeds}, δ {args.deltas}%, R = {args.rounds} "
        f"rounds, F = {args.local_epochs or 20}, centralized {args.centralized_epochs} epochs"
    )
    print(f"Synthetic(1,1) benchmark, {size}; {len(runs)} runs, {args.jobs} at a time, into {args.out}")
    failures = run_all(runs, args.out, args.jobs)

    rows = collect(runs, args.out / "runs")
    header = size + (" (reduced: not comparable to the paper)" if args.reduced else "")
    outputs = {"table2.md": table2(runs, rows, args.deltas, header), "table4.md": table4(runs, rows, header)}
    for name, text in outputs.items():
        (args.out / name).write_text(text)
        print(f"\n{text}")
    if rows:
        plot_curves(runs, rows, args.rounds, args.out / "curves.png")
        outputs["curves.png"] = ""
    print(f"Wrote {', '.join(str(args.out / name) for name in outputs)}")
    print(f"Wall time {time.perf_counter() - started:.0f} s")
    if failures:
        print(f"\n{len(failures)} run(s) did not finish:", *failures, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
