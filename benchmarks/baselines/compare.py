"""The baselines against FedAvg over seeds: every config of ``conf/baselines/<protocol>/`` on its protocol.

Each ``conf/baselines/<protocol>/<rule>.yaml`` is one rule on one protocol (``digits``: scikit-learn's 8×8 digits
under FedProx's MNIST protocol; ``synthetic``: Synthetic(1,1)); ``fedavg.yaml`` is the reference. Every rule runs once
per seed as a ``python -m fedlight fit --config <yaml> --seed_everything <s>`` subprocess (one thread each, ``--jobs``
at a time), so a seed gives every rule the same data, partition, initial model and client draws where the rules
sample alike. A run whose ``metrics.csv`` already holds all its rounds is skipped, so an interrupted comparison goes
on where it stopped.

The score is the global model's accuracy on the union of the clients' held-out splits (``clients/acc``), averaged
over the last ``--last`` rounds (5 by default; the FedOpt authors tuned on the mean of the last 100), since with few
classes per client the global model's accuracy swings from round to round. The table gives, per rule, its mean ±
sample sd over seeds, and the paired difference from FedAvg seed by seed with its standard error
(``benchmarks/paired.py``): "not resolved" when the mean difference lies within two standard errors of 0, i.e.
within the spread the seeds show.

Commands (from the repository root)::

    python benchmarks/baselines/compare.py --reduced                       # CI: digits, 2 seeds, 2 rounds of F = 1
    python benchmarks/baselines/compare.py                                 # full size: both protocols, 3 seeds
    python benchmarks/baselines/compare.py --protocols digits --rounds 30 --rules fedavg fedadam

``<out>/<protocol>.md`` holds each protocol's table (``<out>`` is ``benchmarks/baselines/out/<size>`` by default), the
runs ``<out>/runs/<protocol>_<rule>_seed<s>/``. The script exits with status 1 if a run failed, after writing the
tables from the runs that finished.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from paired import paired  # noqa: E402
from run_files import latest_version, read_metrics, run_options  # noqa: E402

CONF = REPO / "conf" / "baselines"
REFERENCE = "fedavg"
METRIC = "clients/acc"
#: a personalised rule's score of each client's own model (kNN-Per: its interpolated predictor), compared in a second
#: table with FedAvg's global model
PERSONAL = ("clients/personal/acc", "knn_per/acc")
#: The reduced size CI runs: a few seconds of training per run, most of a run is starting Python.
REDUCED = {"protocols": ["digits"], "seeds": [0, 1], "rounds": 2, "overrides": ["--trainer.local_epochs=1"]}


@dataclass(frozen=True)
class Run:
    """One ``fedlight fit``: a rule's config on a protocol with one seed."""

    protocol: str
    rule: str
    seed: int
    rounds: int | None  # None: the config's own
    overrides: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.protocol}_{self.rule}_seed{self.seed}"

    @property
    def config(self) -> Path:
        return CONF / self.protocol / f"{self.rule}.yaml"


def rules_of(protocol: str) -> list[str]:
    """The rules with a config for ``protocol``: FedAvg first, then by name."""
    names = sorted(path.stem for path in (CONF / protocol).glob("*.yaml"))
    if REFERENCE not in names:
        missing = CONF / protocol / f"{REFERENCE}.yaml"
        raise SystemExit(f"{missing} is missing: it is the reference every rule is compared with.")
    return [REFERENCE] + [name for name in names if name != REFERENCE]


def command(run: Run, root: Path) -> list[str]:
    """The ``fedlight fit`` command line of ``run``, resuming its last attempt if that left a checkpoint."""
    args = [sys.executable, "-m", "fedlight", "fit", "--config", str(run.config), f"--seed_everything={run.seed}"]
    if run.rounds is not None:
        args.append(f"--trainer.rounds={run.rounds}")
    args += [
        *run.overrides,
        *run_options(root, run.name),
    ]
    return args


def scores(root: Path, name: str, metric: str = METRIC) -> list[float]:
    """Per-round ``metric`` of the newest run called ``name`` (rounds that did not evaluate left out)."""
    rows = read_metrics(latest_version(root, name))
    return [row[metric] for row in rows if not math.isnan(row.get(metric, math.nan))]


def own_scores(root: Path, name: str) -> list[float]:
    """What each client is scored with: its own model's ``clients/personal/acc`` (or kNN-Per's ``knn_per/acc``) for a
    personalised rule, the global model's ``clients/acc`` otherwise."""
    for metric in PERSONAL:
        if values := scores(root, name, metric):
            return values
    return scores(root, name)


def is_done(run: Run, root: Path, rounds: int) -> bool:
    return len(read_metrics(latest_version(root, run.name))) >= rounds


def run_all(runs: list[Run], out: Path, jobs: int, rounds_of: dict[str, int]) -> list[str]:
    """Runs every run that is not done, ``jobs`` at a time; returns the failures."""
    root, logs = out / "runs", out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))  # this checkout's fedlight
    pending = [run for run in runs if not is_done(run, root, rounds_of[run.name])]
    for run in runs:
        if run not in pending:
            print(f"  skip      {run.name} (metrics.csv complete)")
    failed, running = [], {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                run = pending.pop(0)
                with (logs / f"{run.name}.log").open("w") as log:
                    process = subprocess.Popen(
                        command(run, root), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
                    )
                running[run] = (process, time.perf_counter())
                print(f"  start     {run.name}", flush=True)
            for run, (process, started) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[run]
                if process.returncode == 0 and is_done(run, root, rounds_of[run.name]):
                    print(f"  done      {run.name} in {time.perf_counter() - started:.0f} s", flush=True)
                else:
                    failed.append(f"{run.name}: exit status {process.returncode}; see {logs / f'{run.name}.log'}")
                    print(f"  FAILED    {failed[-1]}", flush=True)
            time.sleep(0.2)
    except BaseException:  # Ctrl-C or a CI timeout: stop the runs this started
        for process, _ in running.values():
            process.terminate()
        raise
    return failed


def table(finals: dict[str, dict[int, float]], rules: list[str]) -> str:
    """Final accuracy (%) per rule, mean ± sd over seeds, and the paired difference from FedAvg.

    ``finals[rule][seed]`` is a run's final accuracy in [0, 1] (its mean over the last rounds); a seed missing for a
    rule or for FedAvg is left out of that rule's difference.

    >>> print(table({"fedavg": {0: 0.5, 1: 0.6, 2: 0.7}, "x": {0: 0.6, 1: 0.7, 2: 0.8}}, ["fedavg", "x"]))
    | rule | final accuracy (%) | Δ vs FedAvg (pp) | verdict |
    |---|---|---|---|
    | fedavg | 60.00 ± 10.00 (n = 3) | – | – |
    | x | 70.00 ± 10.00 (n = 3) | +10.00 ± 0.00 (se, n = 3) | resolved |
    """
    lines = ["| rule | final accuracy (%) | Δ vs FedAvg (pp) | verdict |", "|---|---|---|---|"]
    reference = finals.get(REFERENCE, {})
    for rule in rules:
        values = [100 * v for v in finals.get(rule, {}).values()]
        if not values:
            lines.append(f"| {rule} | failed | – | – |")
            continue
        sd = f"{statistics.stdev(values):.2f}" if len(values) > 1 else "–"
        cell = f"{statistics.fmean(values):.2f} ± {sd} (n = {len(values)})"
        common = sorted(set(finals[rule]) & set(reference))
        if rule == REFERENCE or len(common) < 2:
            lines.append(f"| {rule} | {cell} | – | {'–' if rule == REFERENCE else 'fewer than 2 paired seeds'} |")
            continue
        diff = paired([100 * (finals[rule][s] - reference[s]) for s in common])
        verdict = "resolved" if diff.resolved else "not resolved"
        lines.append(f"| {rule} | {cell} | {diff.mean:+.2f} ± {diff.se:.2f} (se, n = {diff.n}) | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reduced", action="store_true", help="CI size: digits, 2 seeds, 2 rounds of 1 local epoch")
    parser.add_argument(
        "--protocols", nargs="+", choices=["digits", "synthetic"], help="default: both (reduced: digits)"
    )
    parser.add_argument("--rules", nargs="+", help="config names to run (default: every config of the protocol)")
    parser.add_argument("--seeds", nargs="+", type=int, help="default: 0 1 2 (reduced: 0 1)")
    parser.add_argument("--rounds", type=int, help="override the configs' number of rounds")
    parser.add_argument("--local-epochs", type=int, help="override the configs' local epochs F")
    parser.add_argument("--last", type=int, help="rounds averaged for the final accuracy (default 5; reduced: 1)")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each")
    parser.add_argument("--out", type=Path, help="default: benchmarks/baselines/out/<full|reduced>")
    args = parser.parse_args(argv)
    protocols = args.protocols or (REDUCED["protocols"] if args.reduced else ["digits", "synthetic"])
    seeds = args.seeds or (REDUCED["seeds"] if args.reduced else [0, 1, 2])
    rounds = args.rounds or (REDUCED["rounds"] if args.reduced else None)
    last = args.last or (1 if args.reduced else 5)
    overrides = tuple(REDUCED["overrides"]) if args.reduced else ()
    if args.local_epochs is not None:
        overrides = (*overrides, f"--trainer.local_epochs={args.local_epochs}")
    out = (args.out or REPO / "benchmarks" / "baselines" / "out" / ("reduced" if args.reduced else "full")).resolve()

    # SIGTERM (a CI timeout, kill) raises SystemExit, so that run_all stops the runs it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    runs, rules = [], {}
    for protocol in protocols:
        rules[protocol] = [r for r in rules_of(protocol) if args.rules is None or r in args.rules or r == REFERENCE]
        runs += [Run(protocol, rule, seed, rounds, overrides) for rule in rules[protocol] for seed in seeds]
    rounds_of = {run.name: run.rounds or _config_rounds(run.config) for run in runs}
    failed = run_all(runs, out, args.jobs, rounds_of)

    for protocol in protocols:
        finals, owns = {}, {}
        for rule in rules[protocol]:
            finals[rule], owns[rule] = {}, {}
            for seed in seeds:
                name = Run(protocol, rule, seed, rounds).name
                if values := scores(out / "runs", name):
                    finals[rule][seed] = statistics.fmean(values[-last:])
                if values := own_scores(out / "runs", name):
                    owns[rule][seed] = statistics.fmean(values[-last:])
        shown = rounds or _config_rounds(CONF / protocol / f"{REFERENCE}.yaml")
        setting = f"the last {last} of {shown} rounds, seeds {seeds}"
        setting += f" ({' '.join(overrides)})" if overrides else ""
        summary = f"{protocol}: `{METRIC}` averaged over {setting}.\n\n{table(finals, rules[protocol])}\n"
        personalised = [rule for rule in rules[protocol] if owns[rule] != finals[rule]]
        if personalised:
            summary += (
                f"\n{protocol}, each client scored with its own model (`{PERSONAL[0]}` of the personalised rules, "
                f"`{PERSONAL[1]}` of kNN-Per, `{METRIC}` of the others) over {setting}.\n\n"
                f"{table(owns, rules[protocol])}\n"
            )
        (out / f"{protocol}.md").write_text(summary)
        print(f"\n{summary}")
    print(f"{time.perf_counter() - started:.0f} s wall with {args.jobs} jobs")
    for failure in failed:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failed else 0


def _config_rounds(config: Path) -> int:
    """``trainer.rounds`` of a config, following its ``config:`` chain as ``fedlight fit`` does."""
    import yaml

    data = yaml.safe_load(config.read_text()) or {}
    rounds = (data.get("trainer") or {}).get("rounds") or data.get("trainer.rounds")
    if rounds is None and "config" in data:
        return _config_rounds((config.parent / data["config"]).resolve())
    assert rounds is not None, f"{config} sets no trainer.rounds"
    return int(rounds)


if __name__ == "__main__":
    sys.exit(main())
