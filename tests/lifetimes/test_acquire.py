"""`acquire`, `ResidencyLease` and `BorrowedValues` (docs/concepts/lifetimes.md#leases).

Handle normalisation before the gate, the order of acquire's checks, atomicity, version
increments, the lease's properties and context-manager protocol, `add_consumer_stream` and the
borrowed mapping.
"""

# Exception types are fixed; ValueError wording is not (docs/concepts/conventions.md#check-order).
# ruff: noqa: PT011

from __future__ import annotations

import collections.abc
from typing import Any

import numpy as np
import pytest

import fhelium.residency.lease as lease_module
from fhelium import residency
from fhelium.errors import (
    ResidencyClosedError,
    ResidencyHandleError,
    ResidencyLifetimeClosedError,
    ResidencyReentrancyError,
    ResidencyUnavailableError,
)
from fhelium.residency.lease import (
    BorrowedValues,
    ResidencyHold,
    ResidencyLease,
    ResidencyReservation,
)
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, cuda_location
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.model import ResidencyHandle
from fhelium.values import ResidentTensor
from helpers.lifetimes import (
    LoggingRuntime,
    assert_not_reaped,
    assert_reaped,
    cuda_stream,
    mat,
    replicated,
    rt_fixture,  # noqa: F401
)
from helpers.manager import (
    CUDA0,
    CUDA1,
    Source,
    capture,
    foreign_handle,
    fresh,
    loc_snap,
    run_with_timeout,
    spec,
    tensor_value,
    val_snap,
)

# --------------------------------------------------------------------------------------------
# Module surface (conventions.md#public-names)
# --------------------------------------------------------------------------------------------


def test_lease_module_exports_the_four_lifetime_classes() -> None:
    assert set(lease_module.__all__) == {
        "BorrowedValues",
        "ResidencyLease",
        "ResidencyHold",
        "ResidencyReservation",
    }
    for name in lease_module.__all__:
        assert getattr(residency, name) is getattr(lease_module, name)
        assert name in residency.__all__
    assert issubclass(BorrowedValues, collections.abc.Mapping)


# --------------------------------------------------------------------------------------------
# Handle normalisation (before the gate), shared by acquire and hold
# --------------------------------------------------------------------------------------------


def _take(manager: ResidencyManager, kind: str, handles: Any, at: Any = PAGEABLE_HOST) -> Any:
    if kind == "acquire":
        return manager.acquire(handles, at=at)
    return manager.hold(handles, at=at)


KINDS = ["acquire", "hold"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
def test_normalisation_errors_come_before_the_gate(rt: Any, kind: str, closed: bool) -> None:
    manager = ResidencyManager()
    handle = replicated(manager)
    if closed:
        manager.close()
    with pytest.raises(TypeError):
        _take(manager, kind, 5)
    with pytest.raises(TypeError):
        _take(manager, kind, None)
    with pytest.raises(TypeError):
        _take(manager, kind, handle)  # a single handle is not an iterable of handles
    with pytest.raises(TypeError):
        _take(manager, kind, [handle, "not-a-handle"])
    with pytest.raises(TypeError):
        _take(manager, kind, [handle.handle_id])
    with pytest.raises(ValueError):
        _take(manager, kind, [])
    with pytest.raises(ValueError):
        _take(manager, kind, iter(()))
    # Normalisation beats every later check: a bad element with a bad `at`.
    with pytest.raises(TypeError):
        _take(manager, kind, [object()], at="nowhere")
    if closed:
        with pytest.raises(ResidencyClosedError):
            _take(manager, kind, [handle])
        # closed is checked before `at` is validated
        with pytest.raises(ResidencyClosedError):
            _take(manager, kind, [handle], at="nowhere")


@pytest.mark.parametrize("kind", KINDS)
def test_normalisation_errors_come_before_the_gate_inside_a_callback(rt: Any, kind: str) -> None:
    manager = ResidencyManager()
    handle = replicated(manager)
    seen: list[BaseException | None] = []

    def inside() -> None:
        seen.append(capture(lambda: _take(manager, kind, 7)))
        seen.append(capture(lambda: _take(manager, kind, [handle, 1])))
        seen.append(capture(lambda: _take(manager, kind, [])))
        seen.append(capture(lambda: _take(manager, kind, [handle])))

    loaded = manager.register_source(spec(), Source(fresh(), before_load=inside))
    run_with_timeout(lambda: manager.ensure(loaded, PAGEABLE_HOST))
    assert [type(e) for e in seen] == [TypeError, TypeError, ValueError, ResidencyReentrancyError]
    snap = manager.snapshot()
    assert mat(snap, handle, PAGEABLE_HOST).use_count == 0
    assert mat(snap, handle, PAGEABLE_HOST).hold_count == 0


@pytest.mark.parametrize("kind", KINDS)
def test_duplicates_collapse_keeping_the_first_occurrence(rt: Any, kind: str) -> None:
    manager = ResidencyManager()
    a, b, c = replicated(manager), replicated(manager), replicated(manager)
    version = manager.state_version
    lifetime = _take(manager, kind, [b, a, b, c, a])
    try:
        assert lifetime.handles == (b, a, c)
        assert type(lifetime.handles) is tuple
        assert manager.state_version == version + 1
        snap = manager.snapshot()
        field = "use_count" if kind == "acquire" else "hold_count"
        for handle in (a, b, c):
            assert getattr(mat(snap, handle, PAGEABLE_HOST), field) == 1
        assert getattr(loc_snap(snap, PAGEABLE_HOST), field) == 3
    finally:
        lifetime.release()


@pytest.mark.parametrize("kind", KINDS)
def test_any_iterable_of_handles_is_accepted(rt: Any, kind: str) -> None:
    manager = ResidencyManager()
    a, b = replicated(manager), replicated(manager)
    for handles in (iter([a, b]), (a, b), [a, b], (h for h in (a, b)), {a: 1, b: 2}):
        lifetime = _take(manager, kind, handles)
        assert lifetime.handles == (a, b)
        lifetime.release()


def test_acquire_and_hold_arguments_are_keyword_only(rt: Any) -> None:
    manager = ResidencyManager()
    handle = replicated(manager)
    with pytest.raises(TypeError):
        manager.acquire([handle], PAGEABLE_HOST)  # type: ignore[misc]
    with pytest.raises(TypeError):
        manager.hold([handle], PAGEABLE_HOST)  # type: ignore[misc]
    with pytest.raises(TypeError):
        manager.hold([handle], at=CUDA0, consumer_stream=cuda_stream(rt))  # type: ignore[call-arg]
    assert mat(manager.snapshot(), handle, PAGEABLE_HOST).use_count == 0


# --------------------------------------------------------------------------------------------
# acquire: order of checks (lifetimes.md#leases, steps 1-6)
# --------------------------------------------------------------------------------------------


def test_acquire_validates_at_after_the_gate(rt: Any) -> None:
    manager = ResidencyManager()
    handle = replicated(manager)
    with pytest.raises(TypeError):
        manager.acquire([handle], at="pageable-host")
    with pytest.raises(TypeError):
        manager.acquire([foreign_handle()], at=object())  # `at` before the handle lookup
    with pytest.raises(ValueError):
        manager.acquire([handle], at=cuda_location("cuda:5"), consumer_stream=cuda_stream(rt))
    # an invalid CUDA index is found before the stream's type is looked at
    with pytest.raises(ValueError):
        manager.acquire([handle], at=cuda_location("cuda:5"), consumer_stream="stream")


def test_acquire_of_cuda_without_cuda_is_a_value_error() -> None:
    from helpers.manager import simulated

    with simulated(device_count=0):
        manager = ResidencyManager()
        handle = replicated(manager)
        with pytest.raises(ValueError):
            manager.acquire([handle], at=CUDA0)
        with pytest.raises(ValueError):
            manager.hold([handle], at=CUDA0)
        assert mat(manager.snapshot(), handle, PAGEABLE_HOST).use_count == 0


def test_cuda_at_without_stream_is_a_value_error_before_the_handle_lookup(rt: Any) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    with pytest.raises(ValueError):
        manager.acquire([handle], at=CUDA0)
    with pytest.raises(ValueError):
        manager.acquire([handle], at=CUDA0, consumer_stream=None)
    with pytest.raises(ValueError):
        manager.acquire([foreign_handle()], at=CUDA0)
    with pytest.raises(ValueError):
        manager.acquire([handle], at=CUDA1)  # not resident there either: the stream wins
    assert mat(manager.snapshot(), handle, CUDA0).use_count == 0


def test_stream_checks_in_order_before_the_handle_lookup(rt: Any) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    s0, s1 = cuda_stream(rt, 0), cuda_stream(rt, 1)
    # non-Stream: TypeError, even at a host location (type check first)
    with pytest.raises(TypeError):
        manager.acquire([handle], at=CUDA0, consumer_stream="s0")
    with pytest.raises(TypeError):
        manager.acquire([handle], at=PAGEABLE_HOST, consumer_stream=object())
    with pytest.raises(TypeError):
        manager.acquire([foreign_handle()], at=CUDA0, consumer_stream=0)
    # a stream for a host location
    with pytest.raises(ValueError):
        manager.acquire([handle], at=PAGEABLE_HOST, consumer_stream=s0)
    with pytest.raises(ValueError):
        manager.acquire([foreign_handle()], at=PINNED_HOST, consumer_stream=s0)
    # a stream on the wrong device
    with pytest.raises(ValueError):
        manager.acquire([handle], at=CUDA0, consumer_stream=s1)
    with pytest.raises(ValueError):
        manager.acquire([foreign_handle()], at=CUDA0, consumer_stream=s1)
    snap = manager.snapshot()
    assert mat(snap, handle, CUDA0).use_count == 0
    assert mat(snap, handle, PAGEABLE_HOST).use_count == 0


def _pending_completed(manager: ResidencyManager, runtime: LoggingRuntime, handle: Any) -> None:
    """Leave one pending CUDA lease on `handle` at cuda:0 whose events have completed."""
    lease = manager.acquire([handle], at=CUDA0, consumer_stream=cuda_stream(runtime))
    lease.release()
    assert mat(manager.snapshot(), handle, CUDA0).pending_event_count == 1
    runtime.complete_events()


def test_acquire_reaps_after_the_missing_stream_check_but_before_the_stream_checks(
    rt: LoggingRuntime,
) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    _pending_completed(manager, rt, handle)
    # validating `at` fails before the reap
    with pytest.raises(ValueError):
        manager.acquire([handle], at=cuda_location("cuda:9"), consumer_stream=cuda_stream(rt))
    assert_not_reaped(manager, rt)
    # so does the missing consumer stream
    with pytest.raises(ValueError):
        manager.acquire([handle], at=CUDA0)
    assert_not_reaped(manager, rt)
    # the stream type check comes after the reap
    with pytest.raises(TypeError):
        manager.acquire([handle], at=CUDA0, consumer_stream="stream")
    assert_reaped(manager, rt)


def test_acquire_reaps_before_a_failing_handle_lookup(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    _pending_completed(manager, rt, handle)
    with pytest.raises(ResidencyHandleError):
        manager.acquire([foreign_handle()], at=PAGEABLE_HOST)
    assert_reaped(manager, rt)


def test_handle_lookup_errors(rt: Any) -> None:
    manager = ResidencyManager()
    resident = replicated(manager)
    source = Source(fresh())
    source_only = manager.register_source(spec(), source)
    discarded = replicated(manager)
    manager.discard(discarded)
    unknown = ResidencyHandle(manager.manager_id, "no-such-handle", ResidentTensor)
    version = manager.state_version
    for kind in KINDS:
        with pytest.raises(ResidencyHandleError):
            _take(manager, kind, [foreign_handle()])
        with pytest.raises(ResidencyHandleError):
            _take(manager, kind, [unknown])
        with pytest.raises(ResidencyHandleError):
            _take(manager, kind, [discarded])
        with pytest.raises(ResidencyUnavailableError):
            _take(manager, kind, [source_only])  # never materialises anything
        with pytest.raises(ResidencyUnavailableError):
            _take(manager, kind, [resident], at=PINNED_HOST)
    assert manager.state_version == version
    assert val_snap(manager.snapshot(), source_only).materializations == ()
    assert source.calls == 0  # acquire and hold never materialise anything
    assert PINNED_HOST not in manager.locations


@pytest.mark.parametrize("kind", KINDS)
def test_handles_are_checked_in_order(rt: Any, kind: str) -> None:
    manager = ResidencyManager()
    resident = replicated(manager)
    source_only = manager.register_source(spec(), Source(fresh()))
    with pytest.raises(ResidencyUnavailableError):
        _take(manager, kind, [resident, source_only, foreign_handle()])
    with pytest.raises(ResidencyHandleError):
        _take(manager, kind, [resident, foreign_handle(), source_only])


@pytest.mark.parametrize("kind", KINDS)
def test_acquire_is_atomic_when_a_later_handle_fails(rt: Any, kind: str) -> None:
    manager = ResidencyManager()
    a, b = replicated(manager), replicated(manager)
    c = replicated(manager, PINNED_HOST)
    before = manager.snapshot()
    with pytest.raises(ResidencyUnavailableError):
        _take(manager, kind, [a, b, c], at=PINNED_HOST)
    with pytest.raises(ResidencyHandleError):
        _take(manager, kind, [a, b, foreign_handle()])
    after = manager.snapshot()
    assert after.state_version == before.state_version
    for handle in (a, b, c):
        for location in (PAGEABLE_HOST,):
            m = mat(after, handle, location)
            assert (m.use_count, m.hold_count, m.pending_event_count) == (0, 0, 0)
    assert mat(after, c, PINNED_HOST).use_count == 0
    assert mat(after, c, PINNED_HOST).hold_count == 0
    # Nothing was protected: all can be dropped.
    manager.drop(c, PINNED_HOST)


# --------------------------------------------------------------------------------------------
# Lease basics and versions
# --------------------------------------------------------------------------------------------


def test_cpu_lease_properties_tokens_and_versions(rt: Any) -> None:
    manager = ResidencyManager()
    a, b = replicated(manager), replicated(manager)
    version = manager.state_version
    lease = manager.acquire([a, b], at=PAGEABLE_HOST)
    assert isinstance(lease, ResidencyLease)
    assert lease.active is True
    assert lease.handles == (a, b)
    assert lease.location == PAGEABLE_HOST
    assert manager.state_version == version + 1  # once per call, not per handle
    snap = manager.snapshot()
    assert mat(snap, a, PAGEABLE_HOST).use_count == 1
    assert mat(snap, b, PAGEABLE_HOST).use_count == 1
    assert loc_snap(snap, PAGEABLE_HOST).use_count == 2
    assert loc_snap(snap, PAGEABLE_HOST).pending_event_count == 0
    second = manager.acquire([a], at=PAGEABLE_HOST)
    assert mat(manager.snapshot(), a, PAGEABLE_HOST).use_count == 2
    assert manager.state_version == version + 2
    calls = rt.calls.copy()
    assert lease.release() is None
    assert lease.active is False
    assert manager.state_version == version + 3  # CPU release: +1
    assert rt.calls["record_event"] == calls["record_event"]  # no events for host leases
    lease.release()  # idempotent: no change
    lease.release(wait=True)
    assert manager.state_version == version + 3
    snap = manager.snapshot()
    assert mat(snap, a, PAGEABLE_HOST).use_count == 1
    assert mat(snap, b, PAGEABLE_HOST).use_count == 0
    second.release(wait=True)  # `wait` is ignored for CPU leases
    assert manager.state_version == version + 4
    assert loc_snap(manager.snapshot(), PAGEABLE_HOST).use_count == 0


def test_close_is_release(rt: Any) -> None:
    assert ResidencyLease.close is ResidencyLease.release
    assert ResidencyHold.close is ResidencyHold.release
    assert ResidencyReservation.close is ResidencyReservation.release
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    lease = manager.acquire([handle], at=CUDA0, consumer_stream=cuda_stream(rt))
    version = manager.state_version
    lease.close(wait=True)
    assert lease.active is False
    assert manager.state_version == version + 2
    assert mat(manager.snapshot(), handle, CUDA0).pending_event_count == 0


def test_lease_with_pinned_location(rt: Any) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, PINNED_HOST)
    with pytest.raises(ValueError):
        manager.acquire([handle], at=PINNED_HOST, consumer_stream=cuda_stream(rt))
    lease = manager.acquire([handle], at=PINNED_HOST)
    assert lease.location == PINNED_HOST
    assert mat(manager.snapshot(), handle, PINNED_HOST).use_count == 1
    assert mat(manager.snapshot(), handle, PAGEABLE_HOST).use_count == 0
    lease.release()


# --------------------------------------------------------------------------------------------
# BorrowedValues
# --------------------------------------------------------------------------------------------


def test_borrowed_values_return_the_managed_objects(rt: Any) -> None:
    manager = ResidencyManager()
    va, vb = tensor_value(4), tensor_value(6)
    a = manager.adopt(va)
    b = manager.adopt(vb)
    lease = manager.acquire([b, a], at=PAGEABLE_HOST)
    values = lease.values
    assert isinstance(values, BorrowedValues)
    assert isinstance(values, collections.abc.Mapping)
    assert values[a] is va
    assert values[b] is vb
    assert list(values) == [b, a]
    assert len(values) == 2
    assert a in values
    assert values.get(a) is va
    assert list(values.keys()) == [b, a]
    assert list(values.values()) == [vb, va]
    assert [(k, v) for k, v in values.items()] == [(b, vb), (a, va)]
    assert values == {a: va, b: vb}
    assert dict(values) == {a: va, b: vb}
    # A BorrowedValues can be built on the lease positionally and behaves the same.
    assert BorrowedValues(lease)[a] is va
    lease.release()


def test_borrowed_values_of_a_cuda_lease_are_the_cuda_materialisation(rt: Any) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0, CUDA1)
    s0 = cuda_stream(rt, 0)
    first = manager.acquire([handle], at=CUDA0, consumer_stream=s0)
    second = manager.acquire([handle], at=CUDA0, consumer_stream=s0)
    host = manager.acquire([handle], at=PAGEABLE_HOST)
    value = first.values[handle]
    assert rt.placement(value) == CUDA0
    assert second.values[handle] is value  # the same managed object, not a copy
    assert host.values[handle] is not value
    assert rt.placement(host.values[handle]) == PAGEABLE_HOST
    for lease in (first, second, host):
        lease.release(wait=True)


def test_borrowed_lookup_of_a_handle_outside_the_lease_is_a_key_error(rt: Any) -> None:
    manager = ResidencyManager()
    a, b = replicated(manager), replicated(manager)
    lease = manager.acquire([a], at=PAGEABLE_HOST)
    values = lease.values
    with pytest.raises(KeyError) as info:
        values[b]
    assert info.value.args == (b,)
    with pytest.raises(KeyError):
        values[foreign_handle()]
    with pytest.raises(KeyError):
        values["not a handle"]
    assert b not in values
    assert values.get(b) is None
    assert values.get(b, "default") == "default"
    lease.release()


def test_borrowed_values_after_release_raise_lifetime_closed(rt: Any) -> None:
    manager = ResidencyManager()
    a, b = replicated(manager), replicated(manager)
    lease = manager.acquire([a], at=PAGEABLE_HOST)
    values = lease.values
    entered = lease.__enter__()
    lease.release()
    for borrowed in (values, entered, BorrowedValues(lease)):
        with pytest.raises(ResidencyLifetimeClosedError):
            borrowed[a]
        with pytest.raises(ResidencyLifetimeClosedError):
            borrowed[b]  # the inactive check comes before the membership check
        with pytest.raises(ResidencyLifetimeClosedError):
            list(borrowed)
        with pytest.raises(ResidencyLifetimeClosedError):
            len(borrowed)
        with pytest.raises(ResidencyLifetimeClosedError):
            a in borrowed  # noqa: B015
        with pytest.raises(ResidencyLifetimeClosedError):
            borrowed.get(a)
        with pytest.raises(ResidencyLifetimeClosedError):
            list(borrowed.items())
        with pytest.raises(ResidencyLifetimeClosedError):
            list(borrowed.keys())
        with pytest.raises(ResidencyLifetimeClosedError):
            list(borrowed.values())
    with pytest.raises(ResidencyLifetimeClosedError):
        _ = lease.values


def test_iteration_checks_the_lease_before_each_yield(rt: Any) -> None:
    manager = ResidencyManager()
    a, b = replicated(manager), replicated(manager)
    lease = manager.acquire([a, b], at=PAGEABLE_HOST)
    iterator = iter(lease.values)
    assert next(iterator) == a
    lease.release()
    with pytest.raises(ResidencyLifetimeClosedError):
        next(iterator)


def test_borrowed_values_survive_other_leases_releasing(rt: Any) -> None:
    manager = ResidencyManager()
    value = tensor_value()
    handle = manager.adopt(value)
    keep = manager.acquire([handle], at=PAGEABLE_HOST)
    other = manager.acquire([handle], at=PAGEABLE_HOST)
    other.release()
    assert keep.values[handle] is value
    with pytest.raises(ResidencyLifetimeClosedError):
        other.values  # noqa: B018
    keep.release()


# --------------------------------------------------------------------------------------------
# Lease context manager
# --------------------------------------------------------------------------------------------


def test_lease_enter_returns_borrowed_values_and_exit_releases(rt: Any) -> None:
    manager = ResidencyManager()
    value = tensor_value()
    handle = manager.adopt(value)
    lease = manager.acquire([handle], at=PAGEABLE_HOST)
    version = manager.state_version
    with lease as values:
        assert isinstance(values, BorrowedValues)
        assert values is not lease
        assert values[handle] is value
        assert lease.active
        with pytest.raises(RuntimeError) as info:
            lease.__enter__()
        assert not isinstance(info.value, ResidencyLifetimeClosedError)
        assert lease.active
    assert lease.active is False
    assert manager.state_version == version + 1
    assert mat(manager.snapshot(), handle, PAGEABLE_HOST).use_count == 0
    with pytest.raises(ResidencyLifetimeClosedError):
        lease.__enter__()


def test_released_lease_cannot_be_entered(rt: Any) -> None:
    manager = ResidencyManager()
    handle = replicated(manager)
    lease = manager.acquire([handle], at=PAGEABLE_HOST)
    lease.release()
    with pytest.raises(ResidencyLifetimeClosedError):
        lease.__enter__()


def test_lease_exit_does_not_suppress_and_releases_without_waiting(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    s0 = cuda_stream(rt)
    lease = manager.acquire([handle], at=CUDA0, consumer_stream=s0)
    version = manager.state_version
    mark = rt.mark()
    with pytest.raises(LookupError, match="body"), lease as values:  # noqa: PT012
        assert handle in values
        raise LookupError("body")
    assert lease.active is False
    # `__exit__` released with wait=False: one event on the stream, still pending.
    assert [s for s, _ in rt.since(mark)] == [s0]
    assert manager.state_version == version + 1
    snap = manager.snapshot()
    assert mat(snap, handle, CUDA0).use_count == 0
    assert mat(snap, handle, CUDA0).pending_event_count == 1
    rt.complete_events()
    assert manager.state_version == version + 2


# --------------------------------------------------------------------------------------------
# add_consumer_stream
# --------------------------------------------------------------------------------------------


def test_add_consumer_stream_order_of_checks(rt: Any) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    cpu = manager.acquire([handle], at=PAGEABLE_HOST)
    gpu = manager.acquire([handle], at=CUDA0, consumer_stream=cuda_stream(rt, 0))
    # non-CUDA lease: ValueError, whatever is passed
    with pytest.raises(ValueError):
        cpu.add_consumer_stream(cuda_stream(rt, 0))
    with pytest.raises(ValueError):
        cpu.add_consumer_stream("not a stream")
    # non-Stream: TypeError
    for bad in ("stream", None, 0, np.int64(0), torch_stream_like()):
        with pytest.raises(TypeError):
            gpu.add_consumer_stream(bad)
    # wrong device: ValueError
    with pytest.raises(ValueError):
        gpu.add_consumer_stream(cuda_stream(rt, 1))
    cpu.release()
    gpu.release(wait=True)
    # released: LifetimeClosed first, whatever is passed
    for lease in (cpu, gpu):
        for arg in (cuda_stream(rt, 0), cuda_stream(rt, 1), "stream"):
            with pytest.raises(ResidencyLifetimeClosedError):
                lease.add_consumer_stream(arg)


def torch_stream_like() -> Any:
    class FakeStream:
        device = "cuda:0"

    return FakeStream()


def test_added_streams_each_get_an_event_and_duplicates_are_ignored(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    s0, s1, s2 = cuda_stream(rt), cuda_stream(rt), cuda_stream(rt)
    lease = manager.acquire([handle], at=CUDA0, consumer_stream=s0)
    assert lease.add_consumer_stream(s1) is None
    lease.add_consumer_stream(s0)  # already registered (identity): ignored
    lease.add_consumer_stream(s1)
    lease.add_consumer_stream(s2)
    mark = rt.mark()
    lease.release()
    recorded = [stream for stream, _ in rt.since(mark)]
    assert len(recorded) == 3
    assert {id(s) for s in recorded} == {id(s0), id(s1), id(s2)}
    assert rt.pending_event_count() == 3
    snap = manager.snapshot()
    # pending_event_count counts released leases, not events (snapshots.md)
    assert mat(snap, handle, CUDA0).pending_event_count == 1
    rt.complete_events()
    assert mat(manager.snapshot(), handle, CUDA0).pending_event_count == 0


def test_lease_on_the_second_device(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA1)
    s1 = cuda_stream(rt, 1)
    with pytest.raises(ValueError):
        manager.acquire([handle], at=CUDA1, consumer_stream=cuda_stream(rt, 0))
    lease = manager.acquire([handle], at=CUDA1, consumer_stream=s1)
    assert lease.location == CUDA1
    with pytest.raises(ValueError):
        lease.add_consumer_stream(cuda_stream(rt, 0))
    mark = rt.mark()
    lease.release()
    assert [s for s, _ in rt.since(mark)] == [s1]
    snap = manager.snapshot()
    assert loc_snap(snap, CUDA1).pending_event_count == 1
    assert loc_snap(snap, CUDA0) is None or loc_snap(snap, CUDA0).pending_event_count == 0
    rt.complete_events()
    assert loc_snap(manager.snapshot(), CUDA1).pending_event_count == 0
