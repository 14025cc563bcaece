"""Fault injection at every failable action index (docs/concepts/plans.md#execution-errors,
docs/concepts/values.md#reconstruction).

A runtime failure of action `i` (a source that raises or returns a wrong value, a copy or
allocation that fails, a budget exhausted by the scope body, a protection added by the body)
must leave exactly the committed prefix `0..i-1` in place, report it in `partial_report`, name
the failed action with its phase-local index, and leave no charge or reservation behind.

The expected state is computed independently: a twin manager, built the same way, applies the
same prefix with the direct primitives. The two must then agree on every materialisation,
charge, location, reservation and (where the histories match) the state version. Finally the
failed manager is driven to completion and must end where the twin ends.

Drop and discard actions cannot fail at runtime once the preflight passed unless the state
changes in between, which only a scope body can do; so in `execute` and scope entry they are
part of the prefixes, and the exit phase makes every action kind fail.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from fhelium.errors import (
    ResidencyBudgetError,
    ResidencyError,
    ResidencyInUseError,
    ResidencyMaterializationError,
)
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.plan import (
    DiscardValue,
    DropResident,
    EnsureResident,
    MemoryReservation,
    MoveResident,
    ResidencyPlan,
)
from helpers.manager import CUDA0, CUDA1, EXCLUSIVE, REPLICABLE, mat_locs, on, spec, tensor_value
from helpers.plans import (
    ControlledSource,
    FaultRuntime,
    check_execution_error,
    fault_rt_fixture,  # noqa: F401
    no_reserved_bytes,
    raises_exec,
    shape,
)


class Injected(RuntimeError):
    """The injected copy/allocation failure."""


def _apply(manager: ResidencyManager, action: Any) -> None:
    """Apply one action with the direct primitive (the independent reference)."""
    if isinstance(action, EnsureResident):
        manager.ensure(action.handle, action.location)
    elif isinstance(action, MoveResident):
        manager.move(action.handle, action.to, from_location=action.from_location)
    elif isinstance(action, DropResident):
        manager.drop(action.handle, action.location)
    else:
        assert isinstance(action, DiscardValue)
        manager.discard(action.handle)


def _inject(runtime: FaultRuntime, source: ControlledSource, fault: tuple[Any, ...]) -> None:
    kind = fault[0]
    if kind == "copy":
        runtime.arm(fault[1], fault[2], Injected(f"{fault[1]} #{fault[2]} failed"))
    elif kind == "raise":
        source.raise_next = fault[1]
    elif kind == "wrong":
        source.wrong_next = True
    else:
        raise AssertionError(kind)


def _cause_type(fault: tuple[Any, ...]) -> type[BaseException]:
    if fault[0] == "copy":
        return Injected
    if fault[0] == "raise":
        return type(fault[1])
    return ResidencyMaterializationError


# --------------------------------------------------------------------------------------------
# execute_actions
# --------------------------------------------------------------------------------------------


def _execute_world(manager: ResidencyManager, source: ControlledSource) -> list[Any]:
    a = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)  # 16 B
    b = manager.adopt(tensor_value(2), replica_mode=EXCLUSIVE)  # 8 B
    r = manager.register_source(spec(3), source)  # 12 B, rebuilt at pageable
    d = manager.adopt(tensor_value(5), replica_mode=REPLICABLE)  # 20 B
    manager.ensure(d, PINNED_HOST)
    return [
        EnsureResident(a, CUDA0),  # 0: copy_to_cuda #1
        MoveResident(b, PINNED_HOST),  # 1: copy_to_pinned #1
        DropResident(a, PAGEABLE_HOST),  # 2
        EnsureResident(r, CUDA1),  # 3: load, then copy_to_cuda #2
        MoveResident(a, PAGEABLE_HOST, from_location=CUDA0),  # 4: copy_to_pageable #1
        DiscardValue(d),  # 5
        MoveResident(b, CUDA0),  # 6: copy_to_cuda #3 (from pinned)
    ]


EXECUTE_FAULTS = [
    (0, ("copy", "copy_to_cuda", 1)),
    (1, ("copy", "copy_to_pinned", 1)),
    (3, ("raise", ValueError("source broke"))),
    (3, ("raise", OSError("disk gone"))),
    (
        3,
        (
            "raise",
            ResidencyBudgetError(
                location="elsewhere",
                budget_bytes=1,
                used_bytes=1,
                reserved_bytes=0,
                requested_bytes=1,
            ),
        ),
    ),
    (3, ("wrong",)),
    (3, ("copy", "copy_to_cuda", 2)),
    (4, ("copy", "copy_to_pageable", 1)),
    (6, ("copy", "copy_to_cuda", 3)),
]


@pytest.mark.parametrize(
    ("index", "fault"),
    EXECUTE_FAULTS,
    ids=[f"{i}-{f[0]}-{n}" for n, (i, f) in enumerate(EXECUTE_FAULTS)],
)
def test_execute_fault_at_each_action(frt: FaultRuntime, index: int, fault: Any) -> None:
    budgets = {CUDA0: 64}
    source = ControlledSource(3)
    manager = ResidencyManager(budgets)
    actions = _execute_world(manager, source)
    trace_before = manager.trace()
    _inject(frt, source, fault)
    t0 = time.time_ns()
    error = raises_exec(lambda: manager.execute_actions(actions, name="faulty"))
    frt.disarm()
    check_execution_error(
        error,
        plan_name="faulty",
        phase="execute",
        committed=actions[:index],
        failed_action=actions[index],
        failed_action_index=index,
        cause_type=_cause_type(fault),
        cause=fault[1] if fault[0] == "raise" else None,
        started_after=t0,
    )
    assert manager.trace() == trace_before + error.partial_report.transitions
    no_reserved_bytes(manager)

    twin = ResidencyManager(budgets)
    twin_actions = _execute_world(twin, ControlledSource(3))
    for action in twin_actions[:index]:
        _apply(twin, action)
    assert shape(manager, with_version=True) == shape(twin, with_version=True)

    # The manager is healthy: finishing the plan ends where the full twin run ends.
    report = manager.execute_actions(actions[index:])
    assert [t.action for t in report.transitions] == actions[index:]
    for action in twin_actions[index:]:
        _apply(twin, action)
    assert shape(manager, with_version=True) == shape(twin, with_version=True)


def test_execute_without_faults_matches_the_primitives(frt: FaultRuntime) -> None:
    manager = ResidencyManager({CUDA0: 64})
    actions = _execute_world(manager, ControlledSource(3))
    report = manager.execute_actions(actions)
    assert [t.no_op for t in report.transitions] == [False] * len(actions)
    twin = ResidencyManager({CUDA0: 64})
    for action in _execute_world(twin, ControlledSource(3)):
        _apply(twin, action)
    assert shape(manager, with_version=True) == shape(twin, with_version=True)


# --------------------------------------------------------------------------------------------
# Scope entry: reclaim and enter
# --------------------------------------------------------------------------------------------

RESERVATIONS = (MemoryReservation(CUDA0, 32, "ws"), MemoryReservation(PINNED_HOST, 4, "pin"))


def _entry_world(
    manager: ResidencyManager, runtime: FaultRuntime, source: ControlledSource
) -> ResidencyPlan:
    a = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)  # 16 B
    manager.ensure(a, CUDA0)
    b = manager.adopt(tensor_value(2), replica_mode=EXCLUSIVE)  # 8 B
    r = manager.register_source(spec(3), source)  # 12 B
    c = manager.adopt(on(runtime, CUDA0, tensor_value(4)), replica_mode=REPLICABLE)  # 16 B
    # cuda:0 (budget 64) holds 32 B: the 32 B reservation plus enter needs the reclaim first.
    return ResidencyPlan(
        "entry",
        reclaim=[
            MoveResident(c, PAGEABLE_HOST),  # 0: copy_to_pageable #1
            DropResident(a, CUDA0),  # 1
            EnsureResident(r, PINNED_HOST),  # 2: load, copy_to_pinned #1
        ],
        reservations=RESERVATIONS,
        enter=[
            EnsureResident(a, CUDA1),  # 0: copy_to_cuda #1
            MoveResident(b, CUDA0),  # 1: copy_to_cuda #2
            DropResident(a, PAGEABLE_HOST),  # 2
            EnsureResident(r, CUDA0),  # 3: copy_to_cuda #3 (from pinned)
            MoveResident(c, PINNED_HOST),  # 4: copy_to_pinned #2
        ],
        exit=[MoveResident(b, PAGEABLE_HOST)],
    )


ENTRY_FAULTS = [
    ("reclaim", 0, ("copy", "copy_to_pageable", 1)),
    ("reclaim", 2, ("raise", ValueError("source broke"))),
    ("reclaim", 2, ("wrong",)),
    ("reclaim", 2, ("copy", "copy_to_pinned", 1)),
    ("enter", 0, ("copy", "copy_to_cuda", 1)),
    ("enter", 1, ("copy", "copy_to_cuda", 2)),
    ("enter", 3, ("copy", "copy_to_cuda", 3)),
    ("enter", 4, ("copy", "copy_to_pinned", 2)),
]


@pytest.mark.parametrize(
    ("phase", "index", "fault"),
    ENTRY_FAULTS,
    ids=[f"{p}-{i}-{f[0]}" for p, i, f in ENTRY_FAULTS],
)
def test_entry_fault_at_each_action(frt: FaultRuntime, phase: str, index: int, fault: Any) -> None:
    budgets = {CUDA0: 64}
    source = ControlledSource(3)
    manager = ResidencyManager(budgets)
    plan = _entry_world(manager, frt, source)
    assert manager.explain(plan).feasible is True
    scope = manager.scope(plan)
    _inject(frt, source, fault)
    t0 = time.time_ns()
    error = raises_exec(scope.__enter__)
    frt.disarm()
    actions = plan.reclaim if phase == "reclaim" else plan.enter
    committed = (
        list(plan.reclaim[:index])
        if phase == "reclaim"
        else [
            *plan.reclaim,
            *plan.enter[:index],
        ]
    )
    check_execution_error(
        error,
        plan_name="entry",
        phase=phase,
        committed=committed,
        failed_action=actions[index],
        failed_action_index=index,
        cause_type=_cause_type(fault),
        started_after=t0,
    )
    no_reserved_bytes(manager)
    assert scope.report is None
    assert scope.exit_error is None
    assert scope.close() is None  # closed by the failure: no exit actions run

    twin = ResidencyManager(budgets)
    twin_plan = _entry_world(twin, frt, ControlledSource(3))
    if phase == "reclaim":
        for action in twin_plan.reclaim[:index]:
            _apply(twin, action)
    else:
        for action in twin_plan.reclaim:
            _apply(twin, action)
        held = [twin.reserve(r.location, r.nbytes, label=r.label) for r in RESERVATIONS]
        for action in twin_plan.enter[:index]:
            _apply(twin, action)
        for reservation in reversed(held):
            reservation.release()
    assert shape(manager, with_version=True) == shape(twin, with_version=True)


# --------------------------------------------------------------------------------------------
# Scope exit: every action kind can fail because of what the body did
# --------------------------------------------------------------------------------------------


def _exit_world(manager: ResidencyManager, source: ControlledSource) -> tuple[ResidencyPlan, Any]:
    a = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)  # 16 B
    r = manager.register_source(spec(3), source)  # 12 B
    x = manager.adopt(tensor_value(2), replica_mode=REPLICABLE)  # 8 B
    f = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)  # 16 B filler
    plan = ResidencyPlan(
        "exit",
        reservations=[MemoryReservation(PINNED_HOST, 8, "ws")],
        enter=[EnsureResident(a, CUDA0)],
        exit=[
            EnsureResident(a, PINNED_HOST),  # 0: copy_to_pinned #1
            DropResident(a, CUDA0),  # 1: fails if the body holds a at cuda:0
            EnsureResident(r, CUDA1),  # 2: load; budget (cuda:1 is 20 B)
            MoveResident(r, CUDA0),  # 3: copy_to_cuda #2 of the exit
            DiscardValue(x),  # 4: fails if the body holds x
        ],
    )
    return plan, {"a": a, "r": r, "x": x, "f": f}


EXIT_FAULTS = [
    (0, ("copy", "copy_to_pinned", 1), Injected),
    (1, ("hold", "a", CUDA0), ResidencyInUseError),
    (2, ("raise", ValueError("source broke")), ValueError),
    (2, ("fill", "f", CUDA1), ResidencyBudgetError),
    (3, ("copy", "copy_to_cuda", 2), Injected),
    (4, ("hold", "x", PAGEABLE_HOST), ResidencyInUseError),
]


def _body(
    manager: ResidencyManager,
    runtime: FaultRuntime | None,
    source: ControlledSource,
    handles: dict[str, Any],
    fault: tuple[Any, ...],
) -> list[Any]:
    """What the scope body does to make exit action `i` fail; returns lifetimes to release."""
    kind = fault[0]
    if kind == "hold":
        return [manager.hold([handles[fault[1]]], at=fault[2])]
    if kind == "fill":
        manager.ensure(handles[fault[1]], fault[2])
        return []
    if runtime is not None:
        _inject(runtime, source, fault)
    return []


@pytest.mark.parametrize(
    ("index", "fault", "cause_type"),
    EXIT_FAULTS,
    ids=[f"{i}-{f[0]}" for i, f, _ in EXIT_FAULTS],
)
def test_exit_fault_at_each_action(
    frt: FaultRuntime, index: int, fault: Any, cause_type: type[BaseException]
) -> None:
    budgets = {CUDA1: 20}
    source = ControlledSource(3)
    manager = ResidencyManager(budgets)
    plan, handles = _exit_world(manager, source)
    scope = manager.scope(plan)
    t_enter = time.time_ns()
    scope.__enter__()
    lifetimes = _body(manager, frt, source, handles, fault)
    error = raises_exec(scope.close)
    frt.disarm()
    check_execution_error(
        error,
        plan_name="exit",
        phase="exit",
        committed=[*plan.enter, *plan.exit[:index]],
        failed_action=plan.exit[index],
        failed_action_index=index,
        cause_type=cause_type,
        started_after=t_enter,
    )
    assert scope.exit_error is error
    assert scope.report is None
    assert scope.close() is None
    no_reserved_bytes(manager)
    for lifetime in lifetimes:
        lifetime.release()

    twin = ResidencyManager(budgets)
    twin_source = ControlledSource(3)
    twin_plan, twin_handles = _exit_world(twin, twin_source)
    held = twin.reserve(PINNED_HOST, 8, label="ws")
    for action in twin_plan.enter:
        _apply(twin, action)
    twin_lifetimes = _body(twin, None, twin_source, twin_handles, fault)
    for action in twin_plan.exit[:index]:
        _apply(twin, action)
    held.release()
    for lifetime in twin_lifetimes:
        lifetime.release()
    assert shape(manager, with_version=True) == shape(twin, with_version=True)


def test_exit_without_faults_matches_the_primitives(frt: FaultRuntime) -> None:
    manager = ResidencyManager({CUDA1: 20})
    plan, handles = _exit_world(manager, ControlledSource(3))
    with manager.scope(plan) as scope:
        pass
    assert scope.report is not None
    assert len(scope.report.transitions) == 6
    assert mat_locs(manager.snapshot(), handles["r"]) == (CUDA0,)
    twin = ResidencyManager({CUDA1: 20})
    twin_plan, _ = _exit_world(twin, ControlledSource(3))
    held = twin.reserve(PINNED_HOST, 8, label="ws")
    for action in [*twin_plan.enter, *twin_plan.exit]:
        _apply(twin, action)
    held.release()
    assert shape(manager, with_version=True) == shape(twin, with_version=True)


def test_injected_errors_are_not_residency_errors() -> None:
    """Guard for the fixtures above: the injected failure is a plain RuntimeError."""
    assert not issubclass(Injected, ResidencyError)
