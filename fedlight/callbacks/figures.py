"""What the figure-drawing callbacks share: the check that matplotlib, an optional dependency, is there, the
names of the classes they label and the one palette that colours a class alike in every figure of a run.

A class's colour depends only on its index and the run's number of classes C, so the partition summary, the
t-SNE and the entropy maps' label maps of one run give it the same colour (:func:`class_colours`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fedlight.data import FederatedDataModule

#: RGBA of void pixels (label 255) in label maps: black, a colour no class takes.
VOID_COLOUR = (0.0, 0.0, 0.0, 1.0)
_PAPER = (1.0, 1.0, 1.0)  # the figures' background, which no class takes either


def class_names(datamodule: FederatedDataModule) -> tuple[str, ...]:
    """The data's names of classes 0…C−1 for legends; the class numbers where the data have none."""
    names = datamodule.class_names
    return names if names is not None else tuple(str(c) for c in range(datamodule.num_classes))


def class_colours(num_classes: int) -> np.ndarray:
    """``[C, 4]`` RGBA colours in [0, 1], class c's in every figure of a run with C classes.

    matplotlib's qualitative ``tab10`` for up to 10 classes and ``tab20`` for up to 20, whose colours are told
    apart at a glance. Beyond 20 classes (Pascal VOC's 21, Cityscapes' 27) no qualitative map is long enough:
    ``tab20``'s colours come first, then colours picked one at a time from a 16-level RGB grid, each the farthest
    in CIELAB from every colour before it, from black (void) and from white (the paper). The picks are
    deterministic, so a class keeps its colour across figures and runs.

    >>> from matplotlib import colormaps
    >>> bool(np.allclose(class_colours(3), [colormaps["tab10"](c) for c in range(3)]))
    True
    >>> len(np.unique(class_colours(27).round(4), axis=0))
    27
    """
    from matplotlib import colormaps

    if num_classes <= 20:
        cmap = colormaps["tab10" if num_classes <= 10 else "tab20"]
        return np.array([cmap(c) for c in range(num_classes)])
    taken = np.array([colormaps["tab20"](c)[:3] for c in range(20)])  # [20, 3]
    levels = np.linspace(0.0, 1.0, 16)
    grid = np.stack(np.meshgrid(levels, levels, levels, indexing="ij"), axis=-1).reshape(-1, 3)  # [4096, 3]
    grid_lab = _cielab(grid)
    # distance of every candidate to its nearest colour taken so far, void and paper included
    nearest = np.linalg.norm(grid_lab[:, None] - _cielab(np.vstack([taken, VOID_COLOUR[:3], _PAPER]))[None], axis=-1)
    nearest = nearest.min(axis=1)  # [4096]
    picked = []
    for _ in range(num_classes - 20):
        best = int(nearest.argmax())
        picked.append(grid[best])
        nearest = np.minimum(nearest, np.linalg.norm(grid_lab - grid_lab[best], axis=-1))
    rgb = np.vstack([taken, *picked])
    return np.hstack([rgb, np.ones((num_classes, 1))])


def label_map_colours(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """``[..., 4]`` RGBA image of a label map ``[...]``: each class in its :func:`class_colours`, void (255, or any
    label that is no class) in :data:`VOID_COLOUR`."""
    palette = np.vstack([class_colours(num_classes), VOID_COLOUR])  # [C + 1, 4], void last
    return palette[np.where((labels >= 0) & (labels < num_classes), labels, num_classes)]


def _cielab(rgb: np.ndarray) -> np.ndarray:
    """``[N, 3]`` sRGB in [0, 1] → ``[N, 3]`` CIELAB (D65 white), where distances follow perceived differences."""
    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    to_xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]])
    xyz = linear @ to_xyz.T / np.array([0.95047, 1.0, 1.08883])
    delta = 6 / 29
    f = np.where(xyz > delta**3, np.cbrt(xyz), xyz / (3 * delta**2) + 4 / 29)
    return np.stack([116 * f[:, 1] - 16, 500 * (f[:, 0] - f[:, 1]), 200 * (f[:, 1] - f[:, 2])], axis=1)


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
