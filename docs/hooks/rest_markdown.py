"""fedlight's docstrings, written for Sphinx (Google sections with reST inside), as the site's Markdown.

Three reST constructs would render wrongly as Markdown, and are rewritten before the docstrings are parsed:

- roles, ``:class:`~fedlight.bank.ModelBank```, become cross-references to the named object, shown as code
  (the last component with ``~``, the whole target without); a target the site does not document is shown as
  code without a link, never as a broken one;
- literal blocks, a paragraph ending in ``::`` and the indented block after it, become fenced code blocks
  (Markdown would read the block as a paragraph when it is indented under a list or a section);
- simple tables, columns under rules of ``=``, become Markdown tables (Markdown would read the rules as
  headings);
- doctests outside an ``Examples`` section (which the docstring parser handles itself) become fenced code
  (Markdown would read ``>>>`` as quotes).

Nothing else changes: double-backquoted literals, emphasis and lists mean the same in both.
"""

from __future__ import annotations

import html
import re
import textwrap
from collections.abc import Callable

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc|const):`(?P<body>[^`]+)`")
TABLE_RULE = re.compile(r"^(?P<indent>[ \t]*)=+(?:[ \t]+=+)+[ \t]*$")


def indentation(line: str) -> int:
    return len(line) - len(line.lstrip())


def role_to_autoref(body: str, resolve: Callable[[str], str]) -> str:
    """One role's target as an optional cross-reference: linked where the site documents it, plain code elsewhere.

    >>> role_to_autoref("~fedlight.bank.ModelBank", lambda name: name)
    '<autoref identifier="fedlight.bank.ModelBank" optional><code>ModelBank</code></autoref>'
    >>> role_to_autoref("the bank <fedlight.bank.ModelBank>", lambda name: name)
    '<autoref identifier="fedlight.bank.ModelBank" optional><code>the bank</code></autoref>'
    """
    explicit = re.fullmatch(r"(?P<title>.*?)\s*<(?P<target>[^<>]+)>", body, flags=re.DOTALL)
    if explicit:
        title, target = explicit["title"], explicit["target"]
    else:
        target = body.strip()
        title = target.lstrip("~").rsplit(".", 1)[-1] if target.startswith("~") else target
    target = target.lstrip("~.")
    title = " ".join(title.split())  # a role may wrap onto the next line
    return f'<autoref identifier="{html.escape(resolve(target))}" optional><code>{html.escape(title)}</code></autoref>'


def roles_to_autorefs(text: str, resolve: Callable[[str], str]) -> str:
    return ROLE.sub(lambda match: role_to_autoref(match["body"], resolve), text)


def simple_table(lines: list[str]) -> list[str]:
    """A reST simple table (its rules included) as Markdown table lines, at the table's indentation.

    >>> simple_table(["==  =====", "a   one", "    more", "b   two", "==  ====="])
    ['|  |  |', '| --- | --- |', '| a | one more |', '| b | two |']
    >>> simple_table(["===  ===  ===", "x    y y  z", "===  ===  ===", "1    2 overflows  3", "===  ===  ==="])
    ['| x | y y | z |', '| --- | --- | --- |', '| 1 | 2 overflows | 3 |']
    """
    indent = indentation(lines[0])
    rules = [i for i, line in enumerate(lines) if TABLE_RULE.match(line)]
    starts = [match.start() for match in re.finditer(r"=+", lines[0])]

    def cells(line: str) -> list[str]:
        # text that runs past its column's rule moves the boundary to the next gap of two spaces
        bounds = [0]
        for start in starts[1:]:
            gap = max(start, bounds[-1])
            if gap < len(line) and line[gap - 1] != " ":
                while gap < len(line) and (line[gap - 2 : gap] != "  " or line[gap] == " "):
                    gap += 1
            bounds.append(gap)
        return [line[a:b].strip() for a, b in zip(bounds, [*bounds[1:], len(line)], strict=True)]

    def rows(body: list[str]) -> list[list[str]]:
        merged: list[list[str]] = []
        for line in body:
            if not line.strip():
                continue
            row = cells(line)
            if merged and not row[0]:  # a blank first column continues the row above
                merged[-1] = [f"{a} {b}".strip() for a, b in zip(merged[-1], row, strict=True)]
            else:
                merged.append(row)
        return merged

    if len(rules) >= 3:  # header between the first two rules
        header = [" ".join(column) for column in zip(*rows(lines[rules[0] + 1 : rules[1]]), strict=True)]
        body = rows(lines[rules[1] + 1 : rules[-1]])
    else:
        header = [""] * len(starts)
        body = rows(lines[rules[0] + 1 : rules[-1]])

    def markdown_row(row: list[str]) -> str:
        return " " * indent + "| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |"

    return [markdown_row(header), " " * indent + "|" + " --- |" * len(starts)] + [markdown_row(row) for row in body]


def literal_block_end(lines: list[str], start: int, indent: int) -> int:
    """The index after the block indented deeper than ``indent`` that starts at ``start`` (blank lines inside)."""
    end = start
    for i in range(start, len(lines)):
        if lines[i].strip():
            if indentation(lines[i]) <= indent:
                break
            end = i + 1
    return end


def rest_to_markdown(text: str, resolve: Callable[[str], str] = lambda name: name) -> str:
    """A docstring's reST roles, literal blocks, simple tables and bare doctests as Markdown.

    ``resolve`` turns a name as the docstring writes it (``Strategy.check``) into the full path the site's
    cross-references use (``fedlight.strategies.base.Strategy.check``).

    >>> print(rest_to_markdown("Runs::\\n\\n    a :class:`B`\\n\\nthen :func:`c`."))
    Runs:
    <BLANKLINE>
    ```text
    a :class:`B`
    ```
    <BLANKLINE>
    then <autoref identifier="c" optional><code>c</code></autoref>.
    """
    lines = text.splitlines()
    out: list[str] = []
    prose: list[str] = []

    def flush_prose() -> None:
        out.extend(roles_to_autorefs("\n".join(prose), resolve).split("\n") if prose else [])
        prose.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):  # already fenced: keep as it is
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), len(lines) - 1)
            flush_prose()
            out.extend(lines[i : end + 1])
            i = end + 1
        elif line.rstrip().endswith("::") and not line.rstrip().endswith(":::"):
            indent = indentation(line)
            start = next((j for j in range(i + 1, len(lines)) if lines[j].strip()), len(lines))
            end = literal_block_end(lines, start, indent)
            stem = line.rstrip()[:-2]
            if stem.strip():
                prose.append(stem if stem.endswith(" ") or stem.endswith("\t") else stem + ":")
            flush_prose()
            if end > start:
                pad = " " * indent
                block = textwrap.dedent("\n".join(lines[start:end])).split("\n")
                out.extend(["", f"{pad}```text", *(pad + code if code else "" for code in block), f"{pad}```"])
            i = end
        elif line.startswith(">>>"):  # a doctest outside an Examples section: Markdown would quote it
            end = next((j for j in range(i, len(lines)) if not lines[j].strip()), len(lines))
            flush_prose()
            out.extend(["```pycon", *lines[i:end], "```"])
            i = end
        elif TABLE_RULE.match(line) and any(TABLE_RULE.match(later) for later in lines[i + 1 :]):
            # two rules close a table without a header; a row right after the second means a header above it
            second = next(j for j in range(i + 1, len(lines)) if TABLE_RULE.match(lines[j]))
            third = next((j for j in range(second + 1, len(lines)) if TABLE_RULE.match(lines[j])), None)
            has_body = second + 1 < len(lines) and lines[second + 1].strip()
            end = third if has_body and third is not None else second
            prose.extend(["", *simple_table(lines[i : end + 1]), ""])
            i = end + 1
        else:
            prose.append(line)
            i += 1
    flush_prose()
    return "\n".join(out)
