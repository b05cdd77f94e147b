import pytest
import torch
from torchmetrics.classification import MulticlassConfusionMatrix, MulticlassJaccardIndex

from fedlight.metrics.functional.segmentation import confusion_matrix, intersection_over_union, mean_iou


def _random_maps(seed: int, classes: int = 5, shape=(4, 9, 11)):
    generator = torch.Generator().manual_seed(seed)
    target = torch.randint(0, classes, shape, generator=generator)
    target[torch.rand(shape, generator=generator) < 0.1] = 255
    preds = torch.where(torch.rand(shape, generator=generator) < 0.6, target % classes, 0)
    preds = torch.where(torch.rand(shape, generator=generator) < 0.2, torch.randint(0, classes, shape), preds)
    return preds, target


def test_hand_computed_miou():
    # 2×3 image: true [[0, 0, 1], [1, 2, 255]], predicted [[0, 1, 1], [1, 1, 0]]
    preds = torch.tensor([[[0, 1, 1], [1, 1, 0]]])
    target = torch.tensor([[[0, 0, 1], [1, 2, 255]]])
    confmat = confusion_matrix(preds, target, num_classes=3)[0]
    assert confmat.tolist() == [[1, 1, 0], [0, 2, 0], [0, 1, 0]]
    # IoU: class 0 = 1/2, class 1 = 2/(2 + 2) = 1/2, class 2 = 0/1 = 0
    assert intersection_over_union(confmat).tolist() == [0.5, 0.5, 0.0]
    assert mean_iou(confmat).item() == pytest.approx(1 / 3)
    assert mean_iou(confmat, include_background=False).item() == pytest.approx(1 / 4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_torchmetrics(seed):
    preds, target = _random_maps(seed)
    reference = MulticlassJaccardIndex(num_classes=5, average="macro", ignore_index=255)
    reference_confmat = MulticlassConfusionMatrix(num_classes=5, ignore_index=255)
    for p, t in zip(preds, target, strict=True):  # accumulated image by image
        reference.update(p[None], t[None])
        reference_confmat.update(p[None], t[None])
    confmat = confusion_matrix(preds, target, num_classes=5)[0]
    assert torch.equal(confmat, reference_confmat.compute().long())
    assert mean_iou(confmat).item() == pytest.approx(reference.compute().item(), abs=1e-6)


def test_absent_classes_are_left_out_not_counted_as_zero():
    preds = torch.tensor([[0, 0, 1, 1]])
    target = torch.tensor([[0, 0, 1, 1]])
    confmat = confusion_matrix(preds, target, num_classes=4)[0]
    assert intersection_over_union(confmat)[2:].isnan().all()
    assert mean_iou(confmat).item() == 1.0


def test_groups_split_the_counts():
    preds, target = _random_maps(3)
    groups = torch.tensor([0, 2, 0, 1])
    per_group = confusion_matrix(preds, target, 5, groups=groups, num_groups=3)
    assert torch.equal(per_group[0], confusion_matrix(preds[[0, 2]], target[[0, 2]], 5)[0])
    assert torch.equal(per_group[1], confusion_matrix(preds[[3]], target[[3]], 5)[0])
    assert torch.equal(per_group.sum(0), confusion_matrix(preds, target, 5)[0])
