"""Memory of the gather path: the largest gathered block and the process's peak resident memory, whole vs in blocks.

One round of ten clients of a wide MLP (about 4.3 M parameters, so the round's states take K × P × 4 ≈ 172 MB)
aggregated by Krum and by the median, once with the default ``--trainer.gather_budget_mb`` (one block of all
states) and once with a small budget. Each setting runs in a fresh process, so ``ru_maxrss`` is its own peak.

    python benchmarks/robustness/gather_memory.py                 # budgets 1024 and 8 MiB
    python benchmarks/robustness/gather_memory.py --budgets 1024 2
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def one(aggregator: str, budget_mb: float) -> dict:
    import tempfile

    import torch

    sys.path.insert(0, str(REPO))
    from fedlight.clients import ClassificationClient
    from fedlight.data import FederatedDataModule
    from fedlight.engine.trainer import FederatedTrainer
    from fedlight.strategies import RobustAggregation
    from fedlight.testing import ClientImages

    torch.set_num_threads(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with tempfile.TemporaryDirectory() as root:
        data = FederatedDataModule(ClientImages([8] * 10, list(range(10))), batch_size=8, test_fraction=0.0)
        trainer = FederatedTrainer(
            rounds=1, clients_per_round=10, local_epochs=1, logger=None, enable_progress_bar=False,
            default_root_dir=root, gather_budget_mb=budget_mb,
        )  # fmt: skip
        torch.manual_seed(0)
        client = ClassificationClient(
            num_classes=3, input_shape=(1, 8, 8), model="mlp", model_kwargs={"hidden": [2048, 2048]},
            optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
        )  # fmt: skip
        trainer.fit(client, data, RobustAggregation(aggregator=aggregator, f=1))
    return {
        "aggregator": aggregator,
        "budget_mb": budget_mb,
        "numel": trainer.model.layout.numel,
        "whole_mb": 10 * trainer.model.layout.numel * 4 / 2**20,
        "gather_peak_mb": trainer.run.pieces.aggregation.gather_peak_nbytes / 2**20,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_before_fit_mb": before / 1024,
        "global_state_sum": float(trainer.global_state.double().sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=float, nargs="+", default=[1024.0, 8.0])
    parser.add_argument("--aggregators", nargs="+", default=["median", "krum"])
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], float(args.one[1]))))
        return
    print("| aggregator | budget (MiB) | K × P × 4 (MiB) | largest gathered block (MiB) | peak RSS (MiB) | Σ W¹ |")
    print("|---|---:|---:|---:|---:|---:|")
    for aggregator in args.aggregators:
        for budget in args.budgets:
            done = subprocess.run(
                [sys.executable, __file__, "--one", aggregator, str(budget)],
                check=True, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": ""},
            )  # fmt: skip
            r = json.loads(done.stdout.strip().splitlines()[-1])
            cells = [aggregator, f"{budget:g}", f"{r['whole_mb']:.1f}", f"{r['gather_peak_mb']:.1f}"]
            cells += [f"{r['max_rss_mb']:.0f}", f"{r['global_state_sum']:.6f}"]
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
