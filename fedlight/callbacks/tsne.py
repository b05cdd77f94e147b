"""A t-SNE map of the final global model's features, coloured by class: MO-FedProto's Fig. S3.

After the last round, the features of the global model (``forward_features``) on the global test set (the union
of the clients' held-out splits where the data have no test set of their own) are embedded in 2-D with
scikit-learn's t-SNE. Every test image of a classifier is a point; for a segmentation model every
decoder-feature pixel is a point, labelled by the label map downsampled by nearest neighbour (as the
prototypes, D5); void pixels are dropped and, as in Fig. S3, background too unless asked for. When there are
more than ``max_points`` points (2,000: t-SNE's cost grows with their square), that many are drawn uniformly
from all of them with the run's seed, as the batches pass, so memory stays bounded for dense models too;
``max_images`` reads only the first images of the test set.

Writes ``<run_dir>/tsne.png`` (each class in its colour of the run, :func:`~fedlight.callbacks.figures.class_colours`,
and a legend naming the classes after the data) and ``tsne.npz`` (the embedding and the labels, to compare runs),
and logs the picture to W&B as ``analysis/tsne``. Drawing needs matplotlib (``pip install -e ".[plots]"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedlight.callbacks.base import RoundCallback, features_problem
from fedlight.callbacks.figures import class_colours, class_names, matplotlib_problem
from fedlight.data.labels import IGNORE_INDEX
from fedlight.errors import ConfigError
from fedlight.metrics.functional.prototypes import dense_features_and_labels

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from fedlight.context import RunContext


class FeatureTSNE(RoundCallback):
    """Saves and logs a 2-D t-SNE of the final model's features.

    Args:
        max_images: read only the first this many images of the global test set; null reads all of them.
        max_points: points embedded at most (t-SNE's cost grows with their square): every test sample (pixel, for
            a segmentation model) when there are fewer, else a uniform draw of this many, seeded by the run.
        include_background: keep background pixels (class 0); Fig. S3 leaves them out.
        perplexity: t-SNE perplexity (lowered to fit when there are few points).
    """

    def __init__(
        self,
        max_images: int | None = None,
        max_points: int = 2000,
        include_background: bool = False,
        perplexity: float = 30.0,
    ) -> None:
        problems = []
        if max_images is not None and max_images < 1:
            problems.append(f"Expected FeatureTSNE max_images ≥ 1 or null (the whole test set), got {max_images}.")
        if max_points < 3:
            problems.append(f"Expected FeatureTSNE max_points ≥ 3, got {max_points}.")
        if problems:
            raise ConfigError(*problems)
        self.max_images = max_images
        self.max_points = max_points
        self.include_background = include_background
        self.perplexity = perplexity

    def check(self, module, datamodule) -> list[str]:
        name = "fedlight.callbacks.FeatureTSNE"
        return features_problem(name, module) + matplotlib_problem(name)

    def on_fit_end(self, context: RunContext) -> None:
        """Embeds and draws the final model's features (rank 0)."""
        if context.rank != 0 or context.run_dir is None:
            return
        features, labels = self._features(context)
        from sklearn.manifold import TSNE

        perplexity = min(self.perplexity, (len(labels) - 1) / 3)
        embedding = TSNE(2, perplexity=perplexity, init="pca", random_state=context.seed).fit_transform(features)
        np.savez(context.run_dir / "tsne.npz", embedding=embedding, labels=labels)
        path = context.run_dir / "tsne.png"
        tsne_figure(embedding, labels, class_names(context.datamodule), context.name).savefig(path, dpi=110)
        context.log_images({"analysis/tsne": [str(path)]}, step=context.rounds)

    @torch.no_grad()
    def _features(self, context: RunContext) -> tuple[np.ndarray, np.ndarray]:
        """``[M, D]`` features and ``[M]`` labels of the kept points, in test-set order.

        Every point gets a uniform random key as it is read and the ``max_points`` smallest keys are kept: a
        uniform draw without replacement from all points, holding no more than one batch beyond them.
        """
        module, precision = context.global_module(), context.precision
        rng = np.random.default_rng(context.seed)
        features, labels, keys = [], [], []
        images_left = self.max_images  # None: every test image
        for x, y, _ in context.datamodule.test_batches():
            if images_left is not None:
                x, y = x[:images_left], y[:images_left]
                images_left -= len(x)
            with precision.forward_context():
                batch_features = module.net.forward_features(precision.convert_input(x)).float()
            if batch_features.ndim == 4:  # dense: every feature pixel is a point
                batch_features, y = dense_features_and_labels(batch_features, y)
                keep = (y != IGNORE_INDEX) & ((y != 0) | self.include_background)
                batch_features, y = batch_features[keep], y[keep]
            features.append(batch_features.cpu().numpy())
            labels.append(y.cpu().numpy())
            keys.append(rng.random(len(y)))
            if sum(len(k) for k in keys) > self.max_points:
                features, labels, keys = _smallest_keys(features, labels, keys, self.max_points)
            if images_left == 0:
                break
        return np.concatenate(features), np.concatenate(labels)


def _smallest_keys(
    features: list[np.ndarray], labels: list[np.ndarray], keys: list[np.ndarray], count: int
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """The ``count`` points with the smallest keys, in their order, as one-element lists."""
    all_keys = np.concatenate(keys)
    kept = np.sort(np.argpartition(all_keys, count - 1)[:count])
    return [np.concatenate(features)[kept]], [np.concatenate(labels)[kept]], [all_keys[kept]]


def tsne_figure(embedding: np.ndarray, labels: np.ndarray, names: Sequence[str], title: str = "") -> Figure:
    """The 2-D embedding ``[M, 2]`` as a scatter plot with a legend, each class in its run colour.

    Args:
        embedding: ``[M, 2]`` the points.
        labels: ``[M]`` each point's class.
        names: the names of the run's C classes; C decides the palette
            (:func:`~fedlight.callbacks.figures.class_colours`).
        title: added to the figure's title.
    """
    from matplotlib.figure import Figure

    colours = class_colours(len(names))
    size = 30.0 if len(labels) <= 300 else 5.0  # few points are drawn large enough to see their colour
    figure = Figure(figsize=(7.5, 6), layout="constrained")
    axis = figure.subplots()
    for c in np.unique(labels):
        points = embedding[labels == c]
        axis.scatter(points[:, 0], points[:, 1], s=size, color=colours[c], label=names[c], linewidths=0)
    axis.legend(
        loc="center left", bbox_to_anchor=(1.0, 0.5), markerscale=max(1.0, 20.0 / size) ** 0.5,
        fontsize="small", ncol=1 if len(np.unique(labels)) <= 12 else 2, title="class",
    )  # fmt: skip
    axis.set_xticks([])
    axis.set_yticks([])
    axis.set_title(f"t-SNE of the final features  {title}".strip())
    return figure
