"""The device seam's modules are split by concept (docs/architecture.md, the module map).

Each module of ``fhelium.residency._runtime`` stays at most 800 lines, the simulated
runtime's parts import one another one way only, and no module there reaches into
another module's private names (what ``scripts/privates`` counts).
"""

from __future__ import annotations

import ast
import contextlib
import io
import runpy
import sys
from pathlib import Path

import pytest

import fhelium.residency._runtime as runtime_package
from fhelium.residency import simulation

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(runtime_package.__file__).parent
MODULES = sorted(PACKAGE.glob("*.py"))
PREFIX = "fhelium.residency._runtime."


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_each_module_is_at_most_800_lines(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= 800, f"{path.name} has {lines} lines"


def _imports(path: Path) -> set[str]:
    """The sibling modules ``path`` imports, type-checking imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PREFIX):
            found.add(node.module.removeprefix(PREFIX))  # type: ignore[union-attr]
    return found


def test_the_modules_import_each_other_one_way() -> None:
    edges = {path.stem: _imports(path) for path in MODULES if path.stem != "__init__"}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for module in edges.get(start, ()):
            if module == goal or (module not in seen and reaches(module, goal, seen | {module})):
                return True
        return False

    circles = [module for module in edges if reaches(module, module, set())]
    assert circles == []


def test_the_timeline_is_its_own_module() -> None:
    assert simulation.Timeline.__module__ == PREFIX + "timeline"
    assert simulation.TimelineSpan.__module__ == PREFIX + "timeline"
    assert "Timeline" not in {
        node.name
        for node in ast.parse((PACKAGE / "simulated.py").read_text(encoding="utf-8")).body
        if isinstance(node, ast.ClassDef)
    }


def test_no_cross_module_private_access_in_the_seam(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["privates", "--list", str(PACKAGE.parents[1])])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(ROOT / "scripts" / "privates"), run_name="__main__")
    accesses = [line for line in out.getvalue().splitlines() if "/_runtime/" in line]
    assert accesses == []
