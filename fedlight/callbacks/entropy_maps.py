"""Softmax and feature entropy maps of the global model on fixed images: MO-FedProto's Fig. 6 / Fig. S4.

For ``num_images`` images spread evenly over the global test set (the union of the clients' held-out
splits, client after client, when the dataset has none), the same in every round and run, at the rounds
due, the global model W^{t+1} gives:

- its prediction, drawn in Pascal VOC's colour map;
- H_S, the per-pixel entropy of its softmax (:func:`~fedlight.metrics.functional.entropy.softmax_entropy`);
- H_E, the entropy of its decoder features normalised over the channels, upsampled to the input size
  (:func:`~fedlight.metrics.functional.entropy.feature_entropy`, D10).

They are saved as one PNG grid per round, ``<run_dir>/entropy_maps/round_<t>.png`` with one row per image
and the columns input | ground truth | prediction | H_S | H_E (dark: low entropy; H_S scaled to
[0, log C] and H_E to [0, log D], so grids of different rounds and runs compare), logged to W&B as the
image ``analysis/entropy_maps``, and summarised by the mean entropies ``analysis/entropy_softmax`` and
``analysis/entropy_features`` over those images.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from fedlight.callbacks.base import RoundCallback
from fedlight.callbacks.figures import matplotlib_problem
from fedlight.data.labels import voc_colormap
from fedlight.errors import ConfigError
from fedlight.metrics.functional.entropy import feature_entropy, softmax_entropy

if TYPE_CHECKING:
    from fedlight.context import RunContext

# viridis at 0, ¼, ½, ¾, 1 (RGB), linearly interpolated: a perceptually ordered map without a plotting library
_VIRIDIS_AT = np.linspace(0.0, 1.0, 5)
_VIRIDIS = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float64)


class EntropyMaps(RoundCallback):
    """Saves and logs a PNG grid of predictions, H_S and H_E of fixed test images.

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
        last = round_idx == context.rounds - 1
        due = self.every_n_rounds > 0 and (round_idx + 1) % self.every_n_rounds == 0
        if not (due or last):
            return
        x, y = _spread_test_images(context, self.num_images)
        maps = entropy_maps(context, x)
        metrics["analysis/entropy_softmax"] = maps["softmax_entropy"].mean().item()
        metrics["analysis/entropy_features"] = maps["feature_entropy"].mean().item()
        if context.rank != 0 or context.run_dir is None:
            return
        grid = render_grid(x, y, maps["preds"], maps["softmax_entropy"], maps["feature_entropy"], maps["bounds"])
        path = context.run_dir / "entropy_maps" / f"round_{round_idx + 1:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        from PIL import Image

        Image.fromarray(grid).save(path)
        self.last_path = path
        context.log_images({"analysis/entropy_maps": [str(path)]}, step=round_idx)


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


def render_grid(x: Tensor, y: Tensor, preds: Tensor, h_s: Tensor, h_e: Tensor, bounds: Tensor) -> np.ndarray:
    """One row per image: input | ground truth | prediction | H_S | H_E, as ``[N·H, 5·W, 3]`` uint8 RGB.

    Inputs are min–max scaled per image; labels use VOC's colour map (void in its cream colour); H_S and
    H_E are scaled to [0, log C] and [0, log D] and drawn in viridis colours (dark blue low, yellow high).
    """
    palette = voc_colormap()
    x = x.float().cpu()
    low = x.amin(dim=(1, 2, 3), keepdim=True)
    high = x.amax(dim=(1, 2, 3), keepdim=True)
    inputs = ((x - low) / (high - low + 1e-12) * 255).byte().permute(0, 2, 3, 1).numpy()  # [N, H, W, 3]
    if inputs.shape[-1] == 1:
        inputs = inputs.repeat(3, axis=-1)

    def colored(entropy: Tensor, bound: float) -> np.ndarray:
        level = (entropy.cpu().numpy() / bound).clip(0, 1)
        channels = [np.interp(level, _VIRIDIS_AT, _VIRIDIS[:, k]) for k in range(3)]
        return np.stack(channels, axis=-1).round().astype(np.uint8)

    columns = [
        inputs,
        palette[y.cpu().numpy().clip(0, 255)],
        palette[preds.cpu().numpy()],
        colored(h_s, float(bounds[0])),
        colored(h_e, float(bounds[1])),
    ]
    rows = np.concatenate(columns, axis=2)  # [N, H, 5·W, 3]
    return np.ascontiguousarray(rows.reshape(-1, *rows.shape[2:]))
