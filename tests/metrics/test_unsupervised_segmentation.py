import torch

from fedlight.metrics import ProbedUnsupervisedSegmentation, UnsupervisedSegmentation
from fedlight.metrics.functional.unsupervised import cluster_histogram, matched_scores


def _maps(seed: int, shape=(6, 7, 9)):
    generator = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 4, shape, generator=generator)
    # clusters follow the classes through a fixed relabelling, with 30% noise
    clusters = torch.tensor([2, 0, 3, 1])[target]
    noise = torch.rand(shape, generator=generator) < 0.3
    clusters[noise] = torch.randint(0, 4, shape, generator=generator)[noise]
    target[torch.rand(shape, generator=generator) < 0.1] = 255
    return clusters, target


def test_accumulated_batches_equal_one_histogram_of_everything():
    clusters, target = _maps(0)
    metric = UnsupervisedSegmentation(num_clusters=4, num_classes=4)
    for b in range(0, 6, 2):
        metric.update(clusters[b : b + 2], target[b : b + 2])
    out = metric.compute()
    expected = matched_scores(cluster_histogram(clusters, target, 4, 4))
    assert out["assignment"].tolist() == [1, 3, 0, 2]  # the inverse of the relabelling
    torch.testing.assert_close(out["iou"], expected["iou"])
    torch.testing.assert_close(out["miou"], expected["miou"])


def test_states_of_two_clients_merge_into_the_pooled_score():
    clusters, target = _maps(1)
    first, second, pooled = (UnsupervisedSegmentation(4, 4) for _ in range(3))
    first.update(clusters[:2], target[:2])
    second.update(clusters[2:], target[2:])
    pooled.update(clusters, target)
    first.merge_state(second)
    torch.testing.assert_close(first.compute()["miou"], pooled.compute()["miou"])


def test_scores_are_argmaxed_over_the_cluster_axis():
    clusters, target = _maps(2)
    scores = torch.nn.functional.one_hot(clusters, 4).permute(0, 3, 1, 2).float()  # [B, K, H, W]
    from_scores, from_clusters = UnsupervisedSegmentation(4, 4), UnsupervisedSegmentation(4, 4)
    from_scores.update(scores, target)
    from_clusters.update(clusters, target)
    torch.testing.assert_close(from_scores.histogram, from_clusters.histogram)


def test_probed_metric_scores_clusters_by_matching_and_the_probe_directly():
    from fedlight.metrics.unsupervised import ProbedUnsupervisedSegmentation

    target = torch.tensor([[0, 0, 1, 1, 2, 255]])
    clusters = torch.tensor([[2, 2, 0, 0, 1, 1]])  # a perfect partition under the map 2→0, 0→1, 1→2
    linear = torch.tensor([[0, 1, 1, 1, 1, 0]])  # class 0: 1 of 2 right; class 2 never predicted
    metric = ProbedUnsupervisedSegmentation(num_clusters=3, num_classes=3)
    metric.update(clusters=clusters[:, :3], linear=linear[:, :3], target=target[:, :3])
    metric.update(clusters=clusters[:, 3:], linear=linear[:, 3:], target=target[:, 3:])
    out = metric.compute()
    assert out["miou"].item() == 1.0 and out["acc"].item() == 1.0
    # IoU_0 = 1/2, IoU_1 = 2/(2 + 2) (class 0's and class 2's pixels predicted 1), IoU_2 = 0
    assert abs(out["linear/miou"].item() - (0.5 + 0.5 + 0.0) / 3) < 1e-12
    assert out["linear/acc"].item() == 3 / 5


def test_probed_scores_name_each_class_iou_under_the_clusters_match():
    # histogram [[1, 3], [4, 1]]: cluster 0 is class 1 and cluster 1 class 0, so IoU = (4/6, 3/5)
    clusters = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1]])
    target = torch.tensor([[0, 1, 1, 1, 0, 0, 0, 0, 1]])
    metric = ProbedUnsupervisedSegmentation(num_clusters=2, num_classes=2, class_names=("road", "traffic light"))
    metric.update(clusters=clusters, linear=target, target=target)
    out = metric.compute()
    assert abs(out["iou_road"].item() - 4 / 6) < 1e-12 and abs(out["iou_traffic_light"].item() - 3 / 5) < 1e-12
    numbered = ProbedUnsupervisedSegmentation(num_clusters=2, num_classes=2)
    numbered.update(clusters=clusters, linear=target, target=target)
    assert numbered.compute()["iou_0"] == out["iou_road"]
