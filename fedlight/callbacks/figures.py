"""What the figure-drawing callbacks share: the check that matplotlib, an optional dependency, is there."""

from __future__ import annotations

from fedlight.errors import ConfigError


def require_matplotlib(callback: str) -> None:
    """Raises a :class:`~fedlight.errors.ConfigError` naming the fix when matplotlib is not installed.

    Called from constructors, so a config with such a callback fails when it is read, not after training.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            f"{callback} draws its figure with matplotlib, which is not installed: pip install matplotlib "
            "(or pip install -e '.[dev]'), or remove the callback from --trainer.callbacks."
        ) from error
