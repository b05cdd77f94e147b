"""Accuracy and loss per client, merged from sufficient statistics."""

from __future__ import annotations

import torch
from torchmetrics import Metric


class GroupedClassification(Metric):
    """Correct counts, sample counts and loss sums per group (a client, or one global test set).

    Pooled accuracy is Σ correct / Σ count over all groups, which equals the sample-weighted mean of
    the groups' accuracies; the unweighted mean over the groups that have samples is reported too.
    States are sums, so they merge across batches, clients and processes exactly.

    Args:
        num_groups: number of groups; ``update`` takes each sample's group index.

    >>> metric = GroupedClassification(num_groups=2)
    >>> metric.update(loss=torch.tensor([1.0, 3.0, 2.0]), preds=torch.tensor([1, 0, 1]),
    ...               target=torch.tensor([1, 1, 1]), group=torch.tensor([0, 0, 1]))
    >>> out = metric.compute()
    >>> round(out["acc"].item(), 4), out["group_acc"].tolist(), out["acc_mean"].item(), out["loss"].item()
    (0.6667, [0.5, 1.0], 0.75, 2.0)
    """

    full_state_update = False

    def __init__(self, num_groups: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_groups = num_groups
        zeros = torch.zeros(num_groups, dtype=torch.float64)
        self.add_state("correct", default=zeros.clone(), dist_reduce_fx="sum")
        self.add_state("count", default=zeros.clone(), dist_reduce_fx="sum")
        self.add_state("loss_sum", default=zeros.clone(), dist_reduce_fx="sum")

    def update(self, loss: torch.Tensor, preds: torch.Tensor, target: torch.Tensor, group: torch.Tensor) -> None:
        """Accumulates per-sample ``loss`` [B], predicted class ``preds`` [B], ``target`` [B], ``group`` [B]."""
        group = group.long()
        self.correct += torch.bincount(group, weights=(preds == target).double(), minlength=self.num_groups)
        self.count += torch.bincount(group, minlength=self.num_groups).double()
        self.loss_sum += torch.bincount(group, weights=loss.double(), minlength=self.num_groups)

    def compute(self) -> dict[str, torch.Tensor]:
        present = self.count > 0
        group_acc = torch.where(present, self.correct / self.count.clamp_min(1), torch.nan)
        return {
            "acc": self.correct.sum() / self.count.sum(),
            "loss": self.loss_sum.sum() / self.count.sum(),
            "acc_mean": group_acc[present].mean(),
            "group_acc": group_acc,
        }
