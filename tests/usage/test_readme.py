"""The README tells the truth: its first example runs as written and prints what it
says, its picture is there, and its table of the main job (the Llama demo) is what the main
job prints on the CPU (the timeline model's figures are deterministic)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_first_look_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"## A first look\n\n```python\n(.*?)```", text, re.S)
    assert match is not None, "README lost its first example"
    namespace: dict[str, object] = {}
    exec(compile(match.group(1), str(README), "exec"), namespace)
    shape, books = capsys.readouterr().out.splitlines()
    assert shape == "torch.Size([256, 256])"
    used = 256 * 256 * 4 + 256 * 4
    assert books == f"pageable-host {used} {(1 << 30) - used}"


def test_the_picture_is_in_the_repository() -> None:
    text = README.read_text(encoding="utf-8")
    (picture,) = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert (ROOT / picture).read_bytes()[:4] == b"\x89PNG"


def test_the_table_is_what_the_main_job_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"\n```\n(run  .*?)```", text, re.S)
    assert match is not None, "README lost the main job's table"
    pytest.importorskip("transformers")
    from fhelium.residency._demos.llama import run_llama_demo

    run_llama_demo(tmp_path / "out", device="cpu", cache=tmp_path / "cache")
    printed = capsys.readouterr().out
    table = match.group(1).strip().splitlines()
    for line in table:
        assert line in printed.splitlines(), line
