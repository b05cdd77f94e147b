"""Fetching a dataset's public files when ``download: true``, and saying what to do when that is impossible.

Every reader with a public source takes ``download``. With it, missing files are fetched before they are read:
through torchvision's own dataset classes where torchvision has one (MNIST, EMNIST, CIFAR; their mirrors and
checksums), otherwise with torchvision's ``download_and_extract_archive`` from the source's URL, the archive's
MD5 checked before it is unpacked. A download that fails (no network, a checksum that does not match) raises
one :class:`~fedlight.errors.ConfigError` naming the URL and the folder, so the files can be fetched on another
machine and copied there; without ``download`` a missing dataset raises the same kind of message.

The processes of one run (``--trainer.devices=N``) each build the data: a lock file in the target folder lets
the first one download while the others wait, then find the files there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from fedlight.errors import ConfigError

T = TypeVar("T")


def download_failed(name: str, urls: Sequence[str], folder: str | Path, error: BaseException) -> ConfigError:
    """The error of a download that did not complete, naming where the files come from and where they go."""
    return ConfigError(
        f"Could not download {name} from {' or '.join(urls)} into {folder} ({_first_line(error)}).",
        f"Without network, download {' or '.join(urls)} on a machine that has it, copy or extract the files into "
        f"{folder}/ and run again (with --data.dataset.init_args.download=false, nothing is fetched).",
    )


@contextlib.contextmanager
def download_lock(folder: str | Path) -> Iterator[None]:
    """Holds ``<folder>/.fedlight-download.lock`` exclusively (POSIX ``flock``; no lock where there is none)."""
    try:
        import fcntl
    except ImportError:  # Windows: one process per download is the user's to ensure
        yield
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    with open(Path(folder) / ".fedlight-download.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch_archive(
    name: str,
    url: str,
    md5: str | None,
    download_root: str | Path,
    extract_root: str | Path | None = None,
    done: Callable[[], bool] | None = None,
) -> None:
    """Downloads ``url`` into ``download_root`` (skipped when a file with that MD5 is there), checks it and unpacks it.

    Args:
        name: the dataset, for the error message.
        url: the archive's source.
        md5: its checksum; ``None`` only where the source publishes none.
        download_root: where the archive is saved.
        extract_root: where it is unpacked (default: ``download_root``).
        done: whether the unpacked files are there, asked again once the lock is held: another process of the
            run may have fetched them meanwhile.

    Raises:
        ConfigError: when the download fails or the checksum does not match, naming the URL and the folder.
    """
    from torchvision.datasets.utils import download_and_extract_archive

    with download_lock(download_root):
        if done is not None and done():
            return
        try:
            download_and_extract_archive(url, download_root=str(download_root), extract_root=extract_root, md5=md5)
        except (OSError, RuntimeError, ValueError) as error:  # URLError is an OSError; a bad checksum a RuntimeError
            raise download_failed(name, [url], extract_root or download_root, error) from error


def through_torchvision(
    read: Callable[[], T], name: str, urls: Sequence[str], root: str, folder: str | Path, download: bool, missing: str
) -> T:
    """Calls a torchvision dataset constructor, turning its failure into one actionable :class:`ConfigError`.

    Args:
        read: builds the torchvision dataset (with ``download`` passed on).
        name: the dataset, for the message.
        urls: where torchvision downloads it from.
        root: the dataset's ``root`` option.
        folder: where the files go.
        download: whether ``read`` was asked to download.
        missing: what to do when the files are absent and nothing was downloaded.
    """
    try:
        with download_lock(folder) if download else contextlib.nullcontext():
            return read()  # torchvision checks the files first and downloads only what is missing
    except (OSError, RuntimeError) as error:
        if download:
            raise download_failed(name, urls, folder, error) from error
        raise ConfigError(
            f"{name} was not found under --data.dataset.init_args.root={root} ({_first_line(error)}).",
            f"Set --data.dataset.init_args.download=true to fetch it from {' or '.join(urls)} into {folder}/, or "
            f"{missing}",
        ) from error


def _first_line(error: BaseException) -> str:
    """The error's message on one line (torchvision's list every mirror tried on lines of their own)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[:4]) or type(error).__name__
