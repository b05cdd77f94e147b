"""Softmax and feature entropy maps of the global model on fixed images: MO-FedProto's Fig. 6 / Fig. S4.

For ``num_images`` images spread evenly over the global test set (the union of the clients' held-out
splits, client after client, when the dataset has none), the same in every round and run, at the rounds
due, the global model W^{t+1} gives:

- its prediction, each class in its colour of the run (:func:`~fedlight.callbacks.figures.class_colours`, shared
  with the partition summary and the t-SNE);
- H_S, the per-pixel entropy of its softmax (:func:`~fedlight.metrics.functional.entropy.softmax_entropy`);
- H_E, the entropy of its decoder features normalised over the channels, upsampled to the input size
  (:func:`~fedlight.metrics.functional.entropy.feature_entropy`, D10).

They are drawn as one figure per round, ``<run_dir>/entropy_maps/round_<t>.png``, with one row per image
and the titled columns input | ground truth | prediction | H_S | H_E: label maps in the run's class colours (void
black) with a legend naming the classes shown, entropies in viridis (dark: low) on fixed scales, H_S on
[0, log C] and H_E on [0, log D], each with its colour bar, so figures of different rounds and runs compare.
The figure is logged to W&B as the image ``analysis/entropy_maps``, and the mean entropies over those images as
``analysis/entropy_softmax`` and ``analysis/entropy_features``. Drawing needs matplotlib
(``pip install -e ".[plots]"``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from fedlight.callbacks.base import RoundCallback
from fedlight.callbacks.figures import VOID_COLOUR, class_colours, class_names, label_map_colours, matplotlib_problem
from fedlight.errors import ConfigError
from fedlight.metrics.functional.entropy import feature_entropy, softmax_entropy

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from fedlight.context import RunContext

#: Column titles of the figure, left to right.
COLUMNS = ("input", "ground truth", "prediction", "softmax entropy $H_S$", "feature entropy $H_E$")


class EntropyMaps(RoundCallback):
    """Saves and logs a figure of predictions, H_S and H_E of fixed test images.

    Args:
        every_n_rounds: draw after every this many rounds, and after the last one; 0 draws after the last
            round only.
        num_images: images shown, evenly spaced over the global test set (the first and the last included).
    """

    def __init__(self, every_n_rounds: int = 0, num_images: int = 4) -> None:
        problems = []
        if every_n_rounds < 0:
            problems.append(f"Expected EntropyMaps every_n_rounds ≥ 0 (0: the last round only), got {every_n_rounds}.")
        if num_images < 1:
            problems.append(f"Expected EntropyMaps num_images ≥ 1, got {num_images}.")
        if problems:
            raise ConfigError(*problems)
        self.every_n_rounds = every_n_rounds
        self.num_images = num_images
        self.last_path: Path | None = None

    def check(self, module, datamodule) -> list[str]:
        from fedlight.clients.segmentation import SegmentationClient

        problems = matplotlib_problem("fedlight.callbacks.EntropyMaps")
        if not isinstance(module, SegmentationClient):
            problems.insert(
                0,
                "fedlight.callbacks.EntropyMaps draws per-pixel entropy maps of a segmentation model "
                f"(fedlight.clients.SegmentationClient), but --model is {type(module).__name__}, whose outputs have "
                "no pixels; remove EntropyMaps from --trainer.callbacks (FeatureTSNE and AggregateMeanMargin also "
                "work for classification).",
            )
        return problems

    def on_round_end(self, context: RunContext, round_idx: int, metrics: dict[str, Any]) -> None:
        """Draws the maps of W^{t+1} when the round is due (every rank computes; rank 0 writes)."""
        if not context.due(round_idx, self.every_n_rounds):
            return
        x, y = _spread_test_images(context, self.num_images)
        maps = entropy_maps(context, x)
        metrics["analysis/entropy_softmax"] = maps["softmax_entropy"].mean().item()
        metrics["analysis/entropy_features"] = maps["feature_entropy"].mean().item()
        if context.rank != 0 or context.run_dir is None:
            return
        figure = entropy_figure(
            x, y, maps["preds"], maps["softmax_entropy"], maps["feature_entropy"], maps["bounds"],
            class_names(context.datamodule), title=f"{context.name}, round {round_idx + 1}",
        )  # fmt: skip
        path = context.run_dir / "entropy_maps" / f"round_{round_idx + 1:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=100)
        self.last_path = path
        context.log_images({"analysis/entropy_maps": [str(path)]}, step=round_idx + 1)


def _spread_test_images(context: RunContext, count: int) -> tuple[Tensor, Tensor]:
    """``count`` evenly spaced images ``[n, 3, H, W]`` and label maps ``[n, H, W]`` of the global test set."""
    data = context.datamodule
    total = len(data.test) if data.test is not None else len(data.held_out_index)
    wanted = torch.from_numpy(np.unique(np.linspace(0, total - 1, min(count, total)).round().astype(np.int64)))
    images, labels, offset = [], [], 0
    for x, y, _ in data.test_batches():
        inside = wanted[(wanted >= offset) & (wanted < offset + len(x))] - offset
        images.append(x[inside.to(x.device)])
        labels.append(y[inside.to(y.device)])
        offset += len(x)
        if offset > wanted[-1]:
            break
    return torch.cat(images), torch.cat(labels)


@torch.no_grad()
def entropy_maps(context: RunContext, x: Tensor) -> dict[str, Tensor]:
    """Prediction ``[N, H, W]``, H_S and H_E ``[N, H, W]`` of the global model, with their upper bounds."""
    module, precision = context.global_module(), context.precision
    with precision.forward_context():
        features = module.net.forward_features(precision.convert_input(x))  # [N, D, h, w]
        logits = module.net.forward_head(features)  # [N, C, H, W]
    return {
        "preds": logits.argmax(dim=1),
        "softmax_entropy": softmax_entropy(logits.float()),
        "feature_entropy": feature_entropy(features.float(), size=tuple(x.shape[-2:])),
        "bounds": torch.tensor([math.log(logits.shape[1]), math.log(features.shape[1])]),  # log C, log D
    }


def entropy_figure(
    x: Tensor,
    y: Tensor,
    preds: Tensor,
    h_s: Tensor,
    h_e: Tensor,
    bounds: Tensor,
    names: Sequence[str],
    title: str = "",
) -> Figure:
    """One row per image: input | ground truth | prediction | H_S | H_E, as a matplotlib figure.

    Inputs are min–max scaled per image; label maps show each class in its run colour
    (:func:`~fedlight.callbacks.figures.class_colours`) and void in black, with a legend naming the classes shown;
    H_S and H_E are drawn in viridis on [0, log C] and [0, log D], each column with a colour bar.

    Args:
        x: ``[N, 3, H, W]`` (or one channel) input images.
        y: ``[N, H, W]`` label maps.
        preds: ``[N, H, W]`` predicted classes.
        h_s, h_e: ``[N, H, W]`` softmax and feature entropies.
        bounds: ``[2]`` log C and log D, the upper ends of the entropy scales.
        names: the names of the run's C classes, in the legend; C decides the palette.
        title: the figure's title.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    num_classes = len(names)
    x = x.float().cpu()
    low = x.amin(dim=(1, 2, 3), keepdim=True)
    high = x.amax(dim=(1, 2, 3), keepdim=True)
    inputs = ((x - low) / (high - low + 1e-12)).permute(0, 2, 3, 1).numpy()  # [N, H, W, channels] in [0, 1]
    labels, predicted = y.cpu().numpy(), preds.cpu().numpy()
    num_rows = len(inputs)
    figure = Figure(figsize=(5 * 2.2 + 1.6, num_rows * 2.2 + 1.4), layout="constrained")
    axes = figure.subplots(num_rows, 5, squeeze=False)
    entropies = [(h_s.cpu().numpy(), float(bounds[0]), "log C"), (h_e.cpu().numpy(), float(bounds[1]), "log D")]
    for row in range(num_rows):
        image = inputs[row]
        axes[row, 0].imshow(image[..., 0] if image.shape[-1] == 1 else image, cmap="gray")
        axes[row, 1].imshow(label_map_colours(labels[row], num_classes))
        axes[row, 2].imshow(label_map_colours(predicted[row], num_classes))
        for column, (values, bound, _) in enumerate(entropies, start=3):
            axes[row, column].imshow(values[row], cmap="viridis", vmin=0.0, vmax=bound)
    for axis in axes.flat:
        axis.set_xticks([])
        axis.set_yticks([])
    for axis, column_title in zip(axes[0], COLUMNS, strict=True):
        axis.set_title(column_title)
    for column, (_, bound, name) in enumerate(entropies, start=3):
        figure.colorbar(axes[0, column].images[0], ax=axes[:, column], label=f"nats, 0 … {name} = {bound:.2f}")
    shown = np.union1d(np.unique(labels), np.unique(predicted))
    colours = class_colours(num_classes)
    handles = [Patch(color=colours[c], label=names[c]) for c in shown if 0 <= c < num_classes]
    if (shown >= num_classes).any() or (shown < 0).any():
        handles.append(Patch(color=VOID_COLOUR, label="void"))
    figure.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 7), fontsize="small")
    if title:
        figure.suptitle(title)
    return figure
