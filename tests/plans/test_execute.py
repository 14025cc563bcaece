"""`ResidencyManager.execute_actions` (docs/concepts/plans.md#execute-actions).

Check order: name and action normalisation (before the gate, so on a closed manager and during
a callback too), then gate/closed/reentrant, reap, the `expected_state_version` check, transfer
stream validation, the preflight (`ResidencyPlanError(reason)`, nothing executed) and finally
the non-transactional execution, whose failures are wrapped in `ResidencyPlanExecutionError`
with the committed prefix.
"""

# ruff: noqa: PT011

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
import pytest
import torch

from fhelium.errors import (
    ResidencyBudgetError,
    ResidencyClosedError,
    ResidencyHandleError,
    ResidencyMaterializationError,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
    ResidencyReentrancyError,
    ResidencyStaleStateError,
)
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, cuda_location
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.model import ResidencyHandle
from fhelium.residency.plan import (
    DiscardValue,
    DropResident,
    EnsureResident,
    MemoryReservation,
    MoveResident,
    ResidencyPlan,
)
from fhelium.residency.snapshot import ResidencyPlanReport
from fhelium.values import ResidentTensor
from helpers.lifetimes import (
    LoggingRuntime,
    assert_not_reaped,
    cuda_stream,
    rt_fixture,  # noqa: F401
)
from helpers.manager import (
    CUDA0,
    CUDA1,
    DROP_NOOP,
    ENSURE_NOOP,
    EXCLUSIVE,
    MOVE_NOOP,
    REPLICABLE,
    Source,
    capture,
    foreign_handle,
    fresh,
    mat_locs,
    run_with_timeout,
    sim_fixture,  # noqa: F401
    spec,
    state_key,
    stream,
    tensor_value,
    val_snap,
)
from helpers.plans import (
    ControlledSource,
    check_execution_error,
    check_report,
    raises_exec,
)

DEFAULT_NAME = "residency-actions"


def _frozen(manager: ResidencyManager, runtime: Any) -> Any:
    """Everything a failed call must leave untouched."""
    return (
        state_key(manager.snapshot()),
        manager.trace(),
        len(runtime.copies),
    )


# --------------------------------------------------------------------------------------------
# Step 1: name and action normalisation, before the gate
# --------------------------------------------------------------------------------------------

BAD_NAMES = [
    (None, TypeError),
    (5, TypeError),
    (b"plan", TypeError),
    ("", ValueError),
    ("   ", ValueError),
    ("\t\n", ValueError),
]


def _bad_action_lists(handle: ResidencyHandle[Any]) -> list[tuple[Any, type[Exception]]]:
    good = EnsureResident(handle, PAGEABLE_HOST)
    plan = ResidencyPlan("p", enter=[good])
    return [
        (5, TypeError),  # not iterable
        (None, TypeError),
        ([object()], TypeError),
        ([good, "ensure"], TypeError),
        ([good, MemoryReservation(PAGEABLE_HOST, 1, "r")], TypeError),
        ([plan], TypeError),
        ([(handle, PAGEABLE_HOST)], TypeError),
        (plan, TypeError),  # a plan is not an iterable of actions
    ]


@pytest.mark.parametrize(("name", "error"), BAD_NAMES)
@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
def test_bad_name_is_rejected_before_the_gate(
    name: Any, error: type[Exception], closed: bool
) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    actions = [EnsureResident(handle, PAGEABLE_HOST)]
    if closed:
        manager.close()
    with pytest.raises(error):
        manager.execute_actions(actions, name=name)


@pytest.mark.parametrize("case", range(8))
@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
def test_bad_actions_are_rejected_before_the_gate(case: int, closed: bool) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    actions, error = _bad_action_lists(handle)[case]
    version = manager.state_version
    if closed:
        manager.close()
    with pytest.raises(error):
        manager.execute_actions(actions)
    if not closed:
        assert manager.state_version == version
        assert manager.trace() == ()


def test_name_is_checked_before_the_actions() -> None:
    manager = ResidencyManager()
    with pytest.raises(ValueError):
        manager.execute_actions([object()], name="  ")
    with pytest.raises(TypeError):
        manager.execute_actions([object()], name="fine")


def test_normalisation_errors_win_inside_a_source_callback() -> None:
    manager = ResidencyManager()
    seen: dict[str, BaseException | None] = {}

    def inside() -> None:
        seen["bad_actions"] = capture(lambda: manager.execute_actions(5))
        seen["bad_name"] = capture(lambda: manager.execute_actions([], name=""))
        seen["valid"] = capture(lambda: manager.execute_actions([]))

    handle = manager.register_source(spec(), Source(fresh(), before_load=inside))
    manager.ensure(handle, PAGEABLE_HOST)
    assert type(seen["bad_actions"]) is TypeError
    assert type(seen["bad_name"]) is ValueError
    assert isinstance(seen["valid"], ResidencyReentrancyError)


def test_any_iterable_of_actions_is_accepted_and_reported_by_identity(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    first = EnsureResident(a, CUDA0)
    second = EnsureResident(a, PINNED_HOST)
    t0 = time.time_ns()
    report = manager.execute_actions(action for action in (first, second))
    check_report(report, plan_name=DEFAULT_NAME, actions=[first, second], started_after=t0)
    assert mat_locs(manager.snapshot(), a) == (PAGEABLE_HOST, CUDA0, PINNED_HOST)


# --------------------------------------------------------------------------------------------
# Step 3: gate, closed, reentrant
# --------------------------------------------------------------------------------------------


def test_closed_manager_raises_closed_error_for_valid_input() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    manager.close()
    with pytest.raises(ResidencyClosedError):
        manager.execute_actions([EnsureResident(handle, PAGEABLE_HOST)])
    with pytest.raises(ResidencyClosedError):
        manager.execute_actions([])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"expected_state_version": True},
        {"expected_state_version": -1},
        {"expected_state_version": 999},
        {"transfer_streams": [1, 2]},
        {"transfer_streams": {PAGEABLE_HOST: object()}},
    ],
    ids=["bool-version", "negative-version", "stale-version", "list-streams", "host-key"],
)
def test_closed_check_comes_before_version_and_stream_checks(kwargs: dict[str, Any]) -> None:
    manager = ResidencyManager()
    manager.close()
    with pytest.raises(ResidencyClosedError):
        manager.execute_actions([], **kwargs)


def test_execute_actions_inside_a_callback_fails_fast_and_runs_nothing() -> None:
    manager = ResidencyManager()
    other = manager.adopt(tensor_value(2), replica_mode=REPLICABLE)
    outcome: list[BaseException | None] = []

    def inside() -> None:
        outcome.append(capture(lambda: manager.execute_actions([DropResident(other, PINNED_HOST)])))
        outcome.append(capture(lambda: manager.execute_actions([])))

    handle = manager.register_source(spec(), Source(fresh(), before_load=inside))
    manager.ensure(handle, PAGEABLE_HOST)
    assert len(outcome) == 2
    assert all(isinstance(error, ResidencyReentrancyError) for error in outcome), outcome
    # The manager is usable again once the callback returned.
    assert manager.execute_actions([]).transitions == ()


# --------------------------------------------------------------------------------------------
# Step 4: expected_state_version
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "error"),
    [(True, TypeError), (False, TypeError), (1.0, TypeError), ("0", TypeError), (-1, ValueError)],
    ids=["True", "False", "float", "str", "negative"],
)
def test_expected_state_version_type_and_range(sim: Any, bad: Any, error: type[Exception]) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    before = _frozen(manager, sim)
    with pytest.raises(error):
        manager.execute_actions([EnsureResident(a, CUDA0)], expected_state_version=bad)
    assert _frozen(manager, sim) == before


def test_matching_expected_state_version_is_accepted_as_an_index_int(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    version = manager.state_version
    report = manager.execute_actions(
        [EnsureResident(a, CUDA0)], expected_state_version=np.int64(version)
    )
    assert len(report.transitions) == 1
    version = manager.state_version
    manager.execute_actions([EnsureResident(a, CUDA0)], expected_state_version=version)


def test_stale_version_is_rejected_before_any_mutation(sim: Any) -> None:
    manager = ResidencyManager()
    source = ControlledSource()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    r = manager.register_source(spec(3), source)
    version = manager.state_version
    manager.adopt(tensor_value(2))
    actual = manager.state_version
    assert actual > version
    before = _frozen(manager, sim)
    with pytest.raises(ResidencyStaleStateError) as info:
        manager.execute_actions(
            [EnsureResident(r, CUDA1), EnsureResident(a, CUDA0)], expected_state_version=version
        )
    assert info.value.expected_version == version
    assert info.value.actual_version == actual
    assert _frozen(manager, sim) == before
    assert source.calls == 0
    # A newer version than the current one is stale too.
    with pytest.raises(ResidencyStaleStateError) as info:
        manager.execute_actions([], expected_state_version=actual + 1)
    assert (info.value.expected_version, info.value.actual_version) == (actual + 1, actual)


def test_version_check_comes_before_stream_validation_and_preflight(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value())  # EXCLUSIVE, MUST_PRESERVE
    stale = manager.state_version + 5
    infeasible = [DropResident(a, PAGEABLE_HOST)]  # final MUST_PRESERVE copy
    with pytest.raises(ResidencyStaleStateError):
        manager.execute_actions(
            infeasible,
            transfer_streams={PAGEABLE_HOST: stream(sim, 0)},
            expected_state_version=stale,
        )
    with pytest.raises(ResidencyStaleStateError):
        manager.execute_actions(infeasible, transfer_streams=[1], expected_state_version=stale)
    # A malformed version is rejected before a malformed stream mapping.
    with pytest.raises(ValueError):
        manager.execute_actions([], transfer_streams=[1], expected_state_version=-1)


def test_version_check_runs_after_the_reap(rt: LoggingRuntime) -> None:
    """A version read before a completed event was reaped is stale for execution
    (docs/concepts/lifetimes.md#reaping)."""
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    manager.ensure(a, CUDA0)
    lease = manager.acquire([a], at=CUDA0, consumer_stream=cuda_stream(rt, 0))
    lease.release()  # pending until its event completes
    version = manager.state_version
    rt.complete_events()
    assert_not_reaped(manager, rt)
    with pytest.raises(ResidencyStaleStateError) as info:
        manager.execute_actions([], expected_state_version=version)
    assert info.value.expected_version == version
    assert info.value.actual_version == version + 1
    assert manager.state_version == version + 1


# --------------------------------------------------------------------------------------------
# Step 5: transfer streams (plans.md#transfer-streams)
# --------------------------------------------------------------------------------------------


def _bad_streams(runtime: Any) -> list[tuple[Any, type[Exception]]]:
    s0, s1 = stream(runtime, 0), stream(runtime, 1)
    return [
        ([(CUDA0, s0)], TypeError),  # not a Mapping
        ("cuda:0", TypeError),
        ({PAGEABLE_HOST: s0}, ValueError),  # host key
        ({PINNED_HOST: s0}, ValueError),
        ({CUDA0: s0, PINNED_HOST: s0}, ValueError),
        ({CUDA0: s1}, ValueError),  # wrong device
        ({CUDA1: s0}, ValueError),
        ({CUDA0: object()}, TypeError),  # not a stream
        ({CUDA0: None}, TypeError),
        ({"cuda:0": s0}, TypeError),  # not a location
        ({cuda_location("cuda:5"): s0}, ValueError),  # unavailable device
    ]


@pytest.mark.parametrize("case", range(11))
@pytest.mark.parametrize("empty", [False, True], ids=["actions", "no-actions"])
def test_transfer_stream_validation(sim: Any, case: int, empty: bool) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    streams, error = _bad_streams(sim)[case]
    before = _frozen(manager, sim)
    actions = [] if empty else [EnsureResident(a, CUDA0), EnsureResident(a, CUDA1)]
    with pytest.raises(error) as info:
        manager.execute_actions(actions, transfer_streams=streams)
    assert not isinstance(info.value, (ResidencyPlanError, ResidencyPlanExecutionError))
    assert _frozen(manager, sim) == before


def test_stream_validation_comes_before_the_preflight(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value())
    infeasible = [DropResident(a, PAGEABLE_HOST)]
    with pytest.raises(ValueError):
        manager.execute_actions(infeasible, transfer_streams={PAGEABLE_HOST: stream(sim, 0)})
    with pytest.raises(ResidencyPlanError):
        manager.execute_actions(infeasible, transfer_streams={CUDA0: stream(sim, 0)})


def test_streams_are_used_per_destination_and_unused_keys_are_allowed(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    b = manager.adopt(tensor_value(2), replica_mode=REPLICABLE)
    s0, s1 = stream(sim, 0), stream(sim, 1)
    mark = len(sim.copies)
    report = manager.execute_actions(
        [
            EnsureResident(a, CUDA0),  # pageable -> cuda:0 on s0, blocking
            MoveResident(a, CUDA1, from_location=CUDA0),  # cuda:0 -> cuda:1 on s1, non-blocking
            EnsureResident(b, PINNED_HOST),  # host copy: no stream
            EnsureResident(b, CUDA0),  # from pageable (preferred over pinned) on s0
            DropResident(b, CUDA0),  # never uses a stream
            DiscardValue(b),
        ],
        transfer_streams={CUDA0: s0, CUDA1: s1},
    )
    assert len(report.transitions) == 6
    copies = sim.copies[mark:]
    assert [c.destination for c in copies] == [CUDA0, CUDA1, PINNED_HOST, CUDA0]
    assert copies[0].stream is s0
    assert copies[0].non_blocking is False
    assert copies[1].stream is s1
    assert copies[1].non_blocking is True
    assert copies[2].stream is None
    assert copies[3].stream is s0
    assert copies[3].non_blocking is False
    # A key that no action uses is fine.
    c = manager.adopt(tensor_value(3), replica_mode=REPLICABLE)
    manager.execute_actions([EnsureResident(c, PINNED_HOST)], transfer_streams={CUDA1: s1})
    assert sim.copies[-1].destination == PINNED_HOST


def test_destination_without_a_stream_uses_the_current_stream(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    s0 = stream(sim, 0)
    manager.execute_actions([EnsureResident(a, CUDA1)], transfer_streams={CUDA0: s0})
    copy = sim.copies[-1]
    assert copy.destination == CUDA1
    assert copy.stream is not s0
    assert copy.stream is sim.current_stream(torch.device("cuda", 1))


def test_empty_mapping_and_none_mean_no_streams(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    manager.execute_actions([EnsureResident(a, CUDA0)], transfer_streams={})
    manager.execute_actions([EnsureResident(a, CUDA1)], transfer_streams=None)
    assert [c.destination for c in sim.copies[-2:]] == [CUDA0, CUDA1]


def test_real_runtime_without_cuda_rejects_cuda_stream_keys() -> None:
    """Without CUDA a CUDA key fails location validation (ValueError) before the stream
    (docs/concepts/locations-and-budgets.md#without-cuda)."""
    if torch.cuda.is_available():
        pytest.skip("needs a CUDA-less process")
    manager = ResidencyManager()
    with pytest.raises(ValueError):
        manager.execute_actions([], transfer_streams={CUDA0: object()})
    with pytest.raises(TypeError):
        manager.execute_actions([], transfer_streams={PAGEABLE_HOST: object()})


# --------------------------------------------------------------------------------------------
# Step 6: preflight
# --------------------------------------------------------------------------------------------


def _infeasible(name: str, manager: ResidencyManager, keep: list[Any]) -> tuple[list[Any], str]:
    """An action list whose LAST action is infeasible, and the exact preflight reason.

    Lifetimes the scenario needs are appended to `keep` (the caller releases them).
    """
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)  # 16 B, MUST_PRESERVE
    first = EnsureResident(a, CUDA1)  # feasible, must not run
    if name == "foreign-handle":
        handle = foreign_handle()
        return [first, EnsureResident(handle, PAGEABLE_HOST)], str(
            capture(lambda: manager.ensure(handle, PAGEABLE_HOST))
        )
    if name == "unknown-handle":
        handle = ResidencyHandle(manager.manager_id, str(uuid.uuid4()), ResidentTensor)
        return [first, DropResident(handle, PAGEABLE_HOST)], str(
            capture(lambda: manager.drop(handle, PAGEABLE_HOST))
        )
    if name == "discarded-handle":
        gone = manager.adopt(tensor_value(2), replica_mode=REPLICABLE)
        manager.discard(gone)
        return [first, MoveResident(gone, CUDA0)], str(capture(lambda: manager.move(gone, CUDA0)))
    if name == "discarded-in-plan":
        d = manager.adopt(tensor_value(2), replica_mode=REPLICABLE)
        return [first, DiscardValue(d), EnsureResident(d, PINNED_HOST)], (
            f"Value {d.handle_id!r} is discarded"
        )
    if name == "invalid-location":
        bad = cuda_location("cuda:7")
        return [first, EnsureResident(a, bad)], str(capture(lambda: manager.ensure(a, bad)))
    if name == "budget":
        b = manager.adopt(tensor_value(2), replica_mode=REPLICABLE)  # 8 B
        return [first, EnsureResident(a, CUDA0), EnsureResident(b, CUDA0)], (
            "Transition exceeds budget at cuda:0"
        )
    if name == "exclusive":
        x = manager.adopt(tensor_value(2), replica_mode=EXCLUSIVE)
        return [first, EnsureResident(x, PINNED_HOST)], (
            "EnsureResident would replicate an EXCLUSIVE value"
        )
    if name == "explicit-source":
        return [first, MoveResident(a, PINNED_HOST, from_location=CUDA0)], (
            "explicit source cuda:0 is not resident"
        )
    if name == "move-protected":
        h = manager.adopt(tensor_value(3), replica_mode=REPLICABLE)
        keep.append(manager.hold([h], at=PAGEABLE_HOST))
        return [first, MoveResident(h, PINNED_HOST)], "source pageable-host is protected"
    if name == "drop-protected":
        manager.ensure(a, PINNED_HOST)
        keep.append(manager.hold([a], at=PINNED_HOST))
        return [first, DropResident(a, PINNED_HOST)], "materialization at pinned-host is protected"
    if name == "drop-final":
        return [first, DropResident(a, CUDA1), DropResident(a, PAGEABLE_HOST)], (
            "cannot drop final MUST_PRESERVE materialization"
        )
    raise AssertionError(name)


INFEASIBLE = [
    "foreign-handle",
    "unknown-handle",
    "discarded-handle",
    "discarded-in-plan",
    "invalid-location",
    "budget",
    "exclusive",
    "explicit-source",
    "move-protected",
    "drop-protected",
    "drop-final",
]


@pytest.mark.parametrize("name", INFEASIBLE)
def test_preflight_failure_raises_plan_error_with_the_exact_reason(sim: Any, name: str) -> None:
    manager = ResidencyManager({CUDA0: 20})
    source = ControlledSource()
    r = manager.register_source(spec(3), source)
    keep: list[Any] = []
    actions, reason = _infeasible(name, manager, keep)
    actions = [EnsureResident(r, CUDA1), *actions]  # would call the source if it ran
    before = _frozen(manager, sim)
    with pytest.raises(ResidencyPlanError) as info:
        manager.execute_actions(actions, name="doomed")
    assert type(info.value) is ResidencyPlanError
    assert str(info.value) == reason
    # Nothing ran: no transition, no source call, no copy, no version change.
    assert _frozen(manager, sim) == before
    assert source.calls == 0
    # explain reports the same first failure for the same actions.
    explanation = manager.explain(ResidencyPlan("doomed", enter=actions))
    assert explanation.feasible is False
    assert explanation.reason == reason
    assert len(explanation.actions) == len(actions)
    for lifetime in keep:
        lifetime.release()


def test_preflight_does_not_wrap_handle_or_location_errors(sim: Any) -> None:
    manager = ResidencyManager()
    with pytest.raises(ResidencyPlanError) as info:
        manager.execute_actions([EnsureResident(foreign_handle(), PAGEABLE_HOST)])
    assert not isinstance(info.value, ResidencyHandleError)
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    with pytest.raises(ResidencyPlanError) as info:
        manager.execute_actions([EnsureResident(a, cuda_location("cuda:9"))])
    assert not isinstance(info.value, ValueError)


def test_preflight_simulates_the_whole_list_in_order(sim: Any) -> None:
    """Earlier actions free budget and create sources for later ones (the simulated state)."""
    manager = ResidencyManager({CUDA0: 32})
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    b = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    c = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    manager.ensure(a, CUDA0)
    manager.ensure(b, CUDA0)
    # c only fits on cuda:0 because a's cuda:0 copy is moved off first.
    report = manager.execute_actions(
        [
            MoveResident(a, PINNED_HOST, from_location=CUDA0),
            EnsureResident(c, CUDA0),
            MoveResident(c, CUDA1, from_location=PAGEABLE_HOST),
            DropResident(b, CUDA0),
        ]
    )
    assert [t.no_op for t in report.transitions] == [False, False, False, False]
    snap = manager.snapshot()
    assert mat_locs(snap, a) == (PAGEABLE_HOST, PINNED_HOST)
    assert mat_locs(snap, c) == (CUDA0, CUDA1)
    assert mat_locs(snap, b) == (PAGEABLE_HOST,)
    with pytest.raises(ResidencyPlanError, match=r"^Transition exceeds budget at cuda:0$"):
        manager.execute_actions(
            [EnsureResident(a, CUDA0), EnsureResident(b, CUDA0), DropResident(c, CUDA0)]
        )


# --------------------------------------------------------------------------------------------
# Steps 7-8: execution, reports and the trace
# --------------------------------------------------------------------------------------------


def test_empty_action_list_returns_an_empty_report(sim: Any) -> None:
    manager = ResidencyManager()
    manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    version = manager.state_version
    t0 = time.time_ns()
    report = manager.execute_actions([])
    check_report(report, plan_name=DEFAULT_NAME, actions=[], started_after=t0)
    assert report.transitions == ()
    named = manager.execute_actions((), name="nothing", expected_state_version=version)
    check_report(named, plan_name="nothing", actions=[], started_after=t0)
    assert manager.state_version == version
    assert manager.trace() == ()


def test_successful_report_and_trace(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    r = manager.register_source(spec(3), ControlledSource())
    manager.ensure(a, PINNED_HOST)  # one earlier trace entry
    actions = [
        EnsureResident(a, CUDA0),
        EnsureResident(a, CUDA0),
        MoveResident(a, CUDA0),
        EnsureResident(r, CUDA1),
        DropResident(a, PINNED_HOST),
        DropResident(a, PINNED_HOST),
        MoveResident(a, PINNED_HOST, from_location=CUDA0),
        DiscardValue(r),
    ]
    t0 = time.time_ns()
    report = manager.execute_actions(actions, name="mixed")
    check_report(
        report,
        plan_name="mixed",
        actions=actions,
        started_after=t0,
        no_ops=[False, True, False, False, False, True, False, False],
    )
    t = report.transitions
    assert (t[0].source, t[0].destination, t[0].reason) == (PAGEABLE_HOST, CUDA0, None)
    assert (t[1].source, t[1].destination, t[1].reason) == (None, CUDA0, ENSURE_NOOP)
    # Move to an already resident destination removes the selected other replica.
    assert (t[2].source, t[2].destination, t[2].reason) == (PAGEABLE_HOST, CUDA0, None)
    # Reconstruction reports the registered source location.
    assert (t[3].source, t[3].destination) == (PAGEABLE_HOST, CUDA1)
    assert (t[3].logical_nbytes, t[3].storage_nbytes) == (12, 12)
    assert (t[4].source, t[4].destination, t[4].reason) == (PINNED_HOST, None, None)
    assert (t[5].source, t[5].destination, t[5].reason) == (PINNED_HOST, None, DROP_NOOP)
    assert (t[6].source, t[6].destination) == (CUDA0, PINNED_HOST)
    assert (t[7].source, t[7].destination, t[7].no_op) == (None, None, False)
    trace = manager.trace()
    assert len(trace) == 1 + len(actions)
    assert trace[1:] == report.transitions
    snap = manager.snapshot()
    assert mat_locs(snap, a) == (PINNED_HOST,)
    assert val_snap(snap, r).discarded is True


def test_move_noop_with_explicit_source_equal_to_destination(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    manager.ensure(a, CUDA0)
    version = manager.state_version
    report = manager.execute_actions(
        [MoveResident(a, CUDA0, from_location=CUDA0), MoveResident(a, PAGEABLE_HOST)]
    )
    first, second = report.transitions
    assert (first.no_op, first.source, first.reason) == (True, CUDA0, MOVE_NOOP)
    # pageable is resident; the selected source (canonical, excluding `to`) is cuda:0.
    assert (second.no_op, second.source, second.destination) == (False, CUDA0, PAGEABLE_HOST)
    assert manager.state_version == version + 1
    assert mat_locs(manager.snapshot(), a) == (PAGEABLE_HOST,)


def test_trace_capacity_zero_still_reports(sim: Any) -> None:
    manager = ResidencyManager(trace_capacity=0)
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    report = manager.execute_actions([EnsureResident(a, CUDA0), DropResident(a, CUDA0)])
    assert len(report.transitions) == 2
    assert manager.trace() == ()


def test_report_type_and_immutability(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    report = manager.execute_actions([EnsureResident(a, CUDA0)], name="one")
    assert isinstance(report, ResidencyPlanReport)
    with pytest.raises(AttributeError):
        report.plan_name = "other"  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# Runtime failures: wrapping, partial reports, causes (plans.md#execution-errors)
# --------------------------------------------------------------------------------------------


def _three_step(manager: ResidencyManager) -> tuple[Any, Any, ControlledSource, list[Any]]:
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    source = ControlledSource()
    r = manager.register_source(spec(3), source)
    actions = [EnsureResident(a, CUDA0), EnsureResident(r, CUDA1), EnsureResident(a, PINNED_HOST)]
    return a, r, source, actions


CAUSES: list[tuple[str, BaseException]] = [
    ("value-error", ValueError("user load failed")),
    (
        "budget-error",
        ResidencyBudgetError(
            location="x", budget_bytes=1, used_bytes=0, reserved_bytes=0, requested_bytes=2
        ),
    ),
    ("plan-error", ResidencyPlanError("raised by the user")),
    ("key-error", KeyError("k")),
]


@pytest.mark.parametrize(("label", "cause"), CAUSES, ids=[c[0] for c in CAUSES])
def test_every_exception_from_a_source_is_wrapped(sim: Any, label: str, cause: Exception) -> None:
    manager = ResidencyManager()
    a, r, source, actions = _three_step(manager)
    source.raise_next = cause
    t0 = time.time_ns()
    error = raises_exec(lambda: manager.execute_actions(actions, name="wrapped"))
    check_execution_error(
        error,
        plan_name="wrapped",
        phase="execute",
        committed=actions[:1],
        failed_action=actions[1],
        failed_action_index=1,
        cause_type=type(cause),
        cause=cause,
        started_after=t0,
    )
    assert error.failed_reservation is None
    assert error.failed_reservation_index is None
    assert not isinstance(error, ResidencyPlanError)
    # Committed prefix stays, nothing after the failure ran, no charge is left behind.
    snap = manager.snapshot()
    assert mat_locs(snap, a) == (PAGEABLE_HOST, CUDA0)
    assert mat_locs(snap, r) == ()
    assert all(entry.reserved_bytes == 0 for entry in snap.locations)
    assert manager.trace() == error.partial_report.transitions
    # The manager is fully usable again (callback flag and transition owner cleared).
    report = manager.execute_actions(actions[1:])
    assert len(report.transitions) == 2


def test_materialization_error_from_a_source_is_wrapped(sim: Any) -> None:
    manager = ResidencyManager()
    _, r, source, actions = _three_step(manager)
    source.wrong_next = True
    t0 = time.time_ns()
    error = raises_exec(lambda: manager.execute_actions(actions))
    check_execution_error(
        error,
        plan_name=DEFAULT_NAME,
        phase="execute",
        committed=actions[:1],
        failed_action=actions[1],
        failed_action_index=1,
        cause_type=ResidencyMaterializationError,
        started_after=t0,
    )
    assert mat_locs(manager.snapshot(), r) == ()


def test_copy_failure_is_wrapped_and_later_actions_do_not_run(sim: Any) -> None:
    manager = ResidencyManager()
    a, _, source, actions = _three_step(manager)
    boom = RuntimeError("copy exploded")
    sim.fail_next("copy_to_pinned", exc=boom)
    t0 = time.time_ns()
    error = raises_exec(lambda: manager.execute_actions(actions, name="copy"))
    check_execution_error(
        error,
        plan_name="copy",
        phase="execute",
        committed=actions[:2],
        failed_action=actions[2],
        failed_action_index=2,
        cause_type=RuntimeError,
        started_after=t0,
    )
    assert error.detail == "copy exploded"
    assert source.calls == 1
    assert mat_locs(manager.snapshot(), a) == (PAGEABLE_HOST, CUDA0)


def test_failure_at_the_first_action_has_an_empty_partial_report(sim: Any) -> None:
    manager = ResidencyManager()
    _, _, _, actions = _three_step(manager)
    sim.fail_next("copy_to_cuda", exc=RuntimeError("first"))
    before = state_key(manager.snapshot())
    t0 = time.time_ns()
    error = raises_exec(lambda: manager.execute_actions(actions))
    check_execution_error(
        error,
        plan_name=DEFAULT_NAME,
        phase="execute",
        committed=[],
        failed_action=actions[0],
        failed_action_index=0,
        cause_type=RuntimeError,
        started_after=t0,
    )
    assert error.partial_report.transitions == ()
    assert state_key(manager.snapshot()) == before


def test_index_is_into_the_given_actions_even_with_duplicates(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    source = ControlledSource()
    r = manager.register_source(spec(3), source)
    same = EnsureResident(r, CUDA0)
    actions = [same, DropResident(r, CUDA0), same]
    # The first load works, the second (index 2) fails.
    calls = {"n": 0}

    def hook() -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("second load")

    source.hook = hook
    error = raises_exec(lambda: manager.execute_actions([*actions, EnsureResident(a, CUDA1)]))
    assert error.failed_action_index == 2
    assert error.failed_action is same
    assert len(error.partial_report.transitions) == 2
    assert isinstance(error.__cause__, OSError)


def test_keyboard_interrupt_is_not_wrapped_and_gets_a_note(sim: Any) -> None:
    manager = ResidencyManager()
    a, r, source, actions = _three_step(manager)
    interrupt = KeyboardInterrupt()
    source.raise_next = interrupt
    with pytest.raises(KeyboardInterrupt) as info:
        manager.execute_actions(actions, name="interrupted")
    assert info.value is interrupt
    notes = getattr(info.value, "__notes__", [])
    assert notes, "a note must say how many transitions completed and stay committed"
    assert any("1" in note and "committed" in note.lower() for note in notes), notes
    snap = manager.snapshot()
    assert mat_locs(snap, a) == (PAGEABLE_HOST, CUDA0)
    assert mat_locs(snap, r) == ()
    assert all(entry.reserved_bytes == 0 for entry in snap.locations)
    # The callback flag and the transition owner were cleared.
    manager.execute_actions(actions[1:])
    assert mat_locs(manager.snapshot(), r) == (CUDA1,)


def test_keyboard_interrupt_at_the_first_action_is_not_wrapped(sim: Any) -> None:
    manager = ResidencyManager()
    source = ControlledSource()
    r = manager.register_source(spec(3), source)
    source.raise_next = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        manager.execute_actions([EnsureResident(r, CUDA0)])
    assert mat_locs(manager.snapshot(), r) == ()


# --------------------------------------------------------------------------------------------
# State versions (transitions.md#state-version)
# --------------------------------------------------------------------------------------------


def test_state_version_increments_for_plans(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    r = manager.register_source(spec(3), ControlledSource())

    def delta(actions: list[Any]) -> int:
        before = manager.state_version
        manager.execute_actions(actions)
        return manager.state_version - before

    assert delta([]) == 0
    assert delta([EnsureResident(a, CUDA0)]) == 2  # new location + install
    assert delta([EnsureResident(a, CUDA0), DropResident(a, PINNED_HOST)]) == 0  # two no-ops
    assert delta([MoveResident(a, CUDA1, from_location=CUDA0)]) == 3  # location, install, removal
    assert delta([MoveResident(a, CUDA1)]) == 1  # resident destination: only the removal
    assert delta([EnsureResident(r, PINNED_HOST)]) == 2  # new location + install; temp is free
    assert delta([EnsureResident(r, CUDA0), DiscardValue(r)]) == 1 + 3  # install; 2 removals + mark
    assert delta([EnsureResident(a, PAGEABLE_HOST), DropResident(a, CUDA1)]) == 2
    # A failed preflight changes nothing.
    before = manager.state_version
    with pytest.raises(ResidencyPlanError):
        manager.execute_actions(
            [EnsureResident(a, CUDA0), DropResident(a, CUDA0), DropResident(a, PAGEABLE_HOST)]
        )
    assert manager.state_version == before


def test_failed_execution_advances_only_for_the_committed_prefix(sim: Any) -> None:
    manager = ResidencyManager()
    _, _, source, actions = _three_step(manager)
    source.raise_next = ValueError("nope")
    before = manager.state_version
    raises_exec(lambda: manager.execute_actions(actions))
    # cuda:0 registered + install for action 0; the failed reconstruction registers nothing.
    assert manager.state_version == before + 2
    assert CUDA1 not in manager.locations


# --------------------------------------------------------------------------------------------
# Action subclasses are actions (transitions.md#actions: element checks are isinstance checks)
# --------------------------------------------------------------------------------------------


class _SubEnsure(EnsureResident):  # type: ignore[type-arg]
    __slots__ = ()


class _SubMove(MoveResident):  # type: ignore[type-arg]
    __slots__ = ()


class _SubDrop(DropResident):  # type: ignore[type-arg]
    __slots__ = ()


class _SubDiscard(DiscardValue):  # type: ignore[type-arg]
    __slots__ = ()


def _subclass_cases(a: Any) -> dict[str, tuple[Any, Any]]:
    return {
        "ensure": (_SubEnsure(a, CUDA0), EnsureResident(a, CUDA0)),
        "move": (_SubMove(a, CUDA0), MoveResident(a, CUDA0)),
        "drop": (_SubDrop(a, PINNED_HOST), DropResident(a, PINNED_HOST)),
        "discard": (_SubDiscard(a), DiscardValue(a)),
    }


@pytest.mark.parametrize("kind", ["ensure", "move", "drop", "discard"])
def test_action_subclasses_execute_like_their_base_class(sim: Any, kind: str) -> None:
    """A subclass instance is accepted by the isinstance checks, so it must do what its
    base action does (never something else, such as discarding the value)."""
    results = []
    for use_subclass in (True, False):
        manager = ResidencyManager()
        a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
        manager.ensure(a, PINNED_HOST)
        action = _subclass_cases(a)[kind][0 if use_subclass else 1]
        s0 = stream(sim, 0)
        report = manager.execute_actions([action], transfer_streams={CUDA0: s0})
        assert report.transitions[0].action is action
        snap = manager.snapshot()
        results.append(
            (
                mat_locs(snap, a),
                val_snap(snap, a).discarded,
                snap.state_version,
                report.transitions[0].no_op,
                report.transitions[0].source,
                report.transitions[0].destination,
            )
        )
        if kind in ("ensure", "move"):
            assert sim.copies[-1].stream is s0
    assert results[0] == results[1]


def test_action_subclasses_in_scopes_and_explain(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    plan = ResidencyPlan("sub", enter=[_SubEnsure(a, CUDA0)], exit=[_SubDrop(a, CUDA0)])
    explanation = manager.explain(plan)
    assert explanation.feasible is True
    assert [r.destination for r in explanation.actions] == [CUDA0, None]
    with manager.scope(plan):
        assert mat_locs(manager.snapshot(), a) == (PAGEABLE_HOST, CUDA0)
    assert mat_locs(manager.snapshot(), a) == (PAGEABLE_HOST,)
    assert val_snap(manager.snapshot(), a).discarded is False


# --------------------------------------------------------------------------------------------
# Plan transitions are the primitives' transitions (transitions.md#common-steps); other threads
# during a plan
# --------------------------------------------------------------------------------------------


def _comparable(report: Any) -> tuple[Any, ...]:
    return (
        report.no_op,
        report.source,
        report.destination,
        report.logical_nbytes,
        report.storage_nbytes,
        report.allocator_device,
        report.reason,
        report.allocator_allocated_bytes_before is None,
        report.allocator_allocated_bytes_after is None,
    )


def test_plan_transitions_match_direct_primitive_reports(sim: Any) -> None:
    def world(manager: ResidencyManager) -> list[Any]:
        a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
        r = manager.register_source(spec(3), ControlledSource())
        return [
            EnsureResident(a, CUDA0),
            EnsureResident(a, CUDA0),
            MoveResident(a, CUDA1, from_location=CUDA0),
            MoveResident(a, PINNED_HOST),
            EnsureResident(r, CUDA0),
            DropResident(a, CUDA1),
            DropResident(a, CUDA1),
            DiscardValue(r),
        ]

    planned = ResidencyManager()
    report = planned.execute_actions(world(planned))
    direct = ResidencyManager()
    reports = []
    for action in world(direct):
        if isinstance(action, EnsureResident):
            reports.append(direct.ensure(action.handle, action.location))
        elif isinstance(action, MoveResident):
            reports.append(
                direct.move(action.handle, action.to, from_location=action.from_location)
            )
        elif isinstance(action, DropResident):
            reports.append(direct.drop(action.handle, action.location))
        else:
            reports.append(direct.discard(action.handle))
    assert [_comparable(t) for t in report.transitions] == [_comparable(t) for t in reports]
    assert report.transitions[0].allocator_device == torch.device("cuda", 0)
    assert report.transitions[2].allocator_device == torch.device("cuda", 1)


def test_other_threads_fail_fast_while_a_plan_runs_a_source_callback(sim: Any) -> None:
    import threading

    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    in_load = threading.Event()
    proceed = threading.Event()
    source = ControlledSource()

    def block() -> None:
        in_load.set()
        if not proceed.wait(10):
            raise TimeoutError("never released")

    source.hook = block
    r = manager.register_source(spec(3), source)
    outcome: list[Any] = []
    worker = threading.Thread(
        target=lambda: outcome.append(
            capture(lambda: manager.execute_actions([EnsureResident(r, CUDA0)]))
        ),
        daemon=True,
    )
    worker.start()
    try:
        assert in_load.wait(10)
        plan = ResidencyPlan("other", enter=[EnsureResident(a, CUDA1)])
        for call in (
            lambda: manager.execute_actions([EnsureResident(a, CUDA1)]),
            lambda: manager.explain(plan),
            lambda: manager.scope(plan).__enter__(),
        ):
            with pytest.raises(ResidencyReentrancyError):
                run_with_timeout(call, 5.0)
    finally:
        proceed.set()
        worker.join(10)
    assert not worker.is_alive()
    assert outcome == [None]
    assert mat_locs(manager.snapshot(), r) == (CUDA0,)
    assert mat_locs(manager.snapshot(), a) == (PAGEABLE_HOST,)
