"""What a run prints: a start line, its progress and an end summary.

On a terminal, progress is tqdm's bars over rounds and over the clients of a round. Anywhere else (a CI log,
a SLURM output file, ``--trainer.enable_progress_bar=false``) bars would write carriage returns and escape
codes, one line per client; instead one plain line is printed every round (every ⌈T/50⌉ rounds for longer
runs, and always for the last). A pseudo-terminal that reports no size (``script`` without a terminal, some CI
runners) counts as no terminal: tqdm draws nothing at zero columns. Only rank 0 prints.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO, TypeVar

from tqdm.auto import tqdm

from fedlight.context import due

T = TypeVar("T")

#: Metrics shown in round lines and the summary, in this order, when the run has them. A rule that routes samples to
#: cluster models (LADD) reports the routed scores, so they sit right after the global model's, followed by the mean
#: of the test groups' mIoU where the test set is scored by group; a differentially private rule's ε so far closes
#: the line.
SHOWN = (
    "train/loss", "test/acc", "test/miou", "test/routed/acc", "test/routed/miou", "test/group_mean/miou", "test/loss",
    "clients/acc",
    "clients/miou", "clients/routed/miou", "clients/personal/acc", "clients/personal/miou", "test/personal/acc",
    "test/personal/miou", "dp/epsilon",
)  # fmt: skip
#: The few of them a progress bar has room for.
SHOWN_ON_BAR = ("train/loss", "test/acc", "test/miou", "test/routed/miou")


def format_metrics(metrics: dict[str, float], keys: Iterable[str] = SHOWN) -> str:
    """``key value`` pairs for the keys present and finite.

    >>> format_metrics({"test/acc": 0.8125, "train/loss": 0.5, "round": 3.0})
    'train/loss 0.5  test/acc 0.8125'
    """
    shown = [f"{key} {metrics[key]:.4g}" for key in keys if key in metrics and math.isfinite(metrics[key])]
    return "  ".join(shown)


def counted(number: int, noun: str) -> str:
    """``number`` and ``noun``, plural unless it is one.

    >>> counted(1, "round"), counted(3, "round"), counted(0, "round")
    ('1 round', '3 rounds', '0 rounds')
    """
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def shown(path: Path | None) -> Path | None:
    """``path`` as the console shows it: relative to the working folder when inside it, so a resumed run (whose
    folder the checkpoint records in full) names it as the fresh run did.

    >>> str(shown(Path.cwd() / "runs" / "a" / "version_0")), str(shown(Path("/elsewhere/x")))
    ('runs/a/version_0', '/elsewhere/x')
    """
    if path is None or not path.is_absolute():
        return path
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def drawable(stream: TextIO) -> bool:
    """Whether progress bars can be drawn on ``stream``: a terminal that reports a width."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (OSError, ValueError, AttributeError):  # closed, or a stand-in without a file descriptor
        return False


class RunConsole:
    """Prints a run's start, progress and end.

    Args:
        enabled: whether this process prints (rank 0).
        progress_bar: the user's ``enable_progress_bar``; bars also need a terminal.
        out: where lines go (standard output by default).
        terminal: whether bars can be drawn (by default: standard error is a terminal).
    """

    def __init__(
        self, enabled: bool, progress_bar: bool, out: TextIO | None = None, terminal: bool | None = None
    ) -> None:
        self.enabled = enabled
        self.out = out or sys.stdout
        terminal = drawable(sys.stderr) if terminal is None else terminal
        self.bars = enabled and progress_bar and terminal
        self._bar: Any = None
        self._started = time.perf_counter()
        self._every = 1

    def print(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:  # above the open bars, which are drawn again below it
            tqdm.write(line, file=self.out)
        else:
            print(line, file=self.out, flush=True)

    def start(
        self,
        *,
        name: str,
        run_dir: Path | None,
        seed: int,
        clients: int,
        per_round: int,
        first: int,
        rounds: int,
        strategy: str,
    ) -> None:
        """The start line; opens the rounds bar on a terminal."""
        self._started = time.perf_counter()
        self._every = max(1, math.ceil(rounds / 50))
        resumed = f", resuming at round {first + 1}" if first else ""
        self.print(
            f"fedlight: {name} → {shown(run_dir)} | seed {seed} | {strategy}, {per_round} of {clients} clients per "
            f"round, {counted(rounds, 'round')}{resumed}"
        )
        if self.bars:
            self._bar = tqdm(total=rounds, initial=first, desc="rounds", unit="round", dynamic_ncols=True)

    def clients(self, plans: list[T], round_idx: int) -> Iterator[T] | list[T]:
        """The round's clients, behind a nested bar on a terminal."""
        if not self.bars:
            return plans
        return tqdm(plans, desc=f"round {round_idx + 1}", unit="client", leave=False, dynamic_ncols=True)

    def round_end(self, round_idx: int, rounds: int, metrics: dict[str, float]) -> None:
        """Updates the bar, or prints the round's line when it is due."""
        if self._bar is not None:
            self._bar.set_postfix_str(format_metrics(metrics, SHOWN_ON_BAR))
            self._bar.update(1)
        elif due(round_idx, self._every, rounds):
            seconds = metrics.get("round/time_s", math.nan)
            self.print(f"round {round_idx + 1}/{rounds}  {format_metrics(metrics)}  {seconds:.1f} s")

    def end(self, metrics: dict[str, float], run_dir: Path | None, rounds_run: int) -> None:
        """The summary: final metrics, where the run's files are, how to upload an offline W&B run."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        minutes, seconds = divmod(time.perf_counter() - self._started, 60)
        self.print(f"fedlight: {counted(rounds_run, 'round')} in {int(minutes)} min {seconds:.0f} s")
        if metrics:
            self.print(f"  {format_metrics(metrics)}")
        if run_dir is None:
            return
        files = [name for name in ("metrics.csv", "config.yaml", "checkpoints/last.ckpt") if (run_dir / name).exists()]
        self.print(f"  run folder: {shown(run_dir)}" + (f" ({', '.join(files)})" if files else ""))
        if any((run_dir / "wandb").glob("offline-run-*")):
            self.print(f"  W&B (offline): wandb sync {shown(run_dir / 'wandb')}/offline-run-*")
