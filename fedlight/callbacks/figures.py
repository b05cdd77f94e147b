"""What the figure-drawing callbacks share: the check that matplotlib, an optional dependency, is there, and the
names of the classes they label."""

from __future__ import annotations

from fedlight.data.labels import MACRO_CLASSES, VOC_CLASSES


def class_names(num_classes: int) -> tuple[str, ...]:
    """Pascal VOC's names for 21 classes, the macro classes' for 5, else the class numbers."""
    return {21: VOC_CLASSES, 5: MACRO_CLASSES}.get(num_classes, tuple(str(c) for c in range(num_classes)))


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
