"""Backbone features of every client's training images, computed once, and their nearest-neighbour lists.

FUSS's backbone is frozen, so the features of a training image never change: they can be computed once per
client and read back at every step instead of running a ViT-B/8 on every batch. The same pass gives the
nearest-neighbour lists that STEGO's kNN pairing draws from (FUSS Sec. 5.2, STEGO's ``precompute_knns``):
per client, over its own training images, each described by its features mean-pooled over space and
L2-normalised, ranked by cosine similarity, 30 long with the image itself at rank 0
(:func:`fedlight.data.features.knn.knn_indices`).

Layout on disk, one folder per fingerprint of (backbone weights, image size, clients' samples, dtype)::

    <directory>/<fingerprint>/client<k>.npy   [n_k, C, h, w] features of client k's training images (fp16)
    <directory>/<fingerprint>/knn<k>.npy      [n_k, 30] neighbours as pool indices, self first
    <directory>/<fingerprint>/complete        written last; a folder without it is rebuilt

Feature files are memory-mapped, so the resident memory is what the operating system pages in. A
``max_bytes`` budget bounds the disk: clients are cached in order while their features fit, and the
features of the others are computed from their images when asked for (their neighbour lists, a few
kilobytes, are always kept). With several processes each computes its share of the clients, and all
read every file.

Everything is keyed by *pool index*, the position of an image in the data module's pool, which training
batches carry as their third element (``--data.return_index=true``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn

from fedlight.data.features.knn import knn_indices, sample_neighbours

__all__ = ["FeatureCache", "fingerprint"]


class FeatureCache:
    """Per-client features (memory-mapped, or computed on demand) and kNN lists, addressed by pool index.

    Build it with :meth:`build`. ``owner[i]`` is the client whose training split holds pool image i (−1 if
    none), ``row[i]`` its row in that client's files.

    Args:
        owner: ``[N]`` int64 client of every pool image, −1 outside every training split.
        row: ``[N]`` int64 row of every pool image in its client's files.
        knn: ``[N, k]`` int64 neighbours as pool indices (self first), −1 rows outside the training splits.
        stores: per client, the ``[n_k, C, h, w]`` memory map of its features, or ``None`` if not cached.
        compute: features ``[B, C, h, w]`` of pool images ``[B]`` (for clients that are not cached).
    """

    def __init__(
        self,
        owner: Tensor,
        row: Tensor,
        knn: Tensor,
        stores: Sequence[np.ndarray | None],
        compute: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        self.owner, self.row, self.knn = owner, row, knn
        self.stores = list(stores)
        self.compute = compute

    @property
    def nbytes(self) -> int:
        """Bytes of the cached features on disk (the kNN lists add 8·k bytes per image)."""
        return sum(store.nbytes for store in self.stores if store is not None)

    def client_nbytes(self, client: int) -> int:
        """Bytes of client ``client``'s cached features (0 if it is computed on demand)."""
        store = self.stores[client]
        return 0 if store is None else store.nbytes

    def features(self, index: Tensor, device: torch.device | str = "cpu") -> Tensor:
        """Backbone features ``[B, C, h, w]`` (fp32, on ``device``) of pool images ``index`` ``[B]``."""
        index = index.long().cpu()
        owners, rows = self.owner[index], self.row[index]
        assert bool((owners >= 0).all()), f"pool images {index[owners < 0].tolist()} are in no training split"
        parts: list[Tensor | None] = [None] * len(index)
        for client in owners.unique().tolist():
            at = (owners == client).nonzero().flatten()
            store = self.stores[client]
            if store is None:
                assert self.compute is not None, f"client {client}'s features are neither cached nor computable"
                values = self.compute(index[at]).float().cpu()
            else:
                values = torch.from_numpy(np.ascontiguousarray(store[rows[at].numpy()])).float()
            for i, position in enumerate(at.tolist()):
                parts[position] = values[i]
        return torch.stack(parts).to(device)

    def sample_neighbours(
        self, index: Tensor, num_neighbors: int = 2, generator: torch.Generator | None = None
    ) -> Tensor:
        """One partner (a pool index) per image of ``index``, uniform over ranks 1..``num_neighbors``."""
        return sample_neighbours(self.knn, index.cpu(), num_neighbors, generator)

    @classmethod
    @torch.no_grad()
    def build(
        cls,
        backbone: nn.Module,
        images: Callable[[Tensor], Tensor],
        client_indices: Sequence[Tensor],
        pool_size: int,
        directory: str | Path,
        k: int = 30,
        max_bytes: float = math.inf,
        dtype: Literal["float16", "float32"] = "float16",
        batch_size: int = 64,
        device: torch.device | str = "cpu",
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[], None] = lambda: None,
    ) -> FeatureCache:
        """Computes (or reuses) every client's features and neighbour lists.

        Args:
            backbone: the frozen feature extractor, images ``[B, 3, H, W]`` → ``[B, C, h, w]``; run in eval mode.
            images: reads pool images ``[B]`` → ``[B, 3, H, W]`` (on the CPU or ``device``).
            client_indices: per client, the pool indices of its training images.
            pool_size: N, the size of the pool.
            directory: where the fingerprinted folder of files goes.
            k: neighbour-list length, self included (30), capped at the client's size.
            max_bytes: disk budget of the feature files; clients past it are computed on demand.
            dtype: storage type of the features.
            batch_size: images per backbone pass while building.
            device: where the backbone runs.
            rank: this process; process r builds clients r, r + world_size, …
            world_size: number of processes.
            barrier: waits for every process (so that all files exist before any is read).
        """
        backbone = backbone.eval()
        first = images(client_indices[0][:1]).to(device)
        c, h, w = backbone(first).shape[1:]
        per_image = c * h * w * np.dtype(dtype).itemsize
        sizes = [len(ix) for ix in client_indices]
        cached = (np.cumsum(np.array(sizes) * per_image) <= max_bytes).tolist()
        folder = Path(directory) / fingerprint(backbone, first.shape[1:], client_indices, dtype)
        if not (folder / "complete").exists():
            folder.mkdir(parents=True, exist_ok=True)
            for client in range(rank, len(client_indices), world_size):
                indices = client_indices[client].cpu()
                store = None
                if cached[client]:
                    store = np.lib.format.open_memmap(
                        folder / f"client{client}.npy", mode="w+", dtype=dtype, shape=(len(indices), c, h, w)
                    )
                pooled = torch.empty(len(indices), c)
                for start in range(0, len(indices), batch_size):
                    feats = backbone(images(indices[start : start + batch_size]).to(device)).float().cpu()
                    pooled[start : start + len(feats)] = feats.mean(dim=(2, 3))  # [b, C]
                    if store is not None:
                        store[start : start + len(feats)] = feats.numpy().astype(dtype)
                if store is not None:
                    store.flush()
                local = knn_indices(pooled, k=min(k, len(indices)))  # [n_k, k'] rows within the client
                np.save(folder / f"knn{client}.npy", indices[local].numpy())
            barrier()
            if rank == 0:
                (folder / "complete").touch()
        barrier()
        owner = torch.full((pool_size,), -1, dtype=torch.int64)
        row = torch.zeros(pool_size, dtype=torch.int64)
        knn = torch.full((pool_size, min(k, min(sizes))), -1, dtype=torch.int64)
        stores: list[np.ndarray | None] = []
        for client, indices in enumerate(client_indices):
            indices = indices.cpu()
            owner[indices] = client
            row[indices] = torch.arange(len(indices))
            knn[indices] = torch.from_numpy(np.load(folder / f"knn{client}.npy"))[:, : knn.shape[1]]
            path = folder / f"client{client}.npy"
            stores.append(np.load(path, mmap_mode="r") if cached[client] and path.exists() else None)

        def compute(index: Tensor) -> Tensor:
            return backbone(images(index).to(device))

        return cls(owner, row, knn, stores, compute)


def fingerprint(backbone: nn.Module, image_shape: Sequence[int], client_indices: Sequence[Tensor], dtype: str) -> str:
    """A short hash of everything the cached files depend on: the backbone's weights, the image size,
    every client's pool indices and the storage type."""
    digest = hashlib.sha1()
    for name, tensor in backbone.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digest.update(repr((tuple(image_shape), dtype)).encode())
    for indices in client_indices:
        digest.update(indices.cpu().numpy().astype(np.int64).tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:16]
