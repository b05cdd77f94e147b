import pytest
import torch
from torchmetrics.classification import MulticlassJaccardIndex

from fedlight.metrics.segmentation import GroupedSegmentation


def test_pooled_miou_is_one_confusion_matrix_over_all_groups():
    generator = torch.Generator().manual_seed(0)
    target = torch.randint(0, 4, (6, 8, 8), generator=generator)
    preds = torch.where(torch.rand(6, 8, 8, generator=generator) < 0.7, target, 0)
    target[:, 0] = 255
    groups = torch.tensor([0, 0, 1, 2, 2, 2])
    loss = torch.rand(6, generator=generator)
    metric = GroupedSegmentation(num_groups=3, num_classes=4)
    for i in range(6):  # one image at a time, as batches of different clients arrive
        metric.update(loss[i : i + 1], preds[i : i + 1], target[i : i + 1], groups[i : i + 1])
    out = metric.compute()
    reference = MulticlassJaccardIndex(num_classes=4, ignore_index=255)(preds, target)
    assert abs(out["miou"].item() - reference.item()) < 1e-6
    valid = target != 255
    assert abs(out["acc"].item() - (preds == target)[valid].float().mean().item()) < 1e-6
    assert abs(out["loss"].item() - loss.sum().item() / valid.sum().item()) < 1e-6
    jaccard = MulticlassJaccardIndex(num_classes=4, ignore_index=255)
    per_group = [jaccard(preds[groups == g], target[groups == g]) for g in range(3)]
    torch.testing.assert_close(out["group_miou"].float(), torch.stack(per_group))
    assert abs(out["miou_mean"].item() - torch.stack(per_group).mean().item()) < 1e-6


def test_states_merge_like_one_metric():
    generator = torch.Generator().manual_seed(1)
    target = torch.randint(0, 3, (4, 5, 5), generator=generator)
    preds = torch.randint(0, 3, (4, 5, 5), generator=generator)
    group, loss = torch.tensor([0, 1, 0, 1]), torch.ones(4)
    whole, first, second = (GroupedSegmentation(2, 3) for _ in range(3))
    whole.update(loss, preds, target, group)
    first.update(loss[:2], preds[:2], target[:2], group[:2])
    second.update(loss[2:], preds[2:], target[2:], group[2:])
    first.merge_state(second)
    merged, expected = first.compute(), whole.compute()
    for key in ("miou", "miou_fg", "acc", "loss", "iou_2"):
        assert torch.equal(merged[key], expected[key])


def test_class_iou_is_named_after_the_classes_when_they_have_names():
    preds, target = torch.tensor([[0, 1, 1, 2]]), torch.tensor([[0, 1, 2, 2]])
    named = GroupedSegmentation(1, 3, class_names=("background", "traffic light", "Rail-Track"))
    named.update(torch.ones(1), preds, target, torch.zeros(1, dtype=torch.long))
    out = named.compute()
    # IoU by hand: class 0 1/1, class 1 1/2 (one pixel right, one class-2 pixel taken for it), class 2 1/2
    scores = [out[key].item() for key in ("iou_background", "iou_traffic_light", "iou_rail_track")]
    assert scores == [1.0, 0.5, 0.5]
    assert not any(key.startswith("iou_") and key[4:].isdigit() for key in out)
    with pytest.raises(ValueError, match="one distinct name for each of the 3 classes"):
        GroupedSegmentation(1, 3, class_names=("road", "Road", "sky"))
