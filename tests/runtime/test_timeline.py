"""The simulated runtime's virtual-time model (docs/concepts/simulation.md).

Every schedule here is computed by hand from the documented rules, with round bandwidths
(1e9 bytes/s, so 1_000_000 bytes take 1 ms) and values of 1_000_000 bytes. A broken rule
moves a start, an end or the host clock and fails an exact comparison.
"""

# Exception types are fixed; ValueError wording is not (docs/concepts/conventions.md#check-order).
# ruff: noqa: PT011

from __future__ import annotations

import itertools
import json
import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from fhelium.residency import simulation
from fhelium.residency.export import trace_events, write_trace
from fhelium.residency.location import PINNED_HOST, cuda_location
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.model import ReplicaMode
from fhelium.residency.simulation import (
    SimulatedEvent,
    SimulatedRuntime,
    SimulatedStream,
    Timeline,
    TimelineSpan,
    use_runtime,
)
from fhelium.values import ResidentTensor, TensorBundle

DEV0 = torch.device("cuda", 0)
DEV1 = torch.device("cuda", 1)
MB = 1_000_000  # bytes of `value()`
MS = 1e-3


def approx(expected: float) -> Any:
    # Float sums of milliseconds; anything beyond rounding noise is a wrong schedule.
    return pytest.approx(expected, rel=1e-12, abs=1e-15)


def value(nbytes: int = MB) -> ResidentTensor:
    return ResidentTensor(torch.empty(nbytes // 4, dtype=torch.float32))


def runtime_with(
    h2d: float = 1e9, d2h: float = 1e9, d2d: float = 1e10, device_count: int = 2
) -> tuple[SimulatedRuntime, Timeline]:
    timeline = Timeline(h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, d2d_bytes_per_s=d2d)
    return SimulatedRuntime(device_count, timeline=timeline), timeline


def ends(span: TimelineSpan) -> tuple[float, float]:
    return span.start, span.end


def assert_span(
    span: TimelineSpan,
    *,
    device: torch.device,
    engine: str,
    start: float,
    end: float,
    nbytes: int,
    label: str,
) -> None:
    assert span.device == device
    assert span.engine == engine
    assert span.start == approx(start)
    assert span.end == approx(end)
    assert span.nbytes == nbytes
    assert span.label == label


# --------------------------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------------------------


def test_copy_then_compute_on_one_stream_run_back_to_back() -> None:
    runtime, timeline = runtime_with()
    stream = runtime.current_stream(DEV0)
    runtime.copy_to_cuda(runtime.pin(value()), DEV0, stream, non_blocking=True)
    compute = runtime.compute(stream, 2 * MS, label="matmul")
    copy_span, compute_span = timeline.spans
    assert_span(
        copy_span, device=DEV0, engine="h2d", start=0.0, end=MS, nbytes=MB, label="H2D 976.6 KiB"
    )
    assert compute == compute_span
    assert_span(
        compute_span,
        device=DEV0,
        engine="compute",
        start=MS,
        end=3 * MS,
        nbytes=0,
        label="matmul",
    )
    # Sum: the compute waited for the copy on its stream. The host never waited.
    assert timeline.makespan == approx(3 * MS)
    assert timeline.now == 0.0


def test_copy_on_a_transfer_stream_overlaps_compute_on_another() -> None:
    runtime, timeline = runtime_with()
    main = runtime.current_stream(DEV0)
    transfer = runtime.create_stream(DEV0)
    runtime.compute(main, 2 * MS)
    runtime.copy_to_cuda(runtime.pin(value()), DEV0, transfer, non_blocking=True)
    compute_span, copy_span = timeline.spans
    assert ends(compute_span) == (0.0, approx(2 * MS))
    assert ends(copy_span) == (0.0, approx(MS))
    # Max, not sum: the engines run concurrently.
    assert timeline.makespan == approx(2 * MS)


def test_wait_event_orders_a_consumer_after_the_transfer() -> None:
    runtime, timeline = runtime_with()
    main = runtime.current_stream(DEV0)
    transfer = runtime.create_stream(DEV0)
    runtime.copy_to_cuda(runtime.pin(value()), DEV0, transfer, non_blocking=True)
    ready = runtime.record_event(transfer)
    assert ready.time == approx(MS)
    runtime.wait_event(main, ready)
    consumer = runtime.compute(main, 2 * MS)
    assert ends(consumer) == (approx(MS), approx(3 * MS))
    assert runtime.waits == [(main, ready)]
    # The wait did not block the host.
    assert timeline.now == 0.0
    assert runtime.event_query(ready) is False


def test_without_wait_event_the_consumer_does_not_wait() -> None:
    runtime, _ = runtime_with()
    main = runtime.current_stream(DEV0)
    transfer = runtime.create_stream(DEV0)
    runtime.copy_to_cuda(runtime.pin(value()), DEV0, transfer, non_blocking=True)
    assert ends(runtime.compute(main, 2 * MS)) == (0.0, approx(2 * MS))


def test_wait_on_an_earlier_event_does_not_move_the_stream_back() -> None:
    runtime, timeline = runtime_with()
    main = runtime.current_stream(DEV0)
    transfer = runtime.create_stream(DEV0)
    early = runtime.record_event(transfer)  # nothing enqueued: time 0
    runtime.compute(main, 5 * MS)
    runtime.wait_event(main, early)
    assert ends(runtime.compute(main, MS)) == (approx(5 * MS), approx(6 * MS))
    assert timeline.makespan == approx(6 * MS)


def test_two_copies_from_two_streams_share_one_h2d_engine() -> None:
    runtime, timeline = runtime_with()
    first, second = runtime.create_stream(DEV0), runtime.create_stream(DEV0)
    runtime.copy_to_cuda(runtime.pin(value()), DEV0, first, non_blocking=True)
    runtime.copy_to_cuda(runtime.pin(value()), DEV0, second, non_blocking=True)
    a, b = timeline.spans
    assert ends(a) == (0.0, approx(MS))
    assert ends(b) == (approx(MS), approx(2 * MS))  # serialised on the engine
    assert runtime.record_event(second).time == approx(2 * MS)
    assert runtime.record_event(first).time == approx(MS)


def test_copies_to_two_devices_run_in_parallel() -> None:
    runtime, timeline = runtime_with()
    runtime.copy_to_cuda(runtime.pin(value()), DEV0, None, non_blocking=True)
    runtime.copy_to_cuda(runtime.pin(value()), DEV1, None, non_blocking=True)
    a, b = timeline.spans
    assert (a.device, b.device) == (DEV0, DEV1)
    assert ends(a) == ends(b) == (0.0, approx(MS))
    assert timeline.busy("h2d") == approx(2 * MS)
    assert timeline.busy("h2d", DEV1) == approx(MS)


def test_a_pageable_source_blocks_the_host_and_a_pinned_one_does_not() -> None:
    runtime, timeline = runtime_with()
    stream = runtime.create_stream(DEV0)
    runtime.copy_to_cuda(runtime.pin(value()), DEV0, stream, non_blocking=True)
    assert timeline.now == 0.0
    runtime.copy_to_cuda(value(), DEV0, stream, non_blocking=False)
    # The synchronous copy queued behind the first one, and the host waited for it.
    assert ends(timeline.spans[1]) == (approx(MS), approx(2 * MS))
    assert timeline.now == approx(2 * MS)
    # Work enqueued afterwards cannot start before the host enqueued it.
    other = runtime.create_stream(DEV0)
    assert ends(runtime.compute(other, MS)) == (approx(2 * MS), approx(3 * MS))


def test_copy_time_is_the_unique_storage_bytes() -> None:
    runtime, timeline = runtime_with()
    backing = torch.empty(500_000, dtype=torch.float32)  # 2 MB
    bundle = TensorBundle(a=backing[:10], b=backing[10:20], c=torch.empty(0))
    runtime.copy_to_cuda(bundle, DEV0, None, non_blocking=True)
    (span,) = timeline.spans
    assert span.nbytes == 2 * MB
    assert span.end == approx(2 * MS)
    assert span.label == "H2D 1.9 MiB"


def test_device_to_host_copies_are_synchronous_and_follow_the_default_stream() -> None:
    runtime, timeline = runtime_with(d2h=5e8)
    on_device = runtime.to_device(value(), DEV0)
    side = runtime.create_stream(DEV0)
    runtime.compute(runtime.current_stream(DEV0), 2 * MS)
    runtime.compute(side, 10 * MS)  # not on the default stream: the D2H does not wait
    runtime.copy_to_pinned(on_device)
    d2h = timeline.spans[-1]
    assert_span(
        d2h,
        device=DEV0,
        engine="d2h",
        start=2 * MS,
        end=4 * MS,
        nbytes=MB,
        label="D2H 976.6 KiB",
    )
    assert timeline.now == approx(4 * MS)
    # A second D2H (pageable) starts at the host clock.
    runtime.copy_to_pageable(on_device)
    assert ends(timeline.spans[-1]) == (approx(4 * MS), approx(6 * MS))
    assert timeline.now == approx(6 * MS)
    assert timeline.busy("d2h", "cuda:0") == approx(4 * MS)


def test_host_to_host_copies_take_no_virtual_time() -> None:
    runtime, timeline = runtime_with()
    pinned = runtime.copy_to_pinned(value())
    runtime.copy_to_pageable(pinned)
    assert timeline.spans == ()
    assert timeline.now == 0.0
    assert timeline.makespan == 0.0


def test_device_to_device_copies_use_the_destination_d2d_engine() -> None:
    runtime, timeline = runtime_with(d2d=1e10)
    on_device = runtime.to_device(value(), DEV0)
    runtime.copy_to_cuda(on_device, DEV1, None, non_blocking=True)
    (span,) = timeline.spans
    assert_span(
        span,
        device=DEV1,
        engine="d2d",
        start=0.0,
        end=0.1 * MS,
        nbytes=MB,
        label="D2D 976.6 KiB",
    )
    assert timeline.busy("h2d") == 0.0


def test_default_bandwidths() -> None:
    timeline = Timeline()
    assert timeline.h2d_bytes_per_s == 55e9
    assert timeline.d2h_bytes_per_s == 55e9
    assert timeline.d2d_bytes_per_s == 2e12
    runtime = SimulatedRuntime(timeline=timeline)
    runtime.copy_to_cuda(runtime.pin(value(55 * MB)), DEV0, None, non_blocking=True)
    assert timeline.spans[0].end == approx(MS)


# --------------------------------------------------------------------------------------------
# Events and the host clock
# --------------------------------------------------------------------------------------------


def test_event_query_is_false_until_a_host_sync_reaches_the_event() -> None:
    runtime, timeline = runtime_with()
    stream = runtime.create_stream(DEV0)
    runtime.copy_to_cuda(runtime.pin(value()), DEV0, stream, non_blocking=True)
    event = runtime.record_event(stream)
    assert runtime.event_query(event) is False
    assert event.completed is False
    assert runtime.pending_event_count() == 1
    runtime.synchronize_event(event)
    assert timeline.now == approx(MS)
    assert runtime.event_query(event) is True
    assert event.completed is True
    assert runtime.pending_event_count() == 0


def test_an_event_on_an_idle_stream_is_complete_when_recorded() -> None:
    runtime, _ = runtime_with()
    event = runtime.record_event(runtime.create_stream(DEV0))
    assert event.time == 0.0
    assert event.completed is True
    assert runtime.event_query(event) is True
    assert runtime.pending_event_count() == 0


def test_event_query_sees_the_clock_moved_by_other_work() -> None:
    runtime, timeline = runtime_with()
    transfer = runtime.create_stream(DEV0)
    runtime.copy_to_cuda(runtime.pin(value()), DEV0, transfer, non_blocking=True)
    event = runtime.record_event(transfer)
    # A later synchronous copy on another device moves the host clock past the event.
    runtime.copy_to_cuda(value(2 * MB), DEV1, None, non_blocking=False)
    assert timeline.now == approx(2 * MS)
    assert event.completed is False  # not observed yet
    assert runtime.event_query(event) is True
    assert runtime.pending_event_count() == 0


def test_synchronize_stream_waits_for_that_stream_only() -> None:
    runtime, timeline = runtime_with()
    short, long = runtime.create_stream(DEV0), runtime.create_stream(DEV0)
    runtime.compute(short, MS)
    runtime.compute(long, 4 * MS)
    first = runtime.record_event(short)
    last = runtime.record_event(long)
    runtime.synchronize_stream(short)
    # The compute engine serialises: short runs 0-1 ms, long 1-5 ms.
    assert timeline.now == approx(MS)
    assert (first.completed, last.completed) == (True, False)
    runtime.synchronize_stream(long)
    assert timeline.now == approx(5 * MS)
    assert last.completed is True


def test_synchronize_device_waits_for_every_stream_and_engine_of_the_device() -> None:
    runtime, timeline = runtime_with()
    transient = runtime.create_stream(DEV0)
    runtime.compute(transient, 3 * MS)
    runtime.copy_to_cuda(runtime.pin(value()), DEV0, runtime.create_stream(DEV0), non_blocking=True)
    runtime.compute(runtime.create_stream(DEV1), 9 * MS)
    del transient  # a collected stream's work still counts
    runtime.synchronize_device(DEV0)
    assert timeline.now == approx(3 * MS)
    runtime.synchronize_device(DEV1)
    assert timeline.now == approx(9 * MS)


def test_synchronize_device_waits_for_a_cross_device_wait() -> None:
    runtime, timeline = runtime_with()
    producer = runtime.create_stream(DEV0)
    runtime.compute(producer, 4 * MS)
    waiter = runtime.create_stream(DEV1)
    runtime.wait_event(waiter, runtime.record_event(producer))
    runtime.synchronize_device(DEV1)
    assert timeline.now == approx(4 * MS)


def test_complete_and_complete_events_advance_the_clock() -> None:
    runtime, timeline = runtime_with()
    a, b = runtime.create_stream(DEV0), runtime.create_stream(DEV1)
    runtime.compute(a, 2 * MS)
    runtime.compute(b, 7 * MS)
    first, second = runtime.record_event(a), runtime.record_event(b)
    first.complete()
    assert timeline.now == approx(2 * MS)
    assert (first.completed, second.completed) == (True, False)
    runtime.compute(a, 10 * MS)  # starts at 2 ms: ends at 12 ms
    late = runtime.record_event(a)
    assert runtime.complete_events() == 2
    assert timeline.now == approx(12 * MS)
    assert second.completed
    assert late.completed
    assert runtime.complete_events() == 0
    assert timeline.now == approx(12 * MS)


def test_events_without_a_timeline_are_unchanged() -> None:
    runtime = SimulatedRuntime()
    assert runtime.timeline is None
    stream = runtime.create_stream(DEV0)
    runtime.copy_to_cuda(runtime.pin(value()), DEV0, stream, non_blocking=True)
    event = runtime.record_event(stream)
    assert event.time is None
    assert runtime.event_query(event) is False
    runtime.wait_event(runtime.current_stream(DEV0), event)
    assert runtime.waits == [(runtime.current_stream(DEV0), event)]
    assert runtime.event_query(event) is False
    runtime.synchronize_event(event)
    assert runtime.event_query(event) is True
    assert repr(runtime) == "SimulatedRuntime(device_count=2, pinned=True, auto_complete=False)"
    with pytest.raises(RuntimeError, match="timeline"):
        runtime.compute(stream, 1.0)


def test_a_hand_built_event_keeps_test_controlled_completion_under_a_timeline() -> None:
    runtime, timeline = runtime_with()
    event = SimulatedEvent(runtime.create_stream(DEV0))
    assert event.time is None
    assert runtime.event_query(event) is False
    runtime.wait_event(runtime.current_stream(DEV0), event)  # orders nothing
    event.complete()
    assert runtime.event_query(event) is True
    assert timeline.now == 0.0


# --------------------------------------------------------------------------------------------
# Results: makespan, busy, reset
# --------------------------------------------------------------------------------------------


def test_makespan_busy_and_reset() -> None:
    runtime, timeline = runtime_with()
    main, transfer = runtime.current_stream(DEV0), runtime.create_stream(DEV0)
    for _ in range(3):
        runtime.copy_to_cuda(runtime.pin(value()), DEV0, transfer, non_blocking=True)
        runtime.wait_event(main, runtime.record_event(transfer))
        runtime.compute(main, 2 * MS)
    # Copies at 0-1, 1-2, 2-3 ms; computes at 1-3, 3-5, 5-7 ms.
    assert [ends(span) for span in timeline.spans if span.engine == "compute"] == [
        (approx(MS), approx(3 * MS)),
        (approx(3 * MS), approx(5 * MS)),
        (approx(5 * MS), approx(7 * MS)),
    ]
    assert timeline.makespan == approx(7 * MS)
    assert timeline.busy("h2d") == approx(3 * MS)
    assert timeline.busy("compute", DEV0) == approx(6 * MS)
    assert timeline.busy("compute", 1) == 0.0
    assert timeline.busy("d2h") == 0.0
    pending = runtime.record_event(main)
    assert pending.completed is False

    timeline.reset()
    assert timeline.spans == ()
    assert timeline.now == 0.0
    assert timeline.makespan == 0.0
    # Work enqueued before the reset counts as done.
    assert pending.completed is True
    assert runtime.pending_event_count() == 0
    assert ends(runtime.compute(main, MS)) == (0.0, approx(MS))
    assert runtime.record_event(transfer).time == 0.0


def test_makespan_includes_the_host_clock() -> None:
    runtime, timeline = runtime_with()
    runtime.compute(runtime.current_stream(DEV0), 0.0)
    runtime.copy_to_cuda(value(), DEV0, None, non_blocking=False)
    timeline.reset()
    assert timeline.makespan == 0.0
    runtime.copy_to_cuda(value(), DEV0, None, non_blocking=False)
    assert timeline.makespan == timeline.now == approx(MS)


def test_spans_are_in_enqueue_order_and_are_a_snapshot() -> None:
    runtime, timeline = runtime_with()
    late, early = runtime.create_stream(DEV0), runtime.create_stream(DEV1)
    runtime.compute(late, 5 * MS, label="late")
    runtime.wait_event(early, runtime.record_event(late))
    runtime.compute(early, MS, label="after")
    runtime.compute(runtime.create_stream(DEV1), MS, label="first to start")
    spans = timeline.spans
    assert [span.label for span in spans] == ["late", "after", "first to start"]
    runtime.compute(late, MS)
    assert len(spans) == 3
    assert len(timeline.spans) == 4


def test_concurrent_copies_never_overlap_on_one_engine() -> None:
    runtime, timeline = runtime_with()
    source = runtime.pin(value(1000))
    barrier = threading.Barrier(8)

    def worker() -> None:
        stream = runtime.create_stream(DEV0)
        barrier.wait()
        for _ in range(50):
            runtime.copy_to_cuda(source, DEV0, stream, non_blocking=True)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    spans = sorted(timeline.spans, key=lambda span: span.start)
    assert len(spans) == 400
    for before, after in itertools.pairwise(spans):
        assert after.start >= before.end
    assert timeline.makespan == approx(400 * 1e-6)
    assert runtime.calls["copy_to_cuda"] == 400


# --------------------------------------------------------------------------------------------
# Perfetto export
# --------------------------------------------------------------------------------------------


def scheduled_timeline() -> Timeline:
    runtime, timeline = runtime_with(d2h=2e9)
    main, transfer = runtime.current_stream(DEV0), runtime.create_stream(DEV0)
    # Enqueued first but on a later track than the H2D copy that starts with it.
    runtime.compute(runtime.create_stream(DEV1), 0.2 * MS, label="warm-up")  # 0-200 us
    runtime.copy_to_cuda(runtime.pin(value()), DEV0, transfer, non_blocking=True)  # 0-1000 us
    runtime.wait_event(main, runtime.record_event(transfer))
    runtime.compute(main, 2.5 * MS, label="layer 0")  # 1000-3500 us
    on_device = runtime.to_device(value(), DEV0)
    runtime.copy_to_pinned(on_device)  # after the default stream: 3500-4000 us
    # D2D, enqueued after the host waited for the D2H: 4000-4100 us.
    runtime.copy_to_cuda(on_device, DEV1, None, non_blocking=True)
    return timeline


def test_trace_events_show_the_timeline_as_its_own_process() -> None:
    document = trace_events([], timeline=scheduled_timeline())
    events: list[dict[str, Any]] = document["traceEvents"]  # type: ignore[assignment]
    timeline_events = [event for event in events if event["pid"] == 2]
    names = {
        event["tid"]: event["args"]["name"]
        for event in timeline_events
        if event["ph"] == "M" and event["name"] == "thread_name"
    }
    assert names == {
        1: "cuda:0 H2D copy",
        2: "cuda:0 D2H copy",
        3: "cuda:0 D2D copy",
        4: "cuda:0 compute",
        5: "cuda:1 H2D copy",
        6: "cuda:1 D2H copy",
        7: "cuda:1 D2D copy",
        8: "cuda:1 compute",
    }
    (process,) = [event for event in timeline_events if event["name"] == "process_name"]
    assert process["args"] == {"name": "simulated device timeline (virtual time)"}
    spans = [
        (event["name"], event["tid"], event["ts"], event["dur"], event["args"]["bytes"])
        for event in timeline_events
        if event["ph"] == "X"
    ]
    # Sorted by ts, then tid.
    assert spans == [
        ("H2D 976.6 KiB", 1, 0.0, 1000.0, MB),
        ("warm-up", 8, 0.0, 200.0, 0),
        ("layer 0", 4, 1000.0, 2500.0, 0),
        ("D2H 976.6 KiB", 2, 3500.0, 500.0, MB),
        ("D2D 976.6 KiB", 7, 4000.0, 100.0, MB),
    ]
    metadata: dict[str, Any] = document["metadata"]  # type: ignore[assignment]
    assert metadata["timeline"]["makespan_s"] == approx(4.1 * MS)
    assert metadata["timeline"]["now_s"] == approx(4 * MS)
    assert metadata["timeline"]["tracks"]["cuda:0 compute"] == 4
    # Nothing lands in the residency process.
    assert [event for event in events if event["pid"] == 1 and event["ph"] != "M"] == []


def test_trace_without_a_timeline_is_unchanged(tmp_path: Path) -> None:
    timeline = scheduled_timeline()
    plain = trace_events([])
    with_timeline = trace_events([], timeline=timeline)
    metadata: dict[str, Any] = dict(with_timeline["metadata"])  # type: ignore[call-overload]
    del metadata["timeline"]
    assert metadata == plain["metadata"]
    events: list[dict[str, Any]] = with_timeline["traceEvents"]  # type: ignore[assignment]
    assert [event for event in events if event["pid"] != 2] == plain["traceEvents"]
    assert "timeline" not in plain["metadata"]  # type: ignore[operator]

    path = tmp_path / "trace.json"
    write_trace(path, [], timeline=timeline)
    assert json.loads(path.read_text(encoding="utf-8")) == with_timeline
    write_trace(path, [])
    assert json.loads(path.read_text(encoding="utf-8")) == plain
    # Deterministic: the same timeline exports the same document.
    assert trace_events([], timeline=timeline) == with_timeline


def test_trace_events_refuses_a_non_timeline() -> None:
    with pytest.raises(TypeError):
        trace_events([], timeline=object())  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["h2d_bytes_per_s", "d2h_bytes_per_s", "d2d_bytes_per_s"])
@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (True, TypeError),
        ("1e9", TypeError),
        (None, TypeError),
        (0, ValueError),
        (-1.0, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
    ],
)
def test_timeline_bandwidths_are_checked(name: str, bad: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        Timeline(**{name: bad})  # type: ignore[arg-type]


def test_timeline_accepts_int_bandwidths_and_is_keyword_only() -> None:
    assert Timeline(h2d_bytes_per_s=1).h2d_bytes_per_s == 1.0
    with pytest.raises(TypeError):
        Timeline(1e9)  # type: ignore[misc]


def test_auto_complete_and_a_timeline_are_refused_together() -> None:
    timeline = Timeline()
    with pytest.raises(ValueError, match="auto_complete"):
        SimulatedRuntime(auto_complete=True, timeline=timeline)
    # The refused construction did not claim the timeline.
    assert SimulatedRuntime(timeline=timeline).timeline is timeline
    with pytest.raises(TypeError):
        SimulatedRuntime(timeline=object())  # type: ignore[arg-type]


def test_a_timeline_belongs_to_one_runtime() -> None:
    timeline = Timeline()
    first = SimulatedRuntime(timeline=timeline)
    with pytest.raises(ValueError):
        SimulatedRuntime(timeline=timeline)
    assert first.timeline is timeline


@pytest.mark.parametrize(
    ("seconds", "error"),
    [(-1e-9, ValueError), (math.inf, ValueError), (math.nan, ValueError), (True, TypeError)],
)
def test_compute_checks_seconds(seconds: object, error: type[Exception]) -> None:
    runtime, timeline = runtime_with()
    with pytest.raises(error):
        runtime.compute(runtime.current_stream(DEV0), seconds)  # type: ignore[arg-type]
    assert timeline.spans == ()


def test_compute_checks_stream_and_label() -> None:
    runtime, timeline = runtime_with()
    with pytest.raises(TypeError):
        runtime.compute(object(), 1.0)
    with pytest.raises(TypeError):
        runtime.compute(runtime.current_stream(DEV0), 1.0, label=3)  # type: ignore[arg-type]
    assert timeline.spans == ()
    # compute is neither counted nor fault-injected.
    runtime.compute(runtime.current_stream(DEV0), 1)
    assert "compute" not in runtime.calls


def test_busy_checks_engine_and_device() -> None:
    _, timeline = runtime_with()
    with pytest.raises(ValueError):
        timeline.busy("pcie")
    with pytest.raises(TypeError):
        timeline.busy(1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        timeline.busy("h2d", "cpu")
    with pytest.raises(TypeError):
        timeline.busy("h2d", 1.5)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# The new seam methods: counted, fault-injectable, type-checked
# --------------------------------------------------------------------------------------------


def test_wait_event_and_create_stream_are_counted() -> None:
    runtime, _ = runtime_with()
    stream = runtime.create_stream(DEV1)
    assert isinstance(stream, SimulatedStream)
    assert stream.device == DEV1
    assert stream is not runtime.current_stream(DEV1)
    runtime.wait_event(stream, runtime.record_event(stream))
    assert runtime.calls["create_stream"] == 1
    assert runtime.calls["wait_event"] == 1
    with pytest.raises(TypeError):
        runtime.wait_event(stream, object())
    with pytest.raises(TypeError):
        runtime.wait_event(object(), runtime.record_event(stream))
    with pytest.raises(ValueError):
        runtime.create_stream(torch.device("cuda", 2))
    assert len(runtime.waits) == 1


def test_fail_next_covers_wait_event_and_create_stream() -> None:
    runtime, timeline = runtime_with()
    transfer = runtime.create_stream(DEV0)
    runtime.compute(transfer, MS)
    event = runtime.record_event(transfer)
    main = runtime.current_stream(DEV0)
    runtime.fail_next("wait_event", ValueError)
    runtime.fail_next("create_stream")
    with pytest.raises(ValueError, match="injected"):
        runtime.wait_event(main, event)
    with pytest.raises(RuntimeError, match="injected"):
        runtime.create_stream(DEV0)
    # The failed wait ordered nothing and was not logged; both calls were counted.
    assert runtime.waits == []
    assert ends(runtime.compute(main, MS)) == (approx(MS), approx(2 * MS))  # engine, not wait
    assert runtime.calls["wait_event"] == 1
    assert runtime.calls["create_stream"] == 2
    runtime.wait_event(main, event)
    assert runtime.waits == [(main, event)]
    assert timeline.now == 0.0


# --------------------------------------------------------------------------------------------
# A real manager under the timeline
# --------------------------------------------------------------------------------------------


def test_a_manager_ensure_appears_on_the_timeline() -> None:
    runtime, timeline = runtime_with()
    with use_runtime(runtime), ResidencyManager({cuda_location("cuda:0"): 8 * MB}) as manager:
        pinned = manager.adopt(
            runtime.pin(value()), at=PINNED_HOST, replica_mode=ReplicaMode.REPLICABLE
        )
        transfer = runtime.create_stream(DEV0)
        report = manager.ensure(pinned, cuda_location("cuda:0"), stream=transfer)
        assert report.storage_nbytes == MB
        (span,) = timeline.spans
        assert_span(
            span,
            device=DEV0,
            engine="h2d",
            start=0.0,
            end=MS,
            nbytes=MB,
            label="H2D 976.6 KiB",
        )
        assert runtime.copies[-1].stream is transfer
        assert runtime.copies[-1].non_blocking is True
        # The manager waits for each copy on the host.
        assert timeline.now == approx(MS)
        assert runtime.pending_event_count() == 0

        # A pageable value goes through the device's current stream, after the first copy.
        pageable = manager.adopt(value(2 * MB), replica_mode=ReplicaMode.REPLICABLE)
        manager.ensure(pageable, cuda_location("cuda:0"))
        second = timeline.spans[-1]
        assert ends(second) == (approx(MS), approx(3 * MS))
        assert runtime.copies[-1].stream is runtime.current_stream(DEV0)
        assert timeline.now == approx(3 * MS)


def test_public_module_exports() -> None:
    assert sorted(simulation.__all__) == [
        "SimulatedCopy",
        "SimulatedEvent",
        "SimulatedHazard",
        "SimulatedRuntime",
        "SimulatedStream",
        "Timeline",
        "TimelineSpan",
        "current_runtime",
        "set_runtime",
        "use_runtime",
    ]
    from fhelium.residency import _runtime

    for name in simulation.__all__:
        assert getattr(simulation, name) is getattr(_runtime, name)
    assert TimelineSpan._fields == ("device", "engine", "start", "end", "nbytes", "label")


def test_an_event_from_before_a_reset_does_not_move_the_new_clock() -> None:
    timeline = Timeline(h2d_bytes_per_s=1e6)
    runtime = SimulatedRuntime(1, timeline=timeline)
    stream = runtime.create_stream(DEV0)
    runtime.compute(stream, 1e-3)
    event = runtime.record_event(stream)
    timeline.reset()
    assert timeline.now == 0.0
    assert runtime.event_query(event)
    runtime.synchronize_event(event)  # done before the reset: nothing to wait for
    assert timeline.now == 0.0


def test_byte_copies_occupy_the_copy_engines() -> None:
    timeline = Timeline(h2d_bytes_per_s=1e6, d2h_bytes_per_s=2e6)
    runtime = SimulatedRuntime(1, timeline=timeline)
    stream = runtime.create_stream(DEV0)
    pinned = runtime.empty_pinned(1000)
    device = runtime.empty_cuda(1000, DEV0, stream)
    runtime.copy_bytes(device, pinned, stream)  # 1 ms on H2D, the host goes on
    assert timeline.now == 0.0
    runtime.copy_bytes(torch.empty(1000, dtype=torch.uint8), device, stream)  # to pageable
    # After the H2D copy on the same stream, 0.5 ms on D2H, and the host waits for it.
    assert [(s.engine, s.start, s.end) for s in timeline.spans] == [
        ("h2d", 0.0, pytest.approx(1e-3)),
        ("d2h", pytest.approx(1e-3), pytest.approx(1.5e-3)),
    ]
    assert timeline.now == pytest.approx(1.5e-3)
