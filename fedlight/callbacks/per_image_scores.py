"""Every test image's mIoU and pixel accuracy under the final model, for paired tests between runs.

FUSS (Sec. 5.4) tests whether one method beats another with a paired t-test and a Wilcoxon signed-rank test
over the evaluation images: the same images scored by both runs. After the last round this callback scores
the global model on the global test set, image by image, and writes ``<run_dir>/per_image.csv`` with one row
per image, which ``fedlight compare RUN_A RUN_B`` reads.

Scores follow the run's own evaluation. An unsupervised model (``validation_step`` returns ``clusters``) is
scored under one Hungarian match of clusters to classes over the whole test set, the match its ``test/miou``
uses; a supervised one (``preds``) under the identity. An image's mIoU averages the classes present in its
labels or its matched predictions (:func:`~fedlight.metrics.functional.unsupervised.per_image_miou`), its
accuracy is the share of its valid pixels predicted right. A classifier's image (``preds`` of shape ``[B]``) has
accuracy 1 or 0 and no mIoU (NaN): ``fedlight compare --metric acc`` pairs two classifiers' runs.

Each row's ``image`` is the image's position in the test set and a digest of its pixels, so two runs pair
the same images, and runs on different test data cannot be paired by mistake.
"""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedlight.callbacks.base import RoundCallback
from fedlight.metrics.functional.unsupervised import cluster_histogram, hungarian_match, per_image_miou

if TYPE_CHECKING:
    from fedlight.context import RunContext

#: the file the callback writes in the run folder.
PER_IMAGE_FILE = "per_image.csv"


def image_id(position: int, image: torch.Tensor) -> str:
    """``<position>-<first 10 hex digits of the SHA-1 of the image's float32 pixels>``."""
    digest = hashlib.sha1(image.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:10]
    return f"{position:06d}-{digest}"


@torch.no_grad()
def per_image_scores(module, batches: Iterable, num_classes: int, precision=None, ignore_index: int = 255) -> dict:
    """Ids, mIoU and accuracy ``[N]`` of every image of ``batches`` (``(x, y, …)``) under ``module``.

    Args:
        module: a client module in eval mode whose ``validation_step`` returns ``target`` and ``clusters``
            (unsupervised: Hungarian-matched over all images) or ``preds`` (class indices).
        batches: the evaluation batches, in a fixed order.
        num_classes: C.
        precision: Fabric's precision plugin (None: plain float32).
        ignore_index: label of void pixels.
    """
    ids, maps, targets, unsupervised = [], [], [], False
    for batch_idx, batch in enumerate(batches):
        ids += [image_id(len(ids) + i, image) for i, image in enumerate(batch[0])]
        if precision is not None:
            with precision.forward_context():
                out = module.validation_step(precision.convert_input(batch), batch_idx)
        else:
            out = module.validation_step(batch, batch_idx)
        unsupervised = "clusters" in out
        maps.append(out["clusters" if unsupervised else "preds"].cpu())
        targets.append(out["target"].cpu())
    predicted, target = torch.cat(maps), torch.cat(targets)  # [N, H, W], or [N] for a classifier
    if predicted.dim() == 1:
        right = (predicted == target).double()
        return {"image": ids, "miou": np.full(len(ids), np.nan), "acc": right.numpy()}
    if unsupervised:
        num_clusters = int(getattr(module, "num_clusters", num_classes))
        assignment = hungarian_match(cluster_histogram(predicted, target, num_clusters, num_classes, ignore_index))
    else:
        assignment = torch.arange(num_classes)
    miou = per_image_miou(predicted, target, assignment, num_classes, ignore_index)
    valid = target != ignore_index
    right = (assignment[predicted] == target) & valid
    acc = right.flatten(1).sum(1).double() / valid.flatten(1).sum(1).clamp(min=1)
    return {"image": ids, "miou": miou.numpy(), "acc": acc.numpy()}


def write_per_image(scores: dict, path: str | Path) -> Path:
    """Writes :func:`per_image_scores`'s output as a CSV with columns ``image,miou,acc``."""
    path = Path(path)
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["image", "miou", "acc"])
        for row in zip(scores["image"], scores["miou"], scores["acc"], strict=True):
            writer.writerow([row[0], *(repr(float(v)) for v in row[1:])])
    return path


def read_per_image(path: str | Path) -> dict:
    """Reads a ``per_image.csv``: ``image`` (list of ids), ``miou`` and ``acc`` (float arrays)."""
    with Path(path).open(newline="") as file:
        rows = list(csv.DictReader(file))
    return {
        "image": [row["image"] for row in rows],
        "miou": np.array([float(row["miou"]) for row in rows]),
        "acc": np.array([float(row["acc"]) for row in rows]),
    }


class PerImageScores(RoundCallback):
    """Writes ``<run_dir>/per_image.csv``: every global test image's mIoU and accuracy after the last round (a
    classifier's: accuracy 0 or 1, no mIoU)."""

    def on_fit_end(self, context: RunContext) -> None:
        if context.rank != 0 or context.run_dir is None:
            return
        module = context.global_module()
        scores = per_image_scores(
            module,
            context.datamodule.test_batches(),
            context.datamodule.num_classes,
            context.precision,
            int(getattr(module, "ignore_index", 255)),
        )
        write_per_image(scores, context.run_dir / PER_IMAGE_FILE)
