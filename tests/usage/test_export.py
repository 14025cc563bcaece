"""`fhelium.residency.export`: Chrome/Perfetto trace events and the memory plot.

The reports and snapshots come from real managers: a host-only scenario, and a CUDA one
under the two-device simulated runtime.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fhelium.residency import export
from fhelium.residency.export import plot_memory, trace_events, write_trace
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.plan import DropResident, EnsureResident, MoveResident
from fhelium.residency.snapshot import ResidencyPlanReport, ResidencyTransitionReport
from helpers.manager import CUDA0, CUDA1, Source, fresh, simulated, spec, tensor_value

HOST_BUDGET = 1 << 20
CUDA_BUDGET = 4 << 20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

Reports = list[ResidencyTransitionReport | ResidencyPlanReport]
Samples = list[tuple[int, Any]]


def _sample(manager: ResidencyManager, samples: Samples) -> None:
    samples.append((time.time_ns(), manager.snapshot()))


def host_scenario() -> tuple[Reports, Samples]:
    """adopt, register_source, ensure (+ a no-op), drop (+ a no-op), a plan, discard."""
    reports: Reports = []
    samples: Samples = []
    with ResidencyManager({PAGEABLE_HOST: HOST_BUDGET}) as manager:
        _sample(manager, samples)
        manager.adopt(tensor_value(64))
        key = manager.register_source(spec(256), Source(fresh(256)))
        _sample(manager, samples)
        reports.append(manager.ensure(key, PAGEABLE_HOST))
        _sample(manager, samples)
        reports.append(manager.ensure(key, PAGEABLE_HOST))  # no-op
        reports.append(manager.drop(key, PAGEABLE_HOST))
        _sample(manager, samples)
        reports.append(manager.drop(key, PAGEABLE_HOST))  # no-op
        plan = manager.execute_actions(
            [EnsureResident(key, PAGEABLE_HOST), DropResident(key, PAGEABLE_HOST)],
            name="host-stage",
        )
        reports.append(plan)
        _sample(manager, samples)
        reports.append(manager.discard(key))
        _sample(manager, samples)
    return reports, samples


def cuda_scenario() -> tuple[Reports, Samples]:
    """Moves between pageable host, cuda:0 and cuda:1 (simulated), a plan, a pinned copy."""
    reports: Reports = []
    samples: Samples = []
    with (
        simulated(2),
        ResidencyManager({CUDA0: CUDA_BUDGET, CUDA1: CUDA_BUDGET}) as manager,
    ):
        _sample(manager, samples)
        weights = manager.adopt(tensor_value(1 << 18))  # 1 MiB
        key = manager.register_source(spec(1 << 16), Source(fresh(1 << 16)))
        _sample(manager, samples)
        reports.append(manager.move(weights, CUDA0))
        _sample(manager, samples)
        reports.append(manager.move(weights, CUDA1))
        reports.append(manager.move(weights, CUDA1))  # no-op
        _sample(manager, samples)
        reports.append(manager.ensure(key, CUDA0))
        reports.append(manager.ensure(key, PINNED_HOST))
        _sample(manager, samples)
        plan = manager.execute_actions(
            [
                MoveResident(weights, CUDA0),
                DropResident(key, CUDA0),
                EnsureResident(key, CUDA1),
                MoveResident(weights, PAGEABLE_HOST),
            ],
            name="cuda-stage",
        )
        reports.append(plan)
        _sample(manager, samples)
        reports.append(manager.drop(key, PINNED_HOST))
        _sample(manager, samples)
    return reports, samples


def _flatten(reports: Reports) -> list[ResidencyTransitionReport]:
    flat: list[ResidencyTransitionReport] = []
    for item in reports:
        if isinstance(item, ResidencyPlanReport):
            flat.extend(item.transitions)
        else:
            flat.append(item)
    return flat


def _thread_names(events: list[dict[str, Any]]) -> dict[int, str]:
    names = [e for e in events if e["ph"] == "M" and e["name"] == "thread_name"]
    tids = [e["tid"] for e in names]
    assert len(tids) == len(set(tids)), "one thread_name per track"
    return {e["tid"]: e["args"]["name"] for e in names}


def _check_trace(reports: Reports, samples: Samples) -> dict[str, Any]:
    document = trace_events(reports, samples)
    text = json.dumps(document)
    assert json.loads(text) == document  # valid, round-tripping JSON
    assert document["displayTimeUnit"] == "ms"
    assert isinstance(document["metadata"], dict)
    events: list[dict[str, Any]] = document["traceEvents"]
    for event in events:
        for field in ("ph", "ts", "pid", "tid", "name"):
            assert field in event, (field, event)
        assert event["pid"] == 1
        assert event["ts"] >= 0
    timed = [e for e in events if e["ph"] != "M"]
    assert [(e["ts"], e["tid"]) for e in timed] == sorted((e["ts"], e["tid"]) for e in timed)
    # The earliest input timestamp is the origin.
    assert min(e["ts"] for e in timed) == 0

    tracks = _thread_names(events)
    locations = {loc.location.name for _, snap in samples for loc in snap.locations}
    for report in _flatten(reports):
        for location in (report.source, report.destination):
            if location is not None:
                locations.add(location.name)
    location_tracks = Counter(name for name in tracks.values() if name not in ("plans", "discards"))
    assert set(location_tracks) == locations
    assert all(count == 1 for count in location_tracks.values())

    flat = _flatten(reports)
    slices = [e for e in events if e["ph"] == "X" and e["tid"] != _tid(tracks, "plans")]
    instants = [e for e in events if e["ph"] == "i"]
    assert len(slices) == sum(1 for r in flat if not r.no_op)
    assert len(instants) == sum(1 for r in flat if r.no_op)
    for event in [*slices, *instants]:
        assert set(event["args"]) >= {"handle", "source", "destination", "bytes", "reason"}
    for event in (e for e in events if e["ph"] == "X"):
        assert event["dur"] >= 0
    for event in instants:
        assert "dur" not in event
        assert event["args"]["reason"]  # the no-op reason

    # Slices sit on the destination's track, drops on the source's.
    by_start = sorted((r for r in flat if not r.no_op), key=lambda r: r.started_at_ns)
    for report in by_start:
        kind = type(report.action).__name__
        location = report.destination or report.source
        expected = "discards" if location is None else location.name
        match = [
            e
            for e in slices
            if tracks[e["tid"]] == expected
            and e["args"]["handle"] == report.action.handle.handle_id
            and e["name"].split()[0] in kind.lower()
        ]
        assert match, (kind, expected)

    plans = [item for item in reports if isinstance(item, ResidencyPlanReport)]
    plan_slices = [e for e in events if e["ph"] == "X" and tracks[e["tid"]] == "plans"]
    assert sorted(e["name"] for e in plan_slices) == sorted(p.plan_name for p in plans)
    for event, plan in zip(plan_slices, plans, strict=True):
        assert event["args"]["transitions"] == len(plan.transitions)
        assert event["dur"] == (plan.completed_at_ns - plan.started_at_ns) / 1000

    counters = [e for e in events if e["ph"] == "C"]
    assert len(counters) == sum(len(snap.locations) for _, snap in samples)
    budgets = {loc.location.name: loc.budget_bytes for _, s in samples for loc in s.locations}
    for event in counters:
        location = tracks[event["tid"]]
        assert {"used", "reserved"} <= set(event["args"])
        assert ("budget" in event["args"]) == (budgets[location] is not None)
        if budgets[location] is not None:
            assert event["args"]["budget"] == budgets[location]
    return document


def _tid(tracks: dict[int, str], name: str) -> int | None:
    for tid, track in tracks.items():
        if track == name:
            return tid
    return None


def test_trace_events_host_scenario() -> None:
    reports, samples = host_scenario()
    document = _check_trace(reports, samples)
    tracks = _thread_names(document["traceEvents"])
    assert set(tracks.values()) == {"pageable-host", "plans", "discards"}
    counters = [e for e in document["traceEvents"] if e["ph"] == "C"]
    assert max(e["args"]["used"] for e in counters) == 64 * 4 + 256 * 4
    assert all(e["args"]["budget"] == HOST_BUDGET for e in counters)


def test_trace_events_cuda_scenario() -> None:
    reports, samples = cuda_scenario()
    document = _check_trace(reports, samples)
    tracks = set(_thread_names(document["traceEvents"]).values())
    assert {"pageable-host", "pinned-host", "cuda:0", "cuda:1", "plans"} <= tracks
    moves = [e for e in document["traceEvents"] if e["ph"] == "X" and e["name"].startswith("move")]
    assert {(e["args"]["source"], e["args"]["destination"]) for e in moves} >= {
        ("pageable-host", "cuda:0"),
        ("cuda:0", "cuda:1"),
        ("cuda:1", "cuda:0"),
        ("cuda:0", "pageable-host"),
    }
    assert any(e["name"] == "move 1.0 MiB" for e in moves)


def test_trace_events_is_deterministic_and_empty_inputs() -> None:
    reports, samples = host_scenario()
    assert trace_events(reports, samples) == trace_events(iter(reports), iter(samples))
    empty = trace_events([])
    assert empty["displayTimeUnit"] == "ms"
    assert [e["ph"] for e in empty["traceEvents"]] == ["M"]  # type: ignore[attr-defined]


def test_trace_events_rejects_wrong_items() -> None:
    with pytest.raises(TypeError):
        trace_events([object()])  # type: ignore[list-item]
    reports, samples = host_scenario()
    with pytest.raises(TypeError):
        trace_events(reports, [samples[0][1]])
    with pytest.raises(TypeError):
        trace_events(reports, [(1.5, samples[0][1])])


def test_write_trace_writes_compact_utf8_json(tmp_path: Path) -> None:
    reports, samples = cuda_scenario()
    path = tmp_path / "trace.json"
    write_trace(path, reports, samples)
    raw = path.read_bytes()
    assert json.loads(raw.decode("utf-8")) == trace_events(reports, samples)
    assert b"\n" not in raw
    assert b'", "' not in raw  # compact separators
    write_trace(str(tmp_path / "again.json"), reports)
    assert json.loads((tmp_path / "again.json").read_text(encoding="utf-8"))["traceEvents"]


def _png_shape(path: Path) -> tuple[int, ...]:
    from matplotlib import image

    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 5_000
    shape: tuple[int, ...] = image.imread(str(path)).shape
    return shape


def test_plot_memory_writes_png_with_one_subplot_per_location(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _, host_samples = host_scenario()
    _, cuda_samples = cuda_scenario()

    host_png = tmp_path / "host.png"
    plot_memory(host_samples, host_png, title="host scenario")
    cuda_png = tmp_path / "cuda.png"
    plot_memory(cuda_samples, str(cuda_png))

    host_shape = _png_shape(host_png)
    cuda_shape = _png_shape(cuda_png)
    assert len(host_shape) == 3
    assert host_shape[2] in (3, 4)
    # Fixed width; the height grows by one subplot row per location.
    assert host_shape[1] == cuda_shape[1] == 800
    cuda_locations = {loc.location for _, snap in cuda_samples for loc in snap.locations}
    assert len(cuda_locations) > 1
    assert host_shape[0] == 100 + 220 * 1
    assert cuda_shape[0] == 100 + 220 * len(cuda_locations)


def test_plot_memory_single_sample_and_errors(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _, samples = host_scenario()
    single = tmp_path / "single.png"
    plot_memory(samples[:1], single)
    _png_shape(single)
    with pytest.raises(ValueError, match="at least one"):
        plot_memory([], tmp_path / "none.png")


def test_plot_memory_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, samples = host_scenario()
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"fhelium-residency\[plot\]"):
        plot_memory(samples, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_module_all() -> None:
    assert export.__all__ == ["plot_memory", "trace_events", "write_trace"]
