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


def test_the_status_up_front_says_what_ran_only_in_simulation() -> None:
    """Before the picture and the set-up: what has run on real hardware, what only on
    the simulated runtime, and where the GPU check is."""
    text = (ROOT / "README.md").read_text()
    status = text.index("## Status")
    assert status < text.index("## Set up")
    assert status < text.index("![")
    section = text[status : text.index("\n## ", status + 1)]
    assert "simulated runtime" in section
    assert "scripts/gpu-check" in section
    assert "tests/gpu/" in section
    # Whether a GPU run has happened is stated, and agrees with the project record.
    record = (ROOT / "docs" / "project.md").read_text()
    never = "Nothing in this library has run on a GPU yet" in section
    assert never == ("It has not run yet" in record)
