"""The package's internal boundaries (docs/architecture.md): only the engine talks to
the binding's manager, no module reaches into another's privates, no module is over
800 lines, and each error text is written once.
"""

from __future__ import annotations

import ast
import runpy
import sys
from collections import defaultdict
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_PACKAGE = _ROOT / "python" / "fhelium" / "residency"

# The subpackages (the device seam, the disk tier, distributed, nn, the demos) keep
# their own rules and tests; these checks cover the package's top-level modules. The
# module size rule covers every module.
_SUBPACKAGES = ("_runtime/", "_disk/", "distributed/", "nn/", "_demos/")
# Private reads the modules named here still make of a subpackage's objects.
_KNOWN = ("export.py:172: ._snapshot",)  # the Timeline's (spans, now) read together

# Below the engine, which imports them: the plan IR's lowering and the record
# builders call `_core`'s stateless functions.
_CORE_LEAVES = {"_engine.py", "_lowering.py", "_records.py"}
# What other modules may import from `_core` outside `TYPE_CHECKING`: nothing now.
_CORE_TYPES: frozenset[str] = frozenset()


def _modules(*, everywhere: bool = False) -> list[Path]:
    return [
        path
        for path in sorted(_PACKAGE.rglob("*.py"))
        if everywhere
        or not any(part in path.relative_to(_PACKAGE).as_posix() for part in _SUBPACKAGES)
    ]


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """The ids of the nodes inside `if TYPE_CHECKING:` blocks."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for child in node.body:
                inside.update(id(sub) for sub in ast.walk(child))
    return inside


def test_only_the_engine_calls_the_binding() -> None:
    offences = []
    for path in _modules():
        name = path.relative_to(_PACKAGE).as_posix()
        tree = ast.parse(path.read_text(), name)
        typing_only = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "core" and name != "_engine.py":
                offences.append(f"{name}:{node.lineno}: .core")
            if name in _CORE_LEAVES or id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module == "fhelium._core":
                for alias in node.names:
                    if alias.name not in _CORE_TYPES:
                        offences.append(f"{name}:{node.lineno}: _core.{alias.name}")
            elif (
                isinstance(node, ast.ImportFrom)
                and node.module == "fhelium"
                and any(alias.name == "_core" for alias in node.names)
            ):
                offences.append(f"{name}:{node.lineno}: import _core")
    assert offences == []


def test_no_cross_module_private_access(capsys: pytest.CaptureFixture[str]) -> None:
    argv = sys.argv
    sys.argv = ["privates", "--list", str(_ROOT / "python" / "fhelium")]
    try:
        runpy.run_path(str(_ROOT / "scripts" / "privates"), run_name="__main__")
    finally:
        sys.argv = argv
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("cross-module private accesses:")
    offences = [
        line
        for line in lines[:-1]
        if "/residency/" in line
        and not any(part in line for part in _SUBPACKAGES)
        and not line.endswith(_KNOWN)
    ]
    assert offences == []


@pytest.mark.parametrize(
    "path",
    _modules(everywhere=True),
    ids=lambda path: path.relative_to(_PACKAGE).as_posix(),
)
def test_modules_are_at_most_800_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 800


def test_each_error_text_is_written_once() -> None:
    raised: dict[str, list[str]] = defaultdict(list)
    for path in _modules():
        name = path.relative_to(_PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), name)):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            args = node.exc.args
            # A message written out (a literal or an f-string), not one passed along.
            if args and isinstance(args[0], (ast.Constant, ast.JoinedStr)):
                raised[ast.unparse(args[0])].append(f"{name}:{node.lineno}")
    duplicated = {text: where for text, where in raised.items() if len(where) > 1}
    assert duplicated == {}


def test_the_checks_see_the_package() -> None:
    # Guards the checks above against passing vacuously.
    names = {path.name for path in _modules()}
    assert {"_engine.py", "controller.py", "manager.py", "pipeline.py"} <= names
    assert _type_checking_nodes(ast.parse("if TYPE_CHECKING:\n    import x\n"))
