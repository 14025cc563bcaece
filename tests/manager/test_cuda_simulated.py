"""CUDA transfer semantics under the simulated runtime (docs/concepts/transitions.md,
"Copies and streams", "Telemetry").

Stream selection, the `non_blocking` rule, the event recorded on the copy stream and
synchronised before the install, submission-failure cleanup, wrong-device streams, allocator
samples, and two devices with isolated accounting.
"""

# Exception types are fixed; ValueError wording is not (docs/concepts/conventions.md#check-order).
# ruff: noqa: PT011

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from fhelium.errors import ResidencyBudgetError, ResidencyHandleError
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, cuda_location
from fhelium.residency.manager import ResidencyManager
from helpers.manager import (
    CUDA0,
    CUDA1,
    REPLICABLE,
    Source,
    assert_balanced,
    foreign_handle,
    fresh,
    loc_snap,
    mat_locs,
    on,
    simulated,
    spec,
    state_key,
    stream,
    tensor_value,
    used,
)

DEV0 = torch.device("cuda", 0)
DEV1 = torch.device("cuda", 1)


class Spy:
    """Wraps runtime seam methods on the instance and logs the calls, in order."""

    def __init__(self, runtime: Any, names: tuple[str, ...]) -> None:
        self.log: list[tuple[str, tuple[Any, ...], dict[str, Any], Any]] = []
        for name in names:
            original = getattr(runtime, name)
            setattr(runtime, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            entry: list[Any] = [name, args, kwargs, None]
            self.log.append(entry)  # type: ignore[arg-type]
            result = original(*args, **kwargs)
            entry[3] = result
            return result

        return wrapper

    def calls(self, name: str) -> list[Any]:
        return [entry for entry in self.log if entry[0] == name]

    def index(self, predicate: Any) -> int:
        for i, entry in enumerate(self.log):
            if predicate(entry):
                return i
        raise AssertionError("no matching call")


SPIED = (
    "copy_to_cuda",
    "copy_to_pinned",
    "copy_to_pageable",
    "record_event",
    "synchronize_event",
    "synchronize_stream",
    "synchronize_device",
    "storage_keys",
)


@pytest.fixture
def rt() -> Iterator[tuple[Any, Spy]]:
    with simulated() as runtime:
        spy = Spy(runtime, SPIED)
        yield runtime, spy


# --------------------------------------------------------------------------------------------
# Stream selection and the non_blocking rule
# --------------------------------------------------------------------------------------------


def test_host_to_cuda_uses_the_destination_current_stream(rt: tuple[Any, Spy]) -> None:
    runtime, spy = rt
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    manager.ensure(handle, CUDA1)
    (copy,) = runtime.copies
    assert copy.destination == CUDA1
    assert copy.stream is runtime.current_stream(DEV1)
    assert copy.non_blocking is False  # pageable source
    ((_, args, kwargs, _),) = spy.calls("copy_to_cuda")
    assert torch.device(args[1] if len(args) > 1 else kwargs["device"]) == DEV1
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST, CUDA1)
    assert runtime.calls["synchronize_device"] == 0


def test_supplied_stream_is_used_for_the_copy_and_the_event(rt: tuple[Any, Spy]) -> None:
    runtime, spy = rt
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    s0 = stream(runtime, 0)
    manager.ensure(handle, CUDA0, stream=s0)
    (copy,) = runtime.copies
    assert copy.stream is s0
    ((_, args, kwargs, event),) = spy.calls("record_event")
    recorded_on = args[0] if args else kwargs["stream"]
    assert recorded_on is s0
    ((_, sargs, skwargs, _),) = spy.calls("synchronize_event")
    assert (sargs[0] if sargs else skwargs["event"]) is event
    assert event.completed is True
    assert runtime.pending_event_count() == 0


def test_move_uses_the_stream_for_to(rt: tuple[Any, Spy]) -> None:
    runtime, _ = rt
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4))
    s1 = stream(runtime, 1)
    report = manager.move(handle, CUDA1, stream=s1)
    assert report.destination == CUDA1
    assert runtime.copies[-1].stream is s1
    assert mat_locs(manager.snapshot(), handle) == (CUDA1,)


def test_event_is_synchronised_before_the_copy_is_installed() -> None:
    with simulated() as runtime:
        helpers = {"to_device", "pin", "placement", "complete_events", "pending_event_count"}
        helpers |= {"fail_next", "clear_faults"}
        names = tuple(
            name
            for name in dir(runtime)
            if not name.startswith("_") and name not in helpers and callable(getattr(runtime, name))
        )
        spy = Spy(runtime, names)
        manager = ResidencyManager()
        handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
        spy.log.clear()
        manager.ensure(handle, CUDA0)
        ((_, _, _, copied),) = spy.calls("copy_to_cuda")
        i_copy = spy.index(lambda e: e[0] == "copy_to_cuda")
        i_record = spy.index(lambda e: e[0] == "record_event")
        i_sync = spy.index(lambda e: e[0] == "synchronize_event")
        assert i_copy < i_record < i_sync
        assert spy.log[i_sync][1][0] is spy.log[i_record][3]
        # Nothing looks at the copy (validation, alias keys: the install) before the sync.
        uses = [
            i
            for i, entry in enumerate(spy.log)
            if i != i_copy and any(arg is copied for arg in entry[1])
        ]
        assert all(i > i_sync for i in uses), [spy.log[i][0] for i in uses]
        assert runtime.pending_event_count() == 0
        assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST, CUDA0)


@pytest.mark.parametrize(
    ("present", "expected_source", "non_blocking"),
    [
        ((PAGEABLE_HOST,), PAGEABLE_HOST, False),
        ((PINNED_HOST,), PINNED_HOST, True),
        ((CUDA1,), CUDA1, True),
        ((PINNED_HOST, PAGEABLE_HOST), PAGEABLE_HOST, False),  # pageable preferred (source order)
    ],
    ids=["pageable", "pinned", "cuda", "pageable-over-pinned"],
)
def test_non_blocking_follows_the_source(
    rt: tuple[Any, Spy], present: tuple[Any, ...], expected_source: Any, non_blocking: bool
) -> None:
    runtime, _ = rt
    manager = ResidencyManager()
    first, *rest = present
    handle = manager.adopt(on(runtime, first, tensor_value(4)), replica_mode=REPLICABLE)
    for loc in rest:
        manager.ensure(handle, loc)
    report = manager.ensure(handle, CUDA0)
    assert report.source == expected_source
    copy = runtime.copies[-1]
    assert copy.destination == CUDA0
    assert copy.non_blocking is non_blocking
    assert copy.stream is runtime.current_stream(DEV0)


def test_cuda_to_cuda_copy(rt: tuple[Any, Spy]) -> None:
    runtime, _ = rt
    manager = ResidencyManager()
    handle = manager.adopt(on(runtime, CUDA0, tensor_value(4)), replica_mode=REPLICABLE)
    report = manager.ensure(handle, CUDA1)
    assert (report.source, report.destination) == (CUDA0, CUDA1)
    copy = runtime.copies[-1]
    assert (copy.destination, copy.non_blocking) == (CUDA1, True)
    assert copy.stream is runtime.current_stream(DEV1)
    assert runtime.placement(on(runtime, CUDA1, tensor_value(1))) == CUDA1


def test_host_destinations_ignore_streams_and_copy_synchronously(rt: tuple[Any, Spy]) -> None:
    runtime, _ = rt
    manager = ResidencyManager()
    handle = manager.adopt(on(runtime, CUDA0, tensor_value(4)), replica_mode=REPLICABLE)
    manager.ensure(handle, PINNED_HOST)
    manager.ensure(handle, PAGEABLE_HOST)
    assert [c.destination for c in runtime.copies] == [PINNED_HOST, PAGEABLE_HOST]
    assert all(c.stream is None for c in runtime.copies)
    assert runtime.calls["record_event"] == 0
    assert mat_locs(manager.snapshot(), handle) == (CUDA0, PINNED_HOST, PAGEABLE_HOST)


def test_reconstruct_to_cuda_records_and_synchronises_one_event(rt: tuple[Any, Spy]) -> None:
    runtime, _ = rt
    manager = ResidencyManager()
    handle = manager.register_source(spec(4), Source(fresh(4)))
    manager.ensure(handle, CUDA1)
    assert runtime.calls["copy_to_cuda"] == 1
    assert runtime.calls["record_event"] == 1
    assert runtime.calls["synchronize_event"] == 1
    assert runtime.calls["synchronize_device"] == 0
    assert runtime.pending_event_count() == 0


# --------------------------------------------------------------------------------------------
# Stream validation (transitions.md#stream-validation)
# --------------------------------------------------------------------------------------------


def test_wrong_device_stream_is_value_error_and_changes_nothing(rt: tuple[Any, Spy]) -> None:
    runtime, _ = rt
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    before = state_key(manager.snapshot())
    with pytest.raises(ValueError):
        manager.ensure(handle, CUDA0, stream=stream(runtime, 1))
    with pytest.raises(ValueError):
        manager.move(handle, CUDA1, stream=stream(runtime, 0))
    with pytest.raises(ValueError):
        manager.copy(handle, CUDA1, stream=runtime.current_stream(DEV0))
    assert state_key(manager.snapshot()) == before
    assert runtime.copies == []
    assert manager.trace() == ()


def test_stream_validation_precedes_the_no_op_check(rt: tuple[Any, Spy]) -> None:
    runtime, _ = rt
    manager = ResidencyManager()
    handle = manager.adopt(on(runtime, CUDA0, tensor_value(4)))
    s0, s1 = stream(runtime, 0), stream(runtime, 1)
    with pytest.raises(ValueError):
        manager.ensure(handle, CUDA0, stream=s1)  # would be a no-op
    with pytest.raises(ValueError):
        manager.move(handle, CUDA0, stream=s1)  # would be a no-op
    with pytest.raises(ValueError):
        manager.ensure(handle, PAGEABLE_HOST, stream=s0)  # host location
    with pytest.raises(TypeError):
        manager.ensure(handle, CUDA0, stream=object())
    assert manager.trace() == ()
    # The right stream makes the no-op go through.
    report = manager.ensure(handle, CUDA0, stream=s0)
    assert report.no_op is True
    assert runtime.copies == []


def test_stream_for_a_host_location_is_value_error(rt: tuple[Any, Spy]) -> None:
    runtime, _ = rt
    manager = ResidencyManager()
    handle = manager.adopt(on(runtime, CUDA0, tensor_value(4)), replica_mode=REPLICABLE)
    before = state_key(manager.snapshot())
    with pytest.raises(ValueError):
        manager.ensure(handle, PINNED_HOST, stream=stream(runtime, 0))
    with pytest.raises(ValueError):
        manager.move(handle, PAGEABLE_HOST, stream=stream(runtime, 0))
    assert state_key(manager.snapshot()) == before
    assert runtime.copies == []


@pytest.mark.parametrize("bad", [object(), "cuda:0", 0, torch.device("cuda", 0)], ids=repr)
def test_non_stream_objects_are_type_errors(rt: tuple[Any, Spy], bad: object) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    with pytest.raises(TypeError):
        manager.ensure(handle, CUDA0, stream=bad)
    with pytest.raises(TypeError):
        manager.move(handle, CUDA0, stream=bad)


def test_validation_order_handle_then_location_then_stream(rt: tuple[Any, Spy]) -> None:
    runtime, _ = rt
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    with pytest.raises(ResidencyHandleError):
        manager.ensure(foreign_handle(), CUDA0, stream=object())
    with pytest.raises(ValueError):
        manager.ensure(handle, cuda_location("cuda:2"), stream=object())
    with pytest.raises(ValueError):
        manager.move(handle, CUDA0, from_location=cuda_location("cuda:5"), stream=object())
    assert runtime.copies == []


def test_out_of_range_cuda_locations_are_value_errors(rt: tuple[Any, Spy]) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    cuda2 = cuda_location("cuda:2")
    before = state_key(manager.snapshot())
    for call in (
        lambda: manager.ensure(handle, cuda2),
        lambda: manager.move(handle, cuda2),
        lambda: manager.drop(handle, cuda2),
        lambda: manager.move(handle, PAGEABLE_HOST, from_location=cuda2),
        lambda: manager.adopt(tensor_value(), at=cuda2),
        lambda: manager.register_source(spec(), Source(fresh()), source_location=cuda2),
    ):
        with pytest.raises(ValueError):
            call()
    assert state_key(manager.snapshot()) == before


# --------------------------------------------------------------------------------------------
# Submission failure cleanup (transitions.md#copies-and-streams, step 6)
# --------------------------------------------------------------------------------------------


def test_submission_failure_synchronises_the_copy_stream(rt: tuple[Any, Spy]) -> None:
    runtime, spy = rt
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    s1 = stream(runtime, 1)
    boom = RuntimeError("submission failed")
    runtime.fail_next("copy_to_cuda", exc=boom)
    before = state_key(manager.snapshot())
    with pytest.raises(RuntimeError) as info:
        manager.ensure(handle, CUDA1, stream=s1)
    assert info.value is boom
    syncs = spy.calls("synchronize_stream")
    assert len(syncs) == 1
    assert syncs[0][1][0] is s1
    assert state_key(manager.snapshot()) == before
    assert runtime.calls["synchronize_device"] == 0


def test_failing_cleanup_adds_a_note_to_the_original_error(rt: tuple[Any, Spy]) -> None:
    runtime, _ = rt
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    boom = RuntimeError("submission failed")
    runtime.fail_next("copy_to_cuda", exc=boom)
    runtime.fail_next("synchronize_stream", exc=OSError("cleanup failed"))
    before = state_key(manager.snapshot())
    with pytest.raises(RuntimeError) as info:
        manager.ensure(handle, CUDA0)
    assert info.value is boom
    notes = getattr(info.value, "__notes__", [])
    assert notes, "the cleanup failure must be attached as a note"
    assert runtime.calls["synchronize_stream"] == 1
    assert state_key(manager.snapshot()) == before
    manager.ensure(handle, CUDA0)
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST, CUDA0)


def test_event_record_failure_is_cleaned_up_and_propagated(rt: tuple[Any, Spy]) -> None:
    runtime, _ = rt
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4))
    boom = RuntimeError("record failed")
    runtime.fail_next("record_event", exc=boom)
    before = state_key(manager.snapshot())
    with pytest.raises(RuntimeError) as info:
        manager.move(handle, CUDA0)
    assert info.value is boom
    assert runtime.calls["synchronize_stream"] == 1
    assert state_key(manager.snapshot()) == before
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST,)


# --------------------------------------------------------------------------------------------
# Allocator samples (transitions.md#telemetry, snapshots.md#location-snapshots)
# --------------------------------------------------------------------------------------------


def test_report_samples_the_destination_device(rt: tuple[Any, Spy]) -> None:
    runtime, _ = rt
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    allocated_before = runtime.memory_allocated(DEV1)
    reserved_before = runtime.memory_reserved(DEV1)
    report = manager.ensure(handle, CUDA1)
    assert report.allocator_device == DEV1
    assert isinstance(report.allocator_device, torch.device)
    assert report.allocator_allocated_bytes_before == allocated_before == 0
    assert report.allocator_reserved_bytes_before == reserved_before == 0
    assert report.allocator_allocated_bytes_after == runtime.memory_allocated(DEV1) == 16
    assert report.allocator_reserved_bytes_after == runtime.memory_reserved(DEV1)


def test_allocator_device_by_action(rt: tuple[Any, Spy]) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    manager.ensure(handle, CUDA1)
    manager.ensure(handle, PINNED_HOST)
    # Move into the host from CUDA: [to, *current materialisations] -> cuda:1.
    report = manager.move(handle, PAGEABLE_HOST, from_location=CUDA1)
    assert report.allocator_device == DEV1
    assert isinstance(report.allocator_allocated_bytes_before, int)
    manager.ensure(handle, CUDA1)
    report = manager.move(handle, PAGEABLE_HOST)  # removes pinned; cuda:1 is still current
    assert report.source == PINNED_HOST
    assert report.allocator_device == DEV1
    # A move into CUDA samples the destination, even when the source is another device.
    report = manager.move(handle, CUDA0, from_location=CUDA1)
    assert report.allocator_device == DEV0
    # Drop samples its location.
    assert manager.drop(handle, CUDA0).allocator_device == DEV0
    # A drop no-op at a CUDA location still names the device.
    assert manager.drop(handle, CUDA1).allocator_device == DEV1
    # Host-only actions have no allocator device and no samples.
    report = manager.ensure(handle, PAGEABLE_HOST)
    assert report.allocator_device is None
    assert report.allocator_allocated_bytes_before is None
    assert report.allocator_reserved_bytes_after is None
    # Discard samples the first CUDA location among its materialisations.
    manager.ensure(handle, CUDA1)
    report = manager.discard(handle)
    assert report.allocator_device == DEV1


def test_allocator_sampling_failure_never_fails_a_transition(rt: tuple[Any, Spy]) -> None:
    runtime, _ = rt
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    runtime.fail_next("memory_sample", exc=RuntimeError("nvml gone"), count=2)
    report = manager.ensure(handle, CUDA0)
    assert report.allocator_device == DEV0
    assert report.allocator_allocated_bytes_before is None
    assert report.allocator_allocated_bytes_after is None
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST, CUDA0)
    assert manager.trace() == (report,)


def test_snapshot_reports_allocator_readings_for_cuda_locations_only(rt: tuple[Any, Spy]) -> None:
    runtime, _ = rt
    manager = ResidencyManager({CUDA1: 1000})
    handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    manager.ensure(handle, CUDA0)
    snap = manager.snapshot()
    cuda0 = loc_snap(snap, CUDA0)
    cuda1 = loc_snap(snap, CUDA1)
    assert cuda0.allocator_allocated_bytes == runtime.memory_allocated(DEV0) == 16
    assert cuda0.allocator_reserved_bytes == runtime.memory_reserved(DEV0)
    assert cuda1.allocator_allocated_bytes == 0
    pageable = loc_snap(snap, PAGEABLE_HOST)
    assert pageable.allocator_allocated_bytes is None
    assert pageable.allocator_reserved_bytes is None


def test_snapshot_allocator_failure_gives_none(rt: tuple[Any, Spy]) -> None:
    runtime, _ = rt
    manager = ResidencyManager({CUDA0: 100})
    runtime.fail_next("memory_sample", exc=RuntimeError("gone"))
    snap = manager.snapshot()
    assert loc_snap(snap, CUDA0).allocator_allocated_bytes is None
    assert loc_snap(snap, CUDA0).budget_bytes == 100


# --------------------------------------------------------------------------------------------
# Two devices
# --------------------------------------------------------------------------------------------


def test_two_devices_hold_independent_replicas_and_books(rt: tuple[Any, Spy]) -> None:
    runtime, _ = rt
    manager = ResidencyManager({CUDA0: 32, CUDA1: 16})
    a = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    b = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    manager.ensure(a, CUDA0, stream=stream(runtime, 0))
    manager.ensure(b, CUDA0)
    manager.ensure(a, CUDA1, stream=stream(runtime, 1))
    with pytest.raises(ResidencyBudgetError) as info:
        manager.ensure(b, CUDA1)
    assert info.value.location == "cuda:1"
    assert (info.value.used_bytes, info.value.budget_bytes) == (16, 16)
    snap = manager.snapshot()
    assert used(snap, CUDA0) == 32
    assert used(snap, CUDA1) == 16
    assert loc_snap(snap, CUDA0).value_count == 2
    assert loc_snap(snap, CUDA1).value_count == 1
    assert runtime.memory_allocated(DEV0) == 32
    assert runtime.memory_allocated(DEV1) == 16
    assert_balanced(snap)
    manager.drop(a, CUDA1)
    manager.move(b, CUDA1, from_location=CUDA0)
    snap = manager.snapshot()
    assert mat_locs(snap, b) == (PAGEABLE_HOST, CUDA1)
    assert used(snap, CUDA0) == 16
    assert used(snap, CUDA1) == 16
    assert_balanced(snap)


def test_pinning_unavailable_in_the_runtime_is_a_runtime_error_that_changes_nothing() -> None:
    with simulated(pinned=False):
        manager = ResidencyManager()
        handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
        sourced = manager.register_source(spec(4), Source(fresh(4)))
        before = manager.snapshot()
        with pytest.raises(RuntimeError) as info:
            manager.ensure(handle, PINNED_HOST)
        assert "pinned" in str(info.value)
        with pytest.raises(RuntimeError):
            manager.move(sourced, PINNED_HOST)
        after = manager.snapshot()
        assert state_key(after, ignore_peak_charged=(PAGEABLE_HOST,)) == state_key(
            before, ignore_peak_charged=(PAGEABLE_HOST,)
        )
        assert loc_snap(after, PINNED_HOST) is None
        assert manager.trace() == ()


class Interrupt(BaseException):
    """A non-`Exception` failure, such as an interrupt, during the copy submission."""


def test_submission_interrupted_by_a_base_exception_is_still_cleaned_up(
    rt: tuple[Any, Spy],
) -> None:
    # The submission-failure cleanup covers any failure: the copy stream is synchronised before the
    # failure propagates, and nothing is installed.
    runtime, spy = rt
    manager = ResidencyManager()
    handle = manager.register_source(spec(4), Source(fresh(4)))
    before = manager.snapshot()
    runtime.fail_next("copy_to_cuda", exc=Interrupt("stop"))
    with pytest.raises(Interrupt):
        manager.ensure(handle, CUDA1)
    assert len(spy.calls("synchronize_stream")) == 1
    after = manager.snapshot()
    assert state_key(after, ignore_peak_charged=(PAGEABLE_HOST,)) == state_key(
        before, ignore_peak_charged=(PAGEABLE_HOST,)
    )
    assert loc_snap(after, PAGEABLE_HOST).reserved_bytes == 0
    manager.ensure(handle, CUDA1)
    assert mat_locs(manager.snapshot(), handle) == (CUDA1,)
