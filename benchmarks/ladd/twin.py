"""LADD's ablations (Tables 5–7 of Shenaj et al., WACV 2023) on the offline style-cities twin.

Runs every row of ``conf/ladd/twin/`` with the ``fedlight`` command in this process: the four source
pre-trainings (no FDA, FDA windows 1×1, 3×3, 5×5: Table 6 and the first rows of Table 5), then the federated
rows of Table 5 (ST, FDA+ST, +KD, +KD+SWAt, +KD+Clu, everything) and Table 7 (cluster-specific BN, backbone,
classifier, all), each from its pre-training's checkpoint. Every row is summarised as LADD reports it: the
mean ± std over the last 10 % of rounds of the per-round test mIoU, for the global model and for the
style-routed cluster models. The style-clustering accuracy (each cluster labelled with its majority city) is
reported too. A run of every row writes its tables to ``benchmarks/ladd/results/``; a subset of rows writes
them beside its runs, in ``--out``::

    python benchmarks/ladd/twin.py                 # every row, a few minutes on two CPU cores
    python benchmarks/ladd/twin.py --rows source_only pretrain_fda fedavg_st ladd_all
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import time
from collections import Counter
from pathlib import Path

import torch

from fedlight.cli import run

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf/ladd/twin"
RESULTS = REPO / "benchmarks/ladd/results"
PRETRAINING = ["source_only", "pretrain_fda_1x1", "pretrain_fda", "pretrain_fda_5x5"]
FEDERATED = ["st", "fedavg_st", "fda_st_kd", "fda_st_kd_swat", "fda_st_kd_clu", "ladd_all", "ladd_bn", "ladd_backbone",
             "ladd_cls"]  # fmt: skip
#: the order rows run in: the federated rows need only the first two pre-trainings; Table 6's other windows last
ORDER = ["source_only", "pretrain_fda", "fedavg_st", "fda_st_kd", "fda_st_kd_swat", "ladd_all", "ladd_cls", "st",
         "fda_st_kd_clu", "ladd_bn", "ladd_backbone", "pretrain_fda_1x1", "pretrain_fda_5x5"]  # fmt: skip


def tail_summary(rows: list[dict[str, str]], key: str) -> tuple[float, float] | None:
    """Mean and standard deviation (population) of ``key`` over the last 10 % of rounds (at least one)."""
    values = [float(r[key]) for r in rows if r.get(key) not in (None, "")]
    if not values:
        return None
    tail = values[-max(1, math.ceil(0.1 * len(values))) :]
    mean = sum(tail) / len(tail)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in tail) / len(tail))


def cluster_accuracy(run_dir: Path) -> float | None:
    """Share of clients whose cluster's majority city is their own city (LADD's clustering accuracy)."""
    file = run_dir / "clusters.json"
    if not file.is_file():
        return None
    clusters = json.loads(file.read_text())
    correct = sum(Counter(re.sub(r"\d+$", "", c) for c in ids).most_common(1)[0][1] for ids in clusters.values())
    return correct / sum(len(ids) for ids in clusters.values())


def run_row(row: str, out: Path) -> dict[str, object]:
    """Runs one row's config into ``out/<row>/version_0`` and summarises its metrics."""
    args = ["fit", "--config", str(CONF / f"{row}.yaml"), f"--trainer.default_root_dir={out}",
            "--trainer.logger=csv", "--trainer.enable_progress_bar=false"]  # fmt: skip
    if row.startswith("pretrain_fda"):  # the style pools are written next to the runs
        b = {"pretrain_fda_1x1": 0, "pretrain_fda": 1, "pretrain_fda_5x5": 2}[row]
        args.append(f"--data.train_transform.init_args.style_file={out}/styles_b{b}.pt")
    if row in FEDERATED:
        source = "source_only" if row == "st" else "pretrain_fda"
        args.append(f"--trainer.init_from={out}/{source}/version_0/checkpoints/last.ckpt")
    started = time.perf_counter()
    run(args)
    seconds = time.perf_counter() - started
    run_dir = out / row / "version_0"
    with open(run_dir / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    return {
        "row": row,
        "rounds": len(rows),
        "seconds": round(seconds, 1),
        "global": tail_summary(rows, "test/miou"),
        "routed": tail_summary(rows, "test/routed/miou"),
        "clusters": float(rows[-1]["clusters/k"]) if rows[-1].get("clusters/k") else None,
        "cluster_accuracy": cluster_accuracy(run_dir),
    }


def fmt(summary: tuple[float, float] | None) -> str:
    return "–" if summary is None else f"{100 * summary[0]:.2f} ± {100 * summary[1]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=ORDER, help="rows of conf/ladd/twin to run")
    parser.add_argument("--out", type=Path, default=REPO / "runs/ladd/twin_benchmark", help="where the runs go")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; remove it or pass --out elsewhere, so every row is version_0")
    results = []
    for row in args.rows:  # the tables are rewritten after every row, so a cut-short run keeps what it measured
        results.append(run_row(row, args.out))
        print(json.dumps(results[-1]))
        # the committed tables hold every row; a subset (as CI runs) writes its tables beside its runs
        write_tables(results, RESULTS if args.rows == ORDER else args.out)


def write_tables(results: list[dict[str, object]], results_dir: Path) -> None:
    """Writes ``results/twin.md`` (one line per row) and ``results/twin.json``."""
    lines = ["| row | rounds | test mIoU (global) | test mIoU (routed) | k | cluster acc. | time (s) |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        accuracy = "–" if r["cluster_accuracy"] is None else f"{100 * r['cluster_accuracy']:.0f} %"
        k = "–" if not r["clusters"] else f"{r['clusters']:.0f}"
        lines.append(f"| {r['row']} | {r['rounds']} | {fmt(r['global'])} | {fmt(r['routed'])} | {k} | {accuracy} "
                     f"| {r['seconds']} |")  # fmt: skip
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "twin.md").write_text("\n".join(lines) + "\n")
    (results_dir / "twin.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
