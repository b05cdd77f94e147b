"""Errors a user can act on, reported by the command line without a traceback."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad setting or input. Every message names the flag or path and the fix.

    Several problems found together are reported together, one per line.
    """

    def __init__(self, *problems: str) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))
