"""Runtime introspection works on the public surface.

Documentation generators, runtime type checkers and IDE plugins call
`typing.get_type_hints`, which evaluates every annotation in the defining module's globals:
a name imported only under `TYPE_CHECKING` breaks them. The package also reports the
version of the distribution it belongs to.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import tomllib
import typing
from pathlib import Path

import pytest

import fhelium
import fhelium.residency
from fhelium import _version
from helpers.public_surface import member_callable, public_classes, public_functions, public_members

ROOT = Path(__file__).resolve().parents[2]

CLASSES = public_classes()
FUNCTIONS = public_functions()
METHODS = [
    (member, function)
    for entry in CLASSES
    for member in public_members(entry.obj)
    if (function := member_callable(member)) is not None
]


@pytest.mark.parametrize("entry", CLASSES, ids=lambda entry: entry.qualname)
def test_class_hints_resolve(entry: typing.Any) -> None:
    typing.get_type_hints(entry.obj)
    init = entry.obj.__dict__.get("__init__")
    if inspect.isfunction(init):
        typing.get_type_hints(init)


@pytest.mark.parametrize("entry", FUNCTIONS, ids=lambda entry: entry.qualname)
def test_function_hints_resolve(entry: typing.Any) -> None:
    typing.get_type_hints(entry.obj)


@pytest.mark.parametrize(
    ("member", "function"), METHODS, ids=[member.qualname for member, _ in METHODS]
)
def test_member_hints_resolve(member: typing.Any, function: typing.Any) -> None:
    typing.get_type_hints(function)
    raw = member.raw
    if isinstance(raw, property) and raw.fset is not None:
        typing.get_type_hints(raw.fset)


def test_the_surface_is_not_empty() -> None:
    # A broken walk must not pass by checking nothing.
    assert len(CLASSES) > 70
    assert len(FUNCTIONS) > 10
    assert len(METHODS) > 150


def _expected_version() -> str:
    try:
        return importlib.metadata.version("fhelium-residency")
    except importlib.metadata.PackageNotFoundError:
        found = _version.source_tree_version(ROOT)
        assert found is not None
        return found


def test_version_matches_the_distribution() -> None:
    assert isinstance(fhelium.__version__, str)
    assert fhelium.__version__ == _expected_version()
    assert fhelium.residency.__version__ == fhelium.__version__


def test_version_is_not_in_the_package_all() -> None:
    # conventions.md lists exactly 42 names; the version is an attribute, not an API name.
    assert "__version__" not in fhelium.residency.__all__


def test_source_tree_version_follows_the_build() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    if "version" in project:
        expected = project["version"]
    else:  # maturin takes a dynamic version from the workspace Cargo.toml
        assert "version" in project["dynamic"]
        cargo = tomllib.loads((ROOT / "Cargo.toml").read_text(encoding="utf-8"))
        expected = cargo["workspace"]["package"]["version"]
    assert _version.source_tree_version(ROOT) == expected


def test_version_falls_back_to_the_source_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_version, "version", missing)
    # As if the package ran from this checkout (installed, it lives in site-packages,
    # where no source tree is beside it).
    real = _version.source_tree_version
    monkeypatch.setattr(
        _version, "source_tree_version", lambda root=None: real(ROOT if root is None else root)
    )
    expected = real(ROOT)
    assert expected is not None
    assert _version.resolve_version() == expected


def test_version_without_any_source(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_version, "version", missing)
    monkeypatch.setattr(_version, "source_tree_version", lambda root=None: None)
    assert _version.resolve_version() == "0+unknown"


def test_static_pyproject_version_wins(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "9.8.7"\n')
    assert _version.source_tree_version(tmp_path) == "9.8.7"
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\ndynamic = ["version"]\n')
    assert _version.source_tree_version(tmp_path) is None
    (tmp_path / "Cargo.toml").write_text('[workspace.package]\nversion = "1.2.3"\n')
    assert _version.source_tree_version(tmp_path) == "1.2.3"
    assert _version.source_tree_version(tmp_path / "missing") is None
