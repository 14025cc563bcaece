"""The README's first example runs as written (so the README keeps telling the truth)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def test_first_look_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"## A first look\n\n```python\n(.*?)```", text, re.S)
    assert match is not None, "README lost its first example"
    namespace: dict[str, object] = {}
    exec(compile(match.group(1), str(README), "exec"), namespace)
    output = capsys.readouterr().out
    assert "pageable-host" in output
    assert "True" in output, "explain(plan).feasible should print True"


def test_automatic_residency_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"## Automatic residency\n\n.*?```python\n(.*?)```", text, re.S)
    assert match is not None, "README lost its automatic-residency example"
    namespace: dict[str, object] = {}
    exec(compile(match.group(1), str(README), "exec"), namespace)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 7, lines
    assert any("[]" not in line for line in lines[1:]), "later steps evict"


def test_streaming_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = README.read_text(encoding="utf-8")
    match = re.search(
        r"## Streaming with a schedule and prefetch\n\n.*?```python\n(.*?)```", text, re.S
    )
    assert match is not None, "README lost its streaming example"
    namespace: dict[str, object] = {}
    exec(compile(match.group(1), str(README), "exec"), namespace)
    output = capsys.readouterr().out
    assert output.endswith("ms predicted\n"), output
