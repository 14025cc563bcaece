"""CUDA lease release, pending events and reaping (docs/concepts/lifetimes.md, "CUDA consumer
streams", "Lease release", "Reaping").

Everything runs through the `SimulatedRuntime`: events stay incomplete until the test
completes them, so "pending until the event completes" is directly observable. Whether an
operation reaped is observed without reaping: `assert_reaped` / `assert_not_reaped` inject an
`event_query` failure that only fires when a pending lease is still left to query.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from fhelium.errors import ResidencyInUseError
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.plan import DropResident, EnsureResident, ResidencyPlan
from helpers.lifetimes import (
    PLAN_METHODS,
    LoggingRuntime,
    QueryFault,
    assert_not_reaped,
    assert_reaped,
    cuda_stream,
    mat,
    replicated,
    require,
    rt_fixture,  # noqa: F401
)
from helpers.manager import (
    CUDA0,
    CUDA1,
    Source,
    fresh,
    loc_snap,
    mat_locs,
    run_with_timeout,
    spec,
    tensor_value,
)

# --------------------------------------------------------------------------------------------
# Release paths and their versions (lifetimes.md#lease-release)
# --------------------------------------------------------------------------------------------


def test_wait_false_release_is_pending_until_its_event_completes(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    s0 = cuda_stream(rt)
    lease = manager.acquire([handle], at=CUDA0, consumer_stream=s0)
    version = manager.state_version
    assert mat(manager.snapshot(), handle, CUDA0).use_count == 1
    mark = rt.mark()
    lease.release()
    assert lease.active is False
    recorded = rt.since(mark)
    assert [s for s, _ in recorded] == [s0]
    (event,) = [e for _, e in recorded]
    assert event.completed is False
    # use -> pending: +1
    assert manager.state_version == version + 1
    for _ in range(3):  # observing does not reap an incomplete event
        snap = manager.snapshot()
        assert snap.state_version == version + 1
        m = mat(snap, handle, CUDA0)
        assert (m.use_count, m.hold_count, m.pending_event_count) == (0, 0, 1)
        assert loc_snap(snap, CUDA0).pending_event_count == 1
        assert loc_snap(snap, CUDA0).use_count == 0
    # still protected
    with pytest.raises(ResidencyInUseError, match="pending_events=1"):
        manager.drop(handle, CUDA0)
    event.complete()
    # reaped: +1 more
    assert manager.state_version == version + 2
    assert manager.state_version == version + 2
    snap = manager.snapshot()
    assert mat(snap, handle, CUDA0).pending_event_count == 0
    assert loc_snap(snap, CUDA0).pending_event_count == 0
    manager.drop(handle, CUDA0)
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST,)


def test_wait_true_release_synchronises_the_events(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    s0, s1 = cuda_stream(rt), cuda_stream(rt)
    lease = manager.acquire([handle], at=CUDA0, consumer_stream=s0)
    lease.add_consumer_stream(s1)
    version = manager.state_version
    calls = rt.calls.copy()
    mark = rt.mark()
    lease.release(wait=True)
    recorded = rt.since(mark)
    assert {id(s) for s, _ in recorded} == {id(s0), id(s1)}
    assert len(recorded) == 2
    assert all(event.completed for _, event in recorded)
    assert rt.calls["synchronize_event"] - calls["synchronize_event"] == 2
    # no full-device or whole-stream synchronisation in the normal path
    assert rt.calls["synchronize_device"] == calls["synchronize_device"]
    assert rt.calls["synchronize_stream"] == calls["synchronize_stream"]
    assert rt.pending_event_count() == 0
    assert manager.state_version == version + 2
    snap = manager.snapshot()
    assert snap.state_version == version + 2
    assert mat(snap, handle, CUDA0).pending_event_count == 0
    assert mat(snap, handle, CUDA0).use_count == 0
    manager.drop(handle, CUDA0)


def test_pending_counts_per_lease_and_per_location(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    a = replicated(manager, CUDA0)
    b = replicated(manager, CUDA0)
    s0 = cuda_stream(rt)
    first = manager.acquire([a, b], at=CUDA0, consumer_stream=s0)
    second = manager.acquire([a], at=CUDA0, consumer_stream=s0)
    third = manager.acquire([a], at=CUDA0, consumer_stream=s0)
    first.release()
    second.release()
    snap = manager.snapshot()
    assert mat(snap, a, CUDA0).pending_event_count == 2
    assert mat(snap, b, CUDA0).pending_event_count == 1
    assert mat(snap, a, CUDA0).use_count == 1
    assert loc_snap(snap, CUDA0).pending_event_count == 3
    assert loc_snap(snap, CUDA0).use_count == 1
    assert loc_snap(snap, PAGEABLE_HOST).pending_event_count == 0
    rt.complete_events()
    snap = manager.snapshot()
    assert loc_snap(snap, CUDA0).pending_event_count == 0
    assert loc_snap(snap, CUDA0).use_count == 1
    third.release(wait=True)
    assert loc_snap(manager.snapshot(), CUDA0).use_count == 0


def test_a_lease_is_reaped_only_when_all_its_events_completed(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    s0, s1 = cuda_stream(rt), cuda_stream(rt)
    lease = manager.acquire([handle], at=CUDA0, consumer_stream=s0)
    lease.add_consumer_stream(s1)
    mark = rt.mark()
    lease.release()
    events = {id(s): e for s, e in rt.since(mark)}
    version = manager.state_version
    events[id(s1)].complete()
    assert manager.state_version == version
    assert mat(manager.snapshot(), handle, CUDA0).pending_event_count == 1
    events[id(s0)].complete()
    assert manager.state_version == version + 1
    assert mat(manager.snapshot(), handle, CUDA0).pending_event_count == 0


def test_synchronising_the_stream_completes_the_lease(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    s0 = cuda_stream(rt)
    manager.acquire([handle], at=CUDA0, consumer_stream=s0).release()
    assert mat(manager.snapshot(), handle, CUDA0).pending_event_count == 1
    rt.synchronize_stream(s0)
    assert mat(manager.snapshot(), handle, CUDA0).pending_event_count == 0


def test_record_failure_falls_back_to_stream_synchronisation(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    s0, s1 = cuda_stream(rt), cuda_stream(rt)
    lease = manager.acquire([handle], at=CUDA0, consumer_stream=s0)
    lease.add_consumer_stream(s1)
    version = manager.state_version
    calls = rt.calls.copy()
    rt.fail_next("record_event", exc=RuntimeError("record failed"))
    with pytest.warns(RuntimeWarning):
        lease.release()
    assert lease.active is False
    assert rt.calls["synchronize_stream"] - calls["synchronize_stream"] == 2
    assert rt.calls["synchronize_device"] == calls["synchronize_device"]
    assert manager.state_version == version + 1  # the fallback path: +1
    snap = manager.snapshot()
    m = mat(snap, handle, CUDA0)
    assert (m.use_count, m.pending_event_count) == (0, 0)
    manager.drop(handle, CUDA0)


def test_cuda_hold_records_no_events(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    version = manager.state_version
    mark = rt.mark()
    hold = manager.hold([handle], at=CUDA0)
    assert hold.location == CUDA0
    assert mat(manager.snapshot(), handle, CUDA0).hold_count == 1
    hold.release()
    assert rt.since(mark) == []
    assert manager.state_version == version + 2
    assert mat(manager.snapshot(), handle, CUDA0).pending_event_count == 0


# --------------------------------------------------------------------------------------------
# Streams are captured objects (lifetimes.md#cuda-consumer-streams)
# --------------------------------------------------------------------------------------------


def test_release_from_another_thread_uses_the_captured_streams(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    s0, s1 = cuda_stream(rt), cuda_stream(rt)
    current = rt.current_stream(CUDA0.device)
    lease = manager.acquire([handle], at=CUDA0, consumer_stream=s0)
    run_with_timeout(lambda: lease.add_consumer_stream(s1))
    mark = rt.mark()
    run_with_timeout(lease.release)
    recorded = [s for s, _ in rt.since(mark)]
    assert {id(s) for s in recorded} == {id(s0), id(s1)}
    assert all(s is not current for s in recorded)
    assert lease.active is False
    assert mat(manager.snapshot(), handle, CUDA0).pending_event_count == 1
    rt.complete_events()
    assert mat(manager.snapshot(), handle, CUDA0).pending_event_count == 0


def test_wait_true_release_from_another_thread(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    s0 = cuda_stream(rt)
    lease = manager.acquire([handle], at=CUDA0, consumer_stream=s0)
    version = manager.state_version
    mark = rt.mark()
    run_with_timeout(lambda: lease.release(wait=True))
    assert [s for s, _ in rt.since(mark)] == [s0]
    assert manager.state_version == version + 2
    assert rt.pending_event_count() == 0


# --------------------------------------------------------------------------------------------
# Reaping (lifetimes.md#reaping)
# --------------------------------------------------------------------------------------------


class Setup:
    """A manager with one pending CUDA lease on `h` at cuda:0 whose event has completed,
    plus `other` (pageable) and pre-existing lifetimes created before the lease went pending."""

    def __init__(self, runtime: LoggingRuntime) -> None:
        self.runtime = runtime
        manager = self.manager = ResidencyManager()
        self.h = replicated(manager, CUDA0)
        self.other = replicated(manager)
        self.spare = replicated(manager)
        self.pre_hold = manager.hold([self.other], at=PAGEABLE_HOST)
        self.pre_reservation = manager.reserve(PAGEABLE_HOST, 8, label="pre")
        self.pre_lease = manager.acquire([self.other], at=PAGEABLE_HOST)
        self.keep: list[Any] = []
        manager.acquire([self.h], at=CUDA0, consumer_stream=cuda_stream(runtime)).release()
        self.version = manager.state_version
        assert mat(manager.snapshot(), self.h, CUDA0).pending_event_count == 1
        runtime.complete_events()

    def cleanup(self) -> None:
        for lifetime in (*self.keep, self.pre_hold, self.pre_reservation, self.pre_lease):
            lifetime.release()


def _scope(manager: ResidencyManager) -> None:
    with manager.scope(ResidencyPlan("reaping-scope")):
        pass


REAPING: dict[str, Callable[[Setup], Any]] = {
    "state_version": lambda s: s.manager.state_version,
    "snapshot": lambda s: s.manager.snapshot(),
    "acquire": lambda s: s.keep.append(s.manager.acquire([s.other], at=PAGEABLE_HOST)),
    "hold": lambda s: s.keep.append(s.manager.hold([s.other], at=PAGEABLE_HOST)),
    "adopt": lambda s: s.manager.adopt(tensor_value(2)),
    "register_source": lambda s: s.manager.register_source(spec(), Source(fresh())),
    "ensure": lambda s: s.manager.ensure(s.other, CUDA1),
    "copy": lambda s: s.manager.copy(s.other, PINNED_HOST),
    "ensure_noop": lambda s: s.manager.ensure(s.other, PAGEABLE_HOST),
    "move": lambda s: s.manager.move(s.h, CUDA1, from_location=CUDA0),
    "drop": lambda s: s.manager.drop(s.h, CUDA0),
    "discard": lambda s: s.manager.discard(s.spare),
    "execute_actions": lambda s: s.manager.execute_actions([EnsureResident(s.other, CUDA1)]),
    "scope": lambda s: _scope(s.manager),
}

NOT_REAPING: dict[str, Callable[[Setup], Any]] = {
    "explain": lambda s: s.manager.explain(
        ResidencyPlan("explain-drop", enter=(DropResident(s.h, CUDA0),))
    ),
    "reserve": lambda s: s.keep.append(s.manager.reserve(PAGEABLE_HOST, 4, label="r")),
    "locations": lambda s: s.manager.locations,
    "trace": lambda s: s.manager.trace(),
    "clear_trace": lambda s: s.manager.clear_trace(),
    "hold_release": lambda s: s.pre_hold.release(),
    "reservation_release": lambda s: s.pre_reservation.release(),
    "lease_release": lambda s: s.pre_lease.release(),
    "borrowed_lookup": lambda s: s.pre_lease.values[s.other],
    "manager_id": lambda s: s.manager.manager_id,
}


@pytest.mark.parametrize("name", list(REAPING))
def test_operation_reaps_completed_leases(rt: LoggingRuntime, name: str) -> None:
    if name in PLAN_METHODS:
        require(ResidencyManager, name)
    setup = Setup(rt)
    try:
        REAPING[name](setup)
        assert_reaped(setup.manager, rt)
        snap = setup.manager.snapshot()
        assert loc_snap(snap, CUDA0).pending_event_count == 0
    finally:
        setup.cleanup()


@pytest.mark.parametrize("name", list(NOT_REAPING))
def test_operation_does_not_reap(rt: LoggingRuntime, name: str) -> None:
    if name in PLAN_METHODS:
        require(ResidencyManager, name)
    setup = Setup(rt)
    try:
        NOT_REAPING[name](setup)
        assert_not_reaped(setup.manager, rt)
        # the next reaping operation does it (+1)
        version = setup.manager.state_version
        assert version >= setup.version + 1
        assert mat(setup.manager.snapshot(), setup.h, CUDA0).pending_event_count == 0
    finally:
        setup.cleanup()


def test_reaping_versions_are_exact(rt: LoggingRuntime) -> None:
    setup = Setup(rt)
    try:
        # acquire reaps (+1) and acquires (+1)
        setup.keep.append(setup.manager.acquire([setup.other], at=PAGEABLE_HOST))
        assert setup.manager.state_version == setup.version + 2
    finally:
        setup.cleanup()


def test_close_without_wait_reaps_completed_leases(rt: LoggingRuntime) -> None:
    setup = Setup(rt)
    setup.cleanup()
    calls = rt.calls.copy()
    setup.manager.close(wait=False)  # would raise ResidencyInUseError if nothing was reaped
    assert rt.calls["event_query"] > calls["event_query"]
    assert rt.calls["synchronize_event"] == calls["synchronize_event"]


def test_each_plan_action_reaps_before_it_runs(rt: LoggingRuntime) -> None:
    require(ResidencyManager, "execute_actions")
    setup = Setup(rt)
    try:
        report = setup.manager.execute_actions([DropResident(setup.h, CUDA0)])
        assert report.transitions[0].no_op is False
        assert mat_locs(setup.manager.snapshot(), setup.h) == (PAGEABLE_HOST,)
    finally:
        setup.cleanup()


def test_a_raising_event_query_propagates_out_of_the_operation(rt: LoggingRuntime) -> None:
    setup = Setup(rt)
    try:
        rt.fail_next("event_query", exc=QueryFault("query"))
        with pytest.raises(QueryFault):
            setup.manager.snapshot()
        rt.fail_next("event_query", exc=QueryFault("query"))
        with pytest.raises(QueryFault):
            setup.manager.acquire([setup.other], at=PAGEABLE_HOST)
        # only the pre-existing lease: the failed acquire added no token
        assert mat(setup.manager.snapshot(), setup.other, PAGEABLE_HOST).use_count == 1
        assert mat(setup.manager.snapshot(), setup.h, CUDA0).pending_event_count == 0
    finally:
        rt.clear_faults()
        setup.cleanup()


def test_explain_treats_completed_pending_leases_as_unprotected(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    require(manager, "explain")
    handle = replicated(manager, CUDA0)
    manager.acquire([handle], at=CUDA0, consumer_stream=cuda_stream(rt)).release()
    plan = ResidencyPlan("drop-it", enter=(DropResident(handle, CUDA0),))
    explanation = manager.explain(plan)
    assert explanation.feasible is False
    assert explanation.actions[0].executable is False
    rt.complete_events()
    # a query that raises counts as protected
    rt.fail_next("event_query", exc=QueryFault("query"))
    try:
        assert manager.explain(plan).feasible is False
    finally:
        rt.clear_faults()
    explanation = manager.explain(plan)
    assert explanation.feasible is True
    assert explanation.actions[0].executable is True
    assert_not_reaped(manager, rt)  # explain itself did not reap
    assert mat(manager.snapshot(), handle, CUDA0).pending_event_count == 0


# --------------------------------------------------------------------------------------------
# Checked streams are remembered (transitions.md#stream-validation)
# --------------------------------------------------------------------------------------------


def test_a_stream_checked_once_is_not_asked_about_again(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0, CUDA1)
    s0 = cuda_stream(rt)
    manager.acquire([handle], at=CUDA0, consumer_stream=s0).release(wait=True)
    asked = (rt.calls["is_stream"], rt.calls["stream_device"])
    for _ in range(3):
        manager.acquire([handle], at=CUDA0, consumer_stream=s0).release(wait=True)
        manager.ensure(handle, CUDA0, stream=s0)
    assert (rt.calls["is_stream"], rt.calls["stream_device"]) == asked
    # Remembered with its location: the same stream is still refused elsewhere.
    with pytest.raises(ValueError, match="stream is on"):
        manager.acquire([handle], at=CUDA1, consumer_stream=s0)
    with pytest.raises(ValueError, match="host location"):
        manager.ensure(handle, PAGEABLE_HOST, stream=s0)
    # A new stream is checked, and a faulty runtime answer still surfaces for it.
    s1 = cuda_stream(rt)
    rt.fail_next("stream_device", exc=RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        manager.acquire([handle], at=CUDA0, consumer_stream=s1)
    manager.acquire([handle], at=CUDA0, consumer_stream=s1).release(wait=True)
    manager.close()
