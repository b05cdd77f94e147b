"""A round's clients trained as one vectorised model (``--trainer.client_batching``) against the sequential loop.

All runs are ``FederatedTrainer.fit`` with the same workload, seed and FedAvg; the only differences are
``client_batching`` and ``compile_batched``. Runs alternate (sequential, batched, compiled, sequential, …) so
drifting machine load hits all three. The compiled runs' graphs are compiled inside their first rounds (and
cached on disk by torch, so a repeat compiles faster): their whole-run time says what that costs.
Reported: rounds/s (median over rounds after the first, from the engine's ``round/time_s``), their ratio,
the largest difference between the final global models (float rounding: see fedlight/engine/batched.py), and
the memory of the stacked client states (K × P parameters plus their gradients and optimizer state).

Workloads:
  (a) the prototype paper's Synthetic(1,1) MLP (speed harness workload (a)), 10 clients per round, F = 20;
  (b) the MNIST-protocol CNN on digits (workload (b));
  (x) cross-device, of pfl-research's benchmark shape: 1000 users × 50 random 3×32×32 images of 10
      classes, cohort 50, one local epoch, batch 10, a 2-conv CNN, SGD lr 0.01;
  (m) the MLP of (a) on equal clients: 200 users × 50 random 60-D vectors, 10 per round, F = 5.

    python benchmarks/speed/batched.py                  # (a), (b), (m), (x): 10 rounds × 2 repeats
    python benchmarks/speed/batched.py --reduced        # CI: (x) with 100 users, 3 rounds, 1 repeat
    python benchmarks/speed/batched.py --workloads x --rounds 20 --repeats 3
    python benchmarks/speed/batched.py --workloads a --variants steps --steps-mode default
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedlight.clients import ClassificationClient  # noqa: E402
from fedlight.data import Digits, FederatedDataModule, Synthetic  # noqa: E402
from fedlight.data.base import FederatedDataset, LabelledTensors  # noqa: E402
from fedlight.data.partition import PowerLaw  # noqa: E402
from fedlight.engine.trainer import FederatedTrainer  # noqa: E402
from fedlight.strategies import FedAvg  # noqa: E402


class CrossDevice(FederatedDataset):
    """``users`` users with 50 random samples (3×32×32 images by default) each, labels uniform over 10 classes."""

    num_classes = 10
    input_shape = (3, 32, 32)

    def __init__(self, users: int = 1000, per_user: int = 50, shape: tuple[int, ...] = (3, 32, 32)) -> None:
        self.users, self.per_user, self.input_shape = users, per_user, shape

    def load_train(self) -> LabelledTensors:
        generator = torch.Generator().manual_seed(0)
        n = self.users * self.per_user
        x = torch.randn(n, *self.input_shape, generator=generator)
        y = torch.randint(10, (n,), generator=generator)
        return LabelledTensors(x, y, np.repeat(np.arange(self.users), self.per_user))


def workload(name: str, reduced: bool):
    """(datamodule, client kwargs, clients per round, local epochs) of a workload."""
    sgd = lambda p: torch.optim.SGD(p, lr=0.01)  # noqa: E731
    if name == "a":
        data = FederatedDataModule(Synthetic(alpha=1.0, beta=1.0), batch_size=10)
        return data, {"num_classes": 10, "input_shape": (60,), "model": "mlp", "optimizer": sgd}, 10, 20
    if name == "b":
        partition = PowerLaw(num_clients=100, classes_per_client=2, base_samples=2)
        data = FederatedDataModule(Digits(), partition, batch_size=10)
        return data, {"num_classes": 10, "input_shape": (1, 8, 8), "model": "cnn", "optimizer": sgd}, 10, 20
    if name == "m":  # the MLP of (a) on equal clients: 200 users × 50 vectors, 10 per round, F = 5
        data = FederatedDataModule(CrossDevice(200, shape=(60,)), batch_size=10, test_fraction=0.0)
        return data, {"num_classes": 10, "input_shape": (60,), "model": "mlp", "optimizer": sgd}, 10, 5
    users = 100 if reduced else 1000
    data = FederatedDataModule(CrossDevice(users), batch_size=10, test_fraction=0.0)
    kwargs = {"num_classes": 10, "input_shape": (3, 32, 32), "model": "cnn", "optimizer": sgd}
    return data, kwargs, 10 if reduced else 50, 1


class StepCounting(FedAvg):
    """FedAvg that keeps each round's per-client step counts (server-side only, so batching stays on)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[int]] = []

    def on_round_end(self, context, round_idx, updates):
        self.steps.append([u.num_steps for u in updates])
        return super().on_round_end(context, round_idx, updates)


def run(name: str, batching, rounds: int, reduced: bool, compiled: bool = False, steps=False, device=None) -> dict:
    data, kwargs, per_round, epochs = workload(name, reduced)
    torch.manual_seed(0)
    model = ClassificationClient(**kwargs)
    with tempfile.TemporaryDirectory(prefix="fedlight-batched-") as root:
        trainer = FederatedTrainer(
            rounds=rounds, clients_per_round=per_round, local_epochs=epochs, eval_every=rounds,
            checkpoint_every=rounds, logger=None, enable_progress_bar=False, client_batching=batching,
            compile_batched=compiled, compile_steps=steps, seed=0, default_root_dir=root,
            **(device or {}),
        )  # fmt: skip
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # the runs' own progress lines
            strategy = StepCounting()
            trainer.fit(model, data, strategy)
    times = [row["round/time_s"] for row in trainer.history[1:]]
    return {
        "round_s": statistics.median(times),
        "wall_s": time.perf_counter() - started,
        "state": trainer.global_state.clone(),
        "numel": trainer.model.layout.numel,
        "vectorised": batching is not None and not isinstance(trainer.run.pieces.fits.vectorised, str),
        # a lockstep stack runs as many steps as its longest client: Σ steps / max steps bounds its speed-up
        "bound": statistics.median(sum(steps) / max(steps) for steps in strategy.steps[1:] or strategy.steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="a,b,m,x", help="comma-separated: a, b, m, x")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--reduced", action="store_true", help="CI: workload x with 100 users, 3 rounds, 1 repeat")
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled variants")
    parser.add_argument(
        "--variants", default="sequential,batched,compiled,steps", help="comma-separated subset of the variants"
    )
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument(
        "--steps-mode", default="default", help="torch.compile mode of the compiled client steps (e.g. reduce-overhead)"
    )
    args = parser.parse_args()
    device = {"accelerator": args.accelerator, "precision": args.precision}
    if args.reduced:
        args.workloads, args.rounds, args.repeats = "x", 3, 1
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, 1 thread, {args.accelerator}, {args.precision}; rounds/s are medians over "
        "rounds after the first"
    )
    for name in args.workloads.split(","):
        # name → (client_batching, compile_batched, compile_steps)
        _, _, per_round, _ = workload(name, args.reduced)
        # K = the cohort: vectorised whatever client_batching=auto's cost model would choose
        variants = {"sequential": (None, False, False), "batched": (per_round, False, False)}
        if not args.no_compile:
            variants["compiled"] = (per_round, True, False)
            variants["steps"] = (None, False, args.steps_mode)  # compiled client steps, one client at a time
        variants = {key: value for key, value in variants.items() if key in [*args.variants.split(","), "sequential"]}
        runs: dict[str, list[dict]] = {key: [] for key in variants}
        for _ in range(args.repeats):
            for key, (batching, compiled, steps) in variants.items():
                runs[key].append(run(name, batching, args.rounds, args.reduced, compiled, steps, device))
        rate = {k: statistics.median(1 / r["round_s"] for r in v) for k, v in runs.items()}
        wall = {k: statistics.median(r["wall_s"] for r in v) for k, v in runs.items()}
        numel = runs["sequential"][0]["numel"]
        assert all(r["vectorised"] for key in variants if variants[key][0] for r in runs[key]), (
            f"({name}) did not run vectorised"
        )
        print(f"\n({name}) {args.rounds} rounds × {args.repeats} repeats, {per_round} clients per round, P = {numel:,}")
        print(f"  {'':<10}  {'rounds/s':>9}  {'× seq':>6}  {'run s':>7}  {'× seq':>6}  max |Δ| to sequential")
        for key in variants:
            diff = max(
                (a["state"] - b["state"]).abs().max().item() for a, b in zip(runs["sequential"], runs[key], strict=True)
            )
            print(
                f"  {key:<10}  {rate[key]:9.3f}  {rate[key] / rate['sequential']:6.2f}  {wall[key]:7.1f}  "
                f"{wall['sequential'] / wall[key]:6.2f}  {diff:.2e}"
            )
        print("  (rounds/s: median over rounds after the first; run s: the whole fit, compilation included;")
        print("   compiled: the vectorised step compiled; steps: each client's step compiled, no vectorising)")
        bound = runs["sequential"][0]["bound"]
        print(f"  Σ steps / max steps per round (median): {bound:.2f}, the most any lockstep stack can gain here")
        stacked_mb = per_round * numel * 4 * 3 / 2**20  # parameters, gradients, one optimizer state
        print(f"  stacked client states: {per_round} × {numel:,} × 4 B × 3 = {stacked_mb:.1f} MiB")


if __name__ == "__main__":
    main()
