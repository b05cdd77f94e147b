"""Intra-op threads on a quiet and on a busy machine: what ``--trainer.threads`` should default to.

Each workload runs as a user runs it (``python -m fedlight fit --config ...``), once with one torch thread per
process and once with as many threads as the machine has cores (torch's own default), on a quiet machine and
on one where another job keeps every core busy (a process multiplying 1024² matrices with torch's default
threads, as another training run would). The time of a round is the median of ``round/time_s`` over the rounds
after the first; every configuration is repeated and the repeats are interleaved, so a slow minute of the
machine falls on every setting alike. The last column is each setting's time over the best one of its
condition (1.00 is the fastest).

    python benchmarks/speed/threads.py                      # 3 workloads × 2 conditions × 2 settings × 3 repeats
    python benchmarks/speed/threads.py --reduced            # what CI runs: digits only, 2 rounds, 1 repeat
    python benchmarks/speed/threads.py --workloads digits_cnn --repeats 5
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUIET = ["--trainer.logger=csv", "--trainer.enable_progress_bar=false", "--trainer.checkpoint_every=1000"]

#: name → (config and overrides, rounds, reduced rounds)
WORKLOADS = {
    # (b) README command 1: the 2-conv CNN on the digits, 10 clients a round, F = 20, batch 10
    "digits_cnn": (["--config", "conf/digits/fedavg.yaml"], 6, 2),
    # (a) Synthetic(1,1), MLP 60→128→256→10, 10 clients a round, F = 20, batch 10
    "synthetic_mlp": (["--config", "conf/fedproto/synthetic/fedavg_delta0.yaml"], 6, 2),
    # (c) DeepLab-V3+ (MobileNet-V2) on 64×64 scenes: 1,000 scenes over the config's 100 clients, F = 2, batch 16
    "scenes_deeplab": (
        [
            "--config",
            "conf/fedproto/scenes_macro/fedavg_alpha1.yaml",
            "--trainer.callbacks=[]",
            "--data.dataset.init_args.num_samples=1000",
            "--trainer.eval_every=1000",
        ],
        4,
        2,
    ),
}

# Another job: matrix products on torch's default threads, for as long as the benchmark that started it lives.
LOAD = (
    "import os, torch\nparent = os.getppid()\na = torch.randn(1024, 1024)\nwhile os.getppid() == parent:\n    a @ a\n"
)


@contextmanager
def condition(busy: bool):
    """A machine with another job on every core (``busy``), or as it is."""
    if not busy:
        yield
        return
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    load = subprocess.Popen([sys.executable, "-c", LOAD], env=env)
    time.sleep(2.0)  # torch imported, the load running
    try:
        yield
    finally:
        load.kill()
        load.wait()


def round_seconds(workload: str, threads: int, reduced: bool) -> float:
    """Median seconds of the rounds after the first of one run with ``threads`` intra-op threads."""
    flags, rounds, reduced_rounds = WORKLOADS[workload]
    rounds = reduced_rounds if reduced else rounds
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["WANDB_MODE"] = "disabled"
    with tempfile.TemporaryDirectory(prefix="fedlight-threads-") as root:
        command = [
            sys.executable, "-m", "fedlight", "fit", *flags, *QUIET, f"--trainer.rounds={rounds}",
            f"--trainer.threads={threads}", f"--trainer.default_root_dir={root}", "--trainer.name=run",
        ]  # fmt: skip
        subprocess.run(command, check=True, cwd=REPO, env=env, capture_output=True)
        with open(Path(root) / "run" / "version_0" / "metrics.csv") as file:
            times = [float(row["round/time_s"]) for row in csv.DictReader(file)]
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reduced", action="store_true", help="digits only, 2 rounds, 1 repeat")
    args = parser.parse_args()
    if args.reduced:
        args.workloads, args.repeats = ["digits_cnn"], 1
    cores = os.cpu_count() or 1
    settings = sorted({1, cores})
    print(f"{cores} cores; load average before the runs {os.getloadavg()[0]:.2f}")
    times: dict[tuple[str, str, int], list[float]] = {}
    for repeat in range(args.repeats):
        for workload in args.workloads:
            for busy in (False, True):
                with condition(busy):
                    for threads in settings if repeat % 2 == 0 else settings[::-1]:
                        seconds = round_seconds(workload, threads, args.reduced)
                        times.setdefault((workload, "busy" if busy else "quiet", threads), []).append(seconds)
                        print(
                            f"repeat {repeat}: {workload} {'busy' if busy else 'quiet'}, {threads} thread(s): "
                            f"{seconds:.3f} s/round, load {os.getloadavg()[0]:.2f}",
                            flush=True,
                        )
    print(f"load average after the runs {os.getloadavg()[0]:.2f}; s/round: median (min–max) of {args.repeats}")
    print(f"{'workload':<16}{'machine':<8}{'threads':>8}{'s/round':>10}{'spread':>16}{'/best':>8}")
    for workload in args.workloads:
        for machine in ("quiet", "busy"):
            medians = {t: statistics.median(times[(workload, machine, t)]) for t in settings}
            best = min(medians.values())
            for threads in settings:
                values = times[(workload, machine, threads)]
                spread = f"{min(values):.3f}–{max(values):.3f}"
                print(
                    f"{workload:<16}{machine:<8}{threads:>8}{medians[threads]:>10.3f}{spread:>16}"
                    f"{medians[threads] / best:>8.2f}"
                )


if __name__ == "__main__":
    main()
