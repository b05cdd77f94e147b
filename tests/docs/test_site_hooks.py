"""The documentation site's build code (``docs/hooks/``): docstrings from reST to Markdown, the rows' tables, the
benchmarks' figures, lists as GitHub reads them. CI's strict build runs them whole; these tests pin what each
one writes."""

import doctest
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HOOKS = REPO / "docs" / "hooks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"site_{name}", HOOKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rest_markdown = load("rest_markdown")
conf_rows = load("conf_rows")
repository_images = load("repository_images")
github_lists = load("github_lists")


@pytest.mark.parametrize("module", [rest_markdown, conf_rows, github_lists], ids=lambda module: module.__name__)
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_roles_link_their_resolved_target_and_show_the_name_as_written():
    resolved = {"Strategy.check": "fedlight.strategies.base.Strategy.check"}
    text = "Calls :meth:`Strategy.check` and\n:class:`~fedlight.bank.ModelBank`; :mod:`fedlight.state`."
    assert rest_markdown.rest_to_markdown(text, lambda name: resolved.get(name, name)) == (
        'Calls <autoref identifier="fedlight.strategies.base.Strategy.check" optional><code>Strategy.check</code>'
        "</autoref> and\n"
        '<autoref identifier="fedlight.bank.ModelBank" optional><code>ModelBank</code></autoref>; '
        '<autoref identifier="fedlight.state" optional><code>fedlight.state</code></autoref>.'
    )


def test_a_literal_block_under_a_section_is_fenced_at_its_indentation_and_its_roles_kept():
    text = "Args:\n    x: the layout, one of::\n\n        a  :class:`B`\n          c\n\n    y: next."
    assert rest_markdown.rest_to_markdown(text).split("\n") == [
        "Args:",
        "    x: the layout, one of:",
        "",
        "    ```text",
        "    a  :class:`B`",
        "      c",
        "    ```",
        "",
        "    y: next.",
    ]


def test_a_lone_double_colon_line_leaves_no_colon_behind():
    assert rest_markdown.rest_to_markdown("One round ::\n\n    plan\n").split("\n")[:4] == [
        "One round ",
        "",
        "```text",
        "plan",
    ]


def test_simple_table_with_a_header_and_text_past_its_column():
    text = "\n".join(
        [
            "Parts:",
            "",
            "======  ========  =====",
            "part    shape     lr",
            "======  ========  =====",
            "``a``   ``[B, C] → [B, D]``  5e-4",
            "``b|c`` M         5e-3",
            "        more",
            "======  ========  =====",
            "",
            "After.",
        ]
    )
    assert rest_markdown.rest_to_markdown(text).split("\n") == [
        "Parts:",
        "",
        "",
        "| part | shape | lr |",
        "| --- | --- | --- |",
        "| ``a`` | ``[B, C] → [B, D]`` | 5e-4 |",
        "| ``b\\|c`` | M more | 5e-3 |",
        "",
        "",
        "After.",
    ]


def test_bare_doctests_are_fenced_and_those_of_an_examples_section_left_to_the_docstring_parser():
    text = "Sum.\n\n>>> f([1])\n[1]\n\nExample:\n    >>> f([2])\n    [2]"
    assert rest_markdown.rest_to_markdown(text).split("\n") == [
        "Sum.",
        "",
        "```pycon",
        ">>> f([1])",
        "[1]",
        "```",
        "",
        "Example:",
        "    >>> f([2])",
        "    [2]",
    ]


def test_fenced_code_is_left_as_it_is():
    text = "```python\nx = 1  # ::\n:class:`A`\n```\n:class:`A`"
    assert rest_markdown.rest_to_markdown(text).split("\n")[:4] == text.split("\n")[:4]


def test_conf_rows_one_table_per_folder_with_each_file_s_header_comment(tmp_path):
    paper = tmp_path / "conf" / "paper"
    (paper / "data").mkdir(parents=True)
    (paper / "addon.yaml").write_text("# An add-on\n# on any row.\ntrainer: {}\n")
    (paper / "data" / "base.yaml").write_text("# Shared by the rows | all of them.\n\n# not the header\nseed: 0\n")
    (paper / "data" / "rule_alpha0.1.yaml").write_text("# Table 1, <rule>, `a|b`.\nconfig: base.yaml\n")
    page = "# Paper\n\n<!-- conf-rows: conf/paper -->\n\nAfter.\n"
    assert conf_rows.expand(page, tmp_path) == (
        "# Paper\n\n"
        '??? abstract "`conf/paper/`: 1 file"\n\n'
        "    | config | what it is |\n    | --- | --- |\n"
        "    | `addon.yaml` | An add-on on any row. |\n\n"
        '??? abstract "`conf/paper/data/`: 2 files"\n\n'
        "    | config | what it is |\n    | --- | --- |\n"
        "    | `base.yaml` | Shared by the rows \\| all of them. |\n"
        "    | `rule_alpha0.1.yaml` | Table 1, &lt;rule>, `a\\|b`. |"
        "\n\nAfter.\n"
    )


def test_conf_rows_names_the_line_to_fix_when_its_folder_holds_no_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="conf-rows line that names conf/missing"):
        conf_rows.expand("<!-- conf-rows: conf/missing -->\n", tmp_path)


def test_benchmark_images_are_the_committed_figures_not_the_scripts_outputs(tmp_path):
    (tmp_path / "benchmarks" / "a" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "a" / "out").mkdir()
    (tmp_path / "benchmarks" / "a" / "results" / "curves.png").write_bytes(b"")
    (tmp_path / "benchmarks" / "a" / "results" / "table.md").write_text("")
    (tmp_path / "benchmarks" / "a" / "out" / "run.png").write_bytes(b"")
    assert repository_images.benchmark_images(tmp_path) == ["benchmarks/a/results/curves.png"]


def test_lists_under_a_paragraph_are_separated_but_not_those_in_code_tables_or_lists():
    lines = ["Options:", "- a", "  more", "- b", "", "| x |", "- c", "", "~~~", "text", "1. d", "~~~"]
    assert github_lists.separate_lists(lines) == [
        "Options:",
        "",
        "- a",
        "  more",
        "- b",
        "",
        "| x |",
        "- c",
        "",
        "~~~",
        "text",
        "1. d",
        "~~~",
    ]


def test_griffe_extension_rewrites_the_docstrings_it_loads(tmp_path):
    griffe = pytest.importorskip("griffe")
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""The package; see :class:`~pkg.rule.Rule`."""\n')
    (package / "rule.py").write_text(
        '"""Rules."""\n\n\nclass Rule:\n    """A rule.\n\n    Calls :meth:`Rule.check` and :func:`helper`.\n    """\n\n'
        '    def check(self):\n        """Checks."""\n\n\ndef helper():\n    """Helps."""\n'
    )
    extension = load("griffe_rest").RestDocstrings()
    loaded = griffe.load("pkg", search_paths=[tmp_path], extensions=griffe.load_extensions(extension))
    assert loaded.docstring.value == (
        'The package; see <autoref identifier="pkg.rule.Rule" optional><code>Rule</code></autoref>.'
    )
    assert loaded["rule.Rule"].docstring.value == (
        "A rule.\n\nCalls "
        '<autoref identifier="pkg.rule.Rule.check" optional><code>Rule.check</code></autoref> and '
        '<autoref identifier="pkg.rule.helper" optional><code>helper</code></autoref>.'
    )
