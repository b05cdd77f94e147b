"""Help pages shipped in the package: recorded from the current sources, replayed exactly as the parser writes
them at any terminal width, and served on the first call without torch."""

import json

import pytest

from fedlight import help_pages
from fedlight.cli import build_parser
from tests.test_help_cache import fedlight

WIDTHS = ("40", "80", "117", "200")


@pytest.fixture(scope="module")
def parsers():
    parser = build_parser()
    return {"fedlight": parser, **parser._subcommands_action._name_parser_map}


@pytest.fixture(scope="module")
def shipped():
    return json.loads(help_pages.SHIPPED.read_text(encoding="utf-8"))


def test_the_shipped_pages_were_recorded_from_the_current_sources(shipped):
    assert shipped["sources"] == help_pages.sources_digest(), "stale help pages: run `python -m fedlight.help_pages`"


def test_the_shipped_pages_are_the_parsers_where_they_are_served(shipped):
    """Where this environment is the one the pages were recorded in, they are what the parser records now and
    they are served; anywhere else (another Python, another jsonargparse) they are not served at all."""
    recorded_here = {k: shipped[k] for k in ("format", "python", "versions")} == {
        k: v for k, v in help_pages.installation().items() if k != "sources"
    }
    if recorded_here:
        assert shipped == help_pages.record_all(), "stale help pages: run `python -m fedlight.help_pages`"
        assert help_pages.shipped(["fit", "--help"]) is not None
    else:
        assert help_pages.shipped(["fit", "--help"]) is None


@pytest.mark.parametrize("columns", WIDTHS)
def test_a_replayed_page_is_the_parsers_page_at_every_width(parsers, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", columns)
    for name in help_pages.PAGES:
        page = help_pages.record(parsers[name])  # recorded at this width, replayed at it
        assert help_pages.render(page) == page["page"] == parsers[name].format_help(), name


def test_the_first_call_is_the_recorded_page_without_torch(tmp_path, parsers, monkeypatch):
    recorded = tmp_path / "help_pages.json"
    recorded.write_text(json.dumps(help_pages.record_all()))  # as the package ships it
    monkeypatch.setenv("COLUMNS", "93")
    expected = parsers["fit"].format_help()
    first = fedlight(["fit", "--help"], tmp_path / "empty-cache", columns="93", shipped=str(recorded))
    assert first.returncode == 0 and first.stdout == expected
    assert first.stderr.strip() == "[]"  # neither torch, Lightning nor jsonargparse imported
    assert not (tmp_path / "empty-cache").exists()  # nothing had to be written


def test_pages_of_another_installation_or_other_requests_are_not_served(tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("x = 1\n")
    pages = {"fit": {"prog": "fedlight fit", "ops": [["usage", [{"usage": "[-h]"}]]]}}
    recorded = {**help_pages.installation(package), "pages": pages}
    path = tmp_path / "help_pages.json"
    path.write_text(json.dumps(recorded))
    assert help_pages.shipped(["fit", "--help"], path, package) == "usage: fedlight fit [-h]\n"
    assert help_pages.shipped(["fit", "--config", "a.yaml", "--help"], path, package) is None  # defaults change
    assert help_pages.shipped(["compare", "--help"], path, package) is None  # not shipped
    monkeypatch.setenv("JSONARGPARSE_DEFAULT_ENV", "true")  # adds ENV: lines to the parser's page
    assert help_pages.shipped(["fit", "--help"], path, package) is None
    monkeypatch.delenv("JSONARGPARSE_DEFAULT_ENV")
    (package / "a.py").write_text("x = 2\n")  # an edited module: its docstrings may have changed
    assert help_pages.shipped(["fit", "--help"], path, package) is None
    recorded = {**help_pages.installation(package), "pages": pages, "python": "2.7"}
    path.write_text(json.dumps(recorded))
    assert help_pages.shipped(["fit", "--help"], path, package) is None  # argparse lays pages out per version
