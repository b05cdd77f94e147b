"""Stopping a run on request: the first SIGINT (Ctrl-C) or SIGTERM asks the run to stop with a checkpoint; a
second one stops it at once.

A round is the unit a checkpoint can hold: a run resumed from it ends with exactly the numbers of an
uninterrupted one. A request that comes while clients train stops the run once the client in training
finishes, without waiting for the others: the unfinished round is dropped and the checkpoint holds the state
it started from. One that comes later in the round (aggregation, evaluation) ends that round with a
checkpoint. SIGTERM is what schedulers (SLURM, Kubernetes) send before they kill a job.
"""

from __future__ import annotations

import io
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from fedlight import checkpoint as ckpt_io
from fedlight.errors import RunInterrupted

if TYPE_CHECKING:
    pass


SIGNALS = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


class StopRequest:
    """Installs the handlers while entered (main thread only); :attr:`requested` names the first signal."""

    def __init__(self, announce: bool = True) -> None:
        self.announce = announce
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for number in SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _handle(self, number: int, frame: FrameType | None) -> None:
        name = SIGNALS[number]
        if self.requested is not None:
            raise KeyboardInterrupt(name)  # the second signal: stop now
        self.requested = name
        if self.announce:
            print(
                f"fedlight: {name} received: stopping once the client in training finishes (the unfinished round "
                f"is dropped and resumes from its start) and writing a checkpoint (send {name} again to stop at once).",
                file=sys.stderr,
                flush=True,
            )

    def flags(self) -> tuple[float, float]:
        """``(SIGINT?, SIGTERM?)`` of this process as numbers, to be summed over processes."""
        return float(self.requested == "SIGINT"), float(self.requested == "SIGTERM")

    def adopt(self, sigint: float, sigterm: float) -> bool:
        """Takes the signal another process received (``flags`` summed over processes) when this one received none,
        so that every process names the same signal; returns whether any process received one."""
        if self.requested is None and sigint + sigterm > 0:
            self.requested = "SIGINT" if sigint > 0 else "SIGTERM"
        return sigint + sigterm > 0

    def agreed(self, fabric: Any) -> bool:
        """Whether any process received a stop signal, so that all of them stop after the same round (one
        all-reduce with several processes); a process that got none records the signal another one received."""
        if fabric.world_size == 1:
            return self.requested is not None
        flags = fabric.all_reduce(torch.tensor(self.flags(), device=fabric.device), reduce_op="sum")
        return self.adopt(*flags.tolist())


def serialised(state: dict[str, Any]) -> bytes:
    """A run state as bytes, kept while a round runs so that a stop between its clients can drop the round."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def round_start(start_state: bytes | None, last: Path) -> dict[str, Any]:
    """The run state a dropped round started from: ``start_state``, now written to ``last`` so that a resume repeats
    the round exactly, or, when None, the one ``last`` holds already."""
    if start_state is None:
        return ckpt_io.load(last)
    state = torch.load(io.BytesIO(start_state), map_location="cpu", weights_only=True)
    ckpt_io.save_atomic(state, last)
    return state


def stopped_at_once(err: KeyboardInterrupt, run_dir: Path | None) -> RunInterrupted:
    """The error of a run stopped at once, by a second signal or by one before the rounds began: it names the run's
    last checkpoint and its round, if one was written."""
    last = (run_dir / "checkpoints" / ckpt_io.LAST).absolute() if run_dir is not None else None
    saved = ckpt_io.saved_round(last) if last is not None else None
    name = str(err.args[0]) if err.args and str(err.args[0]).startswith("SIG") else "SIGINT"
    return RunInterrupted(name, last if saved is not None else None, saved, saved=False)
