"""Export residency observations: Chrome/Perfetto trace events and memory plots.

`trace_events` turns transition reports, plan reports and timed snapshots into the
Chrome trace-event JSON object (load it in ``chrome://tracing`` or ui.perfetto.dev);
`write_trace` writes it to a file. Given a simulated runtime's `Timeline`, the trace also
shows its copy and compute spans in virtual time. `plot_memory` draws per-location memory
over time into a PNG; it needs matplotlib (the ``plot`` extra).
"""

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any, Final

from fhelium.residency._locations import DISK_BASE, disk_code
from fhelium.residency._runtime.timeline import Timeline, TimelineSpan, spans_and_now
from fhelium.residency._validation import require_count
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, DiskLocation, ResidencyLocation
from fhelium.residency.plan import DiscardValue, DropResident, EnsureResident, MoveResident
from fhelium.residency.snapshot import (
    ResidencyPlanReport,
    ResidencySnapshot,
    ResidencyTransitionReport,
)

__all__ = ["plot_memory", "trace_events", "write_trace"]

_PID: Final = 1
# Fixed track ids, so the same location gets the same track in every trace.
_PAGEABLE_TID: Final = 1
_PINNED_TID: Final = 2
_CUDA_TID_BASE: Final = 16
_DISK_TID_BASE: Final = _CUDA_TID_BASE + 128
_PLANS_TID: Final = 1000
_DISCARDS_TID: Final = 1001
_PLANS_TRACK: Final = "plans"
_DISCARDS_TRACK: Final = "discards"
_MIB: Final = float(1 << 20)
# The simulated device timeline: its own process, one track per device and engine.
_TIMELINE_PID: Final = 2
_TIMELINE_PROCESS: Final = "simulated device timeline (virtual time)"
_TIMELINE_ENGINES: Final = ("h2d", "d2h", "d2d", "compute")
_TIMELINE_TRACKS: Final = {
    "h2d": "H2D copy",
    "d2h": "D2H copy",
    "d2d": "D2D copy",
    "compute": "compute",
}
_PLOT_EXTRA_HINT: Final = (
    "plot_memory needs matplotlib, which is an optional dependency; install the plot extra: "
    "pip install 'fhelium-residency[plot]'"
)

_Event = dict[str, object]
_Sample = tuple[int, ResidencySnapshot[Any]]


def _location_tid(location: ResidencyLocation) -> int:
    if location == PAGEABLE_HOST:
        return _PAGEABLE_TID
    if location == PINNED_HOST:
        return _PINNED_TID
    if isinstance(location, DiskLocation):
        # After every CUDA track, in the order the process first named the directory.
        return _DISK_TID_BASE + disk_code(location) - DISK_BASE
    index = location.device.index
    return _CUDA_TID_BASE + (0 if index is None else index)


def _location_order(location: ResidencyLocation) -> tuple[int, str]:
    return (_location_tid(location), location.name)


def _action_kind(report: ResidencyTransitionReport) -> str:
    action = report.action
    if isinstance(action, EnsureResident):
        return "ensure"
    if isinstance(action, MoveResident):
        return "move"
    if isinstance(action, DropResident):
        return "drop"
    if isinstance(action, DiscardValue):
        return "discard"
    raise TypeError(f"unsupported action {type(action).__name__}")  # pragma: no cover


def _track_metadata(pid: int, tid: int, name: str) -> tuple[_Event, _Event]:
    """A track's name, and its place (its id) among the process's tracks."""
    common: _Event = {"ph": "M", "ts": 0, "pid": pid, "tid": tid}
    return (
        {"name": "thread_name", **common, "args": {"name": name}},
        {"name": "thread_sort_index", **common, "args": {"sort_index": tid}},
    )


def _format_bytes(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024.0
        if value < 1024.0 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def _location_name(location: ResidencyLocation | None) -> str | None:
    return None if location is None else location.name


def _check_int(value: object, name: str) -> int:
    return require_count(value, name)


def _collect_samples(samples: Iterable[tuple[int, ResidencySnapshot[Any]]]) -> list[_Sample]:
    collected: list[_Sample] = []
    for index, sample in enumerate(samples):
        if not isinstance(sample, tuple) or len(sample) != 2:
            raise TypeError(f"samples[{index}] must be a (time_ns, snapshot) pair, got {sample!r}")
        time_ns, snapshot = sample
        _check_int(time_ns, f"samples[{index}] time_ns")
        if not isinstance(snapshot, ResidencySnapshot):
            raise TypeError(
                f"samples[{index}] snapshot must be a ResidencySnapshot, "
                f"got {type(snapshot).__name__}"
            )
        collected.append((time_ns, snapshot))
    return collected


def _us(time_ns: int, origin_ns: int) -> float:
    # Microseconds with nanosecond resolution; exact for any realistic trace length.
    return (time_ns - origin_ns) / 1000.0


def _transition_args(report: ResidencyTransitionReport, plan_name: str | None) -> dict[str, object]:
    args: dict[str, object] = {
        "handle": report.action.handle.handle_id,
        "source": _location_name(report.source),
        "destination": _location_name(report.destination),
        "bytes": report.storage_nbytes,
        "logical_bytes": report.logical_nbytes,
        "reason": report.reason,
    }
    if plan_name is not None:
        args["plan"] = plan_name
    if report.allocator_device is not None:
        args["allocator_device"] = str(report.allocator_device)
        args["allocator_allocated_bytes_before"] = report.allocator_allocated_bytes_before
        args["allocator_allocated_bytes_after"] = report.allocator_allocated_bytes_after
        args["allocator_reserved_bytes_before"] = report.allocator_reserved_bytes_before
        args["allocator_reserved_bytes_after"] = report.allocator_reserved_bytes_after
    return args


def _timeline_tid(span: TimelineSpan) -> int:
    index = span.device.index
    return (
        1
        + len(_TIMELINE_ENGINES) * (0 if index is None else index)
        + (_TIMELINE_ENGINES.index(span.engine))
    )


def _virtual_us(seconds: float) -> float:
    # Microseconds, rounded to the nanosecond so that float noise does not show.
    return round(seconds * 1e6, 3)


def _timeline_events(timeline: Timeline) -> tuple[list[_Event], list[_Event], dict[str, object]]:
    """(metadata events, span events, trace metadata) for a timeline's spans."""
    spans, now = spans_and_now(timeline)
    tracks: dict[int, str] = {}
    for span in spans:
        first = _timeline_tid(span) - _TIMELINE_ENGINES.index(span.engine)
        for offset, engine in enumerate(_TIMELINE_ENGINES):
            tracks[first + offset] = f"{span.device} {_TIMELINE_TRACKS[engine]}"
    events: list[_Event] = [
        {
            "name": span.label,
            "cat": f"timeline,{span.engine}",
            "ph": "X",
            "ts": _virtual_us(span.start),
            "dur": _virtual_us(span.end - span.start),
            "pid": _TIMELINE_PID,
            "tid": _timeline_tid(span),
            "args": {"device": str(span.device), "engine": span.engine, "bytes": span.nbytes},
        }
        for span in spans
    ]
    # Stable sort: equal (ts, tid) spans keep their enqueue order.
    events.sort(key=lambda event: (event["ts"], event["tid"]))
    metadata: list[_Event] = [
        {
            "name": "process_name",
            "ph": "M",
            "ts": 0,
            "pid": _TIMELINE_PID,
            "tid": 0,
            "args": {"name": _TIMELINE_PROCESS},
        }
    ]
    for tid in sorted(tracks):
        metadata.extend(_track_metadata(_TIMELINE_PID, tid, tracks[tid]))
    summary: dict[str, object] = {
        "clock": "virtual seconds from 0",
        "now_s": now,
        "makespan_s": max([now, *(span.end for span in spans)]),
        "tracks": {tracks[tid]: tid for tid in sorted(tracks)},
    }
    return metadata, events, summary


def trace_events(
    transitions: Iterable[ResidencyTransitionReport | ResidencyPlanReport],
    samples: Iterable[tuple[int, ResidencySnapshot[Any]]] = (),
    *,
    timeline: Timeline | None = None,
) -> dict[str, object]:
    """Build the Chrome/Perfetto trace-event JSON object for reports and timed snapshots.

    Every location gets its own track (pid 1, one tid per location, named by a
    ``thread_name`` metadata event). Each executed transition is a complete event
    (``"ph": "X"``) on its destination's track (its source's for drops; discards, which
    have neither, go to a ``"discards"`` track); no-op transitions are instant events
    (``"ph": "i"``). A plan report contributes its transitions and one slice for the
    plan on a ``"plans"`` track. Each ``(time_ns, snapshot)`` sample contributes one
    counter event (``"ph": "C"``) per location with ``used`` and ``reserved`` bytes, and
    ``budget`` when the location has one.

    Times are microseconds relative to the earliest timestamp among the inputs. Events
    are sorted by ``ts``, then ``tid``; the result is deterministic for a given input.

    With ``timeline`` (a simulated runtime's `Timeline`), its spans are added as complete
    events of a second process (pid 2, ``"simulated device timeline (virtual time)"``),
    with four tracks per device that has spans, named like ``"cuda:0 H2D copy"``,
    ``"cuda:0 D2H copy"``, ``"cuda:0 D2D copy"`` and ``"cuda:0 compute"``. Their ``ts``
    and ``dur`` are microseconds of virtual time from 0, unrelated to the wall-clock
    times of the first process; the document's metadata gains a ``"timeline"`` entry.

    See docs/concepts/simulation.md for the timeline.

    Args:
        transitions: Transition reports and plan reports, in any order.
        samples: ``(time_ns, snapshot)`` pairs, for the memory counters.
        timeline: A simulated runtime's `Timeline` whose spans to add, or ``None``.

    Returns:
        The JSON-ready trace document (``traceEvents``, ``displayTimeUnit``, ``metadata``).

    Raises:
        TypeError: An element of ``transitions`` that is not a report, a sample that is not a
            ``(time_ns, snapshot)`` pair, or a ``timeline`` that is not a `Timeline`.

    Example:
        ```python
        import torch
        from fhelium.residency import PINNED_HOST, ReplicaMode, ResidencyManager
        from fhelium.residency.export import trace_events
        from fhelium.residency.simulation import SimulatedRuntime, use_runtime
        from fhelium.values import ResidentTensor

        with use_runtime(SimulatedRuntime(device_count=0)), ResidencyManager() as manager:
            value = ResidentTensor(torch.ones(4))
            handle = manager.adopt(value, replica_mode=ReplicaMode.REPLICABLE)
            manager.ensure(handle, PINNED_HOST)
            document = trace_events(manager.trace(), [(0, manager.snapshot())])
        assert any(event["ph"] == "X" for event in document["traceEvents"])
        ```
    """
    if timeline is not None and not isinstance(timeline, Timeline):
        raise TypeError(f"timeline must be a Timeline or None, got {type(timeline).__name__}")
    flat: list[tuple[ResidencyTransitionReport, str | None]] = []
    plans: list[ResidencyPlanReport] = []
    for index, item in enumerate(transitions):
        if isinstance(item, ResidencyPlanReport):
            plans.append(item)
            flat.extend((report, item.plan_name) for report in item.transitions)
        elif isinstance(item, ResidencyTransitionReport):
            flat.append((item, None))
        else:
            raise TypeError(
                f"transitions[{index}] must be a ResidencyTransitionReport or "
                f"ResidencyPlanReport, got {type(item).__name__}"
            )
    timed = _collect_samples(samples)

    starts = [report.started_at_ns for report, _ in flat]
    starts += [plan.started_at_ns for plan in plans]
    starts += [time_ns for time_ns, _ in timed]
    origin = min(starts, default=0)

    tracks: dict[int, str] = {}

    def track_of(location: ResidencyLocation | None, fallback_tid: int, fallback: str) -> int:
        if location is None:
            tracks[fallback_tid] = fallback
            return fallback_tid
        tid = _location_tid(location)
        tracks[tid] = location.name
        return tid

    events: list[_Event] = []
    for report, plan_name in flat:
        for location in (report.source, report.destination):
            if location is not None:
                track_of(location, _DISCARDS_TID, _DISCARDS_TRACK)
        kind = _action_kind(report)
        tid = track_of(report.destination or report.source, _DISCARDS_TID, _DISCARDS_TRACK)
        name = f"{kind} {_format_bytes(report.storage_nbytes)}"
        args = _transition_args(report, plan_name)
        ts = _us(report.started_at_ns, origin)
        if report.no_op:
            events.append(
                {
                    "name": f"{name} (no-op)",
                    "cat": "residency,no-op",
                    "ph": "i",
                    "s": "t",
                    "ts": ts,
                    "pid": _PID,
                    "tid": tid,
                    "args": args,
                }
            )
        else:
            events.append(
                {
                    "name": name,
                    "cat": f"residency,{kind}",
                    "ph": "X",
                    "ts": ts,
                    "dur": (report.completed_at_ns - report.started_at_ns) / 1000.0,
                    "pid": _PID,
                    "tid": tid,
                    "args": args,
                }
            )

    for plan in plans:
        tid = track_of(None, _PLANS_TID, _PLANS_TRACK)
        events.append(
            {
                "name": plan.plan_name,
                "cat": "residency,plan",
                "ph": "X",
                "ts": _us(plan.started_at_ns, origin),
                "dur": (plan.completed_at_ns - plan.started_at_ns) / 1000.0,
                "pid": _PID,
                "tid": tid,
                "args": {
                    "plan": plan.plan_name,
                    "transitions": len(plan.transitions),
                    "no_ops": sum(1 for report in plan.transitions if report.no_op),
                    "bytes": sum(
                        report.storage_nbytes for report in plan.transitions if not report.no_op
                    ),
                },
            }
        )

    manager_ids: set[str] = set()
    for time_ns, snapshot in timed:
        manager_ids.add(snapshot.manager_id)
        ts = _us(time_ns, origin)
        for entry in sorted(snapshot.locations, key=lambda e: _location_order(e.location)):
            tid = track_of(entry.location, _DISCARDS_TID, _DISCARDS_TRACK)
            counter: dict[str, object] = {
                "used": entry.used_bytes,
                "reserved": entry.reserved_bytes,
            }
            if entry.budget_bytes is not None:
                counter["budget"] = entry.budget_bytes
            events.append(
                {
                    "name": f"{entry.location.name} bytes",
                    "cat": "residency,memory",
                    "ph": "C",
                    "ts": ts,
                    "pid": _PID,
                    "tid": tid,
                    "args": counter,
                }
            )

    # Stable sort: equal (ts, tid) events keep their input order.
    events.sort(key=lambda event: (event["ts"], event["tid"]))
    metadata: list[_Event] = [
        {
            "name": "process_name",
            "ph": "M",
            "ts": 0,
            "pid": _PID,
            "tid": 0,
            "args": {"name": "fhelium.residency"},
        }
    ]
    for tid in sorted(tracks):
        metadata.extend(_track_metadata(_PID, tid, tracks[tid]))
    document_metadata: dict[str, object] = {
        "producer": "fhelium.residency.export",
        "clock": "time.time_ns",
        "origin_ns": origin,
        "manager_ids": sorted(manager_ids),
        "tracks": {tracks[tid]: tid for tid in sorted(tracks)},
    }
    if timeline is None:
        return {
            "traceEvents": [*metadata, *events],
            "displayTimeUnit": "ms",
            "metadata": document_metadata,
        }
    timeline_metadata, timeline_events, summary = _timeline_events(timeline)
    document_metadata["timeline"] = summary
    return {
        "traceEvents": [*metadata, *timeline_metadata, *events, *timeline_events],
        "displayTimeUnit": "ms",
        "metadata": document_metadata,
    }


def write_trace(
    path: str | os.PathLike[str],
    transitions: Iterable[ResidencyTransitionReport | ResidencyPlanReport],
    samples: Iterable[tuple[int, ResidencySnapshot[Any]]] = (),
    *,
    timeline: Timeline | None = None,
) -> None:
    """Write ``trace_events(transitions, samples, timeline=timeline)`` to ``path`` as JSON.

    The JSON is compact UTF-8.

    Open the file in Perfetto (ui.perfetto.dev) or ``chrome://tracing``.

    Args:
        path: The file to write (replaced if it exists).
        transitions: Transition reports and plan reports.
        samples: ``(time_ns, snapshot)`` pairs, for the memory counters.
        timeline: A simulated runtime's `Timeline` whose spans to add, or ``None``.

    Raises:
        TypeError: As `trace_events` raises.
        OSError: The file cannot be written.

    Example:
        ```python
        import torch
        from fhelium.residency import PINNED_HOST, ReplicaMode, ResidencyManager
        from fhelium.residency.export import write_trace
        from fhelium.residency.simulation import SimulatedRuntime, Timeline, use_runtime
        from fhelium.values import ResidentTensor

        runtime = SimulatedRuntime(device_count=0, timeline=Timeline())
        with use_runtime(runtime), ResidencyManager() as manager:
            value = ResidentTensor(torch.ones(4))
            handle = manager.adopt(value, replica_mode=ReplicaMode.REPLICABLE)
            manager.ensure(handle, PINNED_HOST)
            write_trace("trace.json", manager.trace(), timeline=runtime.timeline)
        ```
    """
    document = trace_events(transitions, samples, timeline=timeline)
    text = json.dumps(document, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    with open(path, "w", encoding="utf-8") as stream:
        stream.write(text)


def plot_memory(
    samples: Sequence[tuple[int, ResidencySnapshot[Any]]],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
) -> None:
    """Plot per-location memory over time into a PNG at ``path``.

    One subplot per location (in track order), on a shared time axis in seconds from
    the first sample: ``used`` bytes and ``used + reserved`` bytes as step lines, and
    the budget as a dashed horizontal line where the location has one. The y axis is in
    MiB. Needs matplotlib (``pip install 'fhelium-residency[plot]'``); it renders with
    the Agg backend and leaves matplotlib's global backend untouched.

    Args:
        samples: ``(time_ns, snapshot)`` pairs, in any order.
        path: The PNG file to write.
        title: A figure title, or ``None``.

    Raises:
        ValueError: No samples, or samples that list no location.
        TypeError: A sample that is not a ``(time_ns, snapshot)`` pair, or a ``title`` that is
            not a string.
        ImportError: matplotlib is not installed (the message names the ``plot`` extra).
        OSError: The file cannot be written.
    """
    timed = _collect_samples(samples)
    if not timed:
        raise ValueError("plot_memory needs at least one (time_ns, snapshot) sample")
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title must be a str or None, got {type(title).__name__}")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(_PLOT_EXTRA_HINT) from exc

    timed.sort(key=lambda sample: sample[0])
    origin = timed[0][0]
    series: dict[ResidencyLocation, tuple[list[float], list[float], list[float]]] = {}
    budgets: dict[ResidencyLocation, int] = {}
    for time_ns, snapshot in timed:
        seconds = (time_ns - origin) / 1e9
        for entry in snapshot.locations:
            times, used, charged = series.setdefault(entry.location, ([], [], []))
            times.append(seconds)
            used.append(entry.used_bytes / _MIB)
            charged.append((entry.used_bytes + entry.reserved_bytes) / _MIB)
            if entry.budget_bytes is not None:
                budgets[entry.location] = entry.budget_bytes
    if not series:
        raise ValueError("the samples list no locations to plot")
    locations = sorted(series, key=_location_order)

    figure = Figure(figsize=(8.0, 1.0 + 2.2 * len(locations)), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(locations), 1, sharex=True, squeeze=False)
    for row, location in enumerate(locations):
        ax = axes[row][0]
        times, used, charged = series[location]
        ax.step(times, used, where="post", label="used")
        ax.step(times, charged, where="post", label="used + reserved", linestyle="-.")
        if location in budgets:
            ax.axhline(budgets[location] / _MIB, color="tab:red", linestyle="--", label="budget")
        ax.set_title(location.name, fontsize="medium")
        ax.set_ylabel("MiB")
        ax.set_ylim(bottom=0.0)
        ax.grid(visible=True, alpha=0.3)
        ax.legend(loc="upper right", fontsize="small")
    axes[-1][0].set_xlabel("time (s)")
    if title is not None:
        figure.suptitle(title)
    figure.savefig(path, format="png")
