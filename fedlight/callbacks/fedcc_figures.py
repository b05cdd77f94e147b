"""Pictures of FedCC's input and output: the clients' centroids and the server's, in one t-SNE and one matrix.

FUSS (Sec. 4.2.2) argues that clients learn their clusters in different orders, so that centroid n of one
client need not be centroid n of another, and averaging them index by index mixes unrelated prototypes.
Two pictures show whether that happens in a run:

- **the distance matrix**: cosine distances between every pair of rows of the pooled matrix
  ``[client 0's n rows; …; client K−1's; the server's n]``, in that raw order. Where clients are aligned,
  the off-diagonal client-by-client blocks have a dark diagonal (row j of one client is near row j of
  the other); where they are misaligned, the near pairs lie off that diagonal. The order is kept raw on
  purpose: aligning rows by a Hungarian match first would hide exactly the misalignment FedCC addresses.
  Distances are cosine because clients assign codes to centroids by cosine similarity (FUSS Eq. 3).
- **the t-SNE**: every row embedded in 2-D (scikit-learn's ``TSNE`` on L2-normalised rows), coloured by
  client, the server's rows drawn as black crosses. FedCC-kMeans puts a server row in the middle of every
  group of client rows; FedCC-Maximin picks rows among them; FedAvg's rows may fall between groups.

:func:`centroid_maps` computes both and :func:`centroid_figure` draws them (matplotlib imported there);
:func:`plot_centroid_maps` saves the picture.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from scipy.spatial.distance import cdist

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def pooled_rows(clients: dict[int, torch.Tensor], server: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The pooled ``[K·n + n, D]`` rows (clients in ascending id, then the server) and each row's owner
    (the client id, −1 for the server)."""
    order = sorted(clients)
    rows = [clients[k].detach().double().cpu().numpy() for k in order] + [server.detach().double().cpu().numpy()]
    owners = np.concatenate([np.full(len(r), k) for k, r in zip([*order, -1], rows, strict=True)])
    return np.concatenate(rows), owners


def centroid_maps(clients: dict[int, torch.Tensor], server: torch.Tensor, seed: int = 0) -> dict[str, np.ndarray]:
    """The distance matrix and the t-SNE of the clients' and the server's centroids.

    Args:
        clients: client id → its centroids ``[n, D]`` at the end of its local training.
        server: the server's centroids ``[n, D]`` after aggregation.
        seed: t-SNE's random state.

    Returns:
        ``rows`` ``[R, D]`` (R = K·n + n), ``owners`` ``[R]`` (client id, −1: server), ``distances`` ``[R, R]``
        (cosine distance) and ``embedding`` ``[R, 2]``.
    """
    from sklearn.manifold import TSNE

    rows, owners = pooled_rows(clients, server)
    distances = cdist(rows, rows, metric="cosine")
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True).clip(min=1e-12)
    perplexity = min(30.0, (len(rows) - 1) / 3)
    embedding = TSNE(2, perplexity=perplexity, init="pca", random_state=seed).fit_transform(unit)
    return {"rows": rows, "owners": owners, "distances": distances, "embedding": embedding}


def centroid_figure(maps: dict[str, np.ndarray], title: str = "") -> Figure:
    """:func:`centroid_maps`' output side by side, as a matplotlib figure: each client in a colour of its own
    (:func:`~fedlight.callbacks.figures.class_colours` over the clients, so 18 clients get 18 colours)."""
    from matplotlib.figure import Figure

    from fedlight.callbacks.figures import class_colours

    owners, embedding = maps["owners"], maps["embedding"]
    figure = Figure(figsize=(12, 5.5), layout="tight")
    left, right = figure.subplots(1, 2)
    clients = np.unique(owners[owners >= 0])
    for k, colour in zip(clients, class_colours(len(clients)), strict=True):
        points = embedding[owners == k]
        left.scatter(points[:, 0], points[:, 1], s=14, color=colour, label=f"client {k}")
    server = embedding[owners == -1]
    left.scatter(server[:, 0], server[:, 1], s=60, marker="x", color="black", label="server")
    left.legend(fontsize=7, loc="best")
    left.set_xticks([])
    left.set_yticks([])
    left.set_title("t-SNE of the centroids")
    image = right.imshow(maps["distances"], cmap="viridis")
    edges = np.flatnonzero(np.diff(owners)) + 0.5  # block borders between owners
    for edge in edges:
        right.axhline(edge, color="white", linewidth=0.6)
        right.axvline(edge, color="white", linewidth=0.6)
    right.set_title("cosine distance (clients in order, server last)")
    figure.colorbar(image, ax=right, fraction=0.046)
    figure.suptitle(title)
    return figure


def plot_centroid_maps(maps: dict[str, np.ndarray], path: str | Path, title: str = "") -> Path:
    """Draws :func:`centroid_figure` into ``path`` (a PNG) and returns ``path``."""
    path = Path(path)
    centroid_figure(maps, title).savefig(path, dpi=110)
    return path
