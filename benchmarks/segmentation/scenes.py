"""FedAvg against MO-FedProto on the procedural scenes: the offline twin of Fig. 5 of Michieli & Ozay.

Fig. 5 of the prototype-margin paper compares FedAvg and FedProto (MO-FedProto) on FPascal and FPascal macro
for α ∈ {0.01, 0.1, 1}. Pascal VOC and ImageNet weights cannot be downloaded here, so this benchmark runs the
offline twins of those cells, ``conf/fedproto/scenes[_macro]/{fedavg,fedproto}_alpha<α>.yaml``:
one-object procedural scenes labelled like VOC, DeepLab-V3+ (MobileNet-V2, output stride 16) from a random
initialisation, the paper's partition (Pareto sizes, Dir(α·p) class mixes) and local protocol (Adam, poly
decay 0.9, F local epochs). Each run is one ``fedlight fit`` subprocess (``OMP_NUM_THREADS=1``, W&B off)
with the preset's sizes as command-line overrides; runs whose metrics.csv has all its rounds are skipped.

It writes ``<out>/table.md``: per label set, α and method, the final mIoU (background included, D9's primary
score), the foreground mIoU, pixel accuracy and the wall time, next to the all-background predictor's
scores on the same test images; and it copies every run's last entropy-map grid (input | truth |
prediction | H_S | H_E) to ``<out>/entropy_maps/<run>.png``.

Presets (from the repository root)::

    python benchmarks/segmentation/scenes.py --reduced   # CI: macro, 32×32, 120 images, 4 runs of 3 rounds
    python benchmarks/segmentation/scenes.py --medium    # macro, 64×64, 800 images, 12 rounds: learns
    python benchmarks/segmentation/scenes.py             # full: the configs as they are (fine and macro,
                                                         # 6,665 images, 100 clients, 400 rounds)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from run_files import latest_version, read_metrics

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf" / "fedproto"
METHODS = {"fedavg": "FedAvg", "fedproto": "FedProto"}
# Sizes that override the configs; the full preset overrides nothing.
PRESETS = {
    "reduced": {
        "label_sets": ["macro"],
        "alphas": [0.1, 1.0],
        "rounds": 3,
        "overrides": {
            "data.dataset.init_args.num_samples": 120,
            "data.dataset.init_args.image_size": 32,
            "data.train_transform.init_args.crop_size": 32,
            "data.partitioner.init_args.num_clients": 6,
            "trainer.clients_per_round": 3,
            "trainer.local_epochs": 1,
            "data.batch_size": 8,
            "trainer.eval_every": 1,
        },
    },
    "medium": {
        "label_sets": ["macro"],
        "alphas": [0.1, 1.0],
        "rounds": 12,
        "overrides": {
            "data.dataset.init_args.num_samples": 800,
            "data.partitioner.init_args.num_clients": 16,
            "trainer.clients_per_round": 4,
            "data.batch_size": 8,
            "trainer.eval_every": 1,
        },
    },
    "full": {"label_sets": ["fine", "macro"], "alphas": [0.01, 0.1, 1.0], "rounds": 400, "overrides": {}},
}


@dataclass
class Run:
    """One ``fedlight fit``: a rule on one label set at one α."""

    method: str
    label_set: str
    alpha: float

    @property
    def name(self) -> str:
        return f"{self.label_set}_{self.method}_alpha{self.alpha:g}"

    @property
    def config(self) -> Path:
        """The Fig. 5 cell's config; an α without one takes the α = 1 cell with α overridden (:meth:`flags`)."""
        folder = CONF / ("scenes" if self.label_set == "fine" else "scenes_macro")
        cell = folder / f"{self.method}_alpha{self.alpha:g}.yaml"
        return cell if cell.exists() else folder / f"{self.method}_alpha1.yaml"

    def flags(self, preset: dict) -> list[str]:
        """The config and the preset's size overrides, as ``fedlight fit`` arguments."""
        flags = ["--config", str(self.config), *(f"--{key}={value}" for key, value in preset["overrides"].items())]
        return [*flags, f"--data.partitioner.init_args.alpha={self.alpha}"]


def command(run: Run, args: argparse.Namespace, root: Path) -> list[str]:
    preset = PRESETS[args.preset]
    callbacks = [
        {"class_path": "fedlight.callbacks.PartitionSummary"},
        {"class_path": "fedlight.callbacks.EntropyMaps", "init_args": {"every_n_rounds": 0, "num_images": 4}},
    ]
    line = [sys.executable, "-m", "fedlight", "fit", *run.flags(preset)]
    line += [
        f"--trainer.rounds={args.rounds or preset['rounds']}",
        f"--trainer.callbacks={json.dumps(callbacks)}",
        f"--seed_everything={args.seed}",
        "--trainer.logger=csv",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={root}",
        f"--trainer.name={run.name}",
    ]
    return line


def run_all(runs: Sequence[Run], args: argparse.Namespace, out: Path) -> tuple[list[str], dict[str, float]]:
    """Runs what is not done yet, ``args.jobs`` at a time; returns the failed runs and each run's wall time."""
    root, logs = out / "runs", out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rounds = args.rounds or PRESETS[args.preset]["rounds"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    pending = [r for r in runs if len(read_metrics(latest_version(root, r.name))) < rounds]
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    failed, wall = [], {}
    while pending or running:
        while pending and len(running) < args.jobs:
            run = pending.pop(0)
            with (logs / f"{run.name}.log").open("w") as log:
                process = subprocess.Popen(command(run, args, root), cwd=REPO, env=env, stdout=log, stderr=log)
            running[run.name] = (process, time.perf_counter())
            print(f"started {run.name}", flush=True)
        for name, (process, started) in list(running.items()):
            if process.poll() is None:
                continue
            del running[name]
            wall[name] = time.perf_counter() - started
            print(f"finished {name} in {wall[name]:.0f} s (exit {process.returncode})", flush=True)
            if process.returncode != 0:
                failed.append(name)
        time.sleep(0.5)
    return failed, wall


def all_background_scores(run: Run, args: argparse.Namespace) -> dict[str, float]:
    """mIoU, foreground mIoU and pixel accuracy of predicting background everywhere on the run's test images."""
    import torch

    from fedlight.cli import build_parser
    from fedlight.metrics.functional.segmentation import confusion_matrix, mean_iou, pixel_accuracy

    parser = build_parser()
    cfg = parser.parse_args(["fit", *run.flags(PRESETS[args.preset])])
    data = parser.instantiate(cfg).fit.data
    data.setup()
    confmat = 0
    for _, y, _ in data.test_batches():
        confmat = confmat + confusion_matrix(torch.zeros_like(y), y, data.num_classes)[0]
    return {
        "miou": mean_iou(confmat).item(),
        "miou_fg": mean_iou(confmat, include_background=False).item(),
        "acc": pixel_accuracy(confmat).item(),
    }


def table(runs: Sequence[Run], args: argparse.Namespace, out: Path, wall: dict[str, float]) -> str:
    root = out / "runs"
    preset = PRESETS[args.preset]
    lines = [
        f"# FedAvg vs MO-FedProto on procedural scenes ({args.preset} preset, seed {args.seed})",
        "",
        f"Overrides of the configs: `{' '.join(f'--{k}={v}' for k, v in preset['overrides'].items()) or 'none'}`, "
        f"rounds = {args.rounds or preset['rounds']}.",
        "Final round, global test set = union of the clients' held-out 20%. mIoU includes background (D9).",
        "",
        "| label set | α | method | mIoU | fg mIoU | pixel acc | wall time (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    baselines = {}
    for run in runs:
        key = (run.label_set, run.alpha)
        if key not in baselines:
            baselines[key] = all_background_scores(run, args)
            b = baselines[key]
            lines.append(
                f"| {run.label_set} | {run.alpha:g} | all background | {100 * b['miou']:.1f} | "
                f"{100 * b['miou_fg']:.1f} | {100 * b['acc']:.1f} | – |"
            )
        rows = read_metrics(latest_version(root, run.name))
        last = rows[-1] if rows else {}
        scores = " | ".join(f"{100 * last.get(k, math.nan):.1f}" for k in ("test/miou", "test/miou_fg", "test/acc"))
        seconds = f"{wall[run.name]:.0f}" if run.name in wall else "– (earlier invocation)"
        lines.append(f"| {run.label_set} | {run.alpha:g} | {METHODS[run.method]} | {scores} | {seconds} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--reduced", dest="preset", action="store_const", const="reduced", help="the CI size")
    size.add_argument("--medium", dest="preset", action="store_const", const="medium", help="a run that learns")
    parser.set_defaults(preset="full")
    parser.add_argument("--alphas", type=float, nargs="+", help="override the preset's α values")
    parser.add_argument("--label-sets", nargs="+", choices=["fine", "macro"], help="override the preset's")
    parser.add_argument("--rounds", type=int, help="override the preset's rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (one core each)")
    parser.add_argument("--out", type=Path, help="default: benchmarks/segmentation/out/<preset>")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    out = args.out or REPO / "benchmarks" / "segmentation" / "out" / args.preset
    runs = [
        Run(method, label_set, alpha)
        for label_set in args.label_sets or preset["label_sets"]
        for alpha in args.alphas or preset["alphas"]
        for method in METHODS
    ]
    started = time.perf_counter()
    failed, wall = run_all(runs, args, out)
    (out / "entropy_maps").mkdir(parents=True, exist_ok=True)
    for run in runs:
        run_dir = latest_version(out / "runs", run.name)
        grids = sorted((run_dir / "entropy_maps").glob("round_*.png")) if run_dir else []
        if grids:
            shutil.copy(grids[-1], out / "entropy_maps" / f"{run.name}.png")
    text = table(runs, args, out, wall)
    (out / "table.md").write_text(text)
    print(text)
    print(f"total wall time {time.perf_counter() - started:.0f} s; grids in {out / 'entropy_maps'}")
    if failed:
        print(f"failed: {', '.join(failed)} (logs in {out / 'logs'})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
