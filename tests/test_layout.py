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


def _class(path: Path, name: str) -> ast.ClassDef:
    return next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == name)


def _assigned_attributes(cls: ast.ClassDef) -> set[str]:
    """The ``self.<name>`` a class's methods assign (plain, annotated, augmented, or one of several targets)."""
    names = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                owner = element.value if isinstance(element, ast.Attribute) else None
                if isinstance(owner, ast.Name) and owner.id == "self":
                    names.add(element.attr)
    return names


def test_assigned_attributes_are_found_in_every_form_of_assignment():
    source = "class A:\n    def f(self):\n        self.a = self.b.c = 1\n        self.d: int = 2\n        self.e += 1\n"
    source += "        self.f, (g, h) = 1, (2, 3)\n        other.x = 4\n"
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef))
    assert _assigned_attributes(cls) == {"a", "d", "e", "f"}


def test_the_engine_keeps_its_files_and_the_trainer_small():
    """A file past ~400 lines or a class past ~25 attributes asks to be split. FederatedTrainer's docstring, which
    ``--help`` reads as the documentation of every ``--trainer`` flag, is not counted in its file."""
    trainer_py = PACKAGE / "engine" / "trainer.py"
    docstring = _class(trainer_py, "FederatedTrainer").body[0]
    sizes = {path.name: len(path.read_text().splitlines()) for path in (PACKAGE / "engine").glob("*.py")}
    sizes["trainer.py"] -= docstring.end_lineno - docstring.lineno + 1
    assert {name: lines for name, lines in sizes.items() if lines > 420} == {}
    assert len(_assigned_attributes(_class(trainer_py, "FederatedTrainer"))) <= 25
