"""The package's rooms: what rules, clients and callbacks may import, and the size the engine's files keep."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fedlight"


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (``from x import y`` gives ``x``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_rules_clients_callbacks_and_the_contract_never_import_the_engine():
    rooms = ["strategies", "clients", "callbacks", "models", "metrics", "data"]
    files = [p for room in rooms for p in (PACKAGE / room).rglob("*.py")]
    contract = ("context", "plans", "gather", "passes", "state", "bank", "teachers", "client_state")
    files += [PACKAGE / f"{name}.py" for name in contract]
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(m for m in imported_modules(path) if m.startswith("fedlight.engine"))
        for path in files
    }
    assert {path: modules for path, modules in offenders.items() if modules} == {}


def test_callbacks_do_not_import_rules():
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(m for m in imported_modules(path) if m.startswith("fedlight.strategies"))
        for path in (PACKAGE / "callbacks").rglob("*.py")
    }
    # figures of a rule's own state live with the rule; analyses read passes, not rules
    assert {path: modules for path, modules in offenders.items() if modules} == {}
