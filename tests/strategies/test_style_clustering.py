import json

import numpy as np
import pytest
import torch
from sklearn.datasets import make_blobs
from sklearn.metrics import adjusted_rand_score

from fedlight.errors import ConfigError
from fedlight.strategies.clustering import (
    cluster_centroids,
    read_cluster_file,
    route_to_cluster,
    select_style_clusters,
    write_cluster_file,
)


def _silhouette_by_hand(points: np.ndarray, labels: np.ndarray) -> float:
    distances = np.sqrt(((points[:, None] - points[None]) ** 2).sum(-1))
    scores = []
    for i, own in enumerate(labels):
        same = (labels == own) & (np.arange(len(points)) != i)
        if not same.any():
            scores.append(0.0)  # a singleton scores 0 (Rousseeuw)
            continue
        a = distances[i, same].mean()
        b = min(distances[i, labels == other].mean() for other in set(labels.tolist()) - {own})
        scores.append((b - a) / max(a, b))
    return float(np.mean(scores))


@pytest.fixture(scope="module")
def blobs():
    # 27-D like LADD's styles: 5 well-separated style groups of 8 to 12 clients
    styles, truth = make_blobs(
        n_samples=[8, 12, 10, 9, 11], n_features=27, cluster_std=1.0, center_box=(-30, 30), random_state=3
    )
    return styles, truth


def test_silhouette_selection_recovers_the_number_of_style_groups(blobs):
    styles, truth = blobs
    clustering = select_style_clusters(styles, k_range=range(2, 10), seed=0)
    assert clustering.k == 5
    assert adjusted_rand_score(truth, clustering.labels) == 1.0
    assert sorted(clustering.silhouettes) == list(range(2, 10))
    assert max(clustering.silhouettes, key=clustering.silhouettes.get) == 5
    np.testing.assert_allclose(clustering.centroids, cluster_centroids(styles, clustering.labels), atol=1e-9)


def test_the_silhouette_table_is_the_euclidean_silhouette_of_the_kept_partition(blobs):
    styles, _ = blobs
    clustering = select_style_clusters(torch.from_numpy(styles), k_range=[5], seed=1)
    assert clustering.silhouettes[5] == pytest.approx(_silhouette_by_hand(styles, clustering.labels), rel=1e-9)


def test_k_range_errors_name_the_flag():
    styles = np.random.default_rng(0).normal(size=(6, 3))
    with pytest.raises(ConfigError, match=r"non-empty --strategy\.k_range"):
        select_style_clusters(styles, k_range=range(4, 4), flag="--strategy.k_range")
    with pytest.raises(ConfigError, match=r"k_range within 2…5 for 6 clients.*got 4…19"):
        select_style_clusters(styles)  # LADD's 4…19 needs at least 20 clients
    with pytest.raises(ConfigError, match="got 1…3"):
        select_style_clusters(styles, k_range=range(1, 4))


def test_routing_picks_the_nearest_centroid_in_l2():
    centroids = torch.tensor([[0.0, 0.0], [4.0, 0.0], [0.0, 3.0]])
    styles = torch.tensor([[1.9, 0.0], [2.1, 0.0], [0.0, 1.6], [3.0, 3.0], [2.0, 0.0]])
    # distances² to the three centroids: (3.61, 4.41, 12.61), (4.41, 3.61, 13.41), (2.56, 18.56, 1.96),
    # (18, 10, 9), and (4, 4, 13): a tie, which goes to the lower index
    assert route_to_cluster(styles, centroids).tolist() == [0, 1, 2, 2, 0]


def test_routing_separates_styles_at_the_scale_of_dc_terms():
    centroids = np.array([[1e8, 0.0], [1e8 + 10.0, 0.0]])  # raw 1024×512 amplitudes reach ~1e8
    assert route_to_cluster(np.array([[1e8 + 6.0, 1.0], [1e8 + 4.0, -1.0]]), centroids).tolist() == [1, 0]


def test_cluster_file_in_ladd_format_gives_labels_in_partition_order(tmp_path):
    path = tmp_path / "cityscapes_b1_cluster_heterogeneous.json"
    path.write_text(json.dumps({"1": ["erfurt0", "aachen4"], "0": ["cologne5"], "2": ["weimar5", "zurich6"]}))
    labels = read_cluster_file(path, ["aachen4", "cologne5", "erfurt0", "weimar5", "zurich6"])
    assert labels.tolist() == [1, 0, 1, 2, 2]


def test_cluster_files_round_trip(tmp_path):
    ids = [f"client{i}" for i in range(7)]
    labels = np.array([2, 0, 1, 1, 0, 2, 2])
    write_cluster_file(tmp_path / "clusters.json", labels, ids)
    assert json.loads((tmp_path / "clusters.json").read_text())["1"] == ["client2", "client3"]
    np.testing.assert_array_equal(read_cluster_file(tmp_path / "clusters.json", ids[::-1]), labels[::-1])


def test_cluster_file_ids_that_do_not_match_the_partition_are_listed_together(tmp_path):
    path = tmp_path / "clusters.json"
    path.write_text(json.dumps({"0": ["a", "b", "ghost"], "1": ["b", "c"]}))
    with pytest.raises(ConfigError) as error:
        read_cluster_file(path, ["a", "b", "c", "d"])
    assert error.value.problems[:3] == [
        f"Cluster file {path}: 1 client ids are not clients of the partition: ghost.",
        f"Cluster file {path}: 1 client ids appear in more than one cluster: b.",
        f"Cluster file {path}: 1 client ids of the partition are in no cluster: d.",
    ]


def test_cluster_file_with_gaps_in_cluster_ids_is_refused(tmp_path):
    path = tmp_path / "clusters.json"
    path.write_text(json.dumps({"0": ["a"], "2": ["b"]}))
    with pytest.raises(ConfigError, match=r"expected cluster ids 0…1, got \['0', '2'\]"):
        read_cluster_file(path, ["a", "b"])


def test_missing_cluster_file_says_what_it_holds(tmp_path):
    with pytest.raises(ConfigError, match=r"not found\. It maps cluster ids to client ids"):
        read_cluster_file(tmp_path / "nowhere.json", ["a"])
