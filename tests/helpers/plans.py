"""Shared helpers for the plan tests (test_plans_*.py); this module holds no tests.

Written from the documented behaviour (docs/concepts/plans.md, transitions.md,
snapshots.md), not from the implementation.

* `FaultRuntime`: a `SimulatedRuntime` whose copy methods can be made to fail on their n-th
  call after `arm(...)`, so a fault lands on one chosen action of a plan.
* `ControlledSource`: a reconstruction source whose `load()` can be told to raise, to return
  a wrong value, or to run a hook (inside the manager's callback window).
* `shape(manager)`: a handle-free rendering of the manager state, comparable across two
  managers that issued their handles in the same order.
* `check_execution_error(...)`: the generic field rules of `ResidencyPlanExecutionError`
  (docs/concepts/plans.md#execution-errors).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from fhelium.errors import ResidencyPlanExecutionError
from fhelium.residency._runtime import SimulatedRuntime, use_runtime
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.snapshot import ResidencyPlanReport, ResidencyTransitionReport
from fhelium.values import TensorResident
from helpers.manager import assert_balanced, tensor_value

__all__ = [
    "ControlledSource",
    "FaultRuntime",
    "check_execution_error",
    "check_report",
    "fault_rt_fixture",
    "no_reserved_bytes",
    "raises_exec",
    "shape",
]


class FaultRuntime(SimulatedRuntime):
    """A `SimulatedRuntime` whose copies can fail on the n-th call of one copy method.

    `arm(method, nth, exc)` starts counting calls of `method` ("copy_to_cuda",
    "copy_to_pinned" or "copy_to_pageable") from zero; the `nth` call (1-based) raises `exc`
    and disarms. `disarm()` cancels.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._armed: tuple[str, int, BaseException] | None = None
        self._seen: collections.Counter[str] = collections.Counter()
        self._fault_lock = threading.Lock()

    def arm(self, method: str, nth: int, exc: BaseException) -> None:
        assert method in ("copy_to_cuda", "copy_to_pinned", "copy_to_pageable"), method
        assert nth >= 1
        with self._fault_lock:
            self._armed = (method, nth, exc)
            self._seen = collections.Counter()

    def disarm(self) -> None:
        with self._fault_lock:
            self._armed = None

    def _check(self, method: str) -> None:
        with self._fault_lock:
            armed = self._armed
            if armed is None or armed[0] != method:
                return
            self._seen[method] += 1
            if self._seen[method] != armed[1]:
                return
            self._armed = None
        raise armed[2]

    def copy_to_cuda(self, value: Any, device: Any, stream: Any, *, non_blocking: bool) -> Any:
        self._check("copy_to_cuda")
        return super().copy_to_cuda(value, device, stream, non_blocking=non_blocking)

    def copy_to_pinned(self, value: Any) -> Any:
        self._check("copy_to_pinned")
        return super().copy_to_pinned(value)

    def copy_to_pageable(self, value: Any) -> Any:
        self._check("copy_to_pageable")
        return super().copy_to_pageable(value)


@pytest.fixture(name="frt")
def fault_rt_fixture() -> Iterator[FaultRuntime]:
    """A two-device `FaultRuntime`, installed for the whole test."""
    runtime = FaultRuntime(device_count=2)
    with use_runtime(runtime):
        yield runtime


class ControlledSource:
    """A source of fresh pageable `n`-float32 values with switchable misbehaviour.

    * `raise_next = exc`: the next `load()` raises `exc` (then the source is healthy again);
    * `wrong_next = True`: the next `load()` returns a value of the wrong size;
    * `hook`: called inside every `load()` before it returns (may raise).
    """

    def __init__(self, n: int = 3) -> None:
        self.n = n
        self.calls = 0
        self.raise_next: BaseException | None = None
        self.wrong_next = False
        self.hook: Callable[[], object] | None = None

    def load(self) -> TensorResident:
        self.calls += 1
        if self.hook is not None:
            self.hook()
        exc, self.raise_next = self.raise_next, None
        if exc is not None:
            raise exc
        if self.wrong_next:
            self.wrong_next = False
            return tensor_value(self.n + 1)
        return tensor_value(self.n)


def shape(manager: ResidencyManager, *, with_version: bool = False) -> Any:
    """A handle-free rendering of the manager state (balanced books are asserted first).

    Values are listed in issue order, so two managers that issued handles in the same order
    compare equal exactly when their materialisations, charges, protections, locations and
    reservations agree. `peak_charged_bytes` is left out: a failed reconstruction may leave a
    raised charged peak behind (docs/concepts/locations-and-budgets.md#peaks).
    """
    snap = manager.snapshot()
    assert_balanced(snap)
    values = tuple(
        (
            tuple(
                (m.location, m.charged_nbytes, m.use_count, m.hold_count, m.pending_event_count)
                for m in v.materializations
            ),
            v.has_source,
            v.source_location,
            v.discarded,
        )
        for v in snap.values
    )
    locations = tuple(
        (
            e.location,
            e.budget_bytes,
            e.used_bytes,
            e.reserved_bytes,
            e.remaining_budget_bytes,
            e.peak_used_bytes,
            e.value_count,
            e.reservation_count,
            e.use_count,
            e.hold_count,
        )
        for e in snap.locations
    )
    reservations = tuple((r.location, r.nbytes, r.label) for r in snap.reservations)
    result = (values, locations, reservations)
    return (*result, snap.state_version) if with_version else result


def no_reserved_bytes(manager: ResidencyManager) -> None:
    snap = manager.snapshot()
    assert snap.reservations == ()
    for entry in snap.locations:
        assert entry.reserved_bytes == 0, entry
        assert entry.reservation_count == 0, entry


def check_report(
    report: Any,
    *,
    plan_name: str,
    actions: Sequence[Any],
    started_after: int,
    no_ops: Sequence[bool] | None = None,
) -> None:
    """A `ResidencyPlanReport` whose transitions are exactly `actions` (by identity)."""
    assert isinstance(report, ResidencyPlanReport)
    assert report.plan_name == plan_name
    assert isinstance(report.transitions, tuple)
    assert len(report.transitions) == len(actions), [t.action for t in report.transitions]
    for transition, action in zip(report.transitions, actions, strict=True):
        assert isinstance(transition, ResidencyTransitionReport)
        assert transition.action is action, (transition.action, action)
    if no_ops is not None:
        assert [t.no_op for t in report.transitions] == list(no_ops)
    assert started_after <= report.started_at_ns <= report.completed_at_ns <= time.time_ns()
    if report.transitions:
        assert report.started_at_ns <= report.transitions[0].started_at_ns
        assert report.transitions[-1].completed_at_ns <= report.completed_at_ns
        for earlier, later in zip(report.transitions, report.transitions[1:], strict=False):
            assert earlier.completed_at_ns <= later.started_at_ns


def check_execution_error(
    error: BaseException,
    *,
    plan_name: str,
    phase: str,
    committed: Sequence[Any],
    failed_action: Any,
    failed_action_index: int | None,
    cause_type: type[BaseException],
    started_after: int,
    failed_reservation: Any = None,
    failed_reservation_index: int | None = None,
    cause: BaseException | None = None,
) -> None:
    """Every field rule of a `ResidencyPlanExecutionError`
    (docs/concepts/plans.md#execution-errors)."""
    assert type(error) is ResidencyPlanExecutionError, repr(error)
    assert error.plan_name == plan_name
    assert error.phase == phase
    if failed_action is None:
        assert error.failed_action is None
    else:
        assert error.failed_action is failed_action, (error.failed_action, failed_action)
    assert error.failed_action_index == failed_action_index
    assert type(error.failed_action_index) is type(failed_action_index)
    if failed_reservation is None:
        assert error.failed_reservation is None
    else:
        assert error.failed_reservation is failed_reservation
    assert error.failed_reservation_index == failed_reservation_index
    original = error.__cause__
    assert isinstance(original, cause_type), repr(original)
    if cause is not None:
        assert original is cause
    assert error.detail == str(original)
    check_report(
        error.partial_report, plan_name=plan_name, actions=committed, started_after=started_after
    )
    message = str(error)
    assert repr(plan_name) in message, message
    assert phase in message, message
    assert str(len(committed)) in message, message
    assert error.detail in message, message


def raises_exec(fn: Callable[[], Any]) -> ResidencyPlanExecutionError:
    """Call `fn`, which must raise `ResidencyPlanExecutionError`; return the error."""
    with pytest.raises(ResidencyPlanExecutionError) as info:
        fn()
    return info.value
