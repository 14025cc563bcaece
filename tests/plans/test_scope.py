"""`ResidencyManager.scope` and `ResidencyScope` (docs/concepts/plans.md#scopes).

A scope is single use and nestable. Construction checks types and the expected version and
touches no state. Entry runs, under the gate: the version check, stream validation and the
preflight (errors unwrapped), then reclaim, reservation admission and enter (failures wrapped
with phases "reclaim", "reserve", "enter"). `close()` runs the exit actions without a new
preflight (phase "exit") and always releases the reservations, even when it cannot enter the
manager (docs/concepts/plans.md#scope-exit). An abandoned entered scope releases its
reservations with a `ResourceWarning` naming the plan and never runs its exit actions.
"""

# ruff: noqa: PT011, PT012

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import numpy as np
import pytest

from fhelium.errors import (
    ResidencyBudgetError,
    ResidencyClosedError,
    ResidencyError,
    ResidencyInUseError,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
    ResidencyReentrancyError,
    ResidencyStaleStateError,
)
from fhelium.residency import ResidencyScope
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, cuda_location
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.plan import (
    DiscardValue,
    DropResident,
    EnsureResident,
    MemoryReservation,
    MoveResident,
    ResidencyPlan,
)
from fhelium.residency.snapshot import ResidencyReservationSnapshot
from helpers.lifetimes import (
    LoggingRuntime,
    assert_not_reaped,
    cuda_stream,
    of_category,
    recorded_warnings,
    rt_fixture,  # noqa: F401
)
from helpers.manager import (
    CUDA0,
    CUDA1,
    DROP_NOOP,
    REPLICABLE,
    Source,
    capture,
    fresh,
    loc_snap,
    mat_locs,
    run_with_timeout,
    sim_fixture,  # noqa: F401
    spec,
    state_key,
    stream,
    tensor_value,
)
from helpers.plans import (
    ControlledSource,
    FaultRuntime,
    check_execution_error,
    check_report,
    fault_rt_fixture,  # noqa: F401
    no_reserved_bytes,
    raises_exec,
)


def _no_resource_warning_when_collected(scope: list[Any]) -> None:
    """Drop the last reference to the scope in `scope` and assert no ResourceWarning."""
    with recorded_warnings() as caught:
        scope.clear()
        gc.collect()
    assert of_category(caught, ResourceWarning) == [], [str(w.message) for w in caught]


def _assert_closed_without_report(scope: ResidencyScope) -> None:
    assert scope.report is None
    assert scope.close() is None  # already closed: a no-op
    assert scope.close() is None
    with pytest.raises(RuntimeError) as info:
        scope.__enter__()
    assert not isinstance(info.value, ResidencyError)


# --------------------------------------------------------------------------------------------
# Construction (plans.md#scope-construction)
# --------------------------------------------------------------------------------------------


def test_scope_properties_and_initial_attributes() -> None:
    manager = ResidencyManager()
    plan = ResidencyPlan("props")
    for scope in (
        manager.scope(plan),
        ResidencyScope(manager, plan),
        ResidencyScope(manager, plan, transfer_streams={}, expected_state_version=0),
    ):
        assert isinstance(scope, ResidencyScope)
        assert scope.manager is manager
        assert scope.plan is plan
        assert scope.report is None
        assert scope.exit_error is None
    assert manager.scope(plan).expected_state_version is None
    with_version = manager.scope(plan, expected_state_version=np.int64(7))
    assert with_version.expected_state_version == 7
    assert type(with_version.expected_state_version) is int
    for name, value in (("manager", manager), ("plan", plan), ("expected_state_version", 1)):
        with pytest.raises(AttributeError):
            setattr(with_version, name, value)


@pytest.mark.parametrize(
    "build",
    [
        lambda m, p: m.scope("plan"),
        lambda m, p: m.scope(None),
        lambda m, p: m.scope([p]),
        lambda m, p: ResidencyScope(object(), p),
        lambda m, p: ResidencyScope(None, p),
        lambda m, p: ResidencyScope(m, "plan"),
        lambda m, p: ResidencyScope(p, m),
        lambda m, p: m.scope(p, transfer_streams=[(CUDA0, object())]),
        lambda m, p: m.scope(p, transfer_streams="cuda:0"),
        lambda m, p: ResidencyScope(m, p, transfer_streams=5),
        lambda m, p: m.scope(p, expected_state_version=True),
        lambda m, p: m.scope(p, expected_state_version=1.0),
        lambda m, p: ResidencyScope(m, p, expected_state_version="3"),
    ],
)
@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
def test_construction_type_errors(build: Any, closed: bool) -> None:
    manager = ResidencyManager()
    plan = ResidencyPlan("p")
    if closed:
        manager.close()
    with pytest.raises(TypeError):
        build(manager, plan)


@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
def test_negative_expected_state_version_is_a_value_error_at_construction(closed: bool) -> None:
    manager = ResidencyManager()
    if closed:
        manager.close()
    with pytest.raises(ValueError):
        manager.scope(ResidencyPlan("p"), expected_state_version=-1)
    with pytest.raises(ValueError):
        ResidencyScope(manager, ResidencyPlan("p"), expected_state_version=-1)


def test_construction_does_not_validate_stream_keys_or_the_version_value(sim: Any) -> None:
    manager = ResidencyManager()
    plan = ResidencyPlan("p")
    scope = manager.scope(
        plan, transfer_streams={PAGEABLE_HOST: object()}, expected_state_version=12345
    )
    assert scope.expected_state_version == 12345
    with pytest.raises(ResidencyStaleStateError):
        scope.__enter__()
    _assert_closed_without_report(scope)


def test_construction_works_after_close_and_entry_then_fails() -> None:
    manager = ResidencyManager()
    manager.close()
    scope = manager.scope(ResidencyPlan("late"))
    with pytest.raises(ResidencyClosedError):
        scope.__enter__()
    _assert_closed_without_report(scope)
    assert scope.exit_error is None


def test_construction_works_inside_a_callback_and_entry_there_fails() -> None:
    manager = ResidencyManager()
    built: list[ResidencyScope] = []
    entered: list[BaseException | None] = []

    def inside() -> None:
        built.append(manager.scope(ResidencyPlan("cb")))
        built.append(ResidencyScope(manager, ResidencyPlan("cb2"), expected_state_version=0))
        entered.append(capture(built[0].__enter__))

    handle = manager.register_source(spec(), Source(fresh(), before_load=inside))
    manager.ensure(handle, PAGEABLE_HOST)
    assert len(built) == 2
    assert isinstance(entered[0], ResidencyReentrancyError)
    _assert_closed_without_report(built[0])
    # The other scope was only built, and can be entered (its version is stale by now).
    with pytest.raises(ResidencyStaleStateError):
        built[1].__enter__()
    with ResidencyScope(manager, ResidencyPlan("after")) as scope:
        assert scope.manager is manager


def test_construction_touches_no_state_and_does_not_reap(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    manager.ensure(a, CUDA0)
    lease = manager.acquire([a], at=CUDA0, consumer_stream=cuda_stream(rt, 0))
    lease.release()
    rt.complete_events()
    manager.scope(ResidencyPlan("p", reservations=[MemoryReservation(PINNED_HOST, 1, "r")]))
    ResidencyScope(manager, ResidencyPlan("q"), expected_state_version=0)
    assert_not_reaped(manager, rt)
    assert PINNED_HOST not in manager.locations


def test_scope_copies_the_stream_mapping_at_construction(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    s0, s1 = stream(sim, 0), stream(sim, 1)
    streams: dict[Any, Any] = {CUDA0: s0}
    plan = ResidencyPlan(
        "frozen", enter=[EnsureResident(a, CUDA0)], exit=[EnsureResident(a, CUDA1)]
    )
    scope = manager.scope(plan, transfer_streams=streams)
    # Later changes to the caller's mapping have no effect, valid or not.
    streams[CUDA0] = s1
    streams[PAGEABLE_HOST] = s0
    streams[CUDA1] = s1
    with scope:
        assert sim.copies[-1].destination == CUDA0
        assert sim.copies[-1].stream is s0
        streams.clear()
    assert sim.copies[-1].destination == CUDA1
    assert sim.copies[-1].stream is not s1  # cuda:1 was not in the mapping at construction
    assert scope.report is not None


def test_exit_actions_use_the_scope_streams(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    s0, s1 = stream(sim, 0), stream(sim, 1)
    plan = ResidencyPlan(
        "streams",
        enter=[EnsureResident(a, CUDA0)],
        exit=[MoveResident(a, CUDA1, from_location=CUDA0), EnsureResident(a, PINNED_HOST)],
    )
    mark = len(sim.copies)
    with manager.scope(plan, transfer_streams={CUDA0: s0, CUDA1: s1}):
        pass
    copies = sim.copies[mark:]
    assert [c.destination for c in copies] == [CUDA0, CUDA1, PINNED_HOST]
    assert copies[0].stream is s0
    assert copies[1].stream is s1
    assert copies[1].non_blocking is True
    assert copies[2].stream is None


# --------------------------------------------------------------------------------------------
# Entry: order, preflight errors, single use
# --------------------------------------------------------------------------------------------


def test_entry_runs_reclaim_then_reservations_then_enter(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    plan = ResidencyPlan(
        "ordered",
        reclaim=[EnsureResident(a, CUDA1)],
        reservations=[MemoryReservation(PINNED_HOST, 8, "ws")],
        enter=[EnsureResident(a, CUDA0)],
    )
    version = manager.state_version
    scope = manager.scope(plan)
    t0 = time.time_ns()
    with scope as entered:
        assert entered is scope
        # First registrations reveal the order: reclaim (cuda:1), reservation (pinned), enter.
        assert manager.locations == (PAGEABLE_HOST, CUDA1, PINNED_HOST, CUDA0)
        assert [t.action for t in manager.trace()] == [*plan.reclaim, *plan.enter]
        snap = manager.snapshot()
        assert snap.reservations == (ResidencyReservationSnapshot(PINNED_HOST, 8, "ws"),)
        assert loc_snap(snap, PINNED_HOST).reserved_bytes == 8
        assert loc_snap(snap, PINNED_HOST).reservation_count == 1
        assert mat_locs(snap, a) == (PAGEABLE_HOST, CUDA1, CUDA0)
        # 2 (cuda:1 + install) + 2 (pinned + reservation) + 2 (cuda:0 + install)
        assert snap.state_version == version + 6
        assert scope.report is None
    check_report(
        scope.report, plan_name="ordered", actions=[*plan.reclaim, *plan.enter], started_after=t0
    )
    no_reserved_bytes(manager)
    assert manager.state_version == version + 7  # the reservation release


def test_entering_twice_is_a_runtime_error(sim: Any) -> None:
    manager = ResidencyManager()
    plan = ResidencyPlan("once", reservations=[MemoryReservation(PAGEABLE_HOST, 4, "ws")])
    scope = manager.scope(plan)
    with scope:
        with pytest.raises(RuntimeError) as info:
            scope.__enter__()
        assert not isinstance(info.value, ResidencyError)
        # The active scope is untouched by the refused second entry.
        assert len(manager.snapshot().reservations) == 1
        assert scope.report is None
    assert scope.report is not None
    with pytest.raises(RuntimeError):
        scope.__enter__()
    with pytest.raises(RuntimeError), scope:
        pass
    no_reserved_bytes(manager)


def test_close_before_enter_is_a_runtime_error_and_the_scope_stays_usable(sim: Any) -> None:
    manager = ResidencyManager()
    scope = manager.scope(ResidencyPlan("later"))
    with pytest.raises(RuntimeError) as info:
        scope.close()
    assert not isinstance(info.value, ResidencyError)
    with scope:
        pass
    assert scope.report is not None
    assert scope.report.transitions == ()


def _preflight_cases(sim: Any, manager: ResidencyManager, a: Any) -> dict[str, Any]:
    s0, s1 = stream(sim, 0), stream(sim, 1)
    fine = ResidencyPlan(
        "fine",
        reclaim=[EnsureResident(a, PINNED_HOST)],
        reservations=[MemoryReservation(CUDA1, 4, "ws")],
        enter=[EnsureResident(a, CUDA0)],
    )
    return {
        "stale": (lambda: manager.scope(fine, expected_state_version=99), ResidencyStaleStateError),
        "host-key": (
            lambda: manager.scope(fine, transfer_streams={PINNED_HOST: s0}),
            ValueError,
        ),
        "wrong-device": (lambda: manager.scope(fine, transfer_streams={CUDA0: s1}), ValueError),
        "not-a-stream": (lambda: manager.scope(fine, transfer_streams={CUDA0: 0}), TypeError),
        "bad-key": (
            lambda: manager.scope(fine, transfer_streams={cuda_location("cuda:9"): s0}),
            ValueError,
        ),
        "infeasible-enter": (
            lambda: manager.scope(
                ResidencyPlan(
                    "bad",
                    reclaim=fine.reclaim,
                    enter=[DropResident(a, PINNED_HOST), DropResident(a, PAGEABLE_HOST)],
                )
            ),
            ResidencyPlanError,
        ),
        "infeasible-exit": (
            lambda: manager.scope(
                ResidencyPlan(
                    "bad",
                    reclaim=fine.reclaim,
                    enter=fine.enter,
                    exit=[MoveResident(a, CUDA1, from_location=CUDA1)],
                )
            ),
            ResidencyPlanError,
        ),
        "reservation": (
            lambda: manager.scope(
                ResidencyPlan(
                    "bad",
                    reclaim=fine.reclaim,
                    reservations=[MemoryReservation(CUDA0, 100, "huge")],
                )
            ),
            ResidencyPlanError,
        ),
    }


PREFLIGHT = [
    "stale",
    "host-key",
    "wrong-device",
    "not-a-stream",
    "bad-key",
    "infeasible-enter",
    "infeasible-exit",
    "reservation",
]


@pytest.mark.parametrize("case", PREFLIGHT)
def test_entry_preflight_errors_are_unwrapped_and_nothing_runs(sim: Any, case: str) -> None:
    manager = ResidencyManager({CUDA0: 64})
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    build, error = _preflight_cases(sim, manager, a)[case]
    scope = build()
    before = (state_key(manager.snapshot()), manager.trace(), len(sim.copies))
    with pytest.raises(error) as info:
        scope.__enter__()
    assert not isinstance(info.value, ResidencyPlanExecutionError)
    if error is ResidencyPlanError:
        assert type(info.value) is ResidencyPlanError
        assert str(info.value) == manager.explain(scope.plan).reason
    assert (state_key(manager.snapshot()), manager.trace(), len(sim.copies)) == before
    assert scope.exit_error is None
    _assert_closed_without_report(scope)
    _no_resource_warning_when_collected([scope])


def test_exact_preflight_reasons_at_entry(sim: Any) -> None:
    manager = ResidencyManager({CUDA0: 20})
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    cases = [
        (
            ResidencyPlan("r", reservations=[MemoryReservation(CUDA0, 21, "ws")]),
            "Reservation 'ws' exceeds budget at cuda:0",
        ),
        (
            ResidencyPlan(
                "t",
                reservations=[MemoryReservation(CUDA0, 5, "ws")],
                exit=[EnsureResident(a, CUDA0)],
            ),
            "Transition exceeds budget at cuda:0",
        ),
        (
            ResidencyPlan("d", exit=[DropResident(a, PAGEABLE_HOST)]),
            "cannot drop final MUST_PRESERVE materialization",
        ),
    ]
    for plan, reason in cases:
        with pytest.raises(ResidencyPlanError) as info:
            manager.scope(plan).__enter__()
        assert str(info.value) == reason


def test_version_check_before_streams_before_preflight_at_entry(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value())
    infeasible = ResidencyPlan("bad", enter=[DropResident(a, PAGEABLE_HOST)])
    host = {PAGEABLE_HOST: stream(sim, 0)}
    with pytest.raises(ResidencyStaleStateError):
        manager.scope(infeasible, transfer_streams=host, expected_state_version=77).__enter__()
    with pytest.raises(ValueError):
        manager.scope(infeasible, transfer_streams=host).__enter__()
    current = manager.state_version
    with pytest.raises(ResidencyPlanError):
        manager.scope(infeasible, expected_state_version=current).__enter__()


def test_entry_reaps_before_the_version_check(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    manager.ensure(a, CUDA0)
    lease = manager.acquire([a], at=CUDA0, consumer_stream=cuda_stream(rt, 0))
    lease.release()
    version = manager.state_version
    scope = manager.scope(ResidencyPlan("p"), expected_state_version=version)
    rt.complete_events()
    with pytest.raises(ResidencyStaleStateError) as info:
        scope.__enter__()
    assert (info.value.expected_version, info.value.actual_version) == (version, version + 1)


# --------------------------------------------------------------------------------------------
# Entry failures after the preflight
# --------------------------------------------------------------------------------------------


def test_reclaim_failure(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    source = ControlledSource()
    r = manager.register_source(spec(3), source)
    plan = ResidencyPlan(
        "rec",
        reclaim=[EnsureResident(a, CUDA0), EnsureResident(r, CUDA1), EnsureResident(a, CUDA1)],
        reservations=[MemoryReservation(PINNED_HOST, 8, "ws")],
        enter=[EnsureResident(a, PINNED_HOST)],
    )
    cause = ValueError("load failed")
    source.raise_next = cause
    scope = manager.scope(plan)
    t0 = time.time_ns()
    error = raises_exec(scope.__enter__)
    check_execution_error(
        error,
        plan_name="rec",
        phase="reclaim",
        committed=plan.reclaim[:1],
        failed_action=plan.reclaim[1],
        failed_action_index=1,
        cause_type=ValueError,
        cause=cause,
        started_after=t0,
    )
    # No reservation was admitted (pinned was never even registered) and enter did not run.
    assert PINNED_HOST not in manager.locations
    snap = manager.snapshot()
    assert mat_locs(snap, a) == (PAGEABLE_HOST, CUDA0)
    assert mat_locs(snap, r) == ()
    no_reserved_bytes(manager)
    assert scope.exit_error is None
    _assert_closed_without_report(scope)
    _no_resource_warning_when_collected([scope])


def test_enter_failure_releases_admitted_reservations(frt: FaultRuntime) -> None:
    manager = ResidencyManager({CUDA0: 64})
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    plan = ResidencyPlan(
        "ent",
        reclaim=[EnsureResident(a, CUDA1)],
        reservations=[
            MemoryReservation(CUDA0, 8, "first"),
            MemoryReservation(PINNED_HOST, 4, "second"),
        ],
        enter=[EnsureResident(a, PINNED_HOST), EnsureResident(a, CUDA0), DropResident(a, CUDA1)],
    )
    scope = manager.scope(plan)
    version = manager.state_version
    # The reclaim copy to cuda:1 works; the enter copy to cuda:0 (the second one) fails.
    frt.arm("copy_to_cuda", 2, RuntimeError("allocation failed"))
    t0 = time.time_ns()
    error = raises_exec(scope.__enter__)
    check_execution_error(
        error,
        plan_name="ent",
        phase="enter",
        committed=[*plan.reclaim, plan.enter[0]],
        failed_action=plan.enter[1],
        failed_action_index=1,
        cause_type=RuntimeError,
        started_after=t0,
    )
    assert error.detail == "allocation failed"
    no_reserved_bytes(manager)
    snap = manager.snapshot()
    assert mat_locs(snap, a) == (PAGEABLE_HOST, CUDA1, PINNED_HOST)
    # cuda:1 + install (reclaim), pinned registration, two reservations, install (enter 0),
    # two releases.
    assert snap.state_version == version + 2 + 1 + 2 + 1 + 2
    assert scope.exit_error is None
    _assert_closed_without_report(scope)
    _no_resource_warning_when_collected([scope])


def test_keyboard_interrupt_during_enter_releases_reservations(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    source = ControlledSource()
    r = manager.register_source(spec(3), source)
    plan = ResidencyPlan(
        "kbd",
        reclaim=[EnsureResident(a, CUDA0)],
        reservations=[MemoryReservation(PINNED_HOST, 8, "ws")],
        enter=[EnsureResident(r, CUDA1)],
        exit=[DropResident(a, CUDA0)],
    )
    interrupt = KeyboardInterrupt()
    source.raise_next = interrupt
    scope = manager.scope(plan)
    with pytest.raises(KeyboardInterrupt) as info:
        scope.__enter__()
    assert info.value is interrupt
    assert getattr(info.value, "__notes__", []), "a note must describe the committed transitions"
    no_reserved_bytes(manager)
    assert mat_locs(manager.snapshot(), a) == (PAGEABLE_HOST, CUDA0)  # committed, exit not run
    assert scope.exit_error is None
    _assert_closed_without_report(scope)
    _no_resource_warning_when_collected([scope])


# --------------------------------------------------------------------------------------------
# Exit
# --------------------------------------------------------------------------------------------


def test_successful_exit_report_covers_entry_and_exit(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    plan = ResidencyPlan(
        "full",
        reclaim=[EnsureResident(a, PINNED_HOST)],
        reservations=[MemoryReservation(CUDA1, 3, "ws")],
        enter=[EnsureResident(a, CUDA0)],
        exit=[DropResident(a, CUDA0), DropResident(a, CUDA0), DropResident(a, PINNED_HOST)],
    )
    scope = manager.scope(plan)
    t0 = time.time_ns()
    with scope:
        entry_trace = manager.trace()
        time.sleep(0.002)
        body_time = time.time_ns()
    report = scope.report
    check_report(
        report,
        plan_name="full",
        actions=[*plan.reclaim, *plan.enter, *plan.exit],
        started_after=t0,
        no_ops=[False, False, False, True, False],
    )
    assert report.started_at_ns <= entry_trace[0].started_at_ns  # the entry start
    assert report.completed_at_ns >= body_time
    assert report.transitions[:2] == entry_trace
    assert report.transitions[3].reason == DROP_NOOP
    assert manager.trace() == report.transitions
    assert scope.exit_error is None
    assert mat_locs(manager.snapshot(), a) == (PAGEABLE_HOST,)
    no_reserved_bytes(manager)


def test_exit_actions_are_not_preflighted_again(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    plan = ResidencyPlan(
        "late",
        reservations=[MemoryReservation(PINNED_HOST, 4, "ws")],
        enter=[EnsureResident(a, CUDA0)],
        exit=[EnsureResident(a, CUDA1), DropResident(a, CUDA0), DropResident(a, CUDA1)],
    )
    scope = manager.scope(plan)
    scope.__enter__()
    hold = manager.hold([a], at=CUDA0)  # the body makes exit action 1 infeasible
    t0 = time.time_ns()
    error = raises_exec(scope.close)
    check_execution_error(
        error,
        plan_name="late",
        phase="exit",
        committed=[*plan.enter, plan.exit[0]],
        failed_action=plan.exit[1],
        failed_action_index=1,
        cause_type=ResidencyInUseError,
        started_after=0,
    )
    assert error.partial_report.started_at_ns < t0  # the entry start, not the exit start
    assert scope.exit_error is error
    assert scope.report is None
    # Exit action 0 ran (no second preflight); nothing after the failure did.
    snap = manager.snapshot()
    assert mat_locs(snap, a) == (PAGEABLE_HOST, CUDA0, CUDA1)
    no_reserved_bytes(manager)
    assert scope.close() is None
    assert scope.exit_error is error
    hold.release()
    _no_resource_warning_when_collected([scope])


def test_exit_runs_against_the_state_the_body_left(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    plan = ResidencyPlan("body", enter=[EnsureResident(a, CUDA0)], exit=[DropResident(a, CUDA0)])
    with manager.scope(plan) as scope:
        manager.drop(a, CUDA0)
        manager.ensure(a, CUDA1)
    assert scope.report is not None
    assert scope.report.transitions[-1].no_op is True
    assert scope.report.transitions[-1].reason == DROP_NOOP
    assert mat_locs(manager.snapshot(), a) == (PAGEABLE_HOST, CUDA1)


def test_exit_budget_failure_is_wrapped(sim: Any) -> None:
    manager = ResidencyManager({CUDA0: 32})
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    b = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    plan = ResidencyPlan(
        "budget", reservations=[MemoryReservation(CUDA0, 8, "ws")], exit=[EnsureResident(a, CUDA0)]
    )
    scope = manager.scope(plan)
    scope.__enter__()
    manager.ensure(b, CUDA0)  # 16 + 8 reserved: a no longer fits
    error = raises_exec(scope.close)
    check_execution_error(
        error,
        plan_name="budget",
        phase="exit",
        committed=[],
        failed_action=plan.exit[0],
        failed_action_index=0,
        cause_type=ResidencyBudgetError,
        started_after=0,
    )
    cause = error.__cause__
    assert isinstance(cause, ResidencyBudgetError)
    assert (cause.location, cause.budget_bytes, cause.requested_bytes) == ("cuda:0", 32, 16)
    assert (cause.used_bytes, cause.reserved_bytes) == (16, 8)
    no_reserved_bytes(manager)
    assert mat_locs(manager.snapshot(), a) == (PAGEABLE_HOST,)


def test_exit_with_body_exception_keeps_the_body_exception(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    plan = ResidencyPlan(
        "noted",
        reservations=[MemoryReservation(PINNED_HOST, 4, "ws")],
        enter=[EnsureResident(a, CUDA0)],
        exit=[DropResident(a, CUDA0)],
    )
    holds: list[Any] = []
    scope = manager.scope(plan)
    with pytest.raises(LookupError) as info, scope:
        holds.append(manager.hold([a], at=CUDA0))
        raise LookupError("body failed")
    assert str(info.value) == "body failed"
    notes = getattr(info.value, "__notes__", [])
    assert any("noted" in note for note in notes), notes
    assert isinstance(scope.exit_error, ResidencyPlanExecutionError)
    assert scope.exit_error.phase == "exit"
    assert scope.exit_error.failed_action is plan.exit[0]
    assert isinstance(scope.exit_error.__cause__, ResidencyInUseError)
    assert scope.report is None
    no_reserved_bytes(manager)
    holds[0].release()


def test_exit_failure_without_body_exception_propagates(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    plan = ResidencyPlan("raw", enter=[EnsureResident(a, CUDA0)], exit=[DiscardValue(a)])
    holds: list[Any] = []
    with pytest.raises(ResidencyPlanExecutionError) as info, manager.scope(plan) as scope:
        holds.append(manager.hold([a], at=PAGEABLE_HOST))
    assert info.value is scope.exit_error
    assert info.value.phase == "exit"
    assert info.value.failed_action_index == 0
    holds[0].release()


def test_body_exception_is_never_suppressed_and_exit_still_runs(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    plan = ResidencyPlan(
        "exc",
        reservations=[MemoryReservation(PINNED_HOST, 4, "ws")],
        enter=[EnsureResident(a, CUDA0)],
        exit=[DropResident(a, CUDA0)],
    )
    with pytest.raises(ZeroDivisionError), manager.scope(plan) as scope:
        _ = 1 / 0
    assert scope.report is not None
    assert scope.exit_error is None
    assert mat_locs(manager.snapshot(), a) == (PAGEABLE_HOST,)
    no_reserved_bytes(manager)
    assert scope.__exit__(None, None, None) is None  # closed: a no-op


def test_close_in_the_body_makes_exit_a_no_op(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    plan = ResidencyPlan("early", enter=[EnsureResident(a, CUDA0)], exit=[DropResident(a, CUDA0)])
    with manager.scope(plan) as scope:
        scope.close()
        report = scope.report
        assert report is not None
        assert len(report.transitions) == 2
        manager.ensure(a, CUDA0)  # the exit action must not run again
    assert scope.report is report
    assert mat_locs(manager.snapshot(), a) == (PAGEABLE_HOST, CUDA0)


def test_keyboard_interrupt_during_exit_still_releases_reservations(sim: Any) -> None:
    manager = ResidencyManager()
    source = ControlledSource()
    r = manager.register_source(spec(3), source)
    plan = ResidencyPlan(
        "kbd-exit",
        reservations=[MemoryReservation(CUDA1, 4, "ws")],
        exit=[EnsureResident(r, CUDA0)],
    )
    scope = manager.scope(plan)
    scope.__enter__()
    source.raise_next = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        scope.close()
    no_reserved_bytes(manager)
    assert scope.exit_error is None
    _assert_closed_without_report(scope)
    _no_resource_warning_when_collected([scope])


# --------------------------------------------------------------------------------------------
# Reservations during the body, nesting, versions
# --------------------------------------------------------------------------------------------


def test_reservations_reduce_headroom_for_direct_operations(sim: Any) -> None:
    manager = ResidencyManager({CUDA0: 40})
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)  # 16 B
    plan = ResidencyPlan("room", reservations=[MemoryReservation(CUDA0, 30, "workspace")])
    with manager.scope(plan):
        snap = manager.snapshot()
        entry = loc_snap(snap, CUDA0)
        assert (entry.reserved_bytes, entry.remaining_budget_bytes) == (30, 10)
        assert snap.reservations == (ResidencyReservationSnapshot(CUDA0, 30, "workspace"),)
        with pytest.raises(ResidencyBudgetError) as info:
            manager.ensure(a, CUDA0)
        assert info.value.reserved_bytes == 30
        with pytest.raises(ResidencyBudgetError):
            manager.reserve(CUDA0, 11, label="more")
        with pytest.raises(ResidencyInUseError):
            manager.close()  # a scope reservation is a live reservation
    manager.ensure(a, CUDA0)
    assert loc_snap(manager.snapshot(), CUDA0).peak_charged_bytes == 30


def test_nested_scopes(sim: Any) -> None:
    manager = ResidencyManager({CUDA0: 64})
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    b = manager.adopt(tensor_value(2), replica_mode=REPLICABLE)
    outer_plan = ResidencyPlan(
        "outer",
        reservations=[MemoryReservation(CUDA0, 8, "outer-ws")],
        enter=[EnsureResident(a, CUDA0)],
        exit=[DropResident(a, CUDA0)],
    )
    inner_plan = ResidencyPlan(
        "inner",
        reservations=[MemoryReservation(CUDA0, 4, "inner-ws")],
        enter=[EnsureResident(b, CUDA0)],
        exit=[DropResident(b, CUDA0)],
    )
    with manager.scope(outer_plan) as outer:
        with manager.scope(inner_plan) as inner:
            snap = manager.snapshot()
            assert [r.label for r in snap.reservations] == ["outer-ws", "inner-ws"]
            assert loc_snap(snap, CUDA0).used_bytes == 16 + 8
            assert loc_snap(snap, CUDA0).reserved_bytes == 12
        assert inner.report is not None
        assert [t.action for t in inner.report.transitions] == [*inner_plan.enter, *inner_plan.exit]
        snap = manager.snapshot()
        assert [r.label for r in snap.reservations] == ["outer-ws"]
        assert mat_locs(snap, b) == (PAGEABLE_HOST,)
        assert mat_locs(snap, a) == (PAGEABLE_HOST, CUDA0)
    assert outer.report is not None
    assert [t.action for t in outer.report.transitions] == [*outer_plan.enter, *outer_plan.exit]
    no_reserved_bytes(manager)


def test_scope_state_version_increments(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    plan = ResidencyPlan(
        "versions",
        reservations=[MemoryReservation(PINNED_HOST, 8, "ws"), MemoryReservation(CUDA0, 0, "z")],
        enter=[EnsureResident(a, CUDA0), EnsureResident(a, CUDA0)],
        exit=[DropResident(a, CUDA0)],
    )
    version = manager.state_version
    with manager.scope(plan):
        # pinned registration + reserve, cuda:0 registration + reserve, install, a no-op
        assert manager.state_version == version + 5
    # removal + two reservation releases
    assert manager.state_version == version + 8
    # An empty plan changes nothing.
    with manager.scope(ResidencyPlan("empty")) as scope:
        pass
    assert scope.report is not None
    assert scope.report.transitions == ()
    assert manager.state_version == version + 8


# --------------------------------------------------------------------------------------------
# Abandoned scopes (plans.md#abandoned-scopes) and exits that cannot enter the manager
# (plans.md#scope-exit)
# --------------------------------------------------------------------------------------------


def _enter_and_forget(manager: ResidencyManager, plan: ResidencyPlan) -> None:
    scope = manager.scope(plan)
    assert scope.__enter__() is scope


def test_abandoned_scope_releases_reservations_with_a_warning_and_skips_exit(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    plan = ResidencyPlan(
        "forgotten-plan",
        reservations=[MemoryReservation(PINNED_HOST, 8, "one"), MemoryReservation(CUDA1, 4, "two")],
        enter=[EnsureResident(a, CUDA0)],
        exit=[DropResident(a, CUDA0)],
    )
    with recorded_warnings() as caught:
        _enter_and_forget(manager, plan)
        gc.collect()
    found = of_category(caught, ResourceWarning)
    assert len(found) == 1, [str(w.message) for w in caught]
    assert "forgotten-plan" in str(found[0].message)
    no_reserved_bytes(manager)
    # The exit action never ran.
    assert mat_locs(manager.snapshot(), a) == (PAGEABLE_HOST, CUDA0)
    manager.close()


def test_scopes_that_never_entered_or_were_closed_emit_no_warning(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value())
    never = manager.scope(ResidencyPlan("never", reservations=[MemoryReservation(CUDA0, 1, "x")]))
    failed = manager.scope(ResidencyPlan("failed", enter=[DropResident(a, PAGEABLE_HOST)]))
    with pytest.raises(ResidencyPlanError):
        failed.__enter__()
    closed = manager.scope(ResidencyPlan("closed", reservations=[MemoryReservation(CUDA0, 1, "x")]))
    with closed:
        pass
    _no_resource_warning_when_collected([never, failed, closed])


def test_close_on_a_closed_manager_is_unwrapped_and_still_closes_the_scope(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    plan = ResidencyPlan(
        "orphan",
        reservations=[MemoryReservation(PINNED_HOST, 8, "ws")],
        enter=[EnsureResident(a, CUDA0)],
        exit=[DropResident(a, CUDA0)],
    )
    scope = manager.scope(plan)
    scope.__enter__()
    with pytest.raises(ResidencyInUseError):
        manager.close()
    manager.close(force=True)
    with pytest.raises(ResidencyClosedError):
        scope.close()
    assert scope.exit_error is None
    assert scope.report is None
    assert scope.close() is None
    _no_resource_warning_when_collected([scope])


def test_exit_on_a_closed_manager_with_a_body_exception(sim: Any) -> None:
    manager = ResidencyManager()
    plan = ResidencyPlan("shut", reservations=[MemoryReservation(PAGEABLE_HOST, 2, "ws")])
    with pytest.raises(KeyError) as info, manager.scope(plan) as scope:
        manager.close(force=True)
        raise KeyError("body")
    assert any("shut" in note for note in getattr(info.value, "__notes__", []))
    assert scope.exit_error is None  # not a plan-execution error
    assert scope.close() is None
    # Without a body exception the closed error propagates.
    manager2 = ResidencyManager()
    with pytest.raises(ResidencyClosedError), manager2.scope(plan):
        manager2.close(force=True)


def test_close_during_a_callback_on_another_thread_still_releases_reservations(
    sim: Any,
) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    in_load = threading.Event()
    proceed = threading.Event()

    def block() -> None:
        in_load.set()
        if not proceed.wait(10):
            raise TimeoutError("test never released the callback")

    r = manager.register_source(spec(3), Source(fresh(3), before_load=block))
    plan = ResidencyPlan(
        "busy",
        reservations=[MemoryReservation(PINNED_HOST, 8, "ws"), MemoryReservation(CUDA1, 2, "w2")],
        exit=[EnsureResident(a, CUDA0)],
    )
    scope = manager.scope(plan)
    scope.__enter__()
    outcome: list[BaseException | None] = []
    worker = threading.Thread(
        target=lambda: outcome.append(capture(lambda: manager.ensure(r, PAGEABLE_HOST))),
        daemon=True,
    )
    worker.start()
    try:
        assert in_load.wait(10)
        error = capture(lambda: run_with_timeout(scope.close, 5.0))
    finally:
        proceed.set()
        worker.join(10)
    assert not worker.is_alive()
    assert outcome == [None]
    assert isinstance(error, ResidencyReentrancyError), repr(error)
    assert scope.exit_error is None
    assert scope.report is None
    assert scope.close() is None
    snap = manager.snapshot()
    assert snap.reservations == ()
    assert loc_snap(snap, PINNED_HOST).reserved_bytes == 0
    assert loc_snap(snap, CUDA1).reserved_bytes == 0
    assert mat_locs(snap, a) == (PAGEABLE_HOST,)  # the exit action never ran
    assert mat_locs(snap, r) == (PAGEABLE_HOST,)
    _no_resource_warning_when_collected([scope])
    manager.close()


def test_close_from_inside_a_callback_on_the_same_thread_still_releases_reservations(
    sim: Any,
) -> None:
    manager = ResidencyManager()
    plan = ResidencyPlan("inner-close", reservations=[MemoryReservation(CUDA0, 8, "ws")])
    scope = manager.scope(plan)
    scope.__enter__()
    seen: list[BaseException | None] = []

    def inside() -> None:
        seen.append(capture(scope.close))

    r = manager.register_source(spec(3), Source(fresh(3), before_load=inside))
    manager.ensure(r, PAGEABLE_HOST)
    assert isinstance(seen[0], ResidencyReentrancyError)
    assert scope.exit_error is None
    assert scope.close() is None
    no_reserved_bytes(manager)
    _no_resource_warning_when_collected([scope])
    manager.close()


def test_abandoned_scope_after_a_forced_close_warns_once_and_raises_nothing(sim: Any) -> None:
    manager = ResidencyManager()
    plan = ResidencyPlan("after-force", reservations=[MemoryReservation(PINNED_HOST, 8, "ws")])
    holder = [manager.scope(plan)]
    holder[0].__enter__()
    manager.close(force=True)
    with recorded_warnings() as caught:
        holder.clear()
        gc.collect()
    found = of_category(caught, ResourceWarning)
    assert len(found) == 1, [str(w.message) for w in caught]
    assert "after-force" in str(found[0].message)
    assert [w for w in caught if not issubclass(w.category, ResourceWarning)] == []
