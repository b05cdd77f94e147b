"""Fetching a dataset's public files when ``download: true``, and saying what to do when that is impossible.

Every reader with a public source takes ``download``. With it, missing files are fetched before they are read:
through torchvision's own dataset classes where torchvision has one (MNIST, EMNIST, CIFAR; their mirrors and
checksums), otherwise with torchvision's ``download_and_extract_archive`` from the source's URL, the archive's
MD5 checked before it is unpacked. A download that fails (no network, a checksum that does not match) raises
one :class:`~fedlight.errors.ConfigError` naming the URL and the folder, so the files can be fetched on another
machine and copied there; without ``download`` a missing dataset raises the same kind of message.

The processes of one run (``--trainer.devices=N``) each build the data: a lock file in the target folder lets
the first one download while the others wait, then find the files there.

A copy whose files differ from the published ones (a mirror, a re-packed archive) is verified against a list of
MD5 sums in ``md5sum``'s format (:func:`read_checksums`). Files a reader expects but cannot find are named one by
one, with a file of a similar name in the same folder pointed out as a likely renamed copy (:func:`missing_files`).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import posixpath
import re
import shutil
import socket
import uuid
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


#: seconds a download waits for a source to answer (connecting, or between two reads) before it gives up
TIMEOUT_S = 60.0


@contextlib.contextmanager
def network_timeout() -> Iterator[None]:
    """Gives the sockets opened inside it a timeout of :data:`TIMEOUT_S`: a source that takes the connection and
    never answers fails like any other download (torchvision's and urllib's requests have none of their own)."""
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(TIMEOUT_S)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


#: the lock file a download holds in its target folder while it runs
LOCK_FILE = ".fedlight-download.lock"


@contextlib.contextmanager
def download_lock(folder: str | Path) -> Iterator[None]:
    """Holds ``<folder>/.fedlight-download.lock`` exclusively (POSIX ``flock``; no lock where there is none), and
    removes it when done.

    The holder deletes the file before it unlocks, so a process that was waiting on it wakes up holding a file no
    longer in the folder: it notices (the path's inode is not its file's) and locks the path anew.
    """
    try:
        import fcntl
    except ImportError:  # Windows: one process per download is the user's to ensure
        yield
        return
    path = Path(folder) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        handle = open(path, "a")  # noqa: SIM115 (held across the yield)
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        handle.close()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


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
    from torchvision.datasets.utils import download_url

    target = Path(extract_root or download_root)
    with download_lock(download_root):
        if done is not None and done():
            return
        try:
            with network_timeout():
                download_url(url, str(download_root), md5=md5)  # the MD5 is checked before anything is unpacked
            archive = Path(download_root) / posixpath.basename(url)
            unpack_into_place(archive, target)
        except (OSError, RuntimeError, ValueError) as error:  # URLError is an OSError; a bad checksum a RuntimeError
            raise download_failed(name, [url], target, error) from error


def unpack_into_place(archive: Path, target: Path) -> None:
    """Unpacks ``archive`` into a hidden folder beside its destination, then moves what it holds into ``target``.

    The long part, extracting (CINIC-10's 270,000 files), happens out of sight: a process killed then leaves the
    hidden folder, never a dataset folder with part of its files that a reader would take for the whole. The moves
    that follow are renames, merged into folders that exist already (an SBD beside VOC's images stays, a file a
    partial unpacking left is replaced); the readers' checks of the published counts catch a kill among them.
    """
    from torchvision.datasets.utils import extract_archive

    staging = target / f".fedlight-unpacking-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        extract_archive(str(archive), str(staging))
        for entry in sorted(staging.iterdir()):
            _move_merging(entry, target / entry.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _move_merging(source: Path, destination: Path) -> None:
    if source.is_dir() and destination.is_dir() and not destination.is_symlink():
        for entry in source.iterdir():
            _move_merging(entry, destination / entry.name)
    else:
        os.replace(source, destination)


def through_torchvision(
    read: Callable[[], T],
    name: str,
    urls: Sequence[str],
    root: str,
    folder: str | Path,
    download: bool,
    missing: str,
    expected: Sequence[Path] = (),
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
        expected: the files the dataset needs; those absent are named in the message, one per line.
    """
    try:
        with download_lock(folder) if download else contextlib.nullcontext(), network_timeout():
            return read()  # torchvision checks the files first and downloads only what is missing
    except (OSError, RuntimeError) as error:
        absent = missing_files(expected)
        if download:  # the download's failure says it all: which files were missing is what it set out to fetch
            raise download_failed(name, urls, folder, error) from error
        found = (
            [f"{name} is incomplete under --data.dataset.init_args.root={root}:", *absent]
            if absent
            else [f"{name} was not found under --data.dataset.init_args.root={root} ({_first_line(error)})."]
        )
        raise ConfigError(
            *found,
            f"Set --data.dataset.init_args.download=true to fetch it from {' or '.join(urls)} into {folder}/, or "
            f"{missing}",
        ) from error


def missing_files(paths: Sequence[Path], limit: int = 5) -> list[str]:
    """One line per file of ``paths`` that is absent, the first ``limit`` named and the rest counted.

    A file of a similar name in the same folder that is not itself one of ``paths`` is named as what is likely
    the file renamed (``train-images.idx3-ubyte`` for ``train-images-idx3-ubyte``), so the fix is a rename.
    """
    absent = [Path(path) for path in paths if not Path(path).is_file()]
    wanted = {Path(path) for path in paths}
    listings: dict[Path, list[str]] = {}  # each folder is listed once, however many of its files are absent
    lines = []
    for path in absent[:limit]:
        if path.parent not in listings:
            names = sorted(p.name for p in path.parent.iterdir()) if path.parent.is_dir() else []
            listings[path.parent] = [n for n in names if path.parent / n not in wanted and not n.startswith(".")]
        similar = difflib.get_close_matches(path.name, listings[path.parent], n=1, cutoff=0.85)
        hint = f" ({path.parent / similar[0]} is there: if it is this file, rename it)" if similar else ""
        lines.append(f"{path} is missing{hint}.")
    if len(absent) > limit:
        lines.append(f"… and {len(absent) - limit} more files are missing.")
    return lines


# md5sum's lines: the sum, a space, then a space (text mode) or '*' (binary mode), then the path
_MD5SUM_LINE = re.compile(r"([0-9a-fA-F]{32}) [ *](.+)")


def read_checksums(file: str | Path, flag: str = "--data.dataset.init_args.checksums") -> dict[str, str]:
    """The MD5 sums of a file in ``md5sum``'s format, by normalised ``/``-separated path.

    Each non-blank line is ``<md5>  <path>`` (``<md5> *<path>`` in binary mode); lines starting with ``#`` are
    comments. Paths are taken as written (relative to the dataset's root), with ``./`` and ``\\`` normalised.

    Args:
        file: the list of sums.
        flag: the option that named ``file``, for the message.

    Raises:
        ConfigError: when the file cannot be read or a line is not in that format, naming the file and line.
    """
    try:
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"{flag}={file} cannot be read as a list of MD5 sums ({type(error).__name__}: {error}); give a text file "
            "with one '<md5>  <path relative to root>' line per file, as md5sum writes it."
        ) from error
    sums = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        match = _MD5SUM_LINE.fullmatch(line)
        if match is None:
            raise ConfigError(
                f"Line {number} of {flag}={file} is not '<md5>  <path>' (md5sum's format): {line[:80]!r}. Write "
                "a 32-digit hexadecimal MD5, two spaces and the file's path relative to root, e.g. with "
                "`md5sum cifar-10-batches-py/*` run in root."
            )
        sums[normalised_path(match[2])] = match[1].lower()
    return sums


def normalised_path(path: str) -> str:
    """``path`` with ``/`` separators and without ``./`` or doubled separators, as :func:`read_checksums` keys it."""
    return posixpath.normpath(path.replace("\\", "/"))


def _first_line(error: BaseException) -> str:
    r"""The error's message on one line (torchvision's list every mirror tried on lines of their own, and a mirror
    whose error had no message leaves its ``got:`` empty).

    >>> _first_line(RuntimeError("Error downloading t.gz:\nTried https://a/, got:\nno route\nTried http://b/, got:\n"))
    'Error downloading t.gz: Tried https://a/, got: no route; Tried http://b/, got: an error without a message'
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    lines.append("")
    for i, line in enumerate(lines[:-1]):
        if line.endswith("got:") and (not lines[i + 1] or lines[i + 1].startswith("Tried ")):
            lines[i] += " an error without a message"
        if line.startswith("Tried ") and i > 1:
            lines[i - 1] += ";"
    return " ".join(line for line in lines[:6] if line) or type(error).__name__
