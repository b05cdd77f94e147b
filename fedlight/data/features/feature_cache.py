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
    <directory>/<fingerprint>/complete        written last: every file's size and BLAKE2b digests (JSON)

A folder is trusted only as far as it can be checked. Each file is written under a temporary name and renamed
into place, and ``complete`` is written once every process has written its files, so a build stopped by a
kill or a full disk leaves no folder that a later run reads. Before a completed folder is reused, every file's
size and digest are compared with those recorded, every neighbour list must list its client's own images,
itself first, and every feature file must have its client's shape (:func:`reuse_problems`); a folder that
fails is rebuilt, with a warning naming the files. The free space is checked against the files' size before
anything is written, and the features are written with plain writes, so that a disk that fills up anyway is an
error that says so (ENOSPC) rather than a SIGBUS of a memory map.

Feature files are read through memory maps, so the resident memory is what the operating system pages in. A
``max_bytes`` budget bounds the disk: clients are cached in order while their features fit, and the
features of the others are computed from their images when asked for (their neighbour lists, a few
kilobytes, are always kept). With several processes each computes its share of the clients, and all
read every file.

Everything is keyed by *pool index*, the position of an image in the data module's pool, which training
batches carry as their third element (``--data.return_index=true``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np
import torch
from torch import Tensor, nn

from fedlight.data.cache_files import DigestMode, file_digest, free_space_error, is_disk_full, no_space_error
from fedlight.data.features.knn import knn_indices, sample_neighbours
from fedlight.errors import ConfigError

__all__ = ["MANIFEST", "FeatureCache", "fingerprint", "reuse_problems"]

log = logging.getLogger(__name__)

#: The file that marks a folder complete, written last: every other file's size and digests (JSON).
MANIFEST = "complete"
_FLAG = "--trainer.callbacks (fedlight.callbacks.BackboneFeatureCache) init_args"


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
        verify: DigestMode = "sampled",
    ) -> FeatureCache:
        """Computes (or reuses, once its files are checked) every client's features and neighbour lists.

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
            verify: how a completed folder's files are checked before reuse: ``sampled`` or ``full`` digests
                (:mod:`fedlight.data.cache_files`).

        Raises:
            ConfigError: when the folder cannot be created, when its disk has less free space than the files
                need (before anything is written), or when the disk fills up while writing (the partial files
                are removed and the folder is not marked complete).
        """
        backbone = backbone.eval()
        first = images(client_indices[0][:1]).to(device)
        shape = tuple(backbone(first).shape[1:])  # (C, h, w)
        per_image = math.prod(shape) * np.dtype(dtype).itemsize
        sizes = [len(ix) for ix in client_indices]
        cached = (np.cumsum(np.array(sizes) * per_image) <= max_bytes).tolist()
        folder = Path(directory) / fingerprint(backbone, first.shape[1:], client_indices, dtype)
        marked = (folder / MANIFEST).exists()
        problems = reuse_problems(folder, client_indices, shape, dtype, k, verify) if marked else []
        if problems and rank == 0:
            log.warning("The feature cache %s is rebuilt: %s.", folder, "; ".join(problems))
        if problems or not marked:
            barrier()  # every process has looked at the old files before any is replaced
            files = _plan_files(sizes, cached, per_image, k)
            _prepare_folder(folder, files, rank)
            for client in range(rank, len(client_indices), world_size):
                try:
                    _write_client(folder, client, client_indices[client].cpu(), shape, dtype, cached[client],
                                  backbone, images, k, batch_size, device)  # fmt: skip
                except OSError as err:
                    if is_disk_full(err):
                        raise no_space_error("the feature cache", folder, sum(files.values())) from None
                    raise
            barrier()
            if rank == 0:
                written = [name for name in files if (folder / name).is_file()]
                _write_manifest(folder, written, sum(files.values()), verify)
        barrier()
        listed = json.loads((folder / MANIFEST).read_text())["files"]
        owner = torch.full((pool_size,), -1, dtype=torch.int64)
        row = torch.zeros(pool_size, dtype=torch.int64)
        knn = torch.full((pool_size, min(k, min(sizes))), -1, dtype=torch.int64)
        stores: list[np.ndarray | None] = []
        for client, indices in enumerate(client_indices):
            indices = indices.cpu()
            owner[indices] = client
            row[indices] = torch.arange(len(indices))
            knn[indices] = torch.from_numpy(np.load(folder / f"knn{client}.npy"))[:, : knn.shape[1]]
            name = f"client{client}.npy"
            stores.append(np.load(folder / name, mmap_mode="r") if cached[client] and name in listed else None)

        def compute(index: Tensor) -> Tensor:
            return backbone(images(index).to(device))

        return cls(owner, row, knn, stores, compute)


def reuse_problems(
    folder: Path,
    client_indices: Sequence[Tensor],
    shape: tuple[int, ...],
    dtype: str,
    k: int = 30,
    verify: DigestMode = "sampled",
) -> list[str]:
    """Why the completed folder's files cannot be trusted, each naming its file; empty when they can.

    Every file the manifest lists must have the size and digest recorded when the cache was completed; on top,
    every client's neighbour lists must start with its own images, name only them and be ``k`` long (or the
    client's size), and every feature file must hold ``[n_k, *shape]`` values of ``dtype``.
    """
    manifest = folder / MANIFEST
    try:
        files = json.loads(manifest.read_text())["files"]
        records = {name: (int(r["bytes"]), str(r[verify])) for name, r in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [f"{manifest} records no sizes and digests (a damaged file, or a cache written before they were)"]
    problems = [f"{manifest} lists no knn{c}.npy" for c in range(len(client_indices)) if f"knn{c}.npy" not in files]
    for name, (size, digest) in records.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{path} holds {path.stat().st_size} bytes, {size} when it was written")
        elif file_digest(path, verify) != digest:
            problems.append(f"{path} changed since it was written (its {verify} BLAKE2b digest differs)")
    if problems:
        return problems
    for client, indices in enumerate(client_indices):  # what digests cannot vouch for: the files' meaning
        indices = indices.cpu().numpy()
        lists = np.load(folder / f"knn{client}.npy")
        if lists.ndim != 2 or len(lists) != len(indices) or not np.array_equal(lists[:, 0], indices):
            problems.append(f"{folder / f'knn{client}.npy'} does not list client {client}'s images, each first")
        elif not np.isin(lists, indices).all():
            problems.append(f"{folder / f'knn{client}.npy'} names images outside client {client}'s training split")
        elif lists.shape[1] < min(k, len(indices)):
            problems.append(f"{folder / f'knn{client}.npy'} lists {lists.shape[1]} neighbours, {k} are asked for")
        if f"client{client}.npy" in files:
            store = np.load(folder / f"client{client}.npy", mmap_mode="r")
            if store.shape != (len(indices), *shape) or store.dtype != np.dtype(dtype):
                problems.append(
                    f"{folder / f'client{client}.npy'} holds {store.dtype} {list(store.shape)}, not {dtype} "
                    f"{[len(indices), *shape]}"
                )
    return problems


def _plan_files(sizes: Sequence[int], cached: Sequence[bool], per_image: int, k: int) -> dict[str, int]:
    """The files a build writes and their sizes in bytes (an ``.npy`` header is at most 128 bytes here)."""
    files = {f"client{c}.npy": 128 + n * per_image for c, n in enumerate(sizes) if cached[c]}
    files |= {f"knn{c}.npy": 128 + n * min(k, n) * 8 for c, n in enumerate(sizes)}
    return files


def _prepare_folder(folder: Path, files: dict[str, int], rank: int) -> None:
    """Creates ``folder``, unmarks it (rank 0) and checks that its disk can take ``files``: every file is written
    beside the one it replaces, so the disk needs what is not there yet plus the largest file."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            (folder / MANIFEST).unlink(missing_ok=True)
    except OSError as err:
        raise ConfigError(
            f"Cannot create the feature cache {folder} ({err.strerror}). Pass a writable folder on a disk with free "
            f"space as {_FLAG}.directory."
        ) from None
    present = sum((folder / name).stat().st_size for name in files if (folder / name).is_file())
    needed = max(0, sum(files.values()) - present) + max(files.values())
    advice = (
        f"or lower {_FLAG}.max_gib (clients past it are computed per batch), or pass a folder on another disk as "
        f"{_FLAG}.directory"
    )
    error = free_space_error(folder, needed, "the feature cache", advice)
    if error is not None:
        raise error


def _write_client(
    folder: Path,
    client: int,
    indices: Tensor,
    shape: tuple[int, ...],
    dtype: str,
    cached: bool,
    backbone: nn.Module,
    images: Callable[[Tensor], Tensor],
    k: int,
    batch_size: int,
    device: torch.device | str,
) -> None:
    """Writes ``client<k>.npy`` (when ``cached``) and ``knn<k>.npy``, each through a temporary file.

    The features are written with plain writes, not through a memory map: a full disk is then an ``OSError``
    (ENOSPC) rather than a SIGBUS that kills the process.
    """
    pooled = torch.empty(len(indices), shape[0])
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
              "shape": (len(indices), *shape)}  # fmt: skip
    with _replacing(folder / f"client{client}.npy") if cached else nullcontext() as file:
        if file is not None:
            np.lib.format.write_array_header_1_0(file, header)
        for start in range(0, len(indices), batch_size):
            feats = backbone(images(indices[start : start + batch_size]).to(device)).float().cpu()
            pooled[start : start + len(feats)] = feats.mean(dim=(2, 3))  # [b, C]
            if file is not None:
                file.write(feats.numpy().astype(dtype).tobytes())
    local = knn_indices(pooled, k=min(k, len(indices)))  # [n_k, k'] rows within the client
    with _replacing(folder / f"knn{client}.npy") as file:
        np.save(file, indices[local].numpy())


def _write_manifest(folder: Path, names: Sequence[str], nbytes: int, verify: DigestMode) -> None:
    """Marks the folder complete: ``complete`` lists every file with its size and digests, and is written last.

    The sampled digest is always recorded; the full one, which reads every byte (about 4.5 s per GiB on a busy
    2-core machine), only when ``verify`` asks for it, so a folder built with ``sampled`` is rebuilt once for a
    run that asks for ``full``.
    """
    modes = ("sampled", "full") if verify == "full" else ("sampled",)
    files = {
        name: {"bytes": (folder / name).stat().st_size} | {mode: file_digest(folder / name, mode) for mode in modes}
        for name in names
    }
    try:
        with _replacing(folder / MANIFEST) as file:
            file.write(json.dumps({"files": files}, indent=1).encode())
    except OSError as err:
        if is_disk_full(err):
            raise no_space_error("the feature cache", folder, nbytes) from None
        raise


@contextmanager
def _replacing(path: Path) -> Iterator[BinaryIO]:
    """A file opened for writing under a temporary name, renamed to ``path`` once written and synced; removed
    if the writing fails, so that ``path`` is either the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def fingerprint(backbone: nn.Module, image_shape: Sequence[int], client_indices: Sequence[Tensor], dtype: str) -> str:
    """A short hash of everything the cached files depend on: the backbone's weights, the image size,
    every client's pool indices and the storage type."""
    digest = hashlib.sha1()
    for name, tensor in backbone.state_dict().items():
        digest.update(name.encode())
        # flattened first: a 0-d tensor (BatchNorm's num_batches_tracked) cannot be viewed as bytes
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    digest.update(repr((tuple(image_shape), dtype)).encode())
    for indices in client_indices:
        digest.update(indices.cpu().numpy().astype(np.int64).tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:16]
