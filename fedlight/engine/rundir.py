"""The run folder ``<default_root_dir>/<name>/version_<n>/``: allocating it, one writer at a time, leftovers.

- ``version_<n>`` is claimed with ``mkdir``, which fails for all but one of several processes that start
  together; the losers move on to the next number.
- :class:`RunLock` lets one process write a run folder at a time: ``run.lock`` names its owner (pid, host,
  start time) and is held with ``flock``, which the kernel releases when the owner dies, so a lock left by a
  killed run is taken over by the next one.
- A run killed while writing leaves ``*.tmp`` files; :func:`remove_temporaries` deletes them once the folder
  is locked.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from fedlight import checkpoint as ckpt_io
from fedlight.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_NAME = "run.lock"


def check_root(root: Path, name: str) -> list[str]:
    """Problems with ``--trainer.default_root_dir`` and ``--trainer.name``, found before anything is written.

    The nearest existing ancestor of ``root`` must be a writable folder, and ``name`` must stay inside it.

    >>> check_root(Path("/tmp"), "../elsewhere")[0].split(";")[0]
    "--trainer.name='../elsewhere' leads outside --trainer.default_root_dir"
    """
    problems = []
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or ".." in parts:
        problems.append(
            f"--trainer.name={name!r} leads outside --trainer.default_root_dir; use a plain folder name such as "
            "'fedavg'."
        )
    return problems + folder_problems(root, "--trainer.default_root_dir", "a folder for the runs")


def folder_problems(folder: Path, flag: str, what: str) -> list[str]:
    """Whether ``folder`` can be created and written: its nearest existing ancestor must be a writable folder.

    >>> folder_problems(Path("/dev/null/runs"), "--flag", "a folder")
    ['--flag=/dev/null/runs: /dev/null is a file, not a folder. Pass a folder.']
    """
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return [f"{flag}={folder}: {existing} is a file, not a folder. Pass {what}."]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"{flag}={folder}: {existing} is not writable. Pass {what} you can write to."]
    return []


def new_version_dir(parent: Path, attempts: int = 1000) -> Path:
    """Creates and returns ``parent/version_<n>`` with the next free ``n``, safe against concurrent starts."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for _ in range(attempts):
            versions = [int(p.name[8:]) for p in parent.glob("version_*") if p.name[8:].isdigit()]
            run_dir = parent / f"version_{max(versions, default=-1) + 1}"
            try:
                run_dir.mkdir()
                return run_dir
            except FileExistsError:  # another process took this number a moment ago
                continue
    except OSError as err:
        raise ConfigError(
            f"Cannot create a run folder under {parent} ({err.strerror}). Check --trainer.default_root_dir and "
            "--trainer.name: the folder must be writable and on a disk with free space."
        ) from None
    raise ConfigError(f"Could not claim a free version_<n> folder under {parent} after {attempts} attempts.")


class RunLock:
    """The one-writer lock of a run folder: ``<run_dir>/run.lock``, held with ``flock`` while the run writes."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Takes the lock, or raises :class:`ConfigError` naming the process that holds it.

        A lock file whose owner died is free to ``flock`` and is taken over, noting the dead owner.
        """
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                os.close(fd)
                raise ConfigError(
                    f"The run folder {self.path.parent} is in use by process {owner.get('pid', '?')} on "
                    f"{owner.get('host', '?')} (since {owner.get('since', '?')}): two processes writing one run "
                    "would mix their checkpoints and metrics. Wait for it to end or stop it; to start a separate "
                    "run, leave out --ckpt_path."
                ) from None
            try:  # the file may have been removed by its previous owner between our open and flock
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = _read_owner(fd)
        if previous:
            log.warning(
                "Taking over %s left by process %s on %s, which no longer runs.",
                self.path, previous.get("pid"), previous.get("host"),
            )  # fmt: skip
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Removes the lock file and lets it go (a no-op when not held)."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still held, so no one locks a file that is going away
        os.close(self._fd)
        self._fd = None


def _read_owner(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}


def remove_temporaries(run_dir: Path) -> list[Path]:
    """Deletes the ``*.tmp`` files a killed write left in ``run_dir`` and its ``checkpoints/``; returns them.

    Call only with the folder locked: a running writer's temporary file is not a leftover.
    """
    leftovers = [*run_dir.glob("*.tmp"), *run_dir.glob(".*.tmp"), *(run_dir / "checkpoints").glob(".*.tmp")]
    for path in leftovers:
        path.unlink(missing_ok=True)
    if leftovers:
        log.info("Removed %d unfinished file(s) of an interrupted write: %s", len(leftovers), leftovers)
    return leftovers


class RunFolder:
    """The folder a run writes (rank 0), claimed or continued and locked until :meth:`release`.

    Args:
        root: ``<default_root_dir>/<name>``, under which new runs get a ``version_<n>``.
        rewind: whether a resume may continue a folder whose own last checkpoint is of a later round.
    """

    def __init__(self, root: Path, rewind: bool) -> None:
        self.root = root
        self.rewind = rewind
        self._lock: RunLock | None = None

    def new(self) -> Path:
        """A fresh ``version_<n>``, claimed and locked."""
        run_dir = new_version_dir(self.root)
        self._lock_folder(run_dir)
        return run_dir

    def resumed(self, ckpt_path: Path, state: dict) -> Path:
        """The run folder a resume continues, locked: the one the checkpoint belongs to.

        That is the folder recorded in the checkpoint; for a checkpoint that records none, or whose folder
        was moved, the folder around ``checkpoints/``; for a loose copy of a checkpoint, a new folder. A folder
        whose own last checkpoint is of a later round is not rewound unless ``rewind`` says so.
        """
        run_dir = recorded_run_dir(ckpt_path, state)
        if run_dir is None:
            log.warning("%s belongs to no run folder; the run continues in a new one.", ckpt_path)
            return self.new()
        self._lock_folder(run_dir)
        try:
            own = run_dir / "checkpoints" / ckpt_io.LAST
            later = None if _same_file(own, ckpt_path) else ckpt_io.saved_round(own)
            if later is not None and later > state["round"] and not self.rewind:
                raise ConfigError(
                    f"--ckpt_path {ckpt_path} holds round {state['round']}, but its run folder {run_dir} has "
                    f"already reached round {later} ({own}); resuming would replace the later rounds. Continue "
                    f"the run with --ckpt_path {own}, or pass --trainer.rewind=true to go back to round "
                    f"{state['round']} on purpose."
                )
        except BaseException:
            self.release()
            raise
        return run_dir

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _lock_folder(self, run_dir: Path) -> None:
        lock = RunLock(run_dir)
        lock.acquire()
        self._lock = lock
        remove_temporaries(run_dir)


def recorded_run_dir(ckpt_path: Path, state: dict) -> Path | None:
    """The run folder a checkpoint belongs to: the one it records if it still exists, else the folder around
    its ``checkpoints/`` (an older checkpoint, or a moved run), else None (a loose copy)."""
    recorded = state.get("run_dir")
    if recorded is not None and Path(recorded).is_dir():
        return Path(recorded)
    ckpt_path = ckpt_path.resolve()
    return ckpt_path.parent.parent if ckpt_path.parent.name == "checkpoints" else None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
