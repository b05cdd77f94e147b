"""An MkDocs hook that lists a paper's row configs on its page, each with the comment at the top of its file.

A page line ``<!-- conf-rows: conf/fedsls -->`` becomes one collapsible table per folder under ``conf/fedsls/``:
every YAML file and what its first comment says (the table, dataset, rule and the paper's number), read from
the files at build time, so the list never falls behind the configs.
"""

from __future__ import annotations

import re
from pathlib import Path

PLACEHOLDER = re.compile(r"^<!-- conf-rows: (?P<folder>\S+) -->$", flags=re.MULTILINE)


def header_comment(path: Path) -> str:
    """The comment lines at the top of a YAML file, joined into one line."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(line for line in lines if line)


def markdown_cell(text: str) -> str:
    r"""``text`` safe in a Markdown table cell: ``|``, ``*`` and ``<`` outside code spans are escaped.

    >>> print(markdown_cell("a|b <row> `x<y|z` *all*"))
    a\|b &lt;row> `x<y\|z` \*all\*
    """
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace("*", "\\*")
    return "`".join(parts).replace("|", "\\|")


def rows_markdown(root: Path, folder: str) -> str:
    """The collapsible tables of every YAML file under ``root / folder``, one per folder, a folder before its own."""
    files = sorted((root / folder).rglob("*.yaml"), key=lambda path: (path.parent.parts, path.name))
    if not files:
        raise FileNotFoundError(f"No YAML file under {root / folder}: fix the conf-rows line that names {folder}.")
    by_folder: dict[Path, list[Path]] = {}
    for path in files:
        by_folder.setdefault(path.parent, []).append(path)
    blocks = []
    for parent, paths in by_folder.items():
        name = parent.relative_to(root).as_posix()
        count = f"{len(paths)} file" + ("s" if len(paths) > 1 else "")
        lines = [f'??? abstract "`{name}/`: {count}"', "", "    | config | what it is |", "    | --- | --- |"]
        lines += [f"    | `{path.name}` | {markdown_cell(header_comment(path))} |" for path in paths]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def expand(markdown: str, root: Path) -> str:
    return PLACEHOLDER.sub(lambda match: rows_markdown(root, match["folder"]), markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return expand(markdown, Path(config["config_file_path"]).parent)
