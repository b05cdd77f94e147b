"""Every paper row prints the settings its paper states, except where ``docs/rows.md`` lists the departure.

``docs/rows.md`` has, for each of the four papers, a table "Settings taken from the paper" (``rows`` globs relative to
``conf/``, a dotted ``setting`` of the ``--print_config`` output without its ``init_args`` levels, the paper's
``value`` in YAML, and where the paper states it) and a departure table whose ``settings`` column names, in
backticks, the keys each departure changes for the rows of its ``row`` column (``all``, or paths relative to the
paper's folder under ``conf/``; a path ending in ``/`` stands for every row beneath it).

Each row's resolved config is what ``fedlight fit --config <row> --print_config`` prints, parsed in this process once
per row. A row is every YAML file under ``conf/{fedproto,fedsls,fuss,ladd}/``, base files included (they run as rows
too), except the offline twins (``fuss/twin/``, ``fuss/twin_cocostuff/``, ``ladd/twin/``, ``fedproto/scenes*/``), which
the departure tables list as departures wholesale, and the add-ons stacked on a row (files with neither a model nor a
``config:`` key: ``fedproto/analysis.yaml``, ``fedproto/mnist_subset.yaml``).

The check cannot pass by accident: every glob must match a row, every setting must be printed by at least one of its
rows, and every departure that names settings must cover a row that prints each of them.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"
ROWS_MD = REPO / "docs" / "rows.md"
PAPERS = ("fedproto", "fedsls", "fuss", "ladd")
#: the offline twins' folders, relative to conf/: documented as departures wholesale
TWINS = ("fuss/twin", "fuss/twin_cocostuff", "ladd/twin", "fedproto/scenes*")
SETTINGS_HEADER = ["rows", "setting", "value", "the paper"]
DEPARTURES_HEADER = ["row", "departure", "why", "settings"]
ABSENT = "<not printed>"


@dataclass(frozen=True)
class Setting:
    """One line of a paper's settings table."""

    globs: tuple[str, ...]
    key: str
    value: Any
    where: str
    line: int


@dataclass(frozen=True)
class Departure:
    """One line of a paper's departure table; ``paths`` is None for ``all``."""

    paths: tuple[str, ...] | None
    keys: tuple[str, ...]
    text: str
    line: int


@dataclass
class PaperTables:
    """A paper's settings table and departure table."""

    settings: list[Setting]
    departures: list[Departure]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _yaml_value(text: str) -> Any:
    """The cell's YAML value; numbers written as ``5e-5`` (a string to YAML 1.1) are read as numbers."""
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def parse_rows_md(text: str) -> dict[str, PaperTables]:
    """The settings and departure tables of each paper's section (``## … `conf/<paper>/```) of ``docs/rows.md``."""
    tables: dict[str, PaperTables] = {}
    paper, header = None, None
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("## "):
            found = re.search(r"`conf/([^/`]+)/`", line)
            paper = found.group(1) if found else None
            if paper is not None:
                tables.setdefault(paper, PaperTables([], []))
            header = None
            continue
        if not line.startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = cells
            continue
        if set("".join(cells)) <= set("-: ") or paper is None:
            continue
        where = f"docs/rows.md:{number}"
        if header in (SETTINGS_HEADER, DEPARTURES_HEADER):
            assert len(cells) == len(header), f"{where}: expected {len(header)} cells (a '|' inside one?): {line}"
        if header == SETTINGS_HEADER:
            rows, setting, value, source = cells
            keys = _ticked(setting)
            assert _ticked(rows) and len(keys) == 1, f"{where}: expected `globs` | `key` | value | source: {line}"
            value = _yaml_value(_ticked(value)[0] if _ticked(value) else value)
            tables[paper].settings.append(Setting(tuple(_ticked(rows)), keys[0], value, source, number))
        elif header == DEPARTURES_HEADER:
            scope, departure, _why, settings = cells
            paths = None if scope.lower() == "all" else tuple(_ticked(scope))
            tables[paper].departures.append(Departure(paths, tuple(_ticked(settings)), departure, number))
    return tables


def _is_add_on(path: Path) -> bool:
    return not {"model", "config"} & set(yaml.safe_load(path.read_text()) or {})


def paper_rows(paper: str) -> list[str]:
    """The paper's rows, as paths relative to conf/."""
    rows = []
    for path in sorted((CONF / paper).rglob("*.yaml")):
        row = path.relative_to(CONF)
        twin = any(fnmatch.fnmatch(folder.as_posix(), pattern) for folder in row.parents for pattern in TWINS)
        if not twin and not _is_add_on(path):
            rows.append(row.as_posix())
    return rows


def matching(globs: tuple[str, ...], rows: list[str], root: Path = CONF) -> list[str]:
    """The rows (relative to conf/) that the globs (relative to ``root``) match; a glob ending in ``/`` matches
    every row beneath it."""
    found = {
        path.relative_to(CONF).as_posix()
        for pattern in globs
        for path in root.glob(pattern + "**/*.yaml" if pattern.endswith("/") else pattern)
    }
    return [row for row in rows if row in found]


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys to leaf values, without the ``init_args`` levels; lists are leaves."""
    if not isinstance(node, dict) or (not node and prefix):
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(flatten(value, prefix if key == "init_args" else f"{prefix}.{key}" if prefix else key))
    return out


@functools.cache
def _parser():
    from fedlight.cli import build_parser

    return build_parser()


@functools.cache
def resolved(row: str) -> dict[str, Any]:
    """What ``fedlight fit --config conf/<row> --print_config`` prints, flattened."""
    parser = _parser()
    cfg = parser.parse_args(["fit", "--config", str(CONF / row)])
    # --print_config's own dump prints unset (null) entries too; the values were validated by parse_args
    printed = yaml.safe_load(parser.dump(cfg, skip_unset=False, skip_validation=True))["fit"]
    printed.pop("config", None)
    return flatten(printed)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def _departure_rows(paper: str, departure: Departure, rows: list[str]) -> list[str]:
    return list(rows) if departure.paths is None else matching(departure.paths, rows, CONF / paper)


def undocumented(
    paper: str, tables: PaperTables, rows: list[str], config: Callable[[str], dict[str, Any]]
) -> list[str]:
    """Every (row, setting) whose printed value is not the paper's and that no departure names for that row."""
    excused = {
        (row, key)
        for departure in tables.departures
        for row in _departure_rows(paper, departure, rows)
        for key in departure.keys
    }
    found = []
    for setting in tables.settings:
        for row in matching(setting.globs, rows):
            value = config(row).get(setting.key, ABSENT)
            if not same(value, setting.value) and (row, setting.key) not in excused:
                found.append(
                    f"conf/{row}: {setting.key} = {value!r}, the paper's is {setting.value!r} ({setting.where}; "
                    f"docs/rows.md:{setting.line})"
                )
    return found


def vacuous(paper: str, tables: PaperTables, rows: list[str], config: Callable[[str], dict[str, Any]]) -> list[str]:
    """Lines of the tables that check nothing: a glob matching no row, a key no matched row prints."""
    problems = []
    for setting in tables.settings:
        where = f"docs/rows.md:{setting.line}"
        for glob in setting.globs:
            if not matching((glob,), rows):
                problems.append(f"{where}: `{glob}` matches no row of conf/{paper}/")
        matched = matching(setting.globs, rows)
        if matched and not any(setting.key in config(row) for row in matched):
            problems.append(f"{where}: none of its {len(matched)} rows prints `{setting.key}`")
    all_files = [p.relative_to(CONF).as_posix() for p in sorted((CONF / paper).rglob("*.yaml"))]
    for departure in tables.departures:
        where = f"docs/rows.md:{departure.line}"
        for path in departure.paths or ():
            if not matching((path,), all_files, CONF / paper):
                problems.append(f"{where}: `{path}` matches no file under conf/{paper}/")
        if not departure.keys:
            continue
        if departure.paths == ():
            problems.append(f"{where}: names settings, but its row cell is neither `all` nor backticked paths")
            continue
        covered = _departure_rows(paper, departure, rows)
        if not covered:
            problems.append(f"{where}: names settings but covers no checked row")
        for key in departure.keys:
            if covered and not any(key in config(row) for row in covered):
                problems.append(f"{where}: none of the rows it covers prints `{key}`")
    return problems


@pytest.fixture(scope="module")
def tables() -> dict[str, PaperTables]:
    return parse_rows_md(ROWS_MD.read_text())


@pytest.mark.parametrize("paper", PAPERS)
def test_rows_print_their_papers_settings_or_a_listed_departure(paper, tables):
    assert paper in tables, f"docs/rows.md has no section for conf/{paper}/"
    assert tables[paper].settings, f"docs/rows.md has no 'Settings taken from the paper' table for conf/{paper}/"
    assert tables[paper].departures, f"docs/rows.md has no departure table with a settings column for conf/{paper}/"
    rows = paper_rows(paper)
    problems = vacuous(paper, tables[paper], rows, resolved)
    assert not problems, "docs/rows.md's tables check nothing here:\n" + "\n".join(problems)
    found = undocumented(paper, tables[paper], rows, resolved)
    assert not found, (
        f"{len(found)} setting(s) of conf/{paper}/ rows differ from the paper without a departure in docs/rows.md "
        "naming them (fix the row, or list the departure with its reason and the key in its settings column):\n"
        + "\n".join(found)
    )


def test_the_check_reports_a_silent_departure_and_accepts_a_listed_one():
    """A paper value that a row does not hold is reported until a departure names its key for that row."""
    row = "fedsls/cifar10/fedsls_alpha0.5.yaml"
    text = """
## FedSLS: `conf/fedsls/`

| row | departure | why | settings |
|---|---|---|---|
| all | prose without settings | – | |
| `cifar100/` | another dataset's departure | – | `model.optimizer.lr` |

### Settings taken from the paper

| rows | setting | value | the paper |
|---|---|---|---|
| `fedsls/cifar10/fedsls_*.yaml` | `model.optimizer.lr` | `5e-2` | a misprint |
| `fedsls/cifar10/fedsls_*.yaml` | `strategy.tau` | `0.5` | Eq. 7 |
| `fedsls/cifar10/fedsls_*.yaml` | `model.model_kwargs.pretrained` | `true` | Sec. 4.1.3 |
"""
    parsed = parse_rows_md(text)["fedsls"]
    assert [s.value for s in parsed.settings] == [0.05, 0.5, True]
    rows = [row]
    found = undocumented("fedsls", parsed, rows, resolved)
    assert len(found) == 1 and found[0].startswith(f"conf/{row}: model.optimizer.lr = 0.01, the paper's is 0.05")

    # a row whose printed value changed is reported too, and a missing key counts as a difference
    changed = {**resolved(row), "strategy.tau": 0.25}
    del changed["model.model_kwargs.pretrained"]
    found = undocumented("fedsls", parsed, rows, lambda _: changed)
    keys = ("model.optimizer.lr", "strategy.tau", "model.model_kwargs.pretrained")
    assert [line.split(" = ")[0] for line in found] == [f"conf/{row}: {key}" for key in keys]

    listed = parse_rows_md(text.replace("| `cifar100/` |", "| `cifar10/` |"))["fedsls"]
    assert undocumented("fedsls", listed, rows, resolved) == []


def test_a_typo_in_the_tables_is_reported_not_skipped():
    text = """
## FedSLS: `conf/fedsls/`

| row | departure | why | settings |
|---|---|---|---|
| `cifar1O/` | a typo in the path | – | `model.optimizer.lr` |
| `cifar10/` | a typo in the key | – | `model.optimiser.lr` |

### Settings taken from the paper

| rows | setting | value | the paper |
|---|---|---|---|
| `fedsls/cifar10/fedsls_alpha0.5.yml` | `model.optimizer.lr` | `0.01` | Sec. 4.1.3 |
| `fedsls/cifar10/fedsls_alpha0.5.yaml` | `model.optimizer.learning_rate` | `0.01` | Sec. 4.1.3 |
"""
    parsed = parse_rows_md(text)["fedsls"]
    problems = vacuous("fedsls", parsed, ["fedsls/cifar10/fedsls_alpha0.5.yaml"], resolved)
    assert problems == [
        "docs/rows.md:13: `fedsls/cifar10/fedsls_alpha0.5.yml` matches no row of conf/fedsls/",
        "docs/rows.md:14: none of its 1 rows prints `model.optimizer.learning_rate`",
        "docs/rows.md:6: `cifar1O/` matches no file under conf/fedsls/",
        "docs/rows.md:6: names settings but covers no checked row",
        "docs/rows.md:7: none of the rows it covers prints `model.optimiser.lr`",
    ]
