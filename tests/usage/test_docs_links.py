"""The docs paths docstrings cite as plain text (``docs/concepts/x.md#anchor``) are links
in the rendered site (tools/mkdocs_links.py, a mkdocs hook), relative to the citing page;
a citation of a missing page or anchor is a warning, which fails the strict build."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("mkdocs")

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]


def _hook() -> Any:
    spec = importlib.util.spec_from_file_location(
        "mkdocs_links", ROOT / "tools" / "mkdocs_links.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mkdocs_links"] = module
    spec.loader.exec_module(module)
    return module


def _files(tmp_path: Path) -> Files:
    paths = ["concepts/lifetimes.md", "reference/manager.md", "how-to/size-budgets.md"]
    return Files(
        [
            File(path, str(tmp_path), str(tmp_path / "site"), use_directory_urls=True)
            for path in paths
        ]
    )


def _page(files: Files, path: str) -> Any:
    file = files.get_file_from_path(path)
    return SimpleNamespace(file=file, url=file.url)


def test_a_cited_path_becomes_a_relative_link(tmp_path: Path) -> None:
    hook = _hook()
    hook.on_pre_build({})
    files = _files(tmp_path)
    html = (
        "<p>protect memory (see docs/concepts/lifetimes.md#fork). Sizes: "
        "<code>docs/how-to/size-budgets.md</code>.</p>"
    )
    out = hook.on_page_content(html, _page(files, "reference/manager.md"), {}, files)
    assert '<a href="../../concepts/lifetimes/#fork">docs/concepts/lifetimes.md#fork</a>' in out
    assert (
        '<code><a href="../../how-to/size-budgets/">docs/how-to/size-budgets.md</a></code>' in out
    )


def test_code_blocks_and_links_are_left_alone(tmp_path: Path) -> None:
    hook = _hook()
    files = _files(tmp_path)
    html = (
        "<pre><code># docs/concepts/lifetimes.md</code></pre>"
        '<a href="x">docs/concepts/lifetimes.md</a>'
        '<img alt="docs/concepts/lifetimes.md">'
    )
    assert hook.on_page_content(html, _page(files, "reference/manager.md"), {}, files) == html


def test_a_missing_page_or_anchor_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hook = _hook()
    hook.on_pre_build({})
    files = _files(tmp_path)
    page = _page(files, "reference/manager.md")
    with caplog.at_level(logging.WARNING, logger="mkdocs.hooks.links"):
        out = hook.on_page_content("see docs/concepts/nowhere.md.", page, {}, files)
        assert out == "see docs/concepts/nowhere.md."
        hook.on_page_content("see docs/concepts/lifetimes.md#gone and #fork", page, {}, files)
        hook.on_page_content("and docs/concepts/lifetimes.md#fork", page, {}, files)
        built = tmp_path / "site" / "concepts" / "lifetimes"
        built.mkdir(parents=True)
        (built / "index.html").write_text('<h2 id="fork">Fork</h2>')
        hook.on_post_build({"site_dir": str(tmp_path / "site")})
    messages = [record.getMessage() for record in caplog.records]
    assert any("docs/concepts/nowhere.md, which is not a page" in m for m in messages)
    assert any("#gone: the page has no such anchor" in m for m in messages)
    assert not any("#fork" in m for m in messages)


def test_the_site_uses_the_hook() -> None:
    assert "tools/mkdocs_links.py" in (ROOT / "mkdocs.yml").read_text()


def _documented_modules() -> list[str]:
    """The modules the reference renders (`::: module` in docs/reference/*.md)."""
    names: list[str] = []
    for page in sorted((ROOT / "docs" / "reference").glob("*.md")):
        names += re.findall(r"^::: ([\w.]+)", page.read_text(), re.MULTILINE)
    return names


# The value protocol's documented members, and dunders, are public despite underscores.
_PUBLIC = {"_resident_tensors", "_with_resident_tensors"}


@pytest.mark.parametrize("module", _documented_modules())
def test_the_reference_opening_names_no_private_internals(module: str) -> None:
    doc = importlib.import_module(module).__doc__ or ""
    named = re.findall(r"`([\w.]*_[a-z][\w.]*)`", doc)
    private = [
        name
        for name in named
        if any(part.startswith("_") and not part.startswith("__") for part in name.split("."))
        and name.split(".")[-1] not in _PUBLIC
    ]
    assert private == [], f"{module}'s docstring names {private}"
