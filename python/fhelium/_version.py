"""The package version: one value for ``fhelium.__version__`` and ``fhelium.residency.__version__``.

The installed distribution's metadata (``fhelium-residency``) wins. A source checkout that
was never installed falls back to the version the build would stamp: ``[project].version``
of ``pyproject.toml`` when it is static, otherwise (``dynamic = ["version"]``, as maturin
builds it) ``[workspace.package].version`` of the workspace ``Cargo.toml`` beside it.
"""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

__all__ = ["DISTRIBUTION", "resolve_version", "source_tree_version"]

DISTRIBUTION = "fhelium-residency"
"""The name of the distribution whose metadata carries the version."""

_UNKNOWN = "0+unknown"


def source_tree_version(root: Path | None = None) -> str | None:
    """Read the version a build of the source tree at ``root`` would carry.

    Args:
        root: The repository root holding ``pyproject.toml``; ``None`` means the checkout
            this file lives in (``python/fhelium/`` two levels down).

    Returns:
        The version string, or ``None`` when no readable ``pyproject.toml`` (or, for a
        dynamic version, ``Cargo.toml``) names one.

    Raises:
        tomllib.TOMLDecodeError: A ``pyproject.toml`` or ``Cargo.toml`` that is not
            valid TOML.
    """
    base = Path(__file__).resolve().parents[2] if root is None else root
    pyproject = base / "pyproject.toml"
    if not pyproject.is_file():
        return None
    project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    static = project.get("version")
    if isinstance(static, str):
        return static
    if "version" not in project.get("dynamic", ()):
        return None
    cargo = base / "Cargo.toml"
    if not cargo.is_file():
        return None
    workspace = tomllib.loads(cargo.read_text(encoding="utf-8")).get("workspace", {})
    found = workspace.get("package", {}).get("version")
    return found if isinstance(found, str) else None


def resolve_version() -> str:
    """Return the version of ``fhelium-residency``.

    Returns:
        The installed distribution's version; without distribution metadata, the source
        tree's (see `source_tree_version`); ``"0+unknown"`` when neither exists.

    Raises:
        tomllib.TOMLDecodeError: Only without distribution metadata, for a corrupt
            ``pyproject.toml`` or ``Cargo.toml`` in the source tree.
    """
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # running from a source tree that was never installed
        return source_tree_version() or _UNKNOWN


__version__ = resolve_version()
