"""Stopping a run on request: the first SIGINT (Ctrl-C) or SIGTERM asks the run to stop after the round in
progress, with a checkpoint; a second one stops it at once.

A round is the unit a checkpoint can hold: a run resumed from it ends with exactly the numbers of an
uninterrupted one. SIGTERM is what schedulers (SLURM, Kubernetes) send before they kill a job.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

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
                f"fedlight: {name} received: stopping after the round in progress and writing a checkpoint "
                f"(send it again to stop at once, without saving that round).",
                file=sys.stderr,
                flush=True,
            )
