"""Errors a user can act on, reported by the command line without a traceback."""

from __future__ import annotations

from pathlib import Path


class ConfigError(ValueError):
    """A bad setting or input. Every message names the flag or path and the fix.

    Several problems found together are reported together, one per line.
    """

    #: Raised alike by every process of a run (a set-up check), so that only the first process reports it.
    every_process: bool = False

    def __init__(self, *problems: str) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT (Ctrl-C) or SIGTERM.

    Attributes:
        signal_name: ``SIGINT`` or ``SIGTERM``.
        checkpoint: the checkpoint to resume from, or None when the run wrote none.
        round: the rounds completed and saved in ``checkpoint``.
        saved: whether the run wrote ``checkpoint`` as it stopped (false when a second signal stopped it at once).
        dropped: whether the run stopped between the clients of round ``round + 1`` and dropped that round's work.
    """

    def __init__(
        self, signal_name: str, checkpoint: Path | None, round: int | None, saved: bool, dropped: bool = False
    ) -> None:
        self.signal_name, self.checkpoint, self.round, self.saved = signal_name, checkpoint, round, saved
        self.dropped = dropped
        if checkpoint is None:
            message = f"stopped by {signal_name} before any checkpoint was written"
        elif dropped:
            message = (
                f"stopped by {signal_name} during round {round + 1}, whose unfinished work is dropped; the checkpoint "
                f"{checkpoint} holds the state that round started from"
            )
        elif saved:
            message = f"stopped by {signal_name} after round {round}; the checkpoint {checkpoint} holds it"
        else:
            message = f"stopped at once by a second {signal_name}; the last checkpoint is {checkpoint} (round {round})"
        super().__init__(message)

    def __reduce__(self):  # crosses from a forked rank 0 to the process that launched it
        return type(self), (self.signal_name, self.checkpoint, self.round, self.saved, self.dropped)

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by the signal: 128 + its number."""
        return 128 + {"SIGINT": 2, "SIGTERM": 15}.get(self.signal_name, 2)


def error_line(err: BaseException) -> str:
    """``Type: message`` on one line, from the message's first non-empty line (the type alone for an empty one).

    >>> error_line(RuntimeError("\\nshape mismatch\\nat layer 3"))
    'RuntimeError: shape mismatch'
    >>> error_line(AssertionError())
    'AssertionError'
    """
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
