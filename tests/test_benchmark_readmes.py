"""Every table of measured numbers in ``benchmarks/*/README.md`` names the commit and the command behind it.

The rule, as this file checks it:

- A *table* is a pipe table: a line starting with ``|``, then a delimiter row (cells of ``-`` with an optional
  ``:`` at either end), then every following line that starts with ``|`` (its body). Lines inside fenced code
  blocks (```` ``` ```` or ``~~~``) are neither tables nor headings.
- A table *holds numbers* when at least one body cell, once its inline code spans and ``*``/``_`` emphasis are
  removed, begins with a digit, or with one of ``+ - − ± ~ ≈ < > ≤ ≥`` and then a digit (``82.1 ± 0.6``,
  ``−0.61``, ``1,024 (one block)``, ``32-true``). Tables that only list scripts, options, flags or words are
  exempt: a digit inside a word (``CIFAR-10``), inside a code span (```--scale 16```) or later in a cell of prose
  (``Fig. 5``) does not make a table hold numbers.
- A table's *context* is the text from the line after the previous heading or the previous table, whichever is
  nearer, down to the line before the table. Fenced code blocks in it count for (b) below only.
- The context of a table that holds numbers must contain both

  (a) ``commit <sha>``, the sha 7 to 40 hex digits, bare or in backticks (``Recorded at commit `1a2b3c4```): the
      commit at which its numbers were measured or recorded (rows of several commits: ``commits `1a2b3c4` (a),
      `5d6e7f8` (b) and `9a0b1c2` (c)``); and
  (b) the command that produced them: an inline code span, or a line of a fenced code block, that starts with
      ``python benchmarks/`` (or ``bash benchmarks/`` for a script of runs), or, for numbers taken from the
      command line, with ``fedlight ``, ``python -m `` or ``python -X ``, after any environment assignments
      (``OMP_NUM_THREADS=1 python benchmarks/…``);

  or, for numbers that this repository's code did not measure (a paper's published numbers, a preset's settings),
  the marker ``<!-- not measured: <what they are> -->``.

Every sha so cited must name exactly one commit in the history of ``HEAD``. That one check is skipped where the
checkout has no ``.git`` (an unpacked archive) or is shallow (CI's default ``actions/checkout``, which holds only the
newest commit); the rest of the rule is checked everywhere.
"""

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = sorted(ROOT.glob("benchmarks/*/README.md"))

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s")
DELIMITER = re.compile(r"^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
NUMBER_CELL = re.compile(r"^[+\-−±~≈<>≤≥]?\s*\d")
COMMIT = re.compile(r"\bcommits?\s+(?=`?[0-9a-fA-F]{7,40}\b)")
SHA = re.compile(r"`?([0-9a-fA-F]{7,40})\b`?")
LIST_GAP = re.compile(r"\s*(,\s*)?((and|or)\s+)?")
COMMAND = re.compile(r"^([A-Z_]+=\S*\s+)*(python benchmarks/|bash benchmarks/|fedlight |python -m |python -X )")
NOT_MEASURED = re.compile(r"<!--\s*not measured:\s*\S.*?-->")


@dataclass
class Table:
    path: Path
    line: int  # 1-based line of the header row
    header: str
    body: list[str]
    context: list[str] = field(default_factory=list)
    code: list[str] = field(default_factory=list)  # lines of fenced code blocks in the context

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.header.strip()}"


def cells(row: str) -> list[str]:
    """A row's cells, split at pipes not escaped with a backslash."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def holds_numbers(table: Table) -> bool:
    for row in table.body:
        for cell in cells(row):
            text = re.sub(r"[*_]+", "", CODE_SPAN.sub("", cell)).strip()
            if NUMBER_CELL.match(text):
                return True
    return False


def tables(path: Path) -> list[Table]:
    """The tables of one README, each with its context (see the module's docstring)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    found: list[Table] = []
    context: list[str] = []
    code: list[str] = []
    fenced = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            fenced = not fenced
            i += 1
            continue
        if fenced:
            code.append(line)
            i += 1
            continue
        if HEADING.match(line):
            context, code = [], []
            i += 1
            continue
        if line.lstrip().startswith("|") and i + 1 < len(lines) and DELIMITER.match(lines[i + 1]):
            end = i + 2
            while end < len(lines) and lines[end].lstrip().startswith("|"):
                end += 1
            found.append(Table(path, i + 1, line, lines[i + 2 : end], context, code))
            context, code = [], []
            i = end
            continue
        context.append(line)
        i += 1
    return found


def number_tables() -> list[Table]:
    return [table for path in READMES for table in tables(path) if holds_numbers(table)]


def commits_of(table: Table) -> list[str]:
    """Every sha cited as ``commit <sha>``, or listed as ``commits <sha> (what), <sha> and <sha>``."""
    text = " ".join(table.context)
    shas = []
    for start in COMMIT.finditer(text):
        at = start.end()
        while sha := SHA.match(text, at):
            shas.append(sha.group(1))
            at = sha.end()
            if text.startswith(" (", at):  # a parenthesis saying what the commit holds
                depth, at = 0, at + 1
                while at < len(text):
                    depth += {"(": 1, ")": -1}.get(text[at], 0)
                    at += 1
                    if depth == 0:
                        break
            at = LIST_GAP.match(text, at).end()
    return shas


def has_command(table: Table) -> bool:
    spans = [span for _, span in CODE_SPAN.findall("\n".join(table.context))]
    return any(COMMAND.match(text.strip()) for text in spans + table.code)


def not_measured(table: Table) -> bool:
    return bool(NOT_MEASURED.search("\n".join(table.context)))


def test_the_rule_tells_number_tables_from_word_tables(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Title\n\n"
        "| script | what |\n|---|---|\n| `run.py --scale 16` | CIFAR-10, Fig. 5 |\n\n"
        "```bash\n# not a heading\n| not | a table |\n```\n"
        "Recorded at commit `1a2b3c4` with `python benchmarks/x/run.py --seed 0`:\n\n"
        "| rule | accuracy |\n|:---|---:|\n| **FedAvg** | **−0.61 ± 0.2** |\n\n"
        "| rule | accuracy |\n|---|---|\n| FedAvg | 82.1 |\n"
    )
    word_table, first, second = tables(readme)
    assert not holds_numbers(word_table)
    assert holds_numbers(first) and holds_numbers(second)
    assert commits_of(first) == ["1a2b3c4"] and has_command(first)
    assert commits_of(second) == [] and not has_command(second)  # the context starts after the previous table


def test_every_number_table_names_its_commit_and_command():
    found = number_tables()
    assert READMES and found, "no benchmark README or no table of numbers found"
    offenders = []
    for table in found:
        if not_measured(table):
            continue
        missing = [
            what
            for what, ok in (
                ("no 'commit <sha>'", commits_of(table)),
                ("no command (`python benchmarks/…`, `fedlight …`, `python -m …`)", has_command(table)),
            )
            if not ok
        ]
        if missing:
            offenders.append(f"{table.where}  ({'; '.join(missing)})")
    assert not offenders, (
        f"{len(offenders)} of {len(found)} tables of numbers do not say which commit and command produced them "
        "(see this file's docstring):\n" + "\n".join(offenders)
    )


def test_the_cited_commits_are_in_the_history():
    if not (ROOT / ".git").exists():
        pytest.skip("no .git: the commits cannot be looked up")
    shallow = subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    if shallow.stdout.strip() == "true":
        pytest.skip("a shallow clone holds only part of the history")
    history = subprocess.run(
        ["git", "rev-list", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    offenders = []
    for table in number_tables():
        for sha in commits_of(table):
            matches = [commit for commit in history if commit.startswith(sha.lower())]
            if len(matches) != 1:
                why = "not in the history of HEAD" if not matches else "ambiguous"
                offenders.append(f"{table.where}  (commit {sha}: {why})")
    assert not offenders, "\n".join(offenders)
