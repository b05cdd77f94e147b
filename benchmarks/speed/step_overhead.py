"""The cost of fedlight's client step against the floor's, measured pairwise in one process.

Whole-run timings on a shared machine drift by ±10% between repeats, more than the difference between
fedlight and the plain loop, so this script removes everything but the local training: the same
process holds fedlight's trainer (set up as ``fit`` does) and the floor's model on the same data, and
trains the same client from the same weights, alternating which goes first, ``--repeats`` times:

- fedlight: ``fedlight.engine.local_fit.LocalTraining.fit`` (load W^t into the resident module, a fresh optimizer,
  the precision plugin's input conversion, forward context, backward and optimizer step, the loss sum,
  the flattening of the trained state);
- floor: ``harness.local_fit`` (tensors sliced into batches, SGD, nothing else) plus loading the weights.

It prints the median time per client of each, their ratio and the overhead per optimizer step, then a
cProfile of fedlight's client step sorted by own time.

    python benchmarks/speed/step_overhead.py                    # (b) digits CNN, its round-0 clients
    python benchmarks/speed/step_overhead.py --workload synthetic_mlp
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

import harness  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="digits_cnn", choices=["digits_cnn", "synthetic_mlp"])
    parser.add_argument("--repeats", type=int, default=7, help="passes over the round's clients, per engine")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work: harness.Workload = importlib.import_module(args.workload).WORKLOAD

    from fedlight.engine.trainer import FederatedTrainer
    from fedlight.plans import ClientPlan
    from fedlight.strategies import FedAvg

    with tempfile.TemporaryDirectory() as tmp:
        exported_path = Path(tmp) / "data.pt"
        harness.export(work, exported_path)
        data = harness.load_exported(exported_path, torch.device("cpu"))
        initial = {k: v.clone() for k, v in data.net.state_dict().items()}
        trainer = FederatedTrainer(
            rounds=1,
            clients_per_round=work.clients_per_round,
            local_epochs=work.local_epochs,
            logger=[],
            enable_progress_bar=False,
            default_root_dir=tmp,
            seed=harness.SEED,
        )
        trainer._setup(work.make_client(), work.make_datamodule(), FedAvg(), None, None, logging=False)
        clients = harness.round_clients(data.num_samples, work.clients_per_round, 0)
        steps = sum(work.local_epochs * -(-int(data.num_samples[c]) // data.batch_size) for c in clients)
        optimization = harness.Optimization.of(work, 1)

        def fedlight_pass() -> float:
            started = time.perf_counter()
            for client in clients:
                trainer.run.pieces.training.fit(
                    0, ClientPlan(client=client, epochs=work.local_epochs), trainer.global_state
                )
            return time.perf_counter() - started

        def floor_pass() -> float:
            started = time.perf_counter()
            for client in clients:
                data.net.load_state_dict(initial)
                harness.local_fit(data, client, 0, optimization, torch.device("cpu"), "32-true")
            return time.perf_counter() - started

        fedlight_pass(), floor_pass()  # warm-up: allocator, kernels
        times: dict[str, list[float]] = {"fedlight": [], "floor": []}
        for repeat in range(args.repeats):
            order = [("fedlight", fedlight_pass), ("floor", floor_pass)]
            for name, run in order if repeat % 2 == 0 else order[::-1]:
                times[name].append(run())

        fedlight_s, floor_s = statistics.median(times["fedlight"]), statistics.median(times["floor"])
        ratios = [a / b for a, b in zip(times["fedlight"], times["floor"], strict=True)]
        print(f"workload: {work.title}")
        print(f"round-0 clients {clients}: {steps} optimizer steps per pass, {args.repeats} passes per engine")
        print(f"floor:    {floor_s:8.3f} s per pass  ({1e6 * floor_s / steps:7.1f} µs per step)")
        print(f"fedlight: {fedlight_s:8.3f} s per pass  ({1e6 * fedlight_s / steps:7.1f} µs per step)")
        print(
            f"fedlight/floor, median of paired passes: {statistics.median(ratios):.3f} "
            f"(range {min(ratios):.3f}–{max(ratios):.3f}); "
            f"overhead {1e6 * (fedlight_s - floor_s) / steps:+.1f} µs per step"
        )

        profile = cProfile.Profile()
        profile.runcall(fedlight_pass)
        print("\nfedlight's pass under cProfile (own time, top 12):")
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
