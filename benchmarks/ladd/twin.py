"""LADD's ablations (Tables 5–7 of Shenaj et al., WACV 2023) on the offline style-cities twin.

Runs rows of ``conf/ladd/twin/`` with the ``fedlight`` command in this process: the source pre-trainings (no
FDA, FDA windows 1×1, 3×3, 5×5: Table 6 and the first rows of Table 5), then the federated rows of Table 5 (ST,
FDA+ST, +KD, +KD+SWAt, +KD+Clu, ST+KD+SWAt+Clu without FDA, everything) and Table 7 (cluster-specific BN,
backbone, classifier, all), each from its pre-training's checkpoint, Table 2's FTDA (the source-only model
fine-tuned on the clients' labels, federated and centralized), and, from scratch, Table 3's MCD baselines (FL-UDA
and centralized) and Table 2's centralized DAFormer. Every run is summarised as LADD reports it: the mean ± std
over the last 10 % of rounds of the per-round test mIoU, for the global model and for the style-routed cluster
models, with the style-clustering accuracy (each cluster labelled with its majority city). Over several seeds
(data and training), a row's table entry is the mean ± std over seeds of those tail means. A full run of the
default rows writes its tables to ``benchmarks/ladd/results/``; other runs write them beside their runs, in ``--out``::

    python benchmarks/ladd/twin.py                                  # every row, seed 0
    python benchmarks/ladd/twin.py --seeds 0 1 2                    # the main rows over three seeds
    # the same, one process per seed, then the merged tables
    for s in 0 1 2; do python benchmarks/ladd/twin.py --seeds $s --rows ... --out runs/ladd/s$s & done; wait
    python benchmarks/ladd/twin.py --collect runs/ladd/s0 runs/ladd/s1 runs/ladd/s2
    # extra rows beside the committed ones: collect the committed results too (they are rewritten, not appended to)
    python benchmarks/ladd/twin.py --seeds 0 1 2 --rows pretrain_fda_1x1 pretrain_fda_5x5 --out runs/ladd/table6
    python benchmarks/ladd/twin.py --collect benchmarks/ladd/results runs/ladd/table6
    # the federated rows at another client learning rate (how fast self-training moves the model)
    python benchmarks/ladd/twin.py --seeds 0 1 2 --lr 0.003 --rows pretrain_fda fedavg_st fda_st_kd --out runs/ladd/lr
    python benchmarks/ladd/twin.py --reduced --rows source_only pretrain_fda fda_st_kd ladd_all --out /tmp/x  # CI
    # the federated rows as LADD's released code runs them (conf/ladd/twin/released_code/)
    python benchmarks/ladd/twin.py --released-code --seeds 0 1 2 --rows pretrain_fda fda_st_kd_swat ladd_all --out ...
    # Table 8: four clients, one per style city, scored city by city (its pre-training runs first)
    python benchmarks/ladd/twin.py --seeds 0 1 2 --rows table8_source_only table8_ladd --out runs/ladd/table8
    # Table 2: FTDA from the source-only pre-training (run first), and DAFormer from scratch
    python benchmarks/ladd/twin.py --seeds 0 1 2 --rows ftda_federated ftda_centralized daformer --out runs/ladd/table2

A federated row whose pre-training is neither among ``--rows`` nor in ``--pretrained`` has it run first. Rows scored
city by city (``--data.test_groups``: Table 8's) add each city's tail mean and that of the cities' mean to
``twin.json`` and a Table 8 to ``twin.md``.

The table ``twin.md`` ends with the paired comparisons of :data:`COMPARISONS` that the runs hold: per seed the
later row's score minus the earlier's (routed for rows with clusters, global otherwise), their mean ± standard
error, and the seeds a difference of the paper's size would need at the spread measured (two-sided α = 0.05,
power 0.8; ``benchmarks/paired.py``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from fedlight.cli import run

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from paired import paired, seeds_needed

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf/ladd/twin"
RESULTS = REPO / "benchmarks/ladd/results"
PRETRAINING = ["source_only", "pretrain_fda_1x1", "pretrain_fda", "pretrain_fda_5x5", "table8_source_only",
               "table8_pretrain_fda"]  # fmt: skip
FEDERATED = ["st", "fedavg_st", "fda_st_kd", "fda_st_kd_swat", "fda_st_kd_clu", "st_kd_swat_clu", "ladd_all", "ladd_bn",
             "ladd_backbone", "ladd_cls", "table8_ladd"]  # fmt: skip
#: rows that fine-tune a pre-training on the clients' labels with FedAvg, not LADD: Table 2's FTDA (Cityscapes only
#: in the paper), from the pre-training without FDA
FINE_TUNED = ["ftda_federated", "ftda_centralized"]
#: rows trained from scratch, without a pre-training: Table 3's MCD baselines and Table 2's centralized DAFormer,
#: whose labelled source (the pre-training's) is drawn with the run's seed as the data are
FROM_SCRATCH = ["mcd_fl_uda", "mcd_centralized", "daformer"]
#: the pre-training a federated row starts from, where it is not ``pretrain_fda``
SOURCE = {"st": "source_only", "st_kd_swat_clu": "source_only", "table8_ladd": "table8_pretrain_fda",
          "ftda_federated": "source_only", "ftda_centralized": "source_only"}  # fmt: skip
#: the style pool each FDA pre-training writes in its seed's folder
STYLE_FILES = {"pretrain_fda_1x1": "styles_b0.pt", "pretrain_fda": "styles_b1.pt", "pretrain_fda_5x5": "styles_b2.pt",
               "table8_pretrain_fda": "styles_cities_b1.pt"}  # fmt: skip
#: the order rows run in: the federated rows need only the first two pre-trainings; Table 6's other windows last
ORDER = ["source_only", "pretrain_fda", "fedavg_st", "fda_st_kd", "fda_st_kd_swat", "ladd_all", "ladd_cls", "st",
         "fda_st_kd_clu", "st_kd_swat_clu", "ladd_bn", "ladd_backbone", "pretrain_fda_1x1", "pretrain_fda_5x5",
         "mcd_fl_uda", "mcd_centralized", "ftda_federated", "ftda_centralized", "daformer"]  # fmt: skip
#: the rows run over several seeds: Table 5's main steps and Table 7
MAIN = ["source_only", "pretrain_fda", "fedavg_st", "fda_st_kd", "fda_st_kd_swat", "ladd_bn", "ladd_backbone",
        "ladd_cls", "ladd_all"]  # fmt: skip
#: the paper's mIoU % of each row, CrossCity's (Tables 3, 5, 6 and 7; a cluster row's is its routed score) or, for
#: the rows of :data:`PAPER_CITYSCAPES`, Cityscapes' (Table 2)
PAPER = {"source_only": 26.49, "pretrain_fda_1x1": 31.59, "pretrain_fda": 32.43, "pretrain_fda_5x5": 32.51,
         "st": 30.58, "fedavg_st": 33.59, "fda_st_kd": 37.49, "fda_st_kd_swat": 38.83, "fda_st_kd_clu": 39.18,
         "st_kd_swat_clu": 32.78, "ladd_bn": 38.72, "ladd_backbone": 39.31, "ladd_cls": 39.87, "ladd_all": 40.09,
         "mcd_fl_uda": 24.80, "mcd_centralized": 27.15, "ftda_federated": 59.35, "ftda_centralized": 65.74,
         "daformer": 42.31}  # fmt: skip
#: rows whose paper number is not CrossCity's: Table 2's FTDA (CrossCity's clients have no labels) and DAFormer
PAPER_CITYSCAPES = {"ftda_federated", "ftda_centralized", "daformer"}
#: the paper's B − A where A and B's own numbers come from different datasets: FTDA − Cityscapes' source only (24.05)
PAPER_DELTA = {("source_only", "ftda_federated"): 59.35 - 24.05, ("source_only", "ftda_centralized"): 65.74 - 24.05,
               ("source_only", "daformer"): 42.31 - 24.05}  # fmt: skip
#: Table 8's rows: the paper's per-city mIoU % (Rio, Rome, Taipei, Tokyo) and their average, on CrossCity in [72]'s
#: four-client split (the source-only row is [72]'s own model)
PAPER_TABLE8 = {"table8_source_only": (27.9, 27.6, 26.0, 28.2, 27.4), "table8_ladd": (35.4, 34.0, 31.5, 32.4, 33.3)}
#: test/<name>/miou keys that are no city's
NOT_CITIES = {"routed", "group_mean", "released_global", "personal"}
#: ``--reduced``: a smoke run of a few seconds per row (CI), not a measurement
REDUCED_PRETRAINING = ["--trainer.rounds=3", "--data.dataset.init_args.num_source_samples=160",
                       "--data.dataset.init_args.num_test_per_city=10"]  # fmt: skip
REDUCED_FEDERATED = ["--trainer.rounds=4", "--trainer.clients_per_round=4",
                     "--data.dataset.init_args.num_test_per_city=10"]  # fmt: skip
REDUCED_FROM_SCRATCH = ["--trainer.rounds=3", "--data.dataset.init_args.num_test_per_city=10"]
REDUCED_STEPS = {"daformer": ["--trainer.local_steps=5"]}  # rows that run a number of steps a round, not epochs
NO_SWA = {"st", "fedavg_st", "fda_st_kd", "fda_st_kd_clu"}  # rows without an SWA teacher
#: (A, B): B − A per seed, compared with the paper's B − A (Tables 2, 3, 5–7; :data:`PAPER_DELTA` where A's and
#: B's numbers are of different datasets)
COMPARISONS = [("source_only", "pretrain_fda"), ("pretrain_fda", "fedavg_st"), ("fedavg_st", "fda_st_kd"),
               ("fda_st_kd", "fda_st_kd_swat"), ("fda_st_kd_swat", "ladd_bn"), ("fda_st_kd_swat", "ladd_backbone"),
               ("fda_st_kd_swat", "ladd_cls"), ("fda_st_kd_swat", "ladd_all"), ("st_kd_swat_clu", "ladd_all"),
               ("source_only", "st_kd_swat_clu"), ("source_only", "mcd_fl_uda"), ("source_only", "mcd_centralized"),
               ("mcd_fl_uda", "mcd_centralized"), ("source_only", "ftda_federated"),
               ("source_only", "ftda_centralized"), ("ftda_federated", "ftda_centralized"), ("source_only", "daformer"),
               ("daformer", "ftda_centralized")]  # fmt: skip
#: ``--code-behaviours``: what LADD's released code does where it departs from the paper (docs/ladd.md)
CODE_BEHAVIOURS = [
    "--strategy.init_args.reset_unsampled_clusters=true",
    "--strategy.init_args.shared_pseudo_teacher=true",
    "--strategy.init_args.swa_of_global=true",
]


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


def run_row(
    row: str, out: Path, seed: int = 0, reduced: bool = False, code: bool = False, lr: float | None = None,
    released: bool = False, pretrained: Path | None = None,
) -> dict[str, object]:  # fmt: skip
    """Runs one row's config with ``seed`` (data and training) into ``out/<row>/version_0``; summarises its metrics.

    ``code`` adds three of LADD's code behaviours (:data:`CODE_BEHAVIOURS`) to the federated rows; ``released``
    runs the federated rows from ``released_code/`` (all of them); ``lr`` replaces their clients' learning rate;
    ``pretrained`` is an earlier run's folder whose ``seed<s>/`` pre-trainings the federated rows start from.
    """
    config = CONF / "released_code" / f"{row}.yaml" if released and row in FEDERATED else CONF / f"{row}.yaml"
    if not config.is_file():
        raise SystemExit(
            f"{config} does not exist: released_code/ holds {sorted(p.stem for p in config.parent.glob('*.yaml'))}"
        )
    args = ["fit", "--config", str(config), f"--trainer.default_root_dir={out}",
            "--trainer.logger=csv", "--trainer.enable_progress_bar=false", f"--seed_everything={seed}",
            f"--data.dataset.init_args.seed={seed}"]  # fmt: skip
    if row in STYLE_FILES:  # the style pools are written next to the runs
        args.append(f"--data.train_transform.init_args.style_file={out}/{STYLE_FILES[row]}")
        args.append(f"--data.train_transform.init_args.target.init_args.seed={seed}")  # the same clients' styles
    if row in FROM_SCRATCH:  # MCD's and DAFormer's labelled source comes from the seed's world, as the data do
        args.append(f"--model.init_args.source.init_args.seed={seed}")
    if reduced and row in FROM_SCRATCH + FINE_TUNED:
        args += REDUCED_FROM_SCRATCH + REDUCED_STEPS.get(row, [])
    elif reduced:
        args += REDUCED_FEDERATED if row in FEDERATED else REDUCED_PRETRAINING
        args += [] if row in NO_SWA or row not in FEDERATED else ["--strategy.init_args.swa_start=2"]
    if row in FEDERATED:
        source = SOURCE.get(row, "pretrain_fda")
        sources = out if pretrained is None else pretrained / out.name
        args.append(f"--trainer.init_from={sources}/{source}/version_0/checkpoints/last.ckpt")
        args += CODE_BEHAVIOURS if code else []
        args += [] if lr is None else [f"--model.init_args.optimizer.init_args.lr={lr}"]
    if row in FINE_TUNED:  # LADD's flags (--code-behaviours, --lr) are not FTDA's
        sources = out if pretrained is None else pretrained / out.name
        args.append(f"--trainer.init_from={sources}/{SOURCE[row]}/version_0/checkpoints/last.ckpt")
    started = time.perf_counter()
    run(args)
    seconds = time.perf_counter() - started
    run_dir = out / row / "version_0"
    with open(run_dir / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    cities = [key.split("/")[1] for key in rows[0] if re.fullmatch(r"test/[^/]+/miou", key)]
    cities = [city for city in cities if city not in NOT_CITIES]
    return {
        "row": row,
        "seed": seed,
        "rounds": len(rows),
        "seconds": round(seconds, 1),
        "global": tail_summary(rows, "test/miou"),
        "routed": tail_summary(rows, "test/routed/miou"),
        "released_global": tail_summary(rows, "test/released_global/miou"),
        "routing_agreement": float(rows[-1]["routing/released_agreement"])
        if rows[-1].get("routing/released_agreement")
        else None,
        "clusters": float(rows[-1]["clusters/k"]) if rows[-1].get("clusters/k") else None,
        "cluster_accuracy": cluster_accuracy(run_dir),
        "cities": {city: tail_summary(rows, f"test/{city}/miou") for city in cities} or None,
        "city_mean": tail_summary(rows, "test/group_mean/miou"),
    }


def fmt(summary: tuple[float, float] | None) -> str:
    return "–" if summary is None else f"{100 * summary[0]:.2f} ± {100 * summary[1]:.2f}"


def over_seeds(values: list[float]) -> tuple[float, float] | None:
    """Mean and sample standard deviation over seeds (0 for one seed)."""
    if not values:
        return None
    mean = sum(values) / len(values)
    spread = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=None, help="rows of conf/ladd/twin to run (default: all, or "
                        "with several seeds the main rows)")  # fmt: skip
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="data and training seeds")
    parser.add_argument("--reduced", action="store_true", help="a few rounds per row: a smoke run, not a measurement")
    parser.add_argument("--out", type=Path, default=REPO / "runs/ladd/twin_benchmark", help="where the runs go")
    parser.add_argument("--code-behaviours", action="store_true", help="federated rows as LADD's released code "
                        "runs them: unsampled clusters restart from the global model, one shared pseudo-label "
                        "teacher, the SWA teacher averages the global model")  # fmt: skip
    parser.add_argument("--released-code", action="store_true", help="federated rows from conf/ladd/twin/"
                        "released_code/: every behaviour of LADD's released code (docs/ladd.md)")  # fmt: skip
    parser.add_argument("--lr", type=float, default=None, help="the federated rows' client learning rate instead of "
                        "base.yaml's 0.01: how fast self-training moves the model (the twin's time scale)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--collect", nargs="+", type=Path, help="only write the committed tables from the twin.json "
                        "of these folders (e.g. seeds run as separate processes; name benchmarks/ladd/results too to "
                        "keep the committed runs)")  # fmt: skip
    parser.add_argument("--pretrained", type=Path, default=None, help="an earlier --out whose seed<s>/ pre-trainings "
                        "the federated rows start from, instead of running them again")  # fmt: skip
    parser.add_argument("--tables", type=Path, default=RESULTS, help="where --collect writes twin.md and twin.json")
    args = parser.parse_args()
    if args.collect:
        write_tables(
            [r for folder in args.collect for r in json.loads((folder / "twin.json").read_text())], args.tables
        )
        return
    if args.lr is not None and not args.lr > 0:
        parser.error(f"--lr must be a learning rate > 0, got {args.lr}")
    rows = args.rows or (ORDER if len(args.seeds) == 1 else MAIN)
    if args.pretrained is None:
        rows = with_pretrainings(rows)
    torch.set_num_threads(args.threads)
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; remove it or pass --out elsewhere, so every row is version_0")
    # the committed tables come from full runs of the default rows; others write their tables beside their runs
    changed = args.reduced or args.code_behaviours or args.released_code or args.lr is not None
    results_dir = RESULTS if args.rows is None and not changed else args.out
    results = []
    for seed in args.seeds:  # the tables are rewritten after every row, so a cut-short run keeps what it measured
        for row in rows:
            results.append(
                run_row(row, args.out / f"seed{seed}", seed, args.reduced, args.code_behaviours, args.lr,
                        args.released_code, args.pretrained)
            )  # fmt: skip
            print(json.dumps(results[-1]), flush=True)
            write_tables(results, results_dir)


def with_pretrainings(rows: list[str]) -> list[str]:
    """``rows`` with, before each federated row, the pre-training it starts from when ``rows`` lack it.

    >>> with_pretrainings(["table8_source_only", "table8_ladd", "st"])
    ['table8_source_only', 'table8_pretrain_fda', 'table8_ladd', 'source_only', 'st']
    >>> with_pretrainings(["ftda_federated", "ftda_centralized"])
    ['source_only', 'ftda_federated', 'ftda_centralized']
    """
    out: list[str] = []
    for row in rows:
        source = SOURCE.get(row, "pretrain_fda") if row in FEDERATED + FINE_TUNED else None
        if source is not None and source not in rows and source not in out:
            out.append(source)
        out.append(row)
    return out


def write_tables(results: list[dict[str, object]], results_dir: Path) -> None:
    """Writes ``twin.md`` (per row: the mean ± std over seeds of each seed's tail mean) and ``twin.json`` (every run).

    With one seed the spread is the tail's own, LADD's reporting. The column "routed − none" is the mean ± std
    over seeds of the routed score minus the same seed's FDA+ST+KD+SWAt (Table 7's "none"), a paired difference.
    """
    seeds = sorted({r["seed"] for r in results})
    none = {r["seed"]: r["global"][0] for r in results if r["row"] == "fda_st_kd_swat" and r["global"]}
    lines = [f"Seeds: {', '.join(map(str, seeds))}.", "",
             "| row | paper | rounds | test mIoU (global) | test mIoU (routed) | routed − none | k | cluster acc. "
             "| time (s) |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in dict.fromkeys(r["row"] for r in results):
        runs = [r for r in results if r["row"] == row]

        def summary(key: str, runs: list[dict[str, object]] = runs) -> tuple[float, float] | None:
            if len(runs) == 1:
                return runs[0][key]
            return over_seeds([r[key][0] for r in runs if r[key]])

        gains = over_seeds([r["routed"][0] - none[r["seed"]] for r in runs if r["routed"] and r["seed"] in none])
        accuracy = over_seeds([r["cluster_accuracy"] for r in runs if r["cluster_accuracy"] is not None])
        k = sorted({f"{r['clusters']:.0f}" for r in runs if r["clusters"]})
        seconds = sum(r["seconds"] for r in runs) / len(runs)
        paper = f"{PAPER[row]} (Cityscapes)" if row in PAPER_CITYSCAPES else PAPER.get(row, "–")
        lines.append(f"| {row} | {paper} | {runs[0]['rounds']} | {fmt(summary('global'))} "
                     f"| {fmt(summary('routed'))} | {fmt(gains)} | {'/'.join(k) or '–'} | "
                     f"{'–' if accuracy is None else f'{100 * accuracy[0]:.0f} %'} | {seconds:.1f} |")  # fmt: skip
    lines += paired_lines(results)
    lines += table8_lines(results)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "twin.md").write_text("\n".join(lines) + "\n")
    (results_dir / "twin.json").write_text(json.dumps(results, indent=1))


def table8_lines(results: list[dict[str, object]]) -> list[str]:
    """Table 8 of the rows scored city by city: each city's mIoU and the mean over cities (over seeds: the mean ±
    std of the seeds' tail means; one seed: the tail's mean ± std), beside the paper's CrossCity row."""
    scored = [r for r in results if r.get("cities")]
    if not scored:
        return []
    cities = list(scored[0]["cities"])
    lines = ["", "Table 8 (per city; the twin's cities are not the paper's, whose row is Rio / Rome / Taipei / Tokyo "
             "/ Avg):", "", f"| row | paper | {' | '.join(cities)} | mean over cities | all images |",
             f"|---|---|{'---|' * len(cities)}---|---|"]  # fmt: skip
    for row in dict.fromkeys(r["row"] for r in scored):
        runs = [r for r in scored if r["row"] == row]
        paper = " / ".join(f"{v:.1f}" for v in PAPER_TABLE8[row]) if row in PAPER_TABLE8 else "–"
        per_city = " | ".join(fmt(seed_summary([r["cities"].get(c) for r in runs])) for c in cities)
        lines.append(f"| {row} | {paper} | {per_city} | {fmt(seed_summary([r['city_mean'] for r in runs]))} "
                     f"| {fmt(seed_summary([r['global'] for r in runs]))} |")  # fmt: skip
    return lines + table8_paired_lines(scored, cities)


def table8_paired_lines(scored: list[dict[str, object]], cities: list[str]) -> list[str]:
    """LADD − source only in Table 8, per seed, for each city and for the mean over cities (mean ± se)."""
    a, b = "table8_source_only", "table8_ladd"
    by = {(r["row"], r["seed"]): r for r in scored}
    seeds = sorted(s for (row, s) in by if row == b and (a, s) in by)
    if not seeds:
        return []
    lines = ["", f"| {b} − {a} | paper δ (Avg) | per seed | mean ± se (sd) |", "|---|---|---|---|"]
    delta = PAPER_TABLE8[b][-1] - PAPER_TABLE8[a][-1]
    for name, paper in [*((c, "–") for c in cities), ("mean over cities", f"{delta:+.2f}")]:
        tails = [(by[(b, s)], by[(a, s)]) for s in seeds]
        if name == "mean over cities":
            pairs = [(x["city_mean"], y["city_mean"]) for x, y in tails]
        else:
            pairs = [(x["cities"].get(name), y["cities"].get(name)) for x, y in tails]
        d = [100 * (x[0] - y[0]) for x, y in pairs if x is not None and y is not None]
        if d:
            lines.append(f"| {name} | {paper} | {', '.join(f'{v:+.2f}' for v in d)} | {paired(d)} |")
    return lines


def seed_summary(tails: list[tuple[float, float] | None]) -> tuple[float, float] | None:
    """One run's tail mean ± std, or over several seeds the mean ± std of their tail means."""
    present = [tail for tail in tails if tail is not None]
    if len(present) <= 1:
        return present[0] if present else None
    return over_seeds([mean for mean, _ in present])


def score(result: dict[str, object]) -> float | None:
    """A run's tail mean in %: routed for rows with clusters, the global model's otherwise (LADD's reporting)."""
    summary = result["routed"] or result["global"]
    return None if summary is None else 100 * summary[0]


def paired_lines(results: list[dict[str, object]]) -> list[str]:
    """The :data:`COMPARISONS` the results hold: per-seed differences, mean ± se, and seeds for the paper's δ."""
    by = {(r["row"], r["seed"]): score(r) for r in results}
    lines = ["", "| B − A | paper δ | per seed | mean ± se (sd) | seeds for δ (α 0.05, power 0.8) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for a, b in COMPARISONS:
        seeds = sorted(s for (row, s), v in by.items() if row == b and v is not None and by.get((a, s)) is not None)
        if not seeds:
            continue
        d = [by[(b, s)] - by[(a, s)] for s in seeds]
        p, delta = paired(d), PAPER_DELTA.get((a, b), PAPER[b] - PAPER[a])
        needed = seeds_needed(delta, p.sd) if len(d) > 1 and p.sd > 0 else "–"
        lines.append(f"| {b} − {a} | {delta:+.2f} | {', '.join(f'{x:+.2f}' for x in d)} | {p} | {needed} |")
    return lines if len(lines) > 3 else []


if __name__ == "__main__":
    main()
