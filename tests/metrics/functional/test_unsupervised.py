import itertools

import numpy as np
import pytest
import torch
from torchmetrics.classification import MulticlassAccuracy, MulticlassJaccardIndex

from fedlight.metrics.functional.unsupervised import cluster_histogram, hungarian_match, matched_scores, per_image_miou


def _pixels(histogram: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One (cluster, class) pixel per count of a [K, C] histogram."""
    clusters, classes = [], []
    for k, c in itertools.product(*map(range, histogram.shape)):
        clusters += [k] * int(histogram[k, c])
        classes += [c] * int(histogram[k, c])
    return np.array(clusters), np.array(classes)


def _pixelwise_scores(clusters, classes, class_of_cluster, num_classes):
    """IoU per class and accuracy, counting pixels directly; −1 marks an unmatched cluster."""
    preds = np.asarray(class_of_cluster)[clusters]
    iou = []
    for c in range(num_classes):
        union = np.sum((preds == c) | (classes == c))
        iou.append(np.sum((preds == c) & (classes == c)) / union if union else np.nan)
    return np.array(iou), np.mean(preds == classes)


def _brute_force_match(histogram: np.ndarray) -> tuple[list[int], bool]:
    """Class of every cluster (−1: none) maximising the matched pixels over all one-to-one maps; and whether
    that best map is unique."""
    num_clusters, num_classes = histogram.shape
    best, best_total, ties = None, -1, 0
    for classes in itertools.permutations([*range(num_classes), *[-1] * max(0, num_clusters - num_classes)]):
        class_of_cluster = list(classes[:num_clusters])
        total = sum(histogram[k, c] for k, c in enumerate(class_of_cluster) if c >= 0)
        if total > best_total:
            best, best_total, ties = class_of_cluster, total, 0
        elif total == best_total and class_of_cluster != best:
            ties += 1
    return best, ties == 0


def test_hand_computed_scores():
    # clusters are rows: cluster 0 is mostly class 2, cluster 1 class 0, cluster 2 class 1
    histogram = torch.tensor([[1, 0, 6], [5, 1, 0], [0, 3, 2]])
    out = matched_scores(histogram)
    assert out["assignment"].tolist() == [2, 0, 1]
    # class 0: TP 5, cluster 1 holds 6, class 0 has 6 → 5/7; class 1: 3/(5 + 4 − 3); class 2: 6/(7 + 8 − 6)
    np.testing.assert_allclose(out["iou"].numpy(), [5 / 7, 3 / 6, 6 / 9])
    assert out["miou"].item() == pytest.approx((5 / 7 + 3 / 6 + 6 / 9) / 3)
    assert out["acc"].item() == pytest.approx(14 / 18)


@pytest.mark.parametrize("seed", range(6))
def test_square_match_equals_brute_force_and_torchmetrics(seed):
    histogram = np.random.default_rng(seed).integers(0, 40, size=(4, 4))
    class_of_cluster, unique = _brute_force_match(histogram)
    assert unique, "the test cases are chosen with one best match"
    out = matched_scores(torch.from_numpy(histogram))
    assert out["assignment"].tolist() == class_of_cluster
    clusters, classes = _pixels(histogram)
    preds = torch.as_tensor(class_of_cluster)[clusters]
    miou = MulticlassJaccardIndex(num_classes=4, average="macro")(preds, torch.from_numpy(classes))
    acc = MulticlassAccuracy(num_classes=4, average="micro")(preds, torch.from_numpy(classes))
    assert out["miou"].item() == pytest.approx(miou.item(), abs=1e-6)
    assert out["acc"].item() == pytest.approx(acc.item(), abs=1e-6)


@pytest.mark.parametrize(("seed", "shape"), [(0, (5, 3)), (1, (5, 3)), (2, (3, 4)), (3, (2, 4))])
def test_rectangular_match_equals_brute_force(seed, shape):
    histogram = np.random.default_rng(seed).integers(0, 40, size=shape)
    if seed == 2:
        histogram[:, -1] = 0  # a class absent from the labels: its IoU is undefined, not 0
    class_of_cluster, unique = _brute_force_match(histogram)
    assert unique, "the test cases are chosen with one best match"
    out = matched_scores(torch.from_numpy(histogram))
    assert out["assignment"].tolist() == class_of_cluster
    iou, acc = _pixelwise_scores(*_pixels(histogram), class_of_cluster, shape[1])
    np.testing.assert_allclose(out["iou"].numpy(), iou)
    assert out["miou"].item() == pytest.approx(np.nanmean(iou))
    assert out["acc"].item() == pytest.approx(acc)
    assert np.isnan(iou[-1]) == (seed == 2)


def test_fewer_clusters_than_classes_gives_unmatched_present_classes_zero_iou():
    histogram = torch.tensor([[5, 1, 0], [0, 4, 2]])  # class 2 is present but no cluster is left for it
    out = matched_scores(histogram)
    assert out["assignment"].tolist() == [0, 1]
    np.testing.assert_allclose(out["iou"].numpy(), [5 / 6, 4 / 7, 0.0])


def test_histogram_counts_valid_pixels_only():
    clusters = torch.tensor([[[0, 1], [2, 2]], [[1, 1], [0, 2]]])
    target = torch.tensor([[[1, 255], [0, 0]], [[1, 1], [255, 1]]])
    expected = torch.zeros(3, 2, dtype=torch.int64)
    for k, c in zip(clusters.flatten().tolist(), target.flatten().tolist(), strict=True):
        if c != 255:
            expected[k, c] += 1
    assert torch.equal(cluster_histogram(clusters, target, 3, 2), expected)
    with pytest.raises(ValueError, match="labels in"):
        cluster_histogram(clusters, target.clamp(max=2), 3, 2)


def test_per_image_miou_counts_pixels_of_each_image():
    generator = torch.Generator().manual_seed(0)
    clusters = torch.randint(0, 4, (3, 5, 6), generator=generator)
    target = torch.randint(0, 3, (3, 5, 6), generator=generator)
    target[0, 0] = 255
    assignment = hungarian_match(cluster_histogram(clusters, target, 4, 3))
    scores = per_image_miou(clusters, target, assignment, num_classes=3)
    for b in range(3):
        valid = (target[b] != 255).numpy()
        iou, _ = _pixelwise_scores(clusters[b].numpy()[valid], target[b].numpy()[valid], assignment.tolist(), 3)
        assert scores[b].item() == pytest.approx(np.nanmean(iou))
