"""The layer demo (`python -m fhelium.residency demo layers`) runs end to end on the
CPU (simulated cuda:0 with the timeline model): three runs of one cyclic workload
through one budget, where the schedule-aware policy loads exactly Belady's MIN,
prefetch hides copies behind compute, the budget holds, and the trace and the plot are
written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fhelium.residency.__main__ import main
from fhelium.residency._demos.layers import run_demo
from helpers.controller import fewest_misses

LAYER_BYTES = 64 * 64 * 4


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("demo")
    return run_demo(
        root / "out",
        layers=9,
        width=64,
        batch=2048,  # compute about as long as a copy, in the model
        passes=3,
        budget_layers=3,
        device="cpu",
        cache=root / "cache",
        quiet=True,
    )


def test_three_runs_on_one_budget(summary: dict[str, Any]) -> None:
    runs = summary["runs"]
    assert list(runs) == ["lru", "schedule-aware", "schedule-aware + prefetch"]
    assert summary["time"] == "predicted (timeline model)"
    budget = summary["budget_bytes"]
    for figures in runs.values():
        assert 0 < figures["peak_bytes"] <= budget
        assert figures["d2h_bytes"] == 0  # staged in pinned memory: evictions are drops
        assert figures["h2d_bytes"] == figures["loads"] * LAYER_BYTES
        assert figures["evictions"] > 0, "the budget forces evictions"
    # The same computation each way.
    checksums = {round(figures["checksum"], 3) for figures in runs.values()}
    assert len(checksums) == 1


def test_lru_misses_every_step_and_schedule_aware_loads_as_min(summary: dict[str, Any]) -> None:
    runs = summary["runs"]
    steps = summary["layers"] * summary["passes"]
    assert runs["lru"]["loads"] == steps
    schedule = tuple(layer for _ in range(summary["passes"]) for layer in range(9))
    assert summary["fewest_loads"] == fewest_misses(schedule, 3)  # exhaustive search
    assert runs["schedule-aware"]["loads"] == summary["fewest_loads"]
    saved = runs["lru"]["h2d_bytes"] - runs["schedule-aware"]["h2d_bytes"]
    assert saved == (steps - summary["fewest_loads"]) * LAYER_BYTES


def test_prefetch_overlaps_copies_with_compute(summary: dict[str, Any]) -> None:
    runs = summary["runs"]
    plain, prefetched = (
        runs["schedule-aware"]["seconds"],
        runs["schedule-aware + prefetch"]["seconds"],
    )
    assert prefetched < plain < runs["lru"]["seconds"]
    trace = json.loads(Path(summary["trace"]).read_text())
    tracks = {
        (event["pid"], event["tid"]): event["args"]["name"]
        for event in trace["traceEvents"]
        if event.get("ph") == "M" and event.get("name") == "thread_name"
    }
    spans: dict[str, list[tuple[float, float]]] = {}
    for event in trace["traceEvents"]:
        name = tracks.get((event.get("pid"), event.get("tid")))
        if event.get("ph") == "X" and name in ("cuda:0 H2D copy", "cuda:0 compute"):
            spans.setdefault(name, []).append((event["ts"], event["ts"] + event["dur"]))
    copies, kernels = spans["cuda:0 H2D copy"], spans["cuda:0 compute"]
    overlapping = sum(1 for start, end in copies if any(s < end and start < e for s, e in kernels))
    assert overlapping >= len(copies) // 2, "the prefetch run's copies overlap compute"


def test_the_plot_is_written(summary: dict[str, Any]) -> None:
    assert Path(summary["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_line_entry_point(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "demo",
            "layers",
            "--out",
            str(tmp_path / "cli"),
            "--layers",
            "6",
            "--width",
            "32",
            "--batch",
            "64",
            "--passes",
            "2",
            "--budget-layers",
            "2",
            "--device",
            "cpu",
            "--cache",
            str(tmp_path / "cache"),
        ]
    )
    assert code == 0
    output = capsys.readouterr().out
    for name in ("lru", "schedule-aware", "schedule-aware + prefetch"):
        assert f"\n{name} " in output
    assert "predicted (timeline model)" in output
    assert (tmp_path / "cli" / "trace.json").exists()
    # A second run reuses the layer files written by the first.
    files = sorted((tmp_path / "cache").iterdir())
    assert (
        main(
            [
                "demo",
                "layers",
                "--out",
                str(tmp_path / "again"),
                "--layers",
                "6",
                "--width",
                "32",
                "--batch",
                "64",
                "--passes",
                "1",
                "--device",
                "cpu",
                "--cache",
                str(tmp_path / "cache"),
            ]
        )
        == 0
    )
    assert sorted((tmp_path / "cache").iterdir()) == files


def test_bad_sizes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="budget_layers"):
        run_demo(tmp_path, layers=4, budget_layers=1, device="cpu", cache=tmp_path, quiet=True)


def test_the_disk_mode_keeps_what_the_host_cannot_hold_on_disk(tmp_path: Path) -> None:
    spill = tmp_path / "spill"
    summary = run_demo(
        tmp_path / "out",
        layers=9,
        width=64,
        batch=256,
        passes=2,
        budget_layers=3,
        device="cpu",
        cache=tmp_path / "cache",
        quiet=True,
        disk=spill,
        host_layers=3,
    )
    runs = summary["runs"]
    assert list(runs) == ["lru", "schedule-aware", "schedule-aware + prefetch"]
    for figures in runs.values():
        # Six of nine layers live only on disk: every load of one of them reads it.
        assert figures["disk_read_bytes"] > 0
        assert figures["disk_read_bytes"] % LAYER_BYTES == 0
    checksums = {round(figures["checksum"], 3) for figures in runs.values()}
    assert len(checksums) == 1
    # The manager closed: none of its files is left.
    assert [path for path in spill.rglob("*") if path.is_file()] == []


def test_the_plot_draws_what_the_summary_and_the_manager_report(summary: dict[str, Any]) -> None:
    """Each panel's series is what its run's peak was read from, and over all runs the
    plotted series reach exactly the manager's own high-water marks: no peak of the
    plotted location falls between two samples, unseen by the plot."""
    plotted = summary["plotted"]
    assert list(plotted) == list(summary["runs"])
    for name, series in plotted.items():
        assert len(series["times_ms"]) == len(series["used_bytes"]) == len(series["charged_bytes"])
        assert series["times_ms"] == sorted(series["times_ms"])
        assert max(series["charged_bytes"]) == summary["runs"][name]["peak_bytes"]
        assert all(
            u <= c for u, c in zip(series["used_bytes"], series["charged_bytes"], strict=True)
        )
    peak_used, peak_charged = summary["snapshot_peaks"][summary["location"]]
    assert max(max(s["used_bytes"]) for s in plotted.values()) == peak_used
    assert max(max(s["charged_bytes"]) for s in plotted.values()) == peak_charged
