"""Table 1 of the FedSLS paper at a reduced size, on the offline stand-in for CIFAR-10.

Every method of Table 1 (FedAvg, FedProx, MOON, FedDecorr, FedAU, FedSLS, FedSL with f = 2, 4, 8) runs at
α ∈ {0.5, 0.05}; the related work's FedAvgM and FedNova are added by name (``--methods``). Each run is the
CIFAR-10 row config of ``conf/fedsls/cifar10/`` (so the rule and its hyper-parameters are the table's) with
the workload of a size preset stacked on it: the procedural scenes of :class:`fedlight.data.Scenes` in
classification mode (10 classes) instead of CIFAR-10, fewer and smaller clients, fewer rounds, a narrow
ResNet-18 layout from scratch. The final accuracy is the mean test accuracy over the last rounds, as the
paper reports it.

Runs go to ``<out>/runs/<method>_alpha<α>/version_<n>/metrics.csv``; ``<out>/table1.md`` holds the table
beside the paper's CIFAR-10 columns, and ``<out>/partition_alpha<α>.png`` the per-client class counts
(Fig. 4) when matplotlib is installed. Several runs go in parallel (``--jobs``), one thread each.

``--seeds`` repeats every run with ``seed_everything`` set to each seed (initial weights, client sampling, local
batches; the data and their partition stay those of ``data.seed`` 0, so every seed sees the same federation and
test images), each seed in its own folder ``<out>/seed<s>/``. ``table1.md`` then gives every method's mean ± sd
over the seeds, the paired per-seed differences (each method − FedAvg, FedSLS − each method; mean ± standard
error, ``benchmarks/paired.py``) and, for each of the paper's CIFAR-10 gaps FedSLS − method, the seeds a paired
test would need to detect it at the spread measured here (two-sided α = 0.05, power 0.8). Without ``--seeds``
one seed (0) runs, in ``<out>/`` itself.

Commands (from the repository root)::

    python benchmarks/fedsls/table1.py                 # the reduced size CI runs
    python benchmarks/fedsls/table1.py --size medium   # 100 clients, 300 rounds: a ranking that means more
    python benchmarks/fedsls/table1.py --methods fedavg fedsls fedavgm fednova --alphas 0.05 --jobs 1
    python benchmarks/fedsls/table1.py --seeds 0 1 2 3 4 --jobs 1   # paired differences over five seeds
    python benchmarks/fedsls/table1.py --seeds 0 1 2 3 4 5 6 --table-only   # the table of seeds run separately

The script exits with status 1 if a run failed, after writing the table from the runs that finished.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # this checkout's fedlight, in this process and the spawned workers
sys.path.insert(0, str(REPO / "benchmarks"))
from paired import paired, seeds_needed  # noqa: E402
from run_files import latest_version, read_metrics  # noqa: E402

ROWS = REPO / "conf" / "fedsls" / "cifar10"

#: method → (Table 1 row config, strategy section replacing the row's, or None)
METHODS = {
    "fedavg": ("fedavg", None),
    "fedprox": ("fedprox", None),
    "moon": ("moon", None),
    "feddecorr": ("feddecorr", None),
    "fedau": ("fedau", None),
    "fedsls": ("fedsls", None),
    "fedsl_f2": ("fedsl_f2", None),
    "fedsl_f4": ("fedsl_f4", None),
    "fedsl_f8": ("fedsl_f8", None),
    "fedavgm": ("fedavg", "fedlight.strategies.FedAvgM"),  # related work, not in Table 1
    "fednova": ("fedavg", "fedlight.strategies.FedNova"),  # related work, not in Table 1
}
TABLE_1 = [m for m in METHODS if m not in ("fedavgm", "fednova")]
LABELS = {
    "fedavg": "FedAvg",
    "fedprox": "FedProx",
    "moon": "MOON",
    "feddecorr": "FedDecorr",
    "fedau": "FedAU",
    "fedsls": "FedSLS",
    "fedsl_f2": "FedSL f = 2",
    "fedsl_f4": "FedSL f = 4",
    "fedsl_f8": "FedSL f = 8",
    "fedavgm": "FedAvgM (β = 0.9)",
    "fednova": "FedNova",
}
#: The paper's Table 1, CIFAR-10 (ResNet-18 from ImageNet weights, 100 clients, 2000 rounds): α → (mean, std) %.
PAPER_CIFAR10 = {
    "fedavg": {"0.5": (70.77, 0.1), "0.05": (40.99, 2.0)},
    "fedprox": {"0.5": (73.64, 2.7), "0.05": (41.64, 1.5)},
    "moon": {"0.5": (77.02, 0.8), "0.05": (55.64, 2.4)},
    "feddecorr": {"0.5": (75.79, 0.4), "0.05": (57.18, 2.1)},
    "fedau": {"0.5": (74.91, 0.6), "0.05": (49.24, 3.8)},
    "fedsls": {"0.5": (82.67, 0.2), "0.05": (63.43, 3.6)},
    "fedsl_f2": {"0.5": (79.86, 0.3), "0.05": (38.59, 0.7)},
    "fedsl_f4": {"0.5": (81.65, 0.3), "0.05": (38.44, 0.4)},
    "fedsl_f8": {"0.5": (82.31, 0.2), "0.05": (50.65, 0.4)},
}

#: Workloads stacked on the row configs (dotted keys change single values of the row).
SIZES = {
    "reduced": {
        "rounds": 20,
        "last": 5,
        "scenes": {"num_samples": 2000, "num_test_samples": 300, "image_size": 32},
        "overrides": {
            "trainer.clients_per_round": 4,
            # few rounds: a larger step than the paper's 0.01 (momentum 0.9 and the rest as the rows)
            "model.init_args.optimizer.init_args.lr": 0.05,
            "data.partitioner.init_args.num_clients": 20,
            "data.partitioner.init_args.min_size": 20,
            "data.batch_size": 32,
            "model.init_args.model_kwargs.channels": [8, 16, 32, 64],
            "model.init_args.model_kwargs.layers": [1, 1, 1, 1],
            "model.init_args.model_kwargs.stem_width": 8,
            "model.init_args.model_kwargs.pretrained": False,  # a narrow ResNet has no ImageNet weights
        },
    },
    "medium": {
        "rounds": 300,
        "last": 20,
        "scenes": {"num_samples": 10000, "num_test_samples": 2000, "image_size": 32},
        "overrides": {
            "trainer.clients_per_round": 10,
            "data.partitioner.init_args.num_clients": 100,
            "data.partitioner.init_args.min_size": 10,
            "data.batch_size": 32,
            "model.init_args.model_kwargs.channels": [16, 32, 64, 128],
            "model.init_args.model_kwargs.layers": [1, 1, 1, 1],
            "model.init_args.model_kwargs.stem_width": 16,
            "model.init_args.model_kwargs.pretrained": False,  # a narrow ResNet has no ImageNet weights
        },
    },
}
COMMON = {
    "trainer.eval_every": 1,
    "trainer.checkpoint_every": 100000,
    "trainer.logger": "csv",
    "trainer.enable_progress_bar": False,
    "data.eval_batch_size": 500,
}


def overlay(method: str, alpha: str, size: str, rounds: int, seed: int | None = None) -> str:
    """The YAML of one run: its Table 1 row, the Scenes stand-in, the size preset (and ``seed_everything``)."""
    row, strategy = METHODS[method]
    lines = [f"config: {ROWS / f'{row}_alpha{alpha}.yaml'}", f"trainer.rounds: {rounds}"]
    if seed is not None:
        lines.append(f"seed_everything: {seed}")
    lines += [f"{key}: {_yaml(value)}" for key, value in {**COMMON, **SIZES[size]["overrides"]}.items()]
    # the whole dataset section: the stand-in replaces CIFAR-10
    lines += ["data.dataset:", "  class_path: fedlight.data.Scenes", "  init_args:"]
    scenes = {"mode": "classification", "num_object_classes": 10, **SIZES[size]["scenes"], "seed": 0}
    lines += [f"    {key}: {value}" for key, value in scenes.items()]
    if strategy:
        lines += ["strategy:", f"  class_path: {strategy}"]
    return "\n".join(lines) + "\n"


def _yaml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


def fit(config: Path, out: Path, name: str) -> tuple[str, float, str | None]:
    """Runs one ``fedlight fit`` in this worker process; returns (name, seconds, error)."""
    from fedlight.cli import run

    started = time.perf_counter()
    try:
        run(["fit", "--config", str(config), f"--trainer.default_root_dir={out / 'runs'}", f"--trainer.name={name}"])
    except Exception:  # reported, the other runs go on
        return name, time.perf_counter() - started, traceback.format_exc(limit=5)
    return name, time.perf_counter() - started, None


def accuracies(out: Path, name: str) -> list[float]:
    """Per-round test accuracy of the newest run called ``name``."""
    rows = read_metrics(latest_version(out / "runs", name))
    return [row["test/acc"] for row in rows if not math.isnan(row.get("test/acc", math.nan))]


def partition_figures(out: Path, size: str, alphas: list[str]) -> None:
    """Fig. 4 of the stand-in: per-client class counts at each α (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        print("matplotlib is not installed: no partition figures")
        return
    from fedlight.data import Scenes
    from fedlight.data.partition import Dirichlet
    from fedlight.data.partition.plot import class_counts, plot_class_counts

    settings = SIZES[size]["overrides"]
    pool = Scenes(mode="classification", num_object_classes=10, **SIZES[size]["scenes"], seed=0).load_train()
    labels = pool.partition_labels()
    for alpha in alphas:
        partitioner = Dirichlet(
            num_clients=settings["data.partitioner.init_args.num_clients"],
            alpha=float(alpha),
            min_size=settings["data.partitioner.init_args.min_size"],
            max_retries=100000,
        )
        parts = partitioner(labels, 10, np.random.default_rng(0))  # the datamodule's draw (data.seed = 0)
        figure = plot_class_counts(class_counts(parts, labels, 10), title=f"Dir(α = {alpha}), scenes stand-in")
        figure.savefig(out / f"partition_alpha{alpha}.png", dpi=120, bbox_inches="tight")


def final_accuracy(out: Path, name: str, last: int) -> float | None:
    """The final accuracy (%) of a run: the mean test accuracy over its last ``last`` rounds; None if it failed."""
    try:
        acc = accuracies(out, name)
    except (FileNotFoundError, ValueError):
        return None
    return 100 * float(np.mean(acc[-last:])) if acc else None


def seeds_table(
    out: Path, methods: list[str], alphas: list[str], seeds: list[int], last: int, seconds: dict[str, float]
) -> str:
    """Mean ± sd over seeds per method and α, the paired differences, and the seeds the paper's gaps would need."""
    finals = {
        (method, alpha, seed): final_accuracy(out / f"seed{seed}", f"{method}_alpha{alpha}", last)
        for method in methods
        for alpha in alphas
        for seed in seeds
    }

    def values(method: str, alpha: str) -> list[float]:
        return [finals[method, alpha, seed] for seed in seeds if finals[method, alpha, seed] is not None]

    def differences(b: str, a: str, alpha: str) -> list[float]:
        pairs = [(finals[b, alpha, s], finals[a, alpha, s]) for s in seeds]
        return [x - y for x, y in pairs if x is not None and y is not None]

    header = "| method | " + " | ".join(f"α = {a} (here, mean ± sd)" for a in alphas)
    header += " | " + " | ".join(f"α = {a} (paper, CIFAR-10)" for a in alphas) + " | wall s |"
    lines = [f"Per method, mean ± sample sd over seeds {', '.join(map(str, seeds))}:", "", header]
    lines.append("|" + "---|" * (2 + 2 * len(alphas)))
    for method in methods:
        cells = []
        for alpha in alphas:
            v = values(method, alpha)
            spread = f" ± {np.std(v, ddof=1):.2f}" if len(v) > 1 else ""
            cells.append(f"{np.mean(v):.2f}{spread}" + (f" (n = {len(v)})" if len(v) != len(seeds) else "")
                         if v else "failed")  # fmt: skip
        for alpha in alphas:
            paper = PAPER_CIFAR10.get(method, {}).get(alpha)
            cells.append(f"{paper[0]:.2f} ± {paper[1]}" if paper else "–")
        wall = sum(seconds.get(f"seed{s}/{method}_alpha{a}", math.nan) for s in seeds for a in alphas)
        lines.append(
            f"| {LABELS[method]} | " + " | ".join(cells) + (" | – |" if math.isnan(wall) else f" | {wall:.0f} |")
        )

    comparisons = [(m, "fedavg") for m in methods if m != "fedavg" and "fedavg" in methods]
    comparisons += [("fedsls", m) for m in methods if m not in ("fedsls", "fedavg") and "fedsls" in methods]
    if len(seeds) > 1 and comparisons:
        lines += ["", "Paired per-seed differences B − A (points), mean ± standard error (sd, seeds):", ""]
        lines.append("| B − A | " + " | ".join(f"α = {a}" for a in alphas) + " |")
        lines.append("|" + "---|" * (1 + len(alphas)))
        for b, a in comparisons:
            cells = []
            for alpha in alphas:
                d = differences(b, alpha=alpha, a=a)
                cells.append(str(paired(d)) if len(d) > 1 else "–")
            lines.append(f"| {LABELS[b]} − {LABELS[a]} | " + " | ".join(cells) + " |")

        lines += ["", "The paper's CIFAR-10 gaps FedSLS − method, and the seeds a paired test (two-sided α = 0.05, "
                  "power 0.8) would need to detect a gap of that size at the sd of the differences measured here:",
                  ""]  # fmt: skip
        lines.append("| FedSLS − method | α | paper's gap | here | seeds needed |")
        lines.append("|---|---|---|---|---|")
        for method in methods:
            if method == "fedsls" or "fedsls" not in methods:
                continue
            for alpha in alphas:
                paper, ours = PAPER_CIFAR10.get(method, {}).get(alpha), PAPER_CIFAR10["fedsls"].get(alpha)
                d = differences("fedsls", method, alpha)
                if paper is None or ours is None or len(d) < 2:
                    continue
                gap, p = ours[0] - paper[0], paired(d)
                needed = seeds_needed(gap, p.sd) if p.sd > 0 and gap != 0 else "–"
                lines.append(f"| FedSLS − {LABELS[method]} | {alpha} | {gap:+.2f} | {p} | {needed} |")
    return "\n".join(lines)


def table(out: Path, methods: list[str], alphas: list[str], last: int, seconds: dict[str, float]) -> str:
    header = "| method | " + " | ".join(f"α = {a} (here)" for a in alphas)
    header += " | " + " | ".join(f"α = {a} (paper, CIFAR-10)" for a in alphas) + " | wall s |"
    lines = [header, "|" + "---|" * (2 + 2 * len(alphas))]
    for method in methods:
        cells, wall = [], 0.0
        for alpha in alphas:
            name = f"{method}_alpha{alpha}"
            acc = accuracies(out, name)
            cells.append(f"{100 * np.mean(acc[-last:]):.2f}" if acc else "failed")
            wall += seconds.get(name, float("nan"))
        for alpha in alphas:
            paper = PAPER_CIFAR10.get(method, {}).get(alpha)
            cells.append(f"{paper[0]:.2f} ± {paper[1]}" if paper else "–")
        lines.append(f"| {LABELS[method]} | " + " | ".join(cells) + f" | {wall:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="reduced")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=list(METHODS),
        default=TABLE_1,
        help="default: Table 1's (FedAvgM and FedNova are the related work's; add them by name)",
    )
    parser.add_argument("--alphas", nargs="+", default=["0.5", "0.05"], choices=["0.5", "0.1", "0.05"])
    parser.add_argument("--rounds", type=int, help="override the size's number of rounds")
    parser.add_argument("--last", type=int, help="rounds averaged for the final accuracy (default: the size's)")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each")
    parser.add_argument("--out", type=Path, help="default: benchmarks/fedsls/out/<size>")
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        help="seed_everything of each repetition, each in <out>/seed<s>/ (default: one run per cell, seed 0, in <out>)",
    )
    parser.add_argument(
        "--table-only",
        action="store_true",
        help="run nothing: write table1.md from the runs already in <out> (e.g. seeds run by separate commands)",
    )
    args = parser.parse_args(argv)
    preset = SIZES[args.size]
    rounds, last = args.rounds or preset["rounds"], args.last or preset["last"]
    out = (args.out or REPO / "benchmarks" / "fedsls" / "out" / args.size).resolve()
    (out / "configs").mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    jobs = []
    for seed in args.seeds or [None]:
        root = out if seed is None else out / f"seed{seed}"
        (root / "configs").mkdir(parents=True, exist_ok=True)
        for method in args.methods:
            for alpha in args.alphas:
                name = f"{method}_alpha{alpha}"
                config = root / "configs" / f"{name}.yaml"
                if not args.table_only:
                    config.write_text(overlay(method, alpha, args.size, rounds, seed))
                jobs.append((config, root, name))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")
    seconds, failed = {}, []
    timings = out / "seconds.json"  # every run's wall seconds, kept across commands writing into one <out>
    if timings.is_file():
        seconds.update(json.loads(timings.read_text()))
    context = get_context("spawn")  # fresh interpreters: no torch threads inherited from this one
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=context, initializer=_init_worker) as pool:
        runs = [] if args.table_only else pool.map(fit, *zip(*jobs, strict=True))
        for (_, root, _), (name, elapsed, error) in zip(jobs, runs, strict=False):
            key = name if root == out else f"{root.name}/{name}"
            seconds[key] = elapsed
            timings.write_text(json.dumps(seconds, indent=1))
            print(f"{key}: {elapsed:.1f} s" + (" FAILED" if error else ""), flush=True)
            if error:
                failed.append(key)
                print(error, file=sys.stderr)
    partition_figures(out, args.size, args.alphas)
    if args.seeds:
        text = seeds_table(out, args.methods, args.alphas, args.seeds, last, seconds)
    else:
        text = table(out, args.methods, args.alphas, last, seconds)
    timing = "the runs already there" if args.table_only else f"{time.perf_counter() - started:.0f} s wall"
    summary = (
        f"Final test accuracy (%): mean over the last {last} of {rounds} rounds, size '{args.size}', "
        f"{timing} with {args.jobs} jobs.\n\n{text}\n"
    )
    (out / "table1.md").write_text(summary)
    print(summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
