"""Style clusters of clients: LADD's clustering selection (Shenaj et al., WACV 2023, Sec. 4.2 and Alg. 2).

LADD groups the clients by the style of their images (the mean FDA amplitude window s̄_k of
:func:`fedlight.data.style.fda.client_style`) and keeps cluster-specific parameters per group:

- for every H in [m, n) run H-Means N times and keep the partition with the smallest intra-cluster
  distance (the lowest inertia); LADD uses m = 4, n = 20, N = 10;
- keep the H whose partition has the highest mean silhouette score (Euclidean, raw amplitudes);
- at test time an image goes to the cluster whose centroid μ_c is nearest in L2 to its own style.

LADD's experiments read fixed partitions from JSON files mapping a cluster id to its clients' ids
(``{"0": ["aachen0", ...], "1": [...]}``); :func:`read_cluster_file` and :func:`write_cluster_file`
handle that format. Kept apart from :mod:`fedlight.strategies.functional` because it brings
scikit-learn and file input/output along.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fedlight.errors import ConfigError


@dataclass(frozen=True)
class StyleClustering:
    """The selected partition of the clients.

    Attributes:
        labels: ``[K]`` cluster of each client, in 0…k−1.
        centroids: ``[k, D]`` μ_c, the mean style of each cluster's clients.
        k: the number of clusters chosen.
        silhouettes: silhouette score of the best-inertia partition for every k tried.
    """

    labels: np.ndarray
    centroids: np.ndarray
    k: int
    silhouettes: dict[int, float] = field(default_factory=dict)


def select_style_clusters(
    styles: np.ndarray | torch.Tensor,
    k_range: Sequence[int] = range(4, 20),
    n_init: int = 10,
    seed: int = 0,
    flag: str = "k_range",
) -> StyleClustering:
    """Clusters client styles with k-means for each k and keeps the k of highest silhouette (LADD, Alg. 2).

    For each k, scikit-learn's ``KMeans(n_init=N)`` keeps the restart of lowest inertia, i.e. of the
    smallest intra-cluster distance; the silhouette uses Euclidean distances on the raw styles.
    Ties between k go to the k tried first.

    Args:
        styles: ``[K, D]`` one style per client (27-D for LADD's 3×3 window).
        k_range: the numbers of clusters to try, H ∈ [m, n): ``range(4, 20)`` in LADD.
        n_init: N, k-means restarts per k.
        seed: seeds the k-means initialisations.
        flag: the option that set ``k_range``, named in errors.

    Returns:
        The chosen partition, its centroids and the silhouette of every k tried.

    Raises:
        ConfigError: when ``k_range`` is empty or asks for a k outside 2…K−1, where the silhouette is defined.

    >>> styles = np.array([[0.0], [0.1], [10.0], [10.1], [20.0], [20.1]])
    >>> clustering = select_style_clusters(styles, k_range=range(2, 5))
    >>> clustering.k, [round(clustering.silhouettes[k], 2) for k in (2, 3, 4)]
    (3, [0.66, 0.99, 0.66])
    """
    from sklearn.cluster import KMeans  # here, not at import: scikit-learn costs ~1 s per process
    from sklearn.metrics import silhouette_score

    styles = np.asarray(styles, dtype=np.float64)
    assert styles.ndim == 2, f"expected [K, D] styles, got shape {styles.shape}"
    num_clients = styles.shape[0]
    ks = list(k_range)
    if not ks:
        raise ConfigError(f"Expected a non-empty {flag}, the numbers of style clusters to try (LADD: 4 to 19).")
    if min(ks) < 2 or max(ks) > num_clients - 1:
        raise ConfigError(
            f"Expected every k in {flag} within 2…{num_clients - 1} for {num_clients} clients (the silhouette "
            f"needs 2 ≤ k < K), got {min(ks)}…{max(ks)}. Lower the largest k or use more clients."
        )
    best, silhouettes = None, {}
    for k in ks:
        kmeans = KMeans(n_clusters=k, n_init=n_init, random_state=seed).fit(styles)
        silhouettes[k] = float(silhouette_score(styles, kmeans.labels_, metric="euclidean"))
        if best is None or silhouettes[k] > silhouettes[best[0]]:
            best = (k, kmeans)
    k, kmeans = best
    return StyleClustering(
        labels=kmeans.labels_.astype(np.int64),
        centroids=kmeans.cluster_centers_,
        k=k,
        silhouettes=silhouettes,
    )


def cluster_centroids(styles: np.ndarray | torch.Tensor, labels: np.ndarray | Sequence[int]) -> np.ndarray:
    """Returns μ_c, the mean style of each cluster's clients, e.g. for a partition read from a file.

    Args:
        styles: ``[K, D]`` client styles.
        labels: ``[K]`` cluster of each client, every cluster 0…C−1 non-empty.

    Returns:
        ``[C, D]`` float64.

    >>> cluster_centroids(np.array([[0.0, 2.0], [2.0, 4.0], [9.0, 9.0]]), [0, 0, 1]).tolist()
    [[1.0, 3.0], [9.0, 9.0]]
    """
    styles = np.asarray(styles, dtype=np.float64)
    labels = np.asarray(labels)
    counts = np.bincount(labels)
    assert counts.all(), f"every cluster needs a client, got sizes {counts.tolist()}"
    sums = np.zeros((len(counts), styles.shape[1]))
    np.add.at(sums, labels, styles)
    return sums / counts[:, None]


def route_to_cluster(styles: torch.Tensor | np.ndarray, centroids: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Returns the cluster of each style: its nearest centroid in L2 (LADD's test-time selection, Sec. 4.2).

    Args:
        styles: ``[B, D]`` styles of the test images.
        centroids: ``[C, D]`` μ_c.

    Returns:
        ``[B]`` int64 cluster indices; ties go to the lower index.

    >>> route_to_cluster(torch.tensor([[0.9, 0.0], [0.0, 5.0]]), torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 4.0]]))
    tensor([1, 2])
    """
    styles = torch.as_tensor(styles, dtype=torch.float64)
    centroids = torch.as_tensor(centroids, dtype=torch.float64, device=styles.device)
    assert styles.shape[-1] == centroids.shape[-1], (
        f"styles of {styles.shape[-1]} numbers cannot be compared with centroids of {centroids.shape[-1]}"
    )
    squared = (styles[:, None, :] - centroids[None, :, :]).square().sum(-1)  # [B, C], exact even for ~1e8 terms
    return squared.argmin(dim=1)


def read_cluster_file(path: str | Path, client_ids: Sequence[str]) -> np.ndarray:
    """Reads a LADD cluster file, ``{"<cluster>": [client id, ...], ...}``, as one label per client.

    Args:
        path: the JSON file (LADD ships them under ``clusters_dir/``).
        client_ids: the ids of the partition's clients, in the partition's order.

    Returns:
        ``[K]`` int64 cluster of each client of ``client_ids``, clusters numbered 0…C−1 as in the file.

    Raises:
        ConfigError: for a missing or malformed file, or ids that do not match the partition's (all
            problems listed together).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"Cluster file {path} not found. It maps cluster ids to client ids as JSON, e.g. "
            '{"0": ["aachen0", "bochum1"], "1": [...]} (LADD ships them in clusters_dir/); point the option at it, '
            "or leave it unset to cluster the clients' styles."
        )
    try:
        mapping = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ConfigError(f"Cluster file {path} is not valid JSON: {error}") from error
    if not isinstance(mapping, dict) or not all(isinstance(ids, list) for ids in mapping.values()):
        raise ConfigError(f"Cluster file {path} must map cluster ids to lists of client ids, got {type(mapping)}.")

    problems = []
    keys = sorted(mapping, key=lambda key: int(key) if str(key).isdigit() else -1)
    if [str(key) for key in keys] != [str(c) for c in range(len(keys))]:
        problems.append(f"Cluster file {path}: expected cluster ids 0…{len(keys) - 1}, got {sorted(mapping)}.")
    position = {str(client): i for i, client in enumerate(client_ids)}
    labels = np.full(len(client_ids), -1, dtype=np.int64)
    unknown, repeated = [], []
    for cluster, key in enumerate(keys):
        for client in mapping[key]:
            if str(client) not in position:
                unknown.append(str(client))
            elif labels[position[str(client)]] >= 0:
                repeated.append(str(client))
            else:
                labels[position[str(client)]] = cluster
    missing = [str(client) for client, label in zip(client_ids, labels, strict=True) if label < 0]
    for what, ids in (
        ("are not clients of the partition", unknown),
        ("appear in more than one cluster", repeated),
        ("of the partition are in no cluster", missing),
    ):
        if ids:
            shown = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
            problems.append(f"Cluster file {path}: {len(ids)} client ids {what}: {shown}.")
    if problems:
        problems.append("The cluster file must list every client of the partition exactly once, by the same ids.")
        raise ConfigError(*problems)
    return labels


def write_cluster_file(path: str | Path, labels: np.ndarray | Sequence[int], client_ids: Sequence[str]) -> None:
    """Writes a partition in LADD's cluster-file format, readable by :func:`read_cluster_file`.

    Args:
        path: the JSON file to write.
        labels: ``[K]`` cluster of each client.
        client_ids: the ids of the clients, in the order of ``labels``.
    """
    labels = np.asarray(labels)
    assert len(labels) == len(client_ids), f"{len(labels)} labels for {len(client_ids)} clients"
    mapping = {
        str(c): [str(client) for client, label in zip(client_ids, labels, strict=True) if label == c]
        for c in range(int(labels.max()) + 1)
    }
    Path(path).write_text(json.dumps(mapping, ensure_ascii=False), encoding="utf-8")
