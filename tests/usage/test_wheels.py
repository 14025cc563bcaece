"""Wheels that install without Rust: the release workflow builds abi3 manylinux wheels
for x86_64 and aarch64 and an sdist (in the layout ``maturin generate-ci github``
writes), and the scripts that build and check the same wheel here are in place.

Nothing is built here: the workflow is read as text (no YAML parser is a test
dependency) and the scripts are only parsed by ``bash -n``.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
SCRIPTS = ("wheel", "wheel-check")
# Import names whose declared distribution the installed metadata cannot tell: cuda-python
# is a metapackage, and the ``cuda`` namespace's files belong to cuda-bindings and others.
IMPORTED_AS = {"cuda": ("cuda-python",)}


def _jobs() -> dict[str, str]:
    """Each job of the workflow's ``jobs:`` mapping, as its block of text."""
    text = WORKFLOW.read_text(encoding="utf-8")
    _, _, body = text.partition("\njobs:\n")
    assert body, "the workflow has a jobs: mapping"
    jobs: dict[str, str] = {}
    name = None
    for line in body.splitlines():
        header = re.match(r"^  ([A-Za-z0-9_-]+):\s*$", line)
        if header:
            name = header[1]
            jobs[name] = ""
        elif name is not None:
            jobs[name] += line + "\n"
    return jobs


def _commands(script: str) -> str:
    """The script without its comment lines."""
    lines = (ROOT / "scripts" / script).read_text(encoding="utf-8").splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


def test_the_wheel_matrix_covers_x86_64_and_aarch64_on_manylinux2014_or_later() -> None:
    linux = _jobs()["linux"]
    matrix, _, steps = linux.partition("steps:")
    targets = re.findall(r"^\s+target:\s*([\w-]+)\s*$", matrix, re.MULTILINE)
    assert {"x86_64", "aarch64"} <= set(targets)
    assert "uses: PyO3/maturin-action@v1" in steps
    assert "target: ${{ matrix.platform.target }}" in steps
    manylinux = re.search(r"^\s+manylinux:\s*\"?([\w.]+)\"?\s*$", steps, re.MULTILINE)
    assert manylinux is not None
    assert manylinux[1] in {"2014", "2_17", "2_28", "auto"}
    args = re.search(r"^\s+args:\s*(.+)$", steps, re.MULTILINE)
    assert args is not None
    assert "--release" in args[1]
    assert "--locked" in args[1]
    assert "--out dist" in args[1]
    assert "actions/upload-artifact" in steps


def test_the_wheels_are_abi3() -> None:
    # maturin builds one cp311-abi3 wheel per target because pyo3 has an abi3 feature.
    workspace = tomllib.loads((ROOT / "Cargo.toml").read_text(encoding="utf-8"))
    features = workspace["workspace"]["dependencies"]["pyo3"]["features"]
    assert any(re.fullmatch(r"abi3-py3\d+", feature) for feature in features)
    binding = tomllib.loads(
        (ROOT / "rust" / "residency-python" / "Cargo.toml").read_text(encoding="utf-8")
    )
    assert binding["dependencies"]["pyo3"] == {"workspace": True}
    maturin = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
        "maturin"
    ]
    assert maturin["manifest-path"] == "rust/residency-python/Cargo.toml"
    assert maturin["module-name"] == "fhelium._core"


def test_an_sdist_is_built_and_everything_is_published_on_a_tag() -> None:
    jobs = _jobs()
    assert "command: sdist" in jobs["sdist"]
    assert "actions/upload-artifact" in jobs["sdist"]
    release = jobs["release"]
    needs = re.search(r"^\s+needs:\s*\[([^\]]*)\]", release, re.MULTILINE)
    assert needs is not None
    assert {"linux", "sdist"} <= {job.strip() for job in needs[1].split(",")}
    assert "startsWith(github.ref, 'refs/tags/')" in release
    assert "publish" in release
    text = WORKFLOW.read_text(encoding="utf-8")
    assert re.search(r"^    tags:\s*\n\s+- '\*'", text, re.MULTILINE)


def test_ci_checks_the_built_wheel_with_the_script() -> None:
    check = _jobs()["check"]
    assert "name: wheels-linux-x86_64" in check
    assert "bash scripts/wheel-check" in check


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_scripts_are_executable_bash(script: str) -> None:
    path = ROOT / "scripts" / script
    assert os.access(path, os.X_OK), f"scripts/{script} is not executable"
    assert path.read_text(encoding="utf-8").startswith("#!/usr/bin/env bash\n")
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)


def test_the_wheel_script_builds_a_manylinux2014_abi3_wheel_with_zig() -> None:
    commands = _commands("wheel")
    assert re.search(
        r"maturin build --release --locked --zig --compatibility manylinux2014", commands
    )
    assert "ziglang" in commands
    # Its tools go into a venv of its own, never the caller's environment.
    assert re.search(r'-m venv "\$venv"', commands)
    assert re.search(r'"\$venv/bin/python" -m pip install', commands)


def test_the_check_uses_a_fresh_venv_without_rust_and_runs_the_readme_example() -> None:
    commands = _commands("wheel-check")
    assert "-m venv" in commands
    assert "--system-site-packages" not in commands
    assert "command -v cargo" in commands
    # Nor can a toolchain be found through its homes, or fetched by maturin's backend,
    # and a source archive (which pip would build despite --only-binary) is refused.
    assert "MATURIN_NO_INSTALL_RUST=1" in commands
    assert 'CARGO_HOME="$work/no-cargo" RUSTUP_HOME="$work/no-rustup"' in commands
    assert '[[ "$wheel" == *.whl ]]' in commands
    assert "--only-binary=:all:" in commands
    assert "README.md" in commands
    assert "```python" in commands


def test_built_wheels_and_venvs_are_ignored() -> None:
    ignored = set((ROOT / ".gitignore").read_text(encoding="utf-8").split())
    assert {"/dist/", "/.venv-wheel/", "/.venv-wheel-check/"} <= ignored


def canonicalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _module_level_imports() -> dict[str, list[str]]:
    """Third-party top-level modules the package imports when it is imported (at module
    level, including inside a module-level ``try``/``if``), with where."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "python" / "fhelium").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for statement in tree.body:
            nodes = ast.walk(statement) if isinstance(statement, ast.If | ast.Try) else [statement]
            for node in nodes:
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.partition(".")[0]
                    if top not in sys.stdlib_module_names and top != "fhelium":
                        where = f"{path.relative_to(ROOT)}:{node.lineno}"
                        found.setdefault(top, []).append(where)
    return found


def test_every_module_imported_at_import_time_is_a_declared_dependency() -> None:
    # An installed wheel gets only its declared dependencies. numpy, imported by the disk
    # tier when fhelium.residency is imported, was once undeclared: scripts/wheel-check's
    # install got it only through cuda-python 13's cuda-core, by chance.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = {
        canonicalize(re.split(r"[\s<>=!~;\[]", spec)[0]) for spec in project["dependencies"]
    }
    providers = importlib.metadata.packages_distributions()
    imports = _module_level_imports()
    assert "torch" in imports, "the scan finds the package's imports"
    for module, places in imports.items():
        dists = {canonicalize(dist) for dist in providers.get(module, [module])}
        dists |= set(IMPORTED_AS.get(module, ()))
        assert dists & declared, f"{module} ({', '.join(places)}) is not a declared dependency"
