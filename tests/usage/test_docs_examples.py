"""Every ```python block of the docs pages and of README.md runs, as written, on a CPU.

Each page's blocks run in order in one namespace (a later block may use what an earlier
one defined), in a fresh temporary working directory, with the default device runtime
restored afterwards. A block is skipped only when the nearest non-blank line above its
opening fence is an explicit marker with a reason:

    <!-- no-run: needs torchrun and two processes -->

Use it sparingly: for snippets that need a GPU, several processes or a network. The
marker is documented in docs/about.md. Other fences (``sh``, ``text``, none) never run;
a Python fence must be spelled ``python`` so that no example escapes by accident.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from fhelium.residency.simulation import set_runtime

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")
_NO_RUN = re.compile(r"^\s*<!--\s*no-run:(?P<reason>.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the first code line
    language: str
    code: str
    skip_reason: str | None


def _blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        language = opening["info"].strip().split(" ")[0] if opening["info"].strip() else ""
        body: list[str] = []
        end = index + 1
        while end < len(lines):
            closing = _FENCE.match(lines[end])
            if (
                closing is not None
                and closing["fence"].startswith(fence[0] * len(fence))
                and not closing["info"].strip()
            ):
                break
            text = lines[end]
            body.append(text[len(indent) :] if text.startswith(indent) else text.lstrip())
            end += 1
        previous = index - 1
        while previous >= 0 and not lines[previous].strip():
            previous -= 1
        marker = _NO_RUN.match(lines[previous]) if previous >= 0 else None
        reason = marker["reason"].strip() if marker else None
        if marker is not None and not reason:
            raise AssertionError(f"{page}:{previous + 1}: a no-run marker needs a reason")
        blocks.append(Block(page, index + 2, language, "\n".join(body) + "\n", reason))
        index = end + 1
    return blocks


def _runnable_pages() -> list[Path]:
    return [page for page in PAGES if any(b.language == "python" for b in _blocks(page))]


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_pages_are_found() -> None:
    assert ROOT / "README.md" in PAGES
    assert ROOT / "docs" / "index.md" in PAGES
    assert len(_runnable_pages()) >= 8


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_fences_are_well_formed(page: Path) -> None:
    """Python fences say ``python`` and markers sit on Python blocks only."""
    for block in _blocks(page):
        where = f"{_page_id(page)}:{block.line - 1}"
        if block.language.lower().startswith("py"):
            assert block.language == "python", f"{where}: spell the fence ```python"
        if block.skip_reason is not None:
            assert block.language == "python", f"{where}: no-run marker on a non-Python block"


@pytest.mark.parametrize("page", _runnable_pages(), ids=_page_id)
def test_page_examples_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs_example_{page.stem}"}
    previous = set_runtime(None)
    try:
        for block in _blocks(page):
            if block.language != "python" or block.skip_reason is not None:
                continue
            # Leading newlines keep the page's line numbers in tracebacks.
            source = "\n" * (block.line - 1) + block.code
            exec(compile(source, str(page), "exec"), namespace)
    finally:
        set_runtime(previous)
    capsys.readouterr()
