"""The declared lower bounds are true: every dependency's installed release (what CI
tests) satisfies them, and none claims a release older than the tested line
(docs/project.md#tested-versions)."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def _bounds() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {}
    for requirement in project["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement.replace(" ", ""))
        assert match, f"{requirement}: every dependency has a lower bound, and only that"
        found[match.group(1)] = match.group(2)
    return found


@pytest.mark.parametrize("name", sorted(_bounds()))
def test_the_installed_release_satisfies_the_bound(name: str) -> None:
    assert _release(version(name)) >= _release(_bounds()[name])


def test_the_bounds_are_the_tested_line() -> None:
    """What docs/project.md says CI tested is what pyproject declares."""
    text = (ROOT / "docs" / "project.md").read_text()
    tested = text[text.index("## Tested versions") :]
    for name, bound in _bounds().items():
        assert f"{name} {'.'.join(map(str, _release(bound)))}" in tested, name
