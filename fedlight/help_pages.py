"""Help pages shipped in the package, so that even the first ``fedlight fit --help`` after an install is instant.

Writing a help page means building the parser, which imports every class whose options it lists and with them
torch and Lightning: seconds, for a text that only fedlight's own signatures and docstrings decide. The pages of
``fedlight --help`` and ``fedlight fit|validate|test --help`` are therefore recorded once, when the package is
built, into ``help_pages.json`` next to this file: every piece of the page that does not depend on the terminal
(the usage's parts, each option's invocation and expanded help, the sections and their texts), in the order the
parser's formatter received them. At a call, :func:`shipped` replays them through the standard library's argparse
formatter, which wraps them to the terminal's width exactly as the parser would, without importing anything
heavy.

A page is served only for the installation it was recorded from: the same fedlight sources (a digest of their
contents, so an edited module in an editable install is noticed), the same Python minor version (argparse's layout
changes between them) and the same versions of the packages that write the text (jsonargparse, docstring-parser);
otherwise the page is built by the parser and kept by :mod:`fedlight.help_cache`. ``tests/test_help_pages.py``
checks that the shipped file was recorded from the current sources and, where it was recorded, that it is what
the parser records now, and that a replay equals the parser's page at several widths. After changing any module,
record the pages again (in the environment a release targets)::

    python -m fedlight.help_pages
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from fedlight.help_cache import PACKAGE, is_help_request

SHIPPED = PACKAGE / "help_pages.json"
#: the subcommands whose pages are shipped ("fedlight" is the top-level page)
PAGES = ("fedlight", "fit", "validate", "test")
#: distributions that write the text of a page
WRITERS = ("jsonargparse", "docstring-parser")
FORMAT = 1


def sources_digest(package: Path = PACKAGE) -> str:
    """A digest of the contents of every fedlight module, whose signatures and docstrings make the pages."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def installation(package: Path = PACKAGE) -> dict[str, Any]:
    """What a page's text depends on besides the terminal's width."""
    versions = {}
    for name in WRITERS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "format": FORMAT,
        "python": "{}.{}".format(*sys.version_info[:2]),
        "versions": versions,
        "sources": sources_digest(package),
    }


def shipped(args: Sequence[str], path: Path | None = None, package: Path = PACKAGE) -> str | None:
    """The page of ``args`` replayed at the terminal's width, or ``None`` when ``args`` is not a plain request for
    a shipped page or the shipped pages were recorded from another installation."""
    if not is_help_request(args) or any(k.startswith("JSONARGPARSE") for k in os.environ):
        return None
    name = args[0] if len(args) == 2 else "fedlight"
    if name not in PAGES:
        return None
    try:
        recorded = json.loads((path or SHIPPED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if {k: recorded.get(k) for k in ("format", "python", "versions", "sources")} != installation(package):
        return None
    return render(recorded["pages"][name])


# -- replay -------------------------------------------------------------------------------------------------------
class _Entry:
    """An option as the formatter sees it: its invocation, its usage part, its help already expanded."""

    def __init__(self, entry: dict[str, Any]) -> None:
        self.option_strings = ["-"] if entry.get("optional", True) else []  # options come first in the usage
        self.invocation, self.help, self.usage = entry.get("invocation"), entry.get("help"), entry.get("usage")
        self._sub = [_Entry(sub) for sub in entry.get("sub", [])]

    def _get_subactions(self) -> list[_Entry]:
        return self._sub


class _Replay(argparse.HelpFormatter):
    """argparse's formatter over recorded pieces: argparse decides only the layout at the terminal's width."""

    def _format_action_invocation(self, action) -> str:
        return action.invocation

    def _expand_help(self, action) -> str:
        return action.help

    def _format_actions_usage(self, actions, groups) -> str:
        return " ".join(self._get_actions_usage_parts(actions, groups))

    def _get_actions_usage_parts(self, actions, groups) -> list[str]:  # what argparse ≥ 3.13 wraps the usage by
        return [action.usage for action in actions if action.usage]


def render(page: dict[str, Any]) -> str:
    """The page, laid out for the terminal's width as the parser's own formatter lays it out."""
    formatter = _Replay(prog=page["prog"])
    for kind, *value in page["ops"]:
        if kind == "usage":
            formatter.add_usage(None, [_Entry(entry) for entry in value[0]], [])
        elif kind == "text":
            formatter.add_text(value[0])
        elif kind == "section":
            formatter.start_section(value[0])
        elif kind == "end":
            formatter.end_section()
        else:
            formatter.add_argument(_Entry(value[0]))
    return formatter.format_help()


# -- recording (imports the parser: run when the package is built, and by the tests) ------------------------------
def record(parser) -> dict[str, Any]:
    """The page of ``parser`` (a jsonargparse parser with fedlight's formatter) as the pieces its formatter
    receives, none of which depends on the terminal's width."""
    from fedlight.cli import _plain

    ops: list[list[Any]] = []
    usage: list[dict[str, Any]] = []

    class Recording(parser.formatter_class):
        def add_usage(self, usage_text, actions, groups, prefix=None):
            assert usage_text is None and prefix is None and not groups, "a page with a custom usage or groups"
            ops.append(["usage", usage])
            super().add_usage(usage_text, actions, groups, prefix)

        def _format_actions_usage(self, actions, groups):
            if not usage:  # the first call lists every action of the usage, options first
                for action in actions:
                    part = super()._format_actions_usage([action], [])
                    usage.append({"optional": bool(action.option_strings), "usage": part})
            return super()._format_actions_usage(actions, groups)

        def add_text(self, text):
            if text is not argparse.SUPPRESS and text is not None:
                ops.append(["text", _plain(text % {"prog": self._prog} if "%(prog)" in text else text)])
            super().add_text(text)

        def start_section(self, heading):
            ops.append(["section", _plain(heading) if heading else heading])
            super().start_section(heading)

        def end_section(self):
            ops.append(["end"])
            super().end_section()

        def add_argument(self, action):
            if action.help is not argparse.SUPPRESS:
                ops.append(["argument", self._entry(action)])
            super().add_argument(action)

        def _entry(self, action) -> dict[str, Any]:
            text = action.help
            if (text is None or text.strip()) and text != argparse.SUPPRESS:
                expanded = self._expand_help(action)  # jsonargparse writes a missing help from type and default
                text = _plain(expanded) if expanded and expanded.strip() else text
            entry = {"invocation": self._format_action_invocation(action), "help": text}
            if hasattr(action, "_get_subactions"):
                entry["sub"] = [self._entry(sub) for sub in action._get_subactions()]
            return entry

    saved = parser.formatter_class
    parser.formatter_class = Recording
    try:
        page = parser.format_help()
    finally:
        parser.formatter_class = saved
    return {"prog": parser.prog, "ops": ops, "page": page}


def record_all() -> dict[str, Any]:
    """Every shipped page of the current sources, with what they depend on."""
    from fedlight.cli import build_parser

    parser = build_parser()
    parsers = {"fedlight": parser, **parser._subcommands_action._name_parser_map}
    pages = {}
    for name in PAGES:
        page = record(parsers[name])
        del page["page"]
        pages[name] = page
    return {**installation(), "pages": pages}


def main() -> None:
    """Records the pages of the current sources into ``help_pages.json``."""
    SHIPPED.write_text(json.dumps(record_all(), ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"fedlight: recorded {', '.join(PAGES)} into {SHIPPED}")


if __name__ == "__main__":
    main()
