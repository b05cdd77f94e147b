"""Help pages kept on disk: the same text as the parser writes, served without importing torch or Lightning,
and written afresh whenever anything the page depends on changes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedlight import help_cache

REPO = Path(__file__).resolve().parents[1]
SHOW_IMPORTS = """
import sys
from pathlib import Path
from fedlight import help_pages
from fedlight.__main__ import main
shipped = {shipped!r}
if shipped is not True:  # no shipped pages, or those of another file
    help_pages.SHIPPED = Path(shipped or "no-shipped-pages.json")
try:
    main({args!r})
finally:  # also after the parser's help, which exits
    print(sorted(m for m in ("torch", "lightning", "jsonargparse") if m in sys.modules), file=sys.stderr)
"""


def fedlight(args, cache, columns="100", shipped=False):
    """``fedlight <args>`` in a fresh process; by default without shipped pages, so the cache is what serves
    (``shipped``: True for the package's pages, or the path of another recording)."""
    env = dict(os.environ, FEDLIGHT_CACHE_DIR=str(cache), COLUMNS=columns)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    code = SHOW_IMPORTS.format(args=list(args), shipped=shipped)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)


def test_a_kept_page_is_the_parsers_page_and_needs_no_torch(tmp_path):
    first = fedlight(["fit", "--help"], tmp_path)  # builds the parser, prints and keeps its page
    assert first.returncode == 0 and "--trainer.rounds" in first.stdout
    assert "'torch'" in first.stderr and "'lightning'" in first.stderr
    second = fedlight(["fit", "--help"], tmp_path)
    assert second.returncode == 0 and second.stdout == first.stdout
    assert second.stderr.strip() == "[]"  # nothing heavy imported
    wider = fedlight(["fit", "--help"], tmp_path, columns="140")  # another width: written afresh
    assert "'lightning'" in wider.stderr and wider.stdout != first.stdout
    assert len(wider.stdout.splitlines()) < len(first.stdout.splitlines())  # wrapped for the wider terminal


def test_only_plain_help_requests_are_served():
    assert help_cache.is_help_request(["--help"]) and help_cache.is_help_request(["validate", "-h"])
    assert not help_cache.is_help_request(["fit", "--config", "x.yaml", "--help"])  # the config sets defaults
    assert not help_cache.is_help_request(["fit"]) and not help_cache.is_help_request([])
    assert not help_cache.is_help_request(["--trainer.rounds=3", "--help"])


def make_package(root: Path) -> Path:
    package = root / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text("x = 1\n")
    (package / "sub" / "b.py").write_text("y = 2\n")
    return package


def test_the_key_follows_the_sources_the_versions_and_the_width(tmp_path, monkeypatch):
    package = make_package(tmp_path)
    monkeypatch.setenv("COLUMNS", "100")
    base = help_cache.key(["fit", "--help"], package)
    assert help_cache.key(["fit", "--help"], package) == base
    assert help_cache.key(["test", "--help"], package) != base
    monkeypatch.setenv("COLUMNS", "80")
    assert help_cache.key(["fit", "--help"], package) != base
    monkeypatch.setenv("COLUMNS", "100")
    stat = (package / "sub" / "b.py").stat()
    os.utime(package / "sub" / "b.py", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # an edited module
    edited = help_cache.key(["fit", "--help"], package)
    assert edited != base
    real = help_cache.metadata.version
    monkeypatch.setattr(help_cache.metadata, "version", lambda name: "0.0" if name == "lightning" else real(name))
    assert help_cache.key(["fit", "--help"], package) != edited  # an upgrade
    monkeypatch.setenv("JSONARGPARSE_DEFAULT_ENV", "true")
    assert help_cache.key(["fit", "--help"], package) != edited


def test_a_stale_page_is_not_served(tmp_path, monkeypatch):
    package = make_package(tmp_path)
    monkeypatch.setenv("FEDLIGHT_CACHE_DIR", str(tmp_path / "cache"))
    help_cache.store(["fit", "--help"], "usage: fedlight fit ...\n", package)
    assert help_cache.lookup(["fit", "--help"], package) == "usage: fedlight fit ...\n"
    assert help_cache.lookup(["validate", "--help"], package) is None  # another page
    (package / "c.py").write_text("z = 3\n")  # a new module
    assert help_cache.lookup(["fit", "--help"], package) is None


def test_a_failed_help_is_not_kept_and_an_unwritable_folder_changes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FEDLIGHT_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(SystemExit), help_cache.recording(["nonsense", "--help"]):
        print("usage: fedlight ...\nerror: invalid choice")
        raise SystemExit(2)
    assert "invalid choice" in capsys.readouterr().out  # still shown
    assert not (tmp_path / "cache").exists()

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("FEDLIGHT_CACHE_DIR", str(blocker / "cache"))  # under a file: cannot be created
    with pytest.raises(SystemExit), help_cache.recording(["fit", "--help"]):
        print("usage: fedlight fit")
        raise SystemExit(0)
    assert capsys.readouterr().out == "usage: fedlight fit\n"
    assert help_cache.lookup(["fit", "--help"]) is None
