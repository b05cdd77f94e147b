"""Time to first round: how long ``fedlight`` takes to start, next to what Python, torch and Lightning take.

Each command runs as a fresh process, ``--repeats`` times, the commands interleaved within a repeat so
that a change of load on the machine touches them all alike:

- ``python -c pass``: the interpreter alone;
- ``python -c "import torch"``: the floor, what any PyTorch program pays before its first line;
- ``python -c "import lightning"``: what Lightning adds (its import pulls torchmetrics, which imports
  torchvision, scipy and matplotlib);
- ``python -c "import fedlight.cli"``: the command's imports;
- ``fedlight fit --help``: cold (no page kept yet: the first call on an installation, served from the pages
  shipped in the package, :mod:`fedlight.help_pages`), warm (every later call), and cold without
  ``OMP_NUM_THREADS=1``; pages kept by :mod:`fedlight.help_cache` go to a folder of the run's own
  (``FEDLIGHT_CACHE_DIR``);
- ``fedlight fit --config conf/digits/fedavg.yaml --trainer.rounds=1``: the config as written (metrics to
  ``metrics.csv`` and to W&B offline), and again with ``--trainer.logger=csv`` to show what W&B's start costs.
  For these runs the parent stamps the start line (set-up done, W&B started) and the end of round 0 (its
  round line) as they reach the pipe.

fedlight's modules are compiled to bytecode first (``compileall``), as an installed package is; with
``PYTHONDONTWRITEBYTECODE`` set and no ``__pycache__``, every run would compile them again (~0.2 s).
For every row the report gives the median wall time, its range, the median CPU time of the process
(user + system; for the round-0 column, of the main process up to that line, read from ``/proc``), and the
ratio to the floor. On a shared machine the wall times grow with the load (printed before and after);
the CPU times much less so.

    python benchmarks/speed/startup.py                # 5 repeats
    python benchmarks/speed/startup.py --repeats 9 --out benchmarks/speed/out
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
HELP_TARGET_S = 1.0
FIRST_ROUND_TARGET_S = 6.0
START_LINE = re.compile(r"^fedlight: .* → ")
ROUND_LINE = re.compile(r"^round 1/\d+ .*\s([0-9.]+) s$")


@dataclass
class Row:
    """One command and its timings over the repeats."""

    name: str
    argv: list[str]
    threads: bool = True  # OMP_NUM_THREADS=1
    fit: bool = False  # a training run: stamp its start and first round lines
    cold: bool = False  # empty the help cache first
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    setup: list[float] = field(default_factory=list)  # start line: set-up done
    round0: list[float] = field(default_factory=list)  # end of round 0
    round0_cpu: list[float] = field(default_factory=list)
    round0_own: list[float] = field(default_factory=list)  # round 0's own time, as the round line prints it


def fedlight_command() -> list[str]:
    """The ``fedlight`` console script of this interpreter's environment, else ``python -m fedlight``."""
    script = Path(sys.executable).with_name("fedlight")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "fedlight"]


def rows(config: str) -> list[Row]:
    py, fl = [sys.executable, "-c"], fedlight_command()
    fit = [*fl, "fit", "--config", config, "--trainer.rounds=1"]
    return [
        Row("python -c pass", [*py, "pass"]),
        Row("import torch (floor)", [*py, "import torch"]),
        Row("import lightning", [*py, "import lightning"]),
        Row("import fedlight.cli", [*py, "import fedlight.cli"]),
        Row("fedlight fit --help, cold", [*fl, "fit", "--help"], cold=True),
        Row("fedlight fit --help, warm (page kept)", [*fl, "fit", "--help"]),
        Row("fedlight fit --help, cold, threads unset", [*fl, "fit", "--help"], threads=False, cold=True),
        Row("digits, first round (W&B offline)", fit, fit=True),
        Row("digits, first round (--trainer.logger=csv)", [*fit, "--trainer.logger=csv"], fit=True),
    ]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a running process so far (Linux), else NaN."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def run_once(row: Row, env: dict[str, str], work: Path) -> None:
    argv = list(row.argv)
    if row.fit:
        argv.append(f"--trainer.default_root_dir={work}")
    env = dict(env)
    if row.cold:
        shutil.rmtree(env["FEDLIGHT_CACHE_DIR"], ignore_errors=True)
    if not row.threads:
        env.pop("OMP_NUM_THREADS", None)
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        for line in proc.stdout:
            now = time.perf_counter() - start
            if row.fit and START_LINE.match(line):
                row.setup.append(now)
            elif row.fit and (match := ROUND_LINE.match(line.rstrip())):
                row.round0.append(now)
                row.round0_cpu.append(cpu_seconds(proc.pid))
                row.round0_own.append(float(match.group(1)))
        _, status, usage = os.wait4(proc.pid, 0)
        row.wall.append(time.perf_counter() - start)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            tail = err.read().decode(errors="replace")[-3000:]
            raise SystemExit(f"{' '.join(argv)} exited with {proc.returncode}:\n{tail}")
    row.cpu.append(usage.ru_utime + usage.ru_stime)
    if row.fit and len(row.round0) != len(row.wall):
        raise SystemExit(f"{' '.join(argv)} printed no 'round 1/…' line; cannot time its first round.")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}" if values else ""


def report(table: list[Row], load: tuple[tuple[float, ...], tuple[float, ...]], repeats: int) -> str:
    floor = median(next(r for r in table if r.name.startswith("import torch")).wall)
    out = [
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"{repeats} runs per row, medians; load average (1, 5, 15 min) before "
        f"{', '.join(f'{x:.2f}' for x in load[0])}, after {', '.join(f'{x:.2f}' for x in load[1])}",
        "",
        f"{'command':<44} {'wall s':>7} {'range':>12} {'CPU s':>6} {'× floor':>8}",
    ]
    for r in table:
        out.append(f"{r.name:<44} {median(r.wall):7.2f} {spread(r.wall):>12} {median(r.cpu):6.2f} "
                   f"{median(r.wall) / floor:8.2f}")  # fmt: skip
        if r.fit:
            out.append(f"{'  set-up done (start line)':<44} {median(r.setup):7.2f} {spread(r.setup):>12}")
            out.append(f"{'  end of round 0 (round line)':<44} {median(r.round0):7.2f} {spread(r.round0):>12} "
                       f"{median(r.round0_cpu):6.2f} {median(r.round0) / floor:8.2f}")  # fmt: skip
            out.append(f"{'  round 0 itself (as printed)':<44} {median(r.round0_own):7.2f} {spread(r.round0_own):>12}")
    cold = median(next(r for r in table if r.name == "fedlight fit --help, cold").wall)
    warm = median(next(r for r in table if r.name.startswith("fedlight fit --help, warm")).wall)
    first = median(next(r for r in table if r.name.startswith("digits, first round (W&B")).round0)
    out += ["", "targets (wall, median):"]
    for what, value, target in (("fedlight fit --help, first call (cold)", cold, HELP_TARGET_S),
                                ("fedlight fit --help, later calls (warm)", warm, HELP_TARGET_S),
                                ("digits config, end of round 0", first, FIRST_ROUND_TARGET_S)):  # fmt: skip
        verdict = "met" if value <= target else f"missed by {value - target:.2f} s ({value / target:.2f}×)"
        out.append(f"  {what}: {value:.2f} s against ≤ {target:.0f} s: {verdict}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per command (median reported)")
    parser.add_argument("--config", default="conf/digits/fedavg.yaml", help="config of the first-round rows")
    parser.add_argument("--out", type=Path, default=HERE / "out", help="folder of startup.json")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")

    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.pop("WANDB_MODE", None)  # the config's own W&B setting (offline), whatever the shell says
    table = rows(args.config)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "fedlight")], check=True)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fedlight-startup-") as work:
        env["FEDLIGHT_CACHE_DIR"] = str(Path(work) / "help-pages")
        for repeat in range(args.repeats):
            for row in table:
                run_once(row, env, Path(work) / f"{repeat}")
            text = report(table, (load_before, os.getloadavg()), repeat + 1)
            save(args.out, table, text)  # after every repeat, so a run cut short keeps what it measured
            print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    print(text)


def save(out: Path, table: list[Row], text: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows_json = [vars(r) for r in table]
    (out / "startup.json").write_text(json.dumps({"rows": rows_json, "report": text}, indent=1))


if __name__ == "__main__":
    main()
