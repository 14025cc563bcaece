"""The main job runs end to end on the CPU (simulated cuda:0): evictions happen, the
budget holds, and the trace and the plot are written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fhelium.residency.__main__ import main, run_demo


def test_demo_streams_shards_through_a_bounded_location(tmp_path: Path) -> None:
    summary = run_demo(
        tmp_path / "out",
        shards=8,
        width=64,
        stages=6,
        device="cpu",
        cache=tmp_path / "cache",
        quiet=True,
    )
    assert summary["stages"] == 6
    assert summary["evictions"] > 0, "the budget forces the controller to evict"
    peak, budget = summary["peak_vs_budget"]["cuda:0"]
    assert budget is not None
    assert 0 < peak <= budget
    assert any(pair.endswith("-> cuda:0") for pair in summary["bytes_moved"])
    trace = json.loads((tmp_path / "out" / "trace.json").read_text())
    assert trace["traceEvents"], "the trace has events"
    png = tmp_path / "out" / "memory.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A second run reuses the shard files written by the first.
    files = sorted((tmp_path / "cache").iterdir())
    run_demo(
        tmp_path / "again",
        shards=8,
        width=64,
        stages=2,
        device="cpu",
        cache=tmp_path / "cache",
        quiet=True,
    )
    assert sorted((tmp_path / "cache").iterdir()) == files


def test_command_line_entry_point(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "demo",
            "--out",
            str(tmp_path / "cli"),
            "--shards",
            "6",
            "--width",
            "32",
            "--stages",
            "3",
            "--device",
            "cpu",
            "--cache",
            str(tmp_path / "cache"),
        ]
    )
    assert code == 0
    output = capsys.readouterr().out
    assert "summary:" in output
    assert "stage   3/3" in output
