"""The FedSLS paper's latent-space analysis (Sec. 4.3, Figs. 3 and 5) on the offline stand-in for CIFAR-10.

Each seed trains FedSLS as ``table1.py`` does at the chosen size (the CIFAR-10 row
``conf/fedsls/cifar10/fedsls_alpha<α>.yaml`` on the procedural scenes of :class:`fedlight.data.Scenes`, a narrow
ResNet-18 layout from scratch) with ``conf/fedsls/latent_analysis.yaml`` stacked on it: the global model's
saliency latents of the test images and their 2×, 4× and 8× down-sampled latents are scored against the images
(SSIM, cosine similarity, Euclidean distance) every ``--every`` rounds and after the last. The cosine similarity
compares the features of the run's own global model (``cosine_network: global_model``): the paper's ImageNet
ResNet-50 cannot be downloaded here. Seeds change ``seed_everything`` (initial weights, client sampling, local
batches); the data and its partition stay those of seed 0, so every seed scores the same test images.

Writes ``<out>/latent_space.md`` (the mean scores per encoding, per seed and over seeds, at each measured round),
``<out>/latent_scores.png`` (Fig. 5: the last round's per-image scores of all seeds pooled) and, per seed, the run
folders ``<out>/runs/fedsls_seed<s>/version_<n>/`` with ``latent_saliency/`` (figures of each measured round,
Fig. 3's examples included, and the per-image scores).

Commands (from the repository root)::

    python benchmarks/fedsls/latent_space.py                         # reduced size, seeds 0 1 2
    python benchmarks/fedsls/latent_space.py --seeds 0 --rounds 5    # a quick look
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))  # this checkout's fedlight, in this process and the spawned workers
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(HERE))
from run_files import latest_version, read_metrics  # noqa: E402
from table1 import SIZES, overlay  # noqa: E402

ADD_ON = REPO / "conf" / "fedsls" / "latent_analysis.yaml"
ENCODINGS = ("saliency", "f2", "f4", "f8")
MEASURES = ("ssim", "cosine", "euclidean")


def fit(config: Path, out: Path, name: str, every: int) -> tuple[str, float]:
    """Runs one ``fedlight fit`` with the latent analysis in this worker process; returns (name, seconds)."""
    import torch

    from fedlight.cli import run

    torch.set_num_threads(1)
    started = time.perf_counter()
    run([
        "fit", "--config", str(config), "--config", str(ADD_ON),
        "--trainer.callbacks.init_args.cosine_network=global_model",
        f"--trainer.callbacks.init_args.every_n_rounds={every}",
        f"--trainer.default_root_dir={out / 'runs'}", f"--trainer.name={name}",
    ])  # fmt: skip
    return name, time.perf_counter() - started


def summary(out: Path, seeds: list[int]) -> tuple[str, np.ndarray]:
    """The table of mean scores per round and seed, and the last round's per-image scores of all seeds."""
    lines = [
        "| round | seed | test acc | " + " | ".join(f"{m} {e}" for m in MEASURES for e in ENCODINGS) + " |",
        "|" + "---|" * (3 + len(MEASURES) * len(ENCODINGS)),
    ]
    per_round: dict[int, list[list[float]]] = {}
    pooled = []
    for seed in seeds:
        run_dir = latest_version(out / "runs", f"fedsls_seed{seed}")
        for row in read_metrics(run_dir):
            if np.isnan(row.get("analysis/latent_ssim_saliency", np.nan)):
                continue
            values = [row[f"analysis/latent_{m}_{e}"] for m in MEASURES for e in ENCODINGS]
            per_round.setdefault(int(row["round"]), []).append(values)
            cells = " | ".join(f"{v:.3f}" for v in values)
            lines.append(f"| {int(row['round'])} | {seed} | {100 * row['test/acc']:.1f} | {cells} |")
        last = sorted((run_dir / "latent_saliency").glob("round_*.npz"))[-1]
        pooled.append(np.load(last)["scores"])
    for round_, values in sorted(per_round.items()):
        mean, std = np.mean(values, axis=0), np.std(values, axis=0)
        cells = " | ".join(f"{m:.3f} ± {s:.3f}" for m, s in zip(mean, std, strict=True))
        lines.append(f"| {round_} | mean ± std | | {cells} |")
    return "\n".join(lines), np.concatenate(pooled)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="reduced")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--alpha", default="0.5", choices=["0.5", "0.1", "0.05"])
    parser.add_argument("--rounds", type=int, help="override the size's number of rounds")
    parser.add_argument("--every", type=int, default=10, help="measure every this many rounds (and after the last)")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each")
    parser.add_argument("--out", type=Path, help="default: benchmarks/fedsls/out/latent_space/<size>")
    args = parser.parse_args(argv)
    rounds = args.rounds or SIZES[args.size]["rounds"]
    out = (args.out or HERE / "out" / "latent_space" / args.size).resolve()
    (out / "configs").mkdir(parents=True, exist_ok=True)
    jobs = []
    for seed in args.seeds:
        config = out / "configs" / f"fedsls_seed{seed}.yaml"
        config.write_text(overlay("fedsls", args.alpha, args.size, rounds) + f"seed_everything: {seed}\n")
        jobs.append((config, out, f"fedsls_seed{seed}", args.every))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as pool:
        for name, seconds in pool.map(fit, *zip(*jobs, strict=True)):
            print(f"{name}: {seconds:.1f} s", flush=True)
    text, pooled = summary(out, args.seeds)

    import matplotlib

    matplotlib.use("Agg")
    from fedlight.callbacks.latent_saliency import latent_scores_figure

    title = f"FedSLS, scenes stand-in, α = {args.alpha}, round {rounds}, seeds {args.seeds} ({len(pooled)} scores)"
    latent_scores_figure(pooled, ENCODINGS, title).savefig(out / "latent_scores.png", dpi=110)
    report = (
        f"Mean scores of each latent against its image (size '{args.size}', α = {args.alpha}, {rounds} rounds, "
        f"{time.perf_counter() - started:.0f} s wall with {args.jobs} jobs). SSIM and cosine: higher is closer; "
        f"Euclidean distance: lower is closer.\n\n{text}\n"
    )
    (out / "latent_space.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
