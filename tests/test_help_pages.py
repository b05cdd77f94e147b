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


def test_the_shipped_pages_are_those_the_current_sources_record():
    shipped = json.loads(help_pages.SHIPPED.read_text(encoding="utf-8"))
    assert shipped == help_pages.record_all(), "stale help pages: run `python -m fedlight.help_pages`"


@pytest.mark.parametrize("columns", WIDTHS)
def test_a_replayed_page_is_the_parsers_page_at_every_width(parsers, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", columns)
    shipped = json.loads(help_pages.SHIPPED.read_text(encoding="utf-8"))["pages"]
    for name in help_pages.PAGES:
        assert help_pages.render(shipped[name]) == parsers[name].format_help(), name


def test_the_first_call_is_the_shipped_page_without_torch(tmp_path, parsers, monkeypatch):
    monkeypatch.setenv("COLUMNS", "93")
    expected = parsers["fit"].format_help()
    first = fedlight(["fit", "--help"], tmp_path / "empty-cache", columns="93", shipped=True)
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
