"""Round callbacks as the loop calls them: in order, the first that raises stopping the others, and the error
that ends a run whose callback raised once its rounds are saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedlight import checkpoint as ckpt_io
from fedlight.callbacks.base import CallbackFailed, RoundCallback, saved_rounds
from fedlight.errors import ConfigError

Failure = tuple[RoundCallback, str, Exception]


def call_callbacks(callbacks: list[RoundCallback], hook: str, *args: Any) -> Failure | None:
    """Calls ``hook`` of every round callback in order; returns the first that raised, its hook and error."""
    for callback in callbacks:
        method = getattr(callback, hook, None)
        if callable(method):
            try:
                method(*args)
            except Exception as err:
                return callback, hook, err
    return None


def callback_error(failure: Failure, run_dir: Path | None) -> Exception:
    """The error that ends a run after ``failure``, naming the callback and the checkpoint of ``run_dir`` to resume
    from (a :class:`ConfigError` stays one, with the checkpoint added)."""
    callback, hook, err = failure
    checkpoint = (run_dir / "checkpoints" / ckpt_io.LAST).absolute() if run_dir is not None else None
    saved = ckpt_io.saved_round(checkpoint) if checkpoint is not None and checkpoint.is_file() else None
    if isinstance(err, ConfigError):
        error = ConfigError(*err.problems, f"({type(callback).__name__}: {saved_rounds(checkpoint, saved)}.)")
    else:
        error = CallbackFailed(type(callback).__name__, hook, f"{type(err).__name__}: {err}", checkpoint, saved)
    error.__cause__ = err
    return error
