"""Child processes whose time limits follow their work, not the wall clock.

A test that starts fedlight in other processes (several ranks, a killed run, a sweep's workers) needs a limit, or a
hung process group hangs the suite. A wall-clock limit fails the test on a busy machine although nothing is wrong:
the processes only got less of the CPU. Here the limit is on the work: the CPU seconds that the process and all its
descendants have used (which a busy machine does not inflate), and, for a process that hangs without working (a
deadlocked rendezvous), the wall seconds during which the tree used no CPU at all.

The CPU time is read from Linux's ``/proc``; elsewhere the CPU budget is applied as a wall-clock limit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

#: wall seconds a process tree may use no CPU before it is taken for hung
STALL_S = 180.0
#: seconds between two readings of the tree's CPU time
POLL_S = 2.0


def process_tree(pid: int) -> tuple[set[int], float] | None:
    """``pid`` and its live descendants, and the CPU seconds (user + system) they and the children they reaped have
    used so far; None without ``/proc``."""
    proc = Path("/proc")
    if not (proc / str(pid) / "stat").is_file():
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # the process ended meanwhile
            continue
        child = int(stat.parent.name)
        parents[child] = int(fields[1])
        # utime, stime, cutime, cstime: fields 14–17 of proc(5), 11–14 after the command's closing parenthesis
        times[child] = sum(int(value) for value in fields[11:15]) / ticks
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, of in parents.items() if of == parent and child not in tree]
        tree.update(children)
        frontier += children
    return tree, sum(times.get(member, 0.0) for member in tree)


def _kill_tree(process: subprocess.Popen) -> None:
    """Kills ``process`` and its descendants (which would otherwise keep its pipes open)."""
    found = process_tree(process.pid)
    for pid in sorted(found[0] - {process.pid}) if found else ():
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(pid, signal.SIGKILL)
    process.kill()


def communicate_within(
    process: subprocess.Popen, cpu_budget: float, stall: float = STALL_S
) -> tuple[str | bytes | None, str | bytes | None]:
    """``process.communicate()``, ending the process (and failing) when its tree has used more than ``cpu_budget``
    CPU seconds, or has used none for ``stall`` wall seconds.

    Raises:
        subprocess.TimeoutExpired: after killing the process, with what it wrote so far.
    """
    used, idle_since, started = 0.0, time.monotonic(), time.monotonic()
    while True:
        try:
            return process.communicate(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        found = process_tree(process.pid)
        reading = None if found is None else found[1]
        if reading is None:  # no /proc: the budget as wall seconds
            over, hung = now - started > cpu_budget, False
        else:
            if reading > used:
                used, idle_since = reading, now
            over, hung = used > cpu_budget, now - idle_since > stall
        if over or hung:
            _kill_tree(process)
            output, errors = process.communicate()
            why = f"used {used:.0f} CPU s (budget {cpu_budget:.0f})" if over else f"used no CPU for {stall:.0f} s"
            raise subprocess.TimeoutExpired(process.args, cpu_budget, output=f"{why}\n{output}", stderr=errors)


def run_within(command: list[str], cpu_budget: float, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(command, **kwargs)`` with :func:`communicate_within`'s limits instead of a wall timeout
    (``capture_output`` and ``text`` as ``subprocess.run`` takes them)."""
    if kwargs.pop("capture_output", False):
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
    process = subprocess.Popen(command, **kwargs)
    output, errors = communicate_within(process, cpu_budget)
    done = subprocess.CompletedProcess(command, process.returncode, output, errors)
    if check:
        done.check_returncode()
    return done
