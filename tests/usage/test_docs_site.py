"""The API reference pages document exactly each public module's `__all__`.

`mkdocs build --strict` (run by scripts/test) checks links, anchors and the navigation;
this checks what it cannot: that a name added to a module's `__all__` gets onto its
reference page, and that the package page says where each name lives.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import fhelium.residency

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"
MODULES = [
    *(
        f"fhelium.residency.{name}"
        for name in (
            "location",
            "model",
            "plan",
            "request",
            "policy",
            "lease",
            "manager",
            "controller",
            "snapshot",
            "schedule",
            "pipeline",
            "disk",
            "simulation",
            "distributed",
            "export",
            "sources",
        )
    ),
    "fhelium.residency.nn",
    "fhelium.values",
    "fhelium.errors",
]


def _page(module: str) -> Path:
    return REFERENCE / f"{module.rsplit('.', 1)[-1]}.md"


@pytest.mark.parametrize("module", MODULES)
def test_reference_page_lists_the_modules_all(module: str) -> None:
    text = _page(module).read_text(encoding="utf-8")
    assert text.startswith(f"::: {module}\n"), f"{_page(module)} must document {module}"
    # The items of its `members:` option (not of `inherited_members:`, which lists the
    # methods a class shows from an internal base).
    block = re.search(r"^ {6}members:\n((?: {8}- \S+\n)+)", text, re.M)
    members = re.findall(r"- (\S+)", block.group(1)) if block else []
    assert members == list(importlib.import_module(module).__all__)


def test_package_page_names_every_export() -> None:
    text = (REFERENCE / "residency.md").read_text(encoding="utf-8")
    assert text.startswith("::: fhelium.residency\n")
    listed = set(re.findall(r"`(\w+)`", text))
    assert set(fhelium.residency.__all__) <= listed


def test_every_public_submodule_has_a_page() -> None:
    pages = {path.stem for path in REFERENCE.glob("*.md")}
    public = {
        path.stem
        for path in (ROOT / "python" / "fhelium" / "residency").glob("*.py")
        if not path.stem.startswith("_")
    }
    assert public <= pages, sorted(public - pages)
