"""Accuracy of robust aggregators under Byzantine clients, and accuracy against ε under client-level DP.

``--dataset digits`` (the default) runs the MNIST protocol of ``conf/digits/fedavg.yaml`` (scikit-learn's 1,797
8×8 digits, 100 power-law clients with two digits each, the 2-conv CNN, batch 10, K' = 10 clients per round),
with fewer rounds and local epochs than the config and SGD lr 0.1 instead of 0.01 (which needs the config's 100
rounds of 20 epochs), so that the grid fits on a CPU:

- robustness: aggregator ∈ {FedAvg, median, trimmed mean (β = 0.2), Krum (f = 3), Multi-Krum (f = 3, m = 7),
  Bulyan (f = 1)} × attack ∈ {sign flip, Gaussian, label flip, ALIE, IPM} × f ∈ {0, 10, 20, 30} % of each
  round's clients (``redraw: true``: exactly round(f·K') attackers per round);
- DP: DP-FedAvg with adaptive clipping (γ = 0.5) for noise multipliers z, ε(δ = 1e-5) from the RDP accountant.

``--dataset synthetic`` runs Synthetic(1,1) of ``conf/fedproto/synthetic/fedavg_delta0.yaml`` (30 clients, MLP,
K' = 10, the config's lr 0.01) with the same short T and F; ``--dataset cifar10`` runs the FedSLS CIFAR-10
config (``conf/fedsls/cifar10/fedavg_alpha0.5.yaml``, ResNet-18, needs the CIFAR-10 files in ``data/cifar10``).

Every run is one in-process ``fedlight fit`` of the dataset's config with the strategy section replaced; the
accuracy is the global model's on the union of the clients' held-out splits (CIFAR-10: the test set) after the
last round. ``--seeds`` runs every cell once per seed; the tables give the mean ± standard deviation over seeds.

    python benchmarks/robustness/digits.py --reduced                # < 1 min on 2 CPU cores: a slice of the grid
    python benchmarks/robustness/digits.py                          # the whole grid, T = 20, F = 2 (README.md)
    python benchmarks/robustness/digits.py --dataset synthetic --seeds 0 1 2 --fractions 0 0.2 --skip-dp
    python benchmarks/robustness/digits.py --rounds 100 --epochs 20 --lr 0.01  # the config's own T, F, lr (hours)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

AGGREGATORS = {
    "fedavg": None,
    "median": {"aggregator": "median"},
    "trimmed_mean": {"aggregator": "trimmed_mean", "beta": 0.2},
    "krum": {"aggregator": "krum", "f": 3},
    "multi_krum": {"aggregator": "multi_krum", "f": 3, "m": 7},
    "bulyan": {"aggregator": "bulyan", "f": 1},
}
ATTACKS = {
    "sign_flip": {"kind": "sign_flip", "scale": 1.0},
    "gaussian": {"kind": "gaussian", "scale": 1.0},
    "label_flip": {"kind": "label_flip"},
    "alie": {"kind": "alie"},
    "ipm": {"kind": "ipm", "scale": 0.1},
}
FRACTIONS = (0.0, 0.1, 0.2, 0.3)
#: config, default learning rate, the accuracy metric, and whether the label partition can be changed
DATASETS = {
    "digits": {"config": "conf/digits/fedavg.yaml", "lr": 0.1, "metric": "clients/acc", "classes": True},
    "synthetic": {"config": "conf/fedproto/synthetic/fedavg_delta0.yaml", "lr": 0.01, "metric": "clients/acc"},
    "cifar10": {"config": "conf/fedsls/cifar10/fedavg_alpha0.5.yaml", "lr": 0.01, "metric": "test/acc"},
}
NOISE_MULTIPLIERS = (0.0, 0.3, 0.5, 1.0)
REDUCED = {
    "aggregators": ("fedavg", "median", "krum"),
    "attacks": ("gaussian", "label_flip"),
    "fractions": (0.0, 0.2),
    "noise_multipliers": (0.5,),
}


def strategy(aggregator: str, attack: str | None, fraction: float) -> dict:
    """The ``strategy`` section: Attack ⟶ RobustAggregation ⟶ FedAvg, leaving out what is not used."""
    rule = {"class_path": "fedlight.strategies.FedAvg"}
    if AGGREGATORS[aggregator] is not None:
        rule = {
            "class_path": "fedlight.strategies.RobustAggregation",
            "init_args": {"rule": rule, **AGGREGATORS[aggregator]},
        }
    if attack is None or fraction == 0:
        return rule
    return {
        "class_path": "fedlight.strategies.Attack",
        "init_args": {"rule": rule, "fraction": fraction, "redraw": True, **ATTACKS[attack]},
    }


def dp_strategy(noise_multiplier: float) -> dict:
    return {
        "class_path": "fedlight.strategies.DPFedAvg",
        "init_args": {
            "rule": {"class_path": "fedlight.strategies.FedAvg"},
            "clip_norm": 0.5,
            "noise_multiplier": noise_multiplier,
            "adaptive": True,
            "count_noise_std": 1.0,
            "delta": 1e-5,
            "insecure_seeded_noise": True,  # a simulation: its numbers are reproducible from the seeds
        },
    }


def fit(job: dict) -> dict:
    """One run in this process; returns the job with its final accuracy, ε and time."""
    import torch
    import yaml

    from fedlight.cli import run

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="fedlight-robustness-") as folder:
        config = Path(folder) / "strategy.yaml"
        config.write_text(yaml.safe_dump({"strategy": job["strategy"]}))
        started = time.perf_counter()
        dataset = DATASETS[job["dataset"]]
        partition = (
            [
                f"--data.partitioner.init_args.classes_per_client={job['classes']}",
                # 2 base samples of each of 10 digits for 100 clients would need 200 images of every digit
                f"--data.partitioner.init_args.base_samples={2 if job['classes'] == 2 else 1}",
            ]
            if dataset.get("classes")
            else []
        )
        metrics = run([
            "fit", "--config", str(REPO / dataset["config"]), "--config", str(config),
            f"--trainer.rounds={job['rounds']}", f"--trainer.local_epochs={job['epochs']}",
            f"--trainer.eval_every={job['rounds']}", "--trainer.logger=null", "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={folder}", f"--seed_everything={job['seed']}",
            f"--model.init_args.optimizer.init_args.lr={job['lr']}", *partition,
        ])  # fmt: skip
    return {
        **{k: v for k, v in job.items() if k != "strategy"},
        "acc": 100 * metrics[dataset["metric"]],
        "epsilon": metrics.get("dp/epsilon"),
        "seconds": time.perf_counter() - started,
    }


def mean_std(values: list[float], seeds: int = 1) -> str:
    """``mean ± std`` (sample standard deviation) of the seeds' accuracies, or the value of a single seed; a cell
    with fewer than ``seeds`` runs says how many it has.

    >>> mean_std([60.0, 62.0, 64.0], 3), mean_std([50.0]), mean_std([50.0], 3)
    ('62.0 ± 2.0', '50.0', '50.0 (1 seed)')
    """
    if not values:
        return "–"
    cell = f"{values[0]:.1f}" if len(values) == 1 else f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"
    return cell if len(values) >= seeds else f"{cell} ({len(values)} seed{'s' if len(values) > 1 else ''})"


def table(results: list[dict], aggregators, attacks, fractions, seeds: int = 1) -> str:
    lines = []
    for attack in attacks:
        lines.append(f"\n**{attack}** (accuracy %, columns: attackers per round)\n")
        lines.append("| aggregator | " + " | ".join(f"{round(100 * f)} %" for f in fractions) + " |")
        lines.append("|---|" + "---:|" * len(fractions))
        for aggregator in aggregators:
            cells = []
            for fraction in fractions:
                found = [
                    r["acc"] for r in results
                    if r["kind"] == "robust" and r["aggregator"] == aggregator
                    and (r["fraction"] == fraction == 0 or (r["attack"] == attack and r["fraction"] == fraction))
                ]  # fmt: skip
                cells.append(mean_std(found, seeds))
            lines.append(f"| {aggregator} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def dp_table(results: list[dict], seeds: int = 1) -> str:
    dp = [r for r in results if r["kind"] == "dp"]
    if not dp:
        return ""
    lines = ["\n**DP-FedAvg** (adaptive clipping, γ = 0.5, δ = 1e-5, q = 0.1)\n", "| z | ε | accuracy % |"]
    lines.append("|---:|---:|---:|")
    for z in sorted({r["noise_multiplier"] for r in dp}):
        runs = [r for r in dp if r["noise_multiplier"] == z]
        epsilon = runs[0]["epsilon"]  # the same for every seed: it depends on q, z, T and δ only
        epsilon = "∞" if epsilon is None or epsilon == float("inf") else f"{epsilon:.2f}"
        lines.append(f"| {z} | {epsilon} | {mean_std([r['acc'] for r in runs], seeds)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reduced", action="store_true", help="a slice of the grid, < 1 minute on 2 CPU cores")
    parser.add_argument("--dataset", choices=tuple(DATASETS), default="digits")
    parser.add_argument("--rounds", type=int, default=20, help="T (the configs have 100, 200 and 2000)")
    parser.add_argument("--epochs", type=int, default=2, help="F, local epochs (digits' and Synthetic's configs: 20)")
    parser.add_argument("--lr", type=float, help="the clients' SGD learning rate (digits: 0.1, the config's 0.01)")
    parser.add_argument(
        "--classes-per-client",
        type=int,
        default=2,
        help="digits per client: 2 is the protocol's; 10 (1 base sample) is near-IID",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run of every cell per seed")
    parser.add_argument("--aggregators", nargs="+", choices=tuple(AGGREGATORS), help="a subset of the aggregators")
    parser.add_argument("--attacks", nargs="+", choices=tuple(ATTACKS), help="a subset of the attacks")
    parser.add_argument("--fractions", nargs="+", type=float, help="a subset of the attacker fractions")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--report-only", action="store_true", help="write the tables from the runs finished so far")
    parser.add_argument("--skip-dp", action="store_true", help="leave out the DP runs (they need dp-accounting)")
    args = parser.parse_args()
    aggregators, attacks, fractions, noise = (
        (REDUCED["aggregators"], REDUCED["attacks"], REDUCED["fractions"], REDUCED["noise_multipliers"])
        if args.reduced
        else (tuple(AGGREGATORS), tuple(ATTACKS), FRACTIONS, NOISE_MULTIPLIERS)
    )
    aggregators = args.aggregators or aggregators
    attacks = args.attacks or attacks
    fractions = tuple(args.fractions or fractions)
    rounds, epochs = (5, 1) if args.reduced else (args.rounds, args.epochs)
    classes = args.classes_per_client if DATASETS[args.dataset].get("classes") else None
    lr = DATASETS[args.dataset]["lr"] if args.lr is None else args.lr
    per_seed, logs = [], {}
    for seed in args.seeds:
        base = {"dataset": args.dataset, "rounds": rounds, "epochs": epochs, "lr": lr, "classes": classes, "seed": seed}
        name = f"reduced_seed{seed}" if args.reduced else f"T{rounds}_F{epochs}_lr{lr}_seed{seed}"
        name = name if args.dataset == "digits" else f"{args.dataset}_{name}"
        name += "" if classes in (None, 2) else f"_classes{classes}"
        logs[seed] = args.out / f"{name}.jsonl"  # one line per finished run: rerunning the command continues
        per_seed.append(_jobs(base, aggregators, attacks, fractions, () if args.skip_dp else noise))
    jobs = [job for cell in zip(*per_seed, strict=True) for job in cell]  # every seed of a cell, then the next cell
    args.out.mkdir(parents=True, exist_ok=True)
    results = [json.loads(line) for log in logs.values() if log.exists() for line in log.read_text().splitlines()]
    done = {_key(r) for r in results}
    todo = [] if args.report_only else [job for job in jobs if _key(job) not in done]
    os.environ["OMP_NUM_THREADS"] = "1"
    started = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        for result in pool.map(fit, todo):
            results.append(result)
            with logs[result["seed"]].open("a") as out:
                out.write(json.dumps(result) + "\n")
    elapsed = time.perf_counter() - started
    seconds = sum(r["seconds"] for r in results)
    seeds = ", ".join(map(str, args.seeds))
    report = (
        f"{args.dataset}{'' if classes is None else f', {classes} classes per client'}, T = {rounds}, F = {epochs}, "
        f"lr {lr}, seeds {seeds} (mean ± std over seeds): {len(results)} runs, "
        f"{seconds:.0f} s of run time ({elapsed:.0f} s of wall time in this invocation, {args.jobs} jobs)\n"
        + table(results, aggregators, attacks, fractions, len(args.seeds))
        + "\n"
        + dp_table(results, len(args.seeds))
    )
    stem = (
        logs[args.seeds[0]].stem
        if len(args.seeds) == 1
        else logs[args.seeds[0]].stem.replace(f"seed{args.seeds[0]}", "seeds" + "_".join(map(str, args.seeds)))
    )
    (args.out / f"{stem}.md").write_text(report + "\n")
    print(report)


def _jobs(base: dict, aggregators, attacks, fractions, noise) -> list[dict]:
    """One seed's runs, the most informative first, so that an interrupted grid still answers the main question."""
    jobs = [
        {**base, "kind": "robust", "aggregator": a, "attack": None, "fraction": 0.0, "strategy": strategy(a, None, 0)}
        for a in aggregators
    ]
    jobs += [{**base, "kind": "dp", "noise_multiplier": z, "strategy": dp_strategy(z)} for z in noise]
    cells = [(k, f) for f in (0.2, 0.1, 0.3) if f in fractions for k in attacks]
    jobs += [
        {**base, "kind": "robust", "aggregator": a, "attack": k, "fraction": f, "strategy": strategy(a, k, f)}
        for k, f in cells for a in aggregators
    ]  # fmt: skip
    return jobs


def _key(job: dict) -> tuple:
    return tuple(job.get(k) for k in ("seed", "kind", "aggregator", "attack", "fraction", "noise_multiplier"))


if __name__ == "__main__":
    main()
