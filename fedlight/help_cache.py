"""Help pages kept on disk, so that ``fedlight fit --help`` does not wait for torch and Lightning to import.

Writing the help means importing every class whose options it lists, and with them torch and Lightning:
seconds of start-up (most of it Lightning's own imports), for a text that is the same at every call on one
installation. The page of ``fedlight --help`` or ``fedlight <subcommand> --help``, with nothing else on the
command line, is therefore kept in a file the first time it is written, under a key made of everything the
page depends on: the command line, the terminal's width, the Python and package versions, the
``JSONARGPARSE_*`` variables, and the size and modification time of every fedlight source file. A later
request with the same key prints the file without importing anything heavy; any change (an upgrade, an
edited module, a wider terminal) writes the page afresh. A command line with anything more (``--config``,
which changes the defaults shown) is never served from the cache.

The pages shipped in the package (:mod:`fedlight.help_pages`) come first; this cache serves the installations
they were not recorded from (an editable install whose sources were edited, another Python version).

The folder is ``$FEDLIGHT_CACHE_DIR``, else ``$XDG_CACHE_HOME/fedlight``, else ``~/.cache/fedlight``; one
file per subcommand. A folder that cannot be written leaves the help uncached and changes nothing else.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path

HELP_FLAGS = ("-h", "--help")
#: distributions whose versions can change what the help says
DEPENDENCIES = ("jsonargparse", "docstring-parser", "lightning", "torch", "torchmetrics")
PACKAGE = Path(__file__).resolve().parent


def is_help_request(args: Sequence[str]) -> bool:
    """Whether ``args`` asks for a help page and nothing else: ``[--help]`` or ``[<subcommand>, --help]``."""
    if len(args) == 1:
        return args[0] in HELP_FLAGS
    return len(args) == 2 and args[1] in HELP_FLAGS and not args[0].startswith("-")


def cache_dir() -> Path:
    """Where the pages are kept."""
    if os.environ.get("FEDLIGHT_CACHE_DIR"):
        return Path(os.environ["FEDLIGHT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fedlight"


def key(args: Sequence[str], package: Path = PACKAGE) -> str:
    """A digest of everything the help page of ``args`` depends on."""
    digest = hashlib.sha256()
    parts = [repr(list(args)), str(shutil.get_terminal_size().columns), sys.version]
    for name in DEPENDENCIES:
        try:
            parts.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} absent")
    parts += sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("JSONARGPARSE"))
    for path in sorted(package.rglob("*.py")):
        stat = path.stat()
        parts.append(f"{path.relative_to(package)} {stat.st_size} {stat.st_mtime_ns}")
    digest.update("\n".join(parts).encode())
    return digest.hexdigest()


def _file(args: Sequence[str]) -> Path:
    return cache_dir() / f"help-{args[0] if len(args) == 2 else 'fedlight'}.txt"


def lookup(args: Sequence[str], package: Path = PACKAGE) -> str | None:
    """The kept page for ``args``, or ``None`` when it is not a plain help request or no page matches."""
    if not is_help_request(args):
        return None
    try:
        stored, page = _file(args).read_text(encoding="utf-8").split("\n", 1)
    except (OSError, ValueError):
        return None
    return page if stored == key(args, package) else None


def store(args: Sequence[str], page: str, package: Path = PACKAGE) -> None:
    """Keeps ``page`` for ``args``; a folder that cannot be written is left alone."""
    path = _file(args)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(f"{key(args, package)}\n{page}", encoding="utf-8")
        partial.replace(path)  # atomic: a concurrent reader sees the old page or the new one


@contextlib.contextmanager
def recording(args: Sequence[str]) -> Iterator[None]:
    """Captures what the block prints and keeps it as the page of ``args`` if the block exits with status 0."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    except SystemExit as exit_:
        if exit_.code in (0, None) and buffer.getvalue():
            store(args, buffer.getvalue())
        raise
    finally:
        sys.stdout.write(buffer.getvalue())
