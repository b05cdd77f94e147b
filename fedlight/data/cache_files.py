"""What every cache on disk shares: a digest that says a file is still the one written, a folder that can take
the files, and the message of a full disk.

A cache is trusted only as far as it can be checked. Each cache records, when it is completed, the size and
the BLAKE2b digest of its files (:func:`file_digest`), and checks them on reuse; a file changed since (scrambled,
truncated, deleted, another run's) is rebuilt rather than read. The ``sampled`` digest reads a fixed 16 MiB of a
large file (256 blocks of 64 KiB spread evenly from its first byte to its last, with its size), so checking a
cache of tens of GiB costs a fraction of a second; it catches any rewrite or reordering of the file's contents
but can miss a change confined between two blocks. The ``full`` digest reads every byte. Files of up to 16 MiB
are always read whole.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from pathlib import Path
from typing import Literal

import torch

from fedlight.errors import ConfigError

__all__ = [
    "DigestMode",
    "file_digest",
    "folder_problems",
    "free_space_error",
    "is_disk_full",
    "no_space_error",
    "tensor_digest",
]

DigestMode = Literal["sampled", "full"]
_BLOCKS = 256
_BLOCK_BYTES = 1 << 16  # 64 KiB: 16 MiB read of a large file


def file_digest(path: str | Path, mode: DigestMode = "sampled") -> str:
    """The BLAKE2b digest (32 hex digits) of ``path``'s size and contents, whole or sampled (module docstring).

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile() as f:
    ...     _ = f.write(b"abc"); f.flush()
    ...     file_digest(f.name) == file_digest(f.name, "full")
    True
    """
    size = os.path.getsize(path)
    digest = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=16)
    with open(path, "rb") as file:
        if mode == "full" or size <= _BLOCKS * _BLOCK_BYTES:
            while chunk := file.read(1 << 20):
                digest.update(chunk)
        else:
            for i in range(_BLOCKS):  # the first block starts at byte 0, the last ends at the last byte
                file.seek(i * (size - _BLOCK_BYTES) // (_BLOCKS - 1))
                digest.update(file.read(_BLOCK_BYTES))
    return digest.hexdigest()


def tensor_digest(tensor: torch.Tensor) -> str:
    """The BLAKE2b digest (32 hex digits) of a tensor's dtype, shape and bytes (decoded-image caches record it).

    >>> tensor_digest(torch.zeros(2, dtype=torch.uint8)) == tensor_digest(torch.zeros(1, 2, dtype=torch.uint8))
    False
    """
    tensor = tensor.detach().cpu().contiguous()
    digest = hashlib.blake2b(f"{tensor.dtype}{tuple(tensor.shape)}".encode(), digest_size=16)
    if tensor.numel():
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def folder_problems(folder: str | Path, flag: str) -> list[str]:
    """Problems with a folder a cache will write into: its nearest existing ancestor must be a writable folder.

    >>> folder_problems("/proc/version/cache", "--x.directory")[0].split(":")[0]
    '--x.directory=/proc/version/cache'
    """
    existing = Path(folder).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return [f"{flag}={folder}: {existing} is a file, not a folder. Pass a folder for the cache."]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"{flag}={folder}: {existing} is not writable. Pass a folder you can write to."]
    return []


def free_space_error(folder: Path, needed: int, what: str, advice: str) -> ConfigError | None:
    """The error to raise when the disk of ``folder`` (or of its nearest existing ancestor) has fewer than
    ``needed`` bytes free, else None."""
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free >= needed:
        return None
    return ConfigError(
        f"Not enough free space for {what} in {folder}: it needs {needed} bytes ({needed / 2**30:.2f} GiB) and "
        f"the disk of {existing} has {free} bytes ({free / 2**30:.2f} GiB) free. Free space on that disk, {advice}."
    )


def is_disk_full(err: OSError) -> bool:
    """Whether ``err`` says the disk or the user's quota is full."""
    return err.errno in (errno.ENOSPC, errno.EDQUOT)


def no_space_error(what: str, folder: Path, nbytes: int) -> ConfigError:
    """The message of a write that ran out of disk: what was being written, where, and what to do."""
    return ConfigError(
        f"No space left on the disk to write {what} in {folder} ({nbytes / 2**20:.1f} MiB): the file being written "
        f"was removed and the folder is not marked complete, so no later run reads it. Free space on {folder.parent} "
        "and resume (or start again): the cache is rebuilt."
    )
