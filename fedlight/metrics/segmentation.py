"""mIoU, per-class IoU, pixel accuracy and loss per client, from accumulated confusion matrices."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torchmetrics import Metric

from fedlight.metrics.functional.segmentation import confusion_matrix, intersection_over_union, mean_iou, pixel_accuracy


def iou_keys(num_classes: int, class_names: Sequence[str] | None = None) -> tuple[str, ...]:
    """The keys of the classes' IoU: ``iou_<name>``, the name lowercased with every run of characters other than
    letters and digits turned into one underscore (a key stays one column, one W&B panel), or ``iou_<c>`` for
    classes known by number only.

    >>> iou_keys(2), iou_keys(3, ("background", "Traffic light", "food-stuff"))
    (('iou_0', 'iou_1'), ('iou_background', 'iou_traffic_light', 'iou_food_stuff'))
    """
    if class_names is None:
        return tuple(f"iou_{c}" for c in range(num_classes))
    keys = tuple("iou_" + re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") for name in class_names)
    if len(keys) != num_classes or len(set(keys)) != len(keys):
        raise ValueError(
            f"Expected one distinct name for each of the {num_classes} classes, got {list(class_names)} "
            f"(as keys: {list(keys)}). Fix the dataset's class_names."
        )
    return keys


class GroupedSegmentation(Metric):
    """One confusion matrix per group (a client, or one global test set) and the loss summed over pixels.

    The pooled scores come from the sum of the groups' matrices, i.e. from one confusion matrix over all
    pixels of all groups; ``miou_mean`` is the unweighted mean of the groups' own mIoU. States are counts
    and sums, so they merge exactly across batches, clients and processes (decision D9: VOC mIoU with
    background first, foreground mIoU second).

    Args:
        num_groups: number of groups; ``update`` takes each sample's group index.
        num_classes: number of classes C, background (class 0) included.
        ignore_index: label of void pixels, which count nowhere.
        class_names: the names of the classes, which name their IoU (:func:`iou_keys`); None numbers them.

    >>> metric = GroupedSegmentation(num_groups=2, num_classes=3)
    >>> metric.update(loss=torch.tensor([2.0, 1.0]), preds=torch.tensor([[0, 1, 1], [2, 2, 0]]),
    ...               target=torch.tensor([[0, 1, 2], [2, 255, 0]]), group=torch.tensor([0, 1]))
    >>> out = metric.compute()
    >>> round(out["miou"].item(), 4), round(out["miou_fg"].item(), 4), out["acc"].item(), out["loss"].item()
    (0.6667, 0.5, 0.8, 0.6)
    >>> out["iou_1"].item(), out["group_miou"].tolist()
    (0.5, [0.5, 1.0])
    """

    full_state_update = False

    def __init__(
        self,
        num_groups: int,
        num_classes: int,
        ignore_index: int = 255,
        class_names: Sequence[str] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.num_groups, self.num_classes, self.ignore_index = num_groups, num_classes, ignore_index
        self.iou_keys = iou_keys(num_classes, class_names)
        confmat = torch.zeros(num_groups, num_classes, num_classes, dtype=torch.float64)  # [G, C, C]
        self.add_state("confmat", default=confmat, dist_reduce_fx="sum")
        self.add_state("loss_sum", default=torch.zeros(num_groups, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, loss: torch.Tensor, preds: torch.Tensor, target: torch.Tensor, group: torch.Tensor) -> None:
        """Adds ``loss`` [B] (per-image sums over valid pixels), ``preds``, ``target`` [B, H, W], ``group`` [B]."""
        self.confmat += confusion_matrix(preds, target, self.num_classes, self.ignore_index, group, self.num_groups)
        self.loss_sum += torch.bincount(group.long(), weights=loss.double(), minlength=self.num_groups)

    def compute(self) -> dict[str, torch.Tensor]:
        pooled = self.confmat.sum(dim=0)  # [C, C]
        has_pixels = self.confmat.sum(dim=(1, 2)) > 0  # [G]
        group_miou = torch.where(has_pixels, mean_iou(self.confmat), torch.nan)  # [G]
        out = {
            "miou": mean_iou(pooled),
            "miou_fg": mean_iou(pooled, include_background=False),
            "acc": pixel_accuracy(pooled),
            "loss": self.loss_sum.sum() / pooled.sum(),
            "miou_mean": group_miou[has_pixels].mean(),
            "group_miou": group_miou,
        }
        out.update(zip(self.iou_keys, intersection_over_union(pooled), strict=True))
        return out
