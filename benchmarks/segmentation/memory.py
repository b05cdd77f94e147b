"""Peak memory of a federated DeepLab-V3+ round, and whether the framework's share grows with the clients.

The prototype-margin paper's segmentation round (Table 1): DeepLab-V3+ with a MobileNet-V2 encoder,
batch 16, 10 clients per round. Here at 256×256 on procedural scenes, one local step per client (each of
10 clients holds 20 images: 16 train, 4 held out), F = 1, FedAvg, one round, evaluation included.

Each measurement is a fresh subprocess, so its peak resident set size (``ru_maxrss``; on CUDA also
``torch.cuda.max_memory_allocated``) is that round's own. The data pool and the partition are the same in
every subprocess; only the clients per round K and their local epochs F change. fedlight trains the
round's clients one after another on one resident module and streams each finished state into one fp64
weighted sum, so its own buffers — the global state W^t and the ``[channels, P]`` aggregation sum — do not
depend on K; the script prints them (they are exact). A CPU's peak RSS also grows with the number of
optimizer steps a process has run (the allocator keeps freed activation blocks), so the plans compare
1 client × 10 epochs with 10 clients × 1 epoch: the same 10 steps, 1 or 10 clients.

    python benchmarks/segmentation/memory.py                 # 256×256, batch 16: K×F = 1×1, 1×10, 10×1
    python benchmarks/segmentation/memory.py --size 128      # a faster, smaller check
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def measure(size: int, clients_per_round: int, local_epochs: int, root: str) -> dict[str, float]:
    """Runs one round in this process and returns its peak memory and the framework's buffer sizes."""
    import torch

    from fedlight.clients import SegmentationClient
    from fedlight.data import FederatedDataModule, Scenes
    from fedlight.data.partition import DirichletPowerLaw
    from fedlight.data.transforms import RandomScaleCropFlip
    from fedlight.engine.trainer import FederatedTrainer
    from fedlight.strategies import FedAvg

    torch.manual_seed(0)
    data = FederatedDataModule(
        Scenes(num_samples=200, image_size=size),
        DirichletPowerLaw(num_clients=10, alpha=100.0, gamma=1e6),  # 10 equal clients of 20 images
        batch_size=16,
        eval_batch_size=16,
        train_transform=RandomScaleCropFlip(crop_size=size),
    )
    model = SegmentationClient(21, (3, size, size), model_kwargs={"encoder_weights": None})
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    trainer = FederatedTrainer(
        rounds=1,
        clients_per_round=clients_per_round,
        local_epochs=local_epochs,
        accelerator=accelerator,
        logger="csv",
        enable_progress_bar=False,
        default_root_dir=root,
    )
    started = time.perf_counter()
    metrics = trainer.fit(model, data, FedAvg())
    parameters = trainer.model.layout.numel
    out = {
        "clients_per_round": clients_per_round,
        "steps": sum(data.num_batches(p.client) * p.epochs for p in trainer.run.plans),
        "round_s": time.perf_counter() - started,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux reports KiB
        "parameters": parameters,
        # W^t [P] in fp32 and the weighted sum [channels, P] in fp64: what fedlight itself holds
        "framework_mb": (4 + 8 * FedAvg.weight_channels) * parameters / 2**20,
        "test_miou": metrics.get("test/miou", float("nan")),
    }
    if accelerator == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=256, help="image side (256 in the target line)")
    parser.add_argument(
        "--plans", nargs="+", default=["1x1", "1x10", "10x1"], help="KxF: clients per round × local epochs"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--root", default="/tmp/fedlight_memory_runs", help="where the runs' folders go")
    args = parser.parse_args()
    if args.child is not None:
        clients, epochs = map(int, args.child.split("x"))
        print(json.dumps(measure(args.size, clients, epochs, args.root)))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    results = []
    for plan in args.plans:
        line = [sys.executable, __file__, "--size", str(args.size), "--child", plan, "--root", args.root]
        output = subprocess.run(line, cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(output.strip().splitlines()[-1]))
        r = results[-1]
        cuda = f", peak CUDA {r['peak_cuda_mb']:.0f} MB" if "peak_cuda_mb" in r else ""
        print(
            f"{args.size}×{args.size}, batch 16, K×F = {plan:>4} ({r['steps']:>2} steps): peak RSS "
            f"{r['peak_rss_mb']:.0f} MB{cuda}, framework buffers {r['framework_mb']:.1f} MB "
            f"({r['parameters']:,} parameters), round {r['round_s']:.0f} s",
            flush=True,
        )
    by_steps: dict[int, list[dict]] = {}
    for r in results:
        by_steps.setdefault(r["steps"], []).append(r)
    for steps, same in by_steps.items():
        if len(same) < 2:
            continue
        few, many = min(same, key=lambda r: r["clients_per_round"]), max(same, key=lambda r: r["clients_per_round"])
        growth = many["peak_rss_mb"] - few["peak_rss_mb"]
        print(
            f"same {steps} steps, {few['clients_per_round']} → {many['clients_per_round']} clients per round: peak RSS "
            f"{growth:+.0f} MB ({100 * growth / few['peak_rss_mb']:+.1f}%), framework buffers "
            f"{few['framework_mb']:.1f} → {many['framework_mb']:.1f} MB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
