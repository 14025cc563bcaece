"""The binding builds Python objects through their modules' constructors: Rust sets
no private attribute of a Python object (docs/architecture.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

BINDING = Path(__file__).resolve().parents[2] / "rust" / "residency-python" / "src"

# `x.setattr("_name", ...)` or `x.setattr(intern!(py, "_name"), ...)`; dunders aside.
PRIVATE_SETATTR = re.compile(r"""setattr\(\s*(?:(?:pyo3::)?intern!\(\s*py\s*,\s*)?"_(?!_)""")


def test_rust_sets_no_private_python_attribute() -> None:
    sources = sorted(BINDING.glob("*.rs"))
    if not sources:
        pytest.skip("the binding's sources are not beside this checkout's tests")
    found = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE_SETATTR.search(line)
    ]
    assert found == []


def test_the_pattern_catches_a_private_setattr() -> None:
    assert PRIVATE_SETATTR.search('lease.setattr(intern!(py, "_engine"), engine)?;')
    assert PRIVATE_SETATTR.search('lease.setattr("_token", token)?;')
    assert not PRIVATE_SETATTR.search("record.setattr(name.bind(py), *value)?;")
    assert not PRIVATE_SETATTR.search('x.setattr(intern!(py, "__class__"), cls)?;')
