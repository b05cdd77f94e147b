"""What the figure-drawing callbacks share: the check that matplotlib, an optional dependency, is there."""

from __future__ import annotations


def matplotlib_problem(owner: str) -> list[str]:
    """``[problem]`` when matplotlib is not installed, else ``[]``; a figure callback's :meth:`check` returns it, so a
    config with such a callback fails at set-up with the fix, not after training."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return [
            f'{owner} draws its figure with matplotlib, which is not installed: pip install -e ".[plots]" (or pip '
            "install matplotlib), or remove it from --trainer.callbacks."
        ]
    return []
