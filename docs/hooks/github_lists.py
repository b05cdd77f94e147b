"""An MkDocs hook that reads lists as GitHub does: a list may start right under a paragraph line.

The READMEs the site includes write ``Options:`` and the list below it without a blank line between them, which
GitHub renders as a list and Python-Markdown as one paragraph. A blank line is added before such a list after the
includes are expanded and before fenced code is set aside; code blocks are left as they are.
"""

from __future__ import annotations

import re

LIST_ITEM = re.compile(r"^ {0,3}(?:[-*+]|\d+\.) +\S")
FENCE = re.compile(r"^\s*(```|~~~)")


def separate_lists(lines: list[str]) -> list[str]:
    """``lines`` with a blank line between a paragraph line and a list item that follows it.

    >>> separate_lists(["Options:", "- a", "- b", "", "```yaml", "x:", "- c", "```"])
    ['Options:', '', '- a', '- b', '', '```yaml', 'x:', '- c', '```']
    """
    out: list[str] = []
    fence = None  # the marker of the fenced block we are in
    in_list = False
    for line in lines:
        marker = FENCE.match(line)
        if fence:
            fence = None if marker and marker[1] == fence else fence
        elif marker:
            fence = marker[1]
        elif LIST_ITEM.match(line):
            if not in_list and out and out[-1].strip() and not out[-1].lstrip().startswith(("|", "#", ">")):
                out.append("")
            in_list = True
        elif not line.strip():
            in_list = False
        out.append(line)
    return out


def on_config(config):
    from markdown.extensions import Extension
    from markdown.preprocessors import Preprocessor

    class SeparateLists(Preprocessor):
        def run(self, lines: list[str]) -> list[str]:
            return separate_lists(lines)

    class GitHubLists(Extension):
        def extendMarkdown(self, md) -> None:
            # after the includes (pymdownx.snippets, 32), before fenced code is set aside (25)
            md.preprocessors.register(SeparateLists(md), "github_lists", 27)

    config.markdown_extensions.append(GitHubLists())
    return config
