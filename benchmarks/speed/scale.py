"""Scale: a round's time as the population grows, with every client's held-out split scored or a sample of them.

Each user holds 12 random 1×8×8 images (10 to train on, 2 held out; the size of scikit-learn's digits), labels
uniform over 10 classes; a global test set of 500 such images is the same for every population. The 2-conv CNN
of workload (b), one local epoch of batch 10 (one step per client), SGD lr 0.01, FedAvg with the cohort sampled
uniformly; one torch thread. For populations of 100, 1,000 and 10,000 users and cohorts of 10, 50 and 200 (a
cohort larger than the population is skipped), runs evaluate after every round:

- ``sampled``: as many users as the cohort (``--trainer.eval_clients=K``) and the test set; every user's split
  only after the last round (``--trainer.full_eval_every=0``);
- ``all``: every user's held-out split and the test set (``--trainer.eval_clients=all``, the default), for the
  cohorts of ``--all-cohorts`` only (50): at 10,000 users its rounds take many seconds each.

A round's time runs from one round's start to the next one's (training, aggregation, evaluation, logging,
checkpoints), measured by a round callback; reported is the median over the rounds between the first (warm-up)
and the last (which scores every user), with their spread, and the last round's time. Beside the wall time, the
process's CPU time over the same rounds: on a shared machine it moves much less with the other jobs' load.
The runs of one population and cohort alternate between the two settings over the repeats, and the 1-minute
load average before each run is kept. Target: at the same cohort, a round at 10,000 users within 10 % of one
at 100 users (at 1,000 users for cohort 200).

    python benchmarks/speed/scale.py                      # 3 populations × 3 cohorts, 6 rounds, 2 repeats
    python benchmarks/speed/scale.py --reduced            # what CI runs: 100 and 1,000 users, cohort 10, 3 rounds
    python benchmarks/speed/scale.py --users 10000 --cohorts 50 --rounds 8 --repeats 2
    python benchmarks/speed/scale.py --resume             # runs already in --out are kept, the others run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import ClassVar

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedlight.callbacks.base import RoundCallback  # noqa: E402
from fedlight.clients import ClassificationClient  # noqa: E402
from fedlight.data import FederatedDataModule  # noqa: E402
from fedlight.data.base import FederatedDataset, LabelledTensors  # noqa: E402
from fedlight.engine.trainer import FederatedTrainer  # noqa: E402
from fedlight.strategies import FedAvg  # noqa: E402

SHAPE, PER_USER, TEST_IMAGES = (1, 8, 8), 12, 500
SETTINGS = ("sampled", "all")


class Population(FederatedDataset):
    """``users`` users with 12 random 1×8×8 images each and a fixed test set of 500; drawn once per size."""

    num_classes = 10
    input_shape = SHAPE
    _drawn: ClassVar[dict[int, LabelledTensors]] = {}  # one draw per population, shared by its runs

    def __init__(self, users: int) -> None:
        self.users = users

    def load_train(self) -> LabelledTensors:
        if self.users not in self._drawn:
            generator = torch.Generator().manual_seed(self.users)
            n = self.users * PER_USER
            x = torch.randn(n, *SHAPE, generator=generator)
            y = torch.randint(10, (n,), generator=generator)
            self._drawn[self.users] = LabelledTensors(x, y, np.repeat(np.arange(self.users), PER_USER))
        return self._drawn[self.users]

    def load_test(self) -> LabelledTensors:
        generator = torch.Generator().manual_seed(2**31 - 1)
        x = torch.randn(TEST_IMAGES, *SHAPE, generator=generator)
        return LabelledTensors(x, torch.randint(10, (TEST_IMAGES,), generator=generator))


class RoundClock(RoundCallback):
    """The wall and CPU time at which each round starts and the run ends, so a round's time includes its logging."""

    def __init__(self) -> None:
        self.marks: list[float] = []
        self.cpu_marks: list[float] = []

    def on_round_start(self, context, round_idx: int) -> None:
        self.marks.append(time.perf_counter())
        self.cpu_marks.append(time.process_time())

    def on_fit_end(self, context) -> None:
        self.on_round_start(context, -1)


def run(users: int, cohort: int, setting: str, rounds: int) -> dict:
    """One run; its rounds' times and the set-up time (data, partition, fingerprint, model)."""
    # int((1 − 1/6) · 12) = 10 images to train on, 2 held out
    data = FederatedDataModule(Population(users), batch_size=10, test_fraction=1 / 6, eval_batch_size=1024)
    torch.manual_seed(0)
    sgd = lambda p: torch.optim.SGD(p, lr=0.01)  # noqa: E731
    model = ClassificationClient(num_classes=10, input_shape=SHAPE, model="cnn", optimizer=sgd)
    clock = RoundClock()
    sampled = {"eval_clients": cohort, "full_eval_every": 0} if setting == "sampled" else {}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fedlight-scale-") as root:
        trainer = FederatedTrainer(
            rounds=rounds, clients_per_round=cohort, local_epochs=1, default_root_dir=root, logger="csv",
            enable_progress_bar=False, threads=1, callbacks=[clock], **sampled,
        )  # fmt: skip
        started = time.perf_counter()
        trainer.fit(model, data, FedAvg())
    return {
        "users": users, "cohort": cohort, "setting": setting, "load": load, "round_s": np.diff(clock.marks).tolist(),
        "round_cpu_s": np.diff(clock.cpu_marks).tolist(), "setup_s": clock.marks[0] - started,
    }  # fmt: skip


def summary(results: list[dict]) -> dict:
    """Median and spread of the middle rounds over every repeat of one configuration, and its last round."""
    middle = [t for r in results for t in r["round_s"][1:-1]]
    return {
        "median": statistics.median(middle), "min": min(middle), "max": max(middle),
        "cpu": statistics.median(t for r in results for t in r["round_cpu_s"][1:-1]),
        "last": statistics.median(r["round_s"][-1] for r in results),
        "setup": statistics.median(r["setup_s"] for r in results),
        "load": [r["load"] for r in results],
    }  # fmt: skip


def report(table: dict[tuple[int, int, str], dict], users: list[int], cohorts: list[int]) -> str:
    lines = [
        "| users | cohort | sampled: round s (min–max) | × smallest population | CPU s | × | "
        "all: round s (min–max) | × smallest population | CPU s | × | last round s (sampled / all) | set-up s | "
        "load avg before each run |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for cohort in cohorts:
        present = [u for u in users if (u, cohort, "sampled") in table]
        for u in present:
            cells, loads = [], []
            for setting in SETTINGS:
                if (u, cohort, setting) not in table:
                    cells += ["—"] * 4
                    continue
                row, base = table[u, cohort, setting], table[present[0], cohort, setting]
                cells += [
                    f"{row['median']:.3f} ({row['min']:.3f}–{row['max']:.3f})",
                    f"{row['median'] / base['median']:.2f}",
                ]
                cells += [f"{row['cpu']:.3f}", f"{row['cpu'] / base['cpu']:.2f}"]
                loads += row["load"]
            last = " / ".join(f"{table[u, cohort, s]['last']:.2f}" for s in SETTINGS if (u, cohort, s) in table)
            setup = table[u, cohort, "sampled"]["setup"]
            lines.append(f"| {u:,} | {cohort} | {' | '.join(cells)} | {last} | {setup:.1f} | "
                         f"{', '.join(f'{x:.1f}' for x in loads)} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--cohorts", type=int, nargs="+", default=[10, 50, 200])
    parser.add_argument("--all-cohorts", type=int, nargs="*", default=[50], help="cohorts also run with 'all'")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per run; the first and last are not timed")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--reduced", action="store_true", help="CI: 100 and 1,000 users, cohort 10, 3 rounds")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "scale.json")
    parser.add_argument("--resume", action="store_true", help="keep the runs already in --out, run the others")
    args = parser.parse_args()
    if args.reduced:
        args.users, args.cohorts, args.all_cohorts, args.rounds, args.repeats = [100, 1000], [10], [10], 3, 1
    if args.rounds < 3:
        parser.error("--rounds must be at least 3: the first and the last round are not timed")
    done = json.loads(args.out.read_text()) if args.resume and args.out.is_file() else []
    runs: dict[tuple[int, int, str], list[dict]] = {}
    for result in done:
        runs.setdefault((result["users"], result["cohort"], result["setting"]), []).append(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for users in args.users:
        for cohort in args.cohorts:
            if cohort > users:
                continue
            settings = SETTINGS if cohort in args.all_cohorts else SETTINGS[:1]
            for repeat in range(args.repeats):
                for setting in settings if repeat % 2 == 0 else settings[::-1]:  # alternate which goes first
                    if len(runs.get((users, cohort, setting), [])) > repeat:
                        continue
                    result = run(users, cohort, setting, args.rounds)
                    runs.setdefault((users, cohort, setting), []).append(result)
                    args.out.write_text(json.dumps([r for results in runs.values() for r in results], indent=1))
                    middle = statistics.median(result["round_s"][1:-1])
                    print(f"{users:>6} users, cohort {cohort:>3}, {setting:>7}: {middle:.3f} s per round", flush=True)
    table = {key: summary(results) for key, results in runs.items()}
    print(f"\ntorch {torch.__version__}, {os.cpu_count()} cores, 1 thread; {args.rounds} rounds × {args.repeats}")
    print("round s: median over the rounds between the first and the last of every repeat; × smallest population: "
          "over the smallest population's median at the same cohort and setting")  # fmt: skip
    print(report(table, args.users, args.cohorts))
    print(f"every run's round times: {args.out}")


if __name__ == "__main__":
    main()
