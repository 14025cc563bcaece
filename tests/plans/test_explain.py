"""`ResidencyManager.explain` and the simulation rules it shares with the preflight
(docs/concepts/plans.md#explain, #preflight).

`explain` never raises for infeasibility: handle problems, invalid locations, budgets and
protections become `feasible=False` with the exact preflight reason. It reports one record per
simulated action up to and including the first failure, the plan's reservations, and the
predicted charged peak per location (registered locations in registration order, then new
ones in the order first prepared; within an ensure/move the destination is prepared before the
source). It does not reap, changes no state and calls no source.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

from fhelium.errors import (
    ResidencyClosedError,
    ResidencyReentrancyError,
    ResidencyStaleStateError,
)
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, cuda_location
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.model import (
    Recoverability,
    ReplicaMode,
    ResidencyHandle,
    ResidencyValueSpec,
)
from fhelium.residency.plan import (
    DiscardValue,
    DropResident,
    EnsureResident,
    MemoryReservation,
    MoveResident,
    ResidencyPlan,
)
from fhelium.residency.snapshot import ResidencyActionExplanation, ResidencyPlanExplanation
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
    Other,
    Source,
    capture,
    foreign_handle,
    fresh,
    on,
    sim_fixture,  # noqa: F401
    spec,
    state_key,
    tensor_value,
)
from helpers.plans import ControlledSource

CUDA_MISSING = cuda_location("cuda:7")  # past the simulated devices


def _explain(manager: ResidencyManager, *enter: Any, **fields: Any) -> ResidencyPlanExplanation:
    return manager.explain(ResidencyPlan("why", enter=enter, **fields))


def _record(
    explanation: Any,
    index: int,
    *,
    action: Any,
    executable: bool,
    no_op: bool,
    source: Any,
    destination: Any,
    nbytes: tuple[int, int],
    reason: str | None,
) -> None:
    record = explanation.actions[index]
    assert isinstance(record, ResidencyActionExplanation)
    assert record.action is action
    assert record.executable is executable
    assert record.no_op is no_op
    assert record.source == source
    assert record.destination == destination
    assert (record.logical_nbytes, record.storage_nbytes) == nbytes
    assert record.reason == reason


def _frozen(manager: ResidencyManager, runtime: Any | None = None) -> Any:
    return (
        state_key(manager.snapshot()),
        manager.trace(),
        None if runtime is None else (len(runtime.copies), dict(runtime.calls).get("copy_to_cuda")),
    )


# --------------------------------------------------------------------------------------------
# Guards (transitions.md#guards, plans.md#explain)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
@pytest.mark.parametrize("bad", [None, "plan", [], ("p", ())], ids=["None", "str", "list", "tuple"])
def test_non_plan_raises_type_error_before_the_gate(bad: Any, closed: bool) -> None:
    manager = ResidencyManager()
    if closed:
        manager.close()
    with pytest.raises(TypeError):
        manager.explain(bad)


def test_non_plan_raises_type_error_inside_a_callback() -> None:
    manager = ResidencyManager()
    seen: list[BaseException | None] = []

    def inside() -> None:
        seen.append(capture(lambda: manager.explain("plan")))
        seen.append(capture(lambda: manager.explain(ResidencyPlan("p"))))

    handle = manager.register_source(spec(), Source(fresh(), before_load=inside))
    manager.ensure(handle, PAGEABLE_HOST)
    assert type(seen[0]) is TypeError
    assert isinstance(seen[1], ResidencyReentrancyError)


def test_closed_manager_raises_closed_error() -> None:
    manager = ResidencyManager()
    manager.close()
    with pytest.raises(ResidencyClosedError):
        manager.explain(ResidencyPlan("p"))
    with pytest.raises(ResidencyClosedError):
        manager.explain(ResidencyPlan("p"), expected_state_version=True)


@pytest.mark.parametrize(
    ("bad", "error"),
    [(True, TypeError), (2.0, TypeError), ("1", TypeError), (-3, ValueError)],
    ids=["bool", "float", "str", "negative"],
)
def test_expected_state_version_type_and_range(bad: Any, error: type[Exception]) -> None:
    manager = ResidencyManager()
    with pytest.raises(error):
        manager.explain(ResidencyPlan("p"), expected_state_version=bad)


def test_stale_version_raises_and_matching_version_passes() -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    version = manager.state_version
    plan = ResidencyPlan("p", enter=[DropResident(a, PINNED_HOST)])
    assert manager.explain(plan, expected_state_version=version).feasible is True
    manager.adopt(tensor_value(2))
    with pytest.raises(ResidencyStaleStateError) as info:
        manager.explain(plan, expected_state_version=version)
    assert info.value.expected_version == version
    assert info.value.actual_version == manager.state_version


def test_explain_does_not_raise_for_infeasibility_of_any_kind(sim: Any) -> None:
    manager = ResidencyManager({CUDA0: 4})
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    plans = [
        ResidencyPlan("foreign", enter=[EnsureResident(foreign_handle(), CUDA0)]),
        ResidencyPlan("location", enter=[EnsureResident(a, cuda_location("cuda:4"))]),
        ResidencyPlan("budget", enter=[EnsureResident(a, CUDA0)]),
        ResidencyPlan("final", exit=[DropResident(a, PAGEABLE_HOST)]),
        ResidencyPlan("reservation", reservations=[MemoryReservation(CUDA0, 5, "big")]),
    ]
    for plan in plans:
        explanation = manager.explain(plan)
        assert explanation.feasible is False, plan.name
        assert isinstance(explanation.reason, str)
        assert explanation.reason.strip()


# --------------------------------------------------------------------------------------------
# No state change, no source call, no reap (plans.md#explain, lifetimes.md#reaping)
# --------------------------------------------------------------------------------------------


def test_explain_changes_nothing_and_calls_no_source(sim: Any) -> None:
    manager = ResidencyManager({CUDA0: 64})
    source = ControlledSource()
    r = manager.register_source(spec(3), source)
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    manager.ensure(a, PINNED_HOST)
    plan = ResidencyPlan(
        "all",
        reclaim=[DropResident(a, PINNED_HOST)],
        reservations=[MemoryReservation(CUDA1, 8, "ws")],
        enter=[EnsureResident(r, CUDA0), MoveResident(a, CUDA1), EnsureResident(r, PINNED_HOST)],
        exit=[DiscardValue(r), MoveResident(a, PAGEABLE_HOST)],
    )
    before = _frozen(manager, sim)
    locations = manager.locations
    explanation = manager.explain(plan)
    assert explanation.feasible is True
    assert len(explanation.actions) == 6
    assert _frozen(manager, sim) == before
    assert manager.locations == locations  # cuda:0 budgeted; cuda:1 not registered by explain
    assert source.calls == 0
    # Explaining twice gives the same answer.
    assert manager.explain(plan) == explanation


def test_explain_does_not_reap_and_treats_completed_pending_leases_as_unprotected(
    rt: LoggingRuntime,
) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    manager.ensure(a, CUDA0)
    lease = manager.acquire([a], at=CUDA0, consumer_stream=cuda_stream(rt, 0))
    lease.release()  # pending: its event is still incomplete
    plan = ResidencyPlan(
        "p",
        enter=[DropResident(a, CUDA0)],
    )
    explanation = manager.explain(plan)
    assert explanation.feasible is False
    assert explanation.reason == "materialization at cuda:0 is protected"
    _record(
        explanation,
        0,
        action=plan.enter[0],
        executable=False,
        no_op=False,
        source=CUDA0,
        destination=None,
        nbytes=(16, 16),
        reason="materialization at cuda:0 is protected",
    )
    move = ResidencyPlan("m", enter=[MoveResident(a, PINNED_HOST, from_location=CUDA0)])
    assert manager.explain(move).reason == "source cuda:0 is protected"
    version = manager.state_version
    rt.complete_events()
    # Complete events: unprotected for explain, which still does not reap.
    explanation = manager.explain(plan, expected_state_version=version)
    assert explanation.feasible is True
    assert explanation.actions[0].executable is True
    assert explanation.actions[0].reason is None
    assert manager.explain(move).feasible is True
    assert_not_reaped(manager, rt)
    # A query that raises counts as protected; explain still does not raise.
    rt.fail_next("event_query", exc=RuntimeError("query failed"))
    try:
        failed = manager.explain(plan)
    finally:
        rt.clear_faults()
    assert failed.feasible is False
    assert failed.reason == "materialization at cuda:0 is protected"
    assert_not_reaped(manager, rt)
    # Reaping (any reaping operation) then releases it for real.
    assert manager.state_version == version + 1
    manager.execute_actions([DropResident(a, CUDA0)])


def test_active_lease_and_hold_protect(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    manager.ensure(a, PINNED_HOST)
    lease = manager.acquire([a], at=PINNED_HOST)
    plan = ResidencyPlan("p", enter=[DropResident(a, PINNED_HOST)])
    assert manager.explain(plan).reason == "materialization at pinned-host is protected"
    lease.release()
    assert manager.explain(plan).feasible is True
    hold = manager.hold([a], at=PINNED_HOST)
    assert manager.explain(plan).reason == "materialization at pinned-host is protected"
    hold.release()
    assert manager.explain(plan).feasible is True


# --------------------------------------------------------------------------------------------
# Per-action records (plans.md#per-action-rules, snapshots.md#action-explanations)
# --------------------------------------------------------------------------------------------


def test_ensure_records(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)  # 16 B
    manager.ensure(a, PINNED_HOST)
    r = manager.register_source(spec(3), ControlledSource(), source_location=PINNED_HOST)
    x = manager.adopt(tensor_value(2), replica_mode=EXCLUSIVE)  # 8 B
    actions = [
        EnsureResident(a, CUDA0),  # source: first canonical = pageable
        EnsureResident(a, PINNED_HOST),  # no-op
        EnsureResident(r, CUDA1),  # reconstruction from the registered source location
        EnsureResident(r, CUDA0),  # now from cuda:1, the only materialisation
        EnsureResident(x, PAGEABLE_HOST),  # EXCLUSIVE at its own location: no-op
        EnsureResident(x, CUDA0),  # replication of an EXCLUSIVE value
    ]
    explanation = _explain(manager, *actions)
    assert explanation.feasible is False
    assert explanation.reason == "EnsureResident would replicate an EXCLUSIVE value"
    assert len(explanation.actions) == 6
    common = {"executable": True, "no_op": False, "reason": None}
    _record(
        explanation, 0, action=actions[0], source=PAGEABLE_HOST, destination=CUDA0,
        nbytes=(16, 16), **common,
    )  # fmt: skip
    _record(
        explanation, 1, action=actions[1], executable=True, no_op=True, source=None,
        destination=PINNED_HOST, nbytes=(16, 16), reason=ENSURE_NOOP,
    )  # fmt: skip
    _record(
        explanation, 2, action=actions[2], source=PINNED_HOST, destination=CUDA1,
        nbytes=(12, 12), **common,
    )  # fmt: skip
    _record(
        explanation, 3, action=actions[3], source=CUDA1, destination=CUDA0,
        nbytes=(12, 12), **common,
    )  # fmt: skip
    _record(
        explanation, 4, action=actions[4], executable=True, no_op=True, source=None,
        destination=PAGEABLE_HOST, nbytes=(8, 8), reason=ENSURE_NOOP,
    )  # fmt: skip
    record = explanation.actions[5]
    assert record.executable is False
    assert record.no_op is False
    assert record.destination == CUDA0
    assert record.reason == "EnsureResident would replicate an EXCLUSIVE value"


def test_ensure_source_is_the_first_canonical_location(sim: Any) -> None:
    manager = ResidencyManager()
    # Installed in the order cuda:1, cuda:0, pinned: canonical order still picks pinned.
    a = manager.adopt(on(sim, CUDA1, tensor_value()), replica_mode=REPLICABLE)
    manager.ensure(a, CUDA0)
    manager.ensure(a, PINNED_HOST)
    explanation = _explain(manager, EnsureResident(a, PAGEABLE_HOST))
    assert explanation.actions[0].source == PINNED_HOST
    manager.drop(a, PINNED_HOST)
    explanation = _explain(manager, EnsureResident(a, PAGEABLE_HOST))
    assert explanation.actions[0].source == CUDA0


def test_move_records(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)  # 16 B
    manager.ensure(a, CUDA0)
    r = manager.register_source(spec(3), ControlledSource())
    x = manager.adopt(tensor_value(2), replica_mode=EXCLUSIVE)
    actions = [
        MoveResident(a, CUDA0),  # resident destination: removes pageable (canonical first)
        MoveResident(a, CUDA0),  # now only cuda:0: no-op, source None
        MoveResident(a, CUDA0, from_location=CUDA0),  # explicit same: no-op, source == to
        MoveResident(a, PINNED_HOST),  # copy from cuda:0, then removal
        MoveResident(r, CUDA1),  # no materialisation: reconstruction, nothing removed
        MoveResident(x, CUDA1, from_location=PAGEABLE_HOST),
        MoveResident(x, CUDA0, from_location=PINNED_HOST),  # not resident there
    ]
    explanation = _explain(manager, *actions)
    assert explanation.feasible is False
    assert explanation.reason == "explicit source pinned-host is not resident"
    assert len(explanation.actions) == 7
    ok = {"executable": True, "no_op": False, "reason": None}
    _record(
        explanation, 0, action=actions[0], source=PAGEABLE_HOST, destination=CUDA0,
        nbytes=(16, 16), **ok,
    )  # fmt: skip
    _record(
        explanation, 1, action=actions[1], executable=True, no_op=True, source=None,
        destination=CUDA0, nbytes=(16, 16), reason=MOVE_NOOP,
    )  # fmt: skip
    _record(
        explanation, 2, action=actions[2], executable=True, no_op=True, source=CUDA0,
        destination=CUDA0, nbytes=(16, 16), reason=MOVE_NOOP,
    )  # fmt: skip
    _record(
        explanation, 3, action=actions[3], source=CUDA0, destination=PINNED_HOST,
        nbytes=(16, 16), **ok,
    )  # fmt: skip
    _record(
        explanation, 4, action=actions[4], source=PAGEABLE_HOST, destination=CUDA1,
        nbytes=(12, 12), **ok,
    )  # fmt: skip
    _record(
        explanation, 5, action=actions[5], source=PAGEABLE_HOST, destination=CUDA1,
        nbytes=(8, 8), **ok,
    )  # fmt: skip
    record = explanation.actions[6]
    assert (record.executable, record.no_op, record.destination) == (False, False, CUDA0)
    assert record.source == PINNED_HOST  # the explicit source, settled before the failure
    assert record.reason == "explicit source pinned-host is not resident"


def test_an_infeasible_move_names_its_explicit_source(sim: Any) -> None:
    # A source-backed value resident nowhere, moved from an explicit location: the
    # explanation names that location, though the move cannot run.
    manager = ResidencyManager()
    spec = ResidencyValueSpec(
        ResidentTensor, 16, 16, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
    )

    class Loader:
        def load(self) -> ResidentTensor:
            return ResidentTensor(torch.zeros(4))

    handle = manager.register_source(spec, Loader())
    plan = ResidencyPlan("p", enter=[MoveResident(handle, PAGEABLE_HOST, PINNED_HOST)])
    (record,) = manager.explain(plan).actions
    assert (record.executable, record.source, record.destination) == (
        False,
        PINNED_HOST,
        PAGEABLE_HOST,
    )
    assert record.reason == "explicit source pinned-host is not resident"
    # An explicit source that is not even usable is named too.
    (unusable,) = _explain(manager, MoveResident(handle, PAGEABLE_HOST, CUDA_MISSING)).actions
    assert (unusable.executable, unusable.source) == (False, CUDA_MISSING)
    assert "not usable" in (unusable.reason or "")


def test_move_with_protected_source_in_both_cases(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    manager.ensure(a, CUDA0)
    hold = manager.hold([a], at=PAGEABLE_HOST)
    # Case B (destination not resident) and case A (destination resident).
    for to in (PINNED_HOST, CUDA0):
        explanation = _explain(manager, MoveResident(a, to))
        assert explanation.feasible is False
        assert explanation.reason == "source pageable-host is protected"
        record = explanation.actions[0]
        assert (record.executable, record.no_op) == (False, False)
        assert record.source == PAGEABLE_HOST
        assert record.destination == to
    # Moving from the unprotected replica is fine.
    assert _explain(manager, MoveResident(a, PINNED_HOST, from_location=CUDA0)).feasible
    hold.release()


def test_drop_records(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)  # MUST_PRESERVE
    manager.ensure(a, CUDA0)
    r = manager.register_source(spec(3), ControlledSource())
    manager.ensure(r, PINNED_HOST)
    actions = [
        DropResident(a, PINNED_HOST),  # no-op
        DropResident(a, CUDA0),
        DropResident(r, PINNED_HOST),  # a reconstructible value may lose its last copy
        DropResident(r, PINNED_HOST),  # no-op again
        DropResident(a, PAGEABLE_HOST),  # final MUST_PRESERVE copy
    ]
    explanation = _explain(manager, *actions)
    assert explanation.feasible is False
    assert explanation.reason == "cannot drop final MUST_PRESERVE materialization"
    _record(
        explanation, 0, action=actions[0], executable=True, no_op=True, source=PINNED_HOST,
        destination=None, nbytes=(16, 16), reason=DROP_NOOP,
    )  # fmt: skip
    _record(
        explanation, 1, action=actions[1], executable=True, no_op=False, source=CUDA0,
        destination=None, nbytes=(16, 16), reason=None,
    )  # fmt: skip
    _record(
        explanation, 2, action=actions[2], executable=True, no_op=False, source=PINNED_HOST,
        destination=None, nbytes=(12, 12), reason=None,
    )  # fmt: skip
    _record(
        explanation, 3, action=actions[3], executable=True, no_op=True, source=PINNED_HOST,
        destination=None, nbytes=(12, 12), reason=DROP_NOOP,
    )  # fmt: skip
    _record(
        explanation, 4, action=actions[4], executable=False, no_op=False, source=PAGEABLE_HOST,
        destination=None, nbytes=(16, 16), reason="cannot drop final MUST_PRESERVE materialization",
    )  # fmt: skip


def test_protection_is_checked_before_the_last_copy_rule(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value())
    hold = manager.hold([a], at=PAGEABLE_HOST)
    explanation = _explain(manager, DropResident(a, PAGEABLE_HOST))
    assert explanation.reason == "materialization at pageable-host is protected"
    hold.release()


def test_discard_records(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    manager.ensure(a, CUDA0)
    manager.ensure(a, PINNED_HOST)
    r = manager.register_source(spec(3), ControlledSource())
    actions = [DiscardValue(r), DiscardValue(a)]
    explanation = _explain(manager, *actions)
    assert explanation.feasible is True
    _record(
        explanation, 0, action=actions[0], executable=True, no_op=False, source=None,
        destination=None, nbytes=(12, 12), reason=None,
    )  # fmt: skip
    _record(
        explanation, 1, action=actions[1], executable=True, no_op=False, source=None,
        destination=None, nbytes=(16, 16), reason=None,
    )  # fmt: skip
    holds = [manager.hold([a], at=CUDA0), manager.hold([a], at=PINNED_HOST)]
    explanation = _explain(manager, DiscardValue(a))
    assert explanation.feasible is False
    reason = explanation.reason
    assert reason is not None
    assert reason.startswith("discarded value has protected locations ")
    assert "cuda:0" in reason
    assert "pinned-host" in reason
    assert "pageable-host" not in reason
    assert explanation.actions[0].executable is False
    for hold in holds:
        hold.release()


def test_handle_lookup_failures(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    gone = manager.adopt(tensor_value(2), replica_mode=REPLICABLE)
    manager.discard(gone)
    unknown = ResidencyHandle(manager.manager_id, str(uuid.uuid4()), ResidentTensor)
    foreign = foreign_handle()
    retyped = ResidencyHandle(a.manager_id, a.handle_id, Other)  # same ids, other value type
    cases = [
        (EnsureResident(retyped, CUDA0), lambda: manager.ensure(retyped, CUDA0)),
        (EnsureResident(foreign, CUDA0), lambda: manager.ensure(foreign, CUDA0)),
        (DropResident(unknown, CUDA0), lambda: manager.drop(unknown, CUDA0)),
        (MoveResident(gone, CUDA0), lambda: manager.move(gone, CUDA0)),
        (DiscardValue(gone), lambda: manager.discard(gone)),
    ]
    for action, direct in cases:
        first = EnsureResident(a, CUDA1)
        explanation = _explain(manager, first, action, DropResident(a, CUDA1))
        reason = str(capture(direct))
        assert explanation.feasible is False
        assert explanation.reason == reason
        assert len(explanation.actions) == 2
        _record(
            explanation, 1, action=action, executable=False, no_op=False, source=None,
            destination=None, nbytes=(0, 0), reason=reason,
        )  # fmt: skip


def test_handle_discarded_earlier_in_the_plan(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    actions = [DiscardValue(a), EnsureResident(a, CUDA0)]
    explanation = manager.explain(ResidencyPlan("p", reclaim=actions[:1], exit=actions[1:]))
    reason = f"Value {a.handle_id!r} is discarded"
    assert explanation.feasible is False
    assert explanation.reason == reason
    _record(
        explanation, 1, action=actions[1], executable=False, no_op=False, source=None,
        destination=None, nbytes=(0, 0), reason=reason,
    )  # fmt: skip
    # A second discard in the same plan fails the same way.
    again = _explain(manager, DiscardValue(a), DiscardValue(a))
    assert again.reason == reason


def test_invalid_location_becomes_the_reason(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    bad = cuda_location("cuda:2")  # the simulation has two devices
    direct = str(capture(lambda: manager.ensure(a, bad)))
    for action in (
        EnsureResident(a, bad),
        MoveResident(a, bad),
        MoveResident(a, PINNED_HOST, from_location=bad),
        DropResident(a, bad),
    ):
        explanation = _explain(manager, action)
        assert explanation.feasible is False
        assert explanation.reason == direct, action
        assert explanation.actions[0].executable is False
        assert explanation.actions[0].no_op is False


def test_cuda_locations_without_cuda_are_infeasible_not_errors() -> None:
    """On the real runtime without CUDA the ValueError text becomes the reason
    (docs/concepts/locations-and-budgets.md#location-validation)."""
    if torch.cuda.is_available():
        pytest.skip("needs a CUDA-less process")
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    direct = str(capture(lambda: manager.ensure(a, CUDA0)))
    explanation = _explain(manager, EnsureResident(a, CUDA0))
    assert explanation.feasible is False
    assert explanation.reason == direct
    reservation = manager.explain(
        ResidencyPlan("r", reservations=[MemoryReservation(CUDA0, 1, "gpu")])
    )
    assert reservation.feasible is False
    assert reservation.reason == str(capture(lambda: manager.reserve(CUDA0, 1, label="gpu")))


def test_simulation_stops_at_the_first_failure(sim: Any) -> None:
    manager = ResidencyManager({CUDA0: 16})
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    b = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    plan = ResidencyPlan(
        "p",
        reclaim=[EnsureResident(a, PINNED_HOST)],
        enter=[EnsureResident(a, CUDA0), EnsureResident(b, CUDA0), EnsureResident(b, CUDA1)],
        exit=[DropResident(a, CUDA0)],
    )
    explanation = manager.explain(plan)
    assert explanation.feasible is False
    assert explanation.reason == "Transition exceeds budget at cuda:0"
    assert [r.action for r in explanation.actions] == [*plan.reclaim, *plan.enter[:2]]
    assert explanation.actions[-1].reason == "Transition exceeds budget at cuda:0"
    assert explanation.actions[-1].executable is False
    # The over-budget total is in the peak (plans.md#simulation-results).
    assert dict(explanation.predicted_peak_bytes)[CUDA0] == 32


def test_actions_are_simulated_in_reclaim_enter_exit_order(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    reclaim = [EnsureResident(a, PINNED_HOST)]
    enter = [MoveResident(a, CUDA0, from_location=PINNED_HOST)]
    exit_ = [DropResident(a, CUDA0), DropResident(a, PINNED_HOST)]
    plan = ResidencyPlan("order", enter=enter, exit=exit_, reclaim=reclaim)
    explanation = manager.explain(plan)
    assert explanation.plan_name == "order"
    assert explanation.feasible is True
    assert explanation.reason is None
    assert [r.action for r in explanation.actions] == [*reclaim, *enter, *exit_]
    # The exit drop of pinned is a no-op because the enter move removed it.
    assert [r.no_op for r in explanation.actions] == [False, False, False, True]


def test_in_plan_materialisations_are_never_protected(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    hold = manager.hold([a], at=PAGEABLE_HOST)
    plan = ResidencyPlan(
        "p", enter=[EnsureResident(a, CUDA0), DropResident(a, CUDA0), EnsureResident(a, CUDA1)]
    )
    assert manager.explain(plan).feasible is True
    # Protection never blocks adding replicas, only removal of the held one.
    assert manager.explain(ResidencyPlan("q", enter=[DiscardValue(a)])).feasible is False
    hold.release()


# --------------------------------------------------------------------------------------------
# Reservations (plans.md#reservations-in-simulation)
# --------------------------------------------------------------------------------------------


def test_reservations_are_admitted_after_reclaim(sim: Any) -> None:
    manager = ResidencyManager({CUDA0: 32})
    a = manager.adopt(on(sim, CUDA0, tensor_value()), replica_mode=REPLICABLE)  # 16 B on cuda:0
    ws = MemoryReservation(CUDA0, 24, "ws")
    freeing = ResidencyPlan("free", reclaim=[MoveResident(a, PAGEABLE_HOST)], reservations=[ws])
    explanation = manager.explain(freeing)
    assert explanation.feasible is True
    assert explanation.reservations == (ws,)
    # reclaim peak: cuda:0 16 (current), then the reservation: 0 + 24.
    assert dict(explanation.predicted_peak_bytes)[CUDA0] == 24
    # The same reservation is over budget when nothing is reclaimed first.
    blocked = ResidencyPlan("blocked", enter=[MoveResident(a, PAGEABLE_HOST)], reservations=[ws])
    explanation = manager.explain(blocked)
    assert explanation.feasible is False
    assert explanation.reason == "Reservation 'ws' exceeds budget at cuda:0"
    # A reservation failure stops before any later action.
    assert explanation.actions == ()
    assert dict(explanation.predicted_peak_bytes)[CUDA0] == 40


def test_reservation_failure_keeps_all_reservations_and_reclaim_records(sim: Any) -> None:
    manager = ResidencyManager({CUDA1: 10})
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    first = MemoryReservation(CUDA1, 6, "first")
    second = MemoryReservation(CUDA1, 6, "second")
    third = MemoryReservation(PINNED_HOST, 100, "third")
    reclaim = [EnsureResident(a, PINNED_HOST)]
    plan = ResidencyPlan(
        "p", reclaim=reclaim, reservations=[first, second, third], enter=[DropResident(a, CUDA1)]
    )
    explanation = manager.explain(plan)
    assert explanation.feasible is False
    assert explanation.reason == "Reservation 'second' exceeds budget at cuda:1"
    assert explanation.reservations == (first, second, third)
    assert [r.action for r in explanation.actions] == reclaim
    assert dict(explanation.predicted_peak_bytes)[CUDA1] == 12


def test_reservations_reduce_headroom_for_later_actions(sim: Any) -> None:
    manager = ResidencyManager({CUDA0: 20})
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)  # 16 B
    fits = ResidencyPlan("fits", reservations=[MemoryReservation(CUDA0, 4, "w")])
    assert manager.explain(fits).feasible is True
    plan = ResidencyPlan(
        "p", reservations=[MemoryReservation(CUDA0, 5, "w")], enter=[EnsureResident(a, CUDA0)]
    )
    explanation = manager.explain(plan)
    assert explanation.reason == "Transition exceeds budget at cuda:0"
    assert dict(explanation.predicted_peak_bytes)[CUDA0] == 21
    # Live reservations count too.
    live = manager.reserve(CUDA0, 5, label="live")
    explanation = _explain(manager, EnsureResident(a, CUDA0))
    assert explanation.reason == "Transition exceeds budget at cuda:0"
    live.release()
    assert _explain(manager, EnsureResident(a, CUDA0)).feasible is True


def test_invalid_reservation_location_becomes_the_reason(sim: Any) -> None:
    manager = ResidencyManager()
    bad = cuda_location("cuda:3")
    plan = ResidencyPlan("p", reservations=[MemoryReservation(bad, 1, "x")])
    explanation = manager.explain(plan)
    assert explanation.feasible is False
    assert explanation.reason == str(capture(lambda: manager.reserve(bad, 1, label="x")))


# --------------------------------------------------------------------------------------------
# predicted_peak_bytes (plans.md#simulation-results)
# --------------------------------------------------------------------------------------------


def test_peaks_start_from_the_current_charge_not_the_historical_peak(sim: Any) -> None:
    manager = ResidencyManager({PINNED_HOST: 100})
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    b = manager.adopt(tensor_value(2), replica_mode=REPLICABLE)
    manager.discard(b)  # pageable: used 16, historical peak 24
    reservation = manager.reserve(PAGEABLE_HOST, 3, label="held")
    explanation = manager.explain(ResidencyPlan("empty"))
    assert explanation.feasible is True
    assert explanation.actions == ()
    assert explanation.reservations == ()
    assert explanation.predicted_peak_bytes == ((PINNED_HOST, 0), (PAGEABLE_HOST, 19))
    reservation.release()
    assert manager.explain(ResidencyPlan("x", enter=[DropResident(a, CUDA1)])).feasible


def test_peak_order_registered_first_then_first_prepared(sim: Any) -> None:
    manager = ResidencyManager({CUDA1: 64})  # registered: cuda:1 (budget), then pageable
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)  # 16 B
    r = manager.register_source(spec(3), ControlledSource())  # 12 B, source at pageable
    plan = ResidencyPlan(
        "p",
        reclaim=[EnsureResident(a, CUDA0)],  # prepares cuda:0
        reservations=[MemoryReservation(PINNED_HOST, 5, "pin")],  # prepares pinned
        enter=[EnsureResident(r, CUDA1)],  # temporary at pageable, then cuda:1
        exit=[MoveResident(a, CUDA1, from_location=CUDA0), DropResident(r, CUDA1)],
    )
    explanation = manager.explain(plan)
    assert explanation.feasible is True
    assert explanation.predicted_peak_bytes == (
        (CUDA1, 28),  # r 12, then a 16 arrives before cuda:0 is released elsewhere
        (PAGEABLE_HOST, 16 + 12),  # a, plus r's temporary reconstruction charge
        (CUDA0, 16),
        (PINNED_HOST, 5),
    )
    assert isinstance(explanation.predicted_peak_bytes, tuple)


def test_destination_is_prepared_before_the_source(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    one = _explain(manager, MoveResident(a, CUDA0, from_location=CUDA1))
    assert one.reason == "explicit source cuda:1 is not resident"
    assert one.predicted_peak_bytes == ((PAGEABLE_HOST, 16), (CUDA0, 0), (CUDA1, 0))
    other = _explain(manager, MoveResident(a, CUDA1, from_location=CUDA0))
    assert other.predicted_peak_bytes == ((PAGEABLE_HOST, 16), (CUDA1, 0), (CUDA0, 0))


def test_temporary_and_transfer_overlap_peaks(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)  # 16 B pageable
    r = manager.register_source(spec(3), ControlledSource(), source_location=PINNED_HOST)
    plan = ResidencyPlan(
        "p",
        enter=[
            MoveResident(a, PINNED_HOST),  # pinned 16, pageable released afterwards
            EnsureResident(r, CUDA0),  # temporary 12 at pinned on top of a's 16
            MoveResident(a, PAGEABLE_HOST),  # back: pageable 16 again
            DropResident(r, CUDA0),
            MoveResident(r, PINNED_HOST),  # reconstruction in place: 12 (temp and install)
        ],
    )
    explanation = manager.explain(plan)
    assert explanation.feasible is True
    assert explanation.predicted_peak_bytes == (
        (PAGEABLE_HOST, 16),
        (PINNED_HOST, 28),
        (CUDA0, 12),
    )
    assert [r.source for r in explanation.actions] == [
        PAGEABLE_HOST,
        PINNED_HOST,
        PINNED_HOST,
        CUDA0,
        PINNED_HOST,
    ]


def test_budgets_are_compared_to_the_total_including_the_temporary_charge(sim: Any) -> None:
    manager = ResidencyManager({PAGEABLE_HOST: 20})
    manager.adopt(tensor_value(2), replica_mode=REPLICABLE)  # pageable 8 of 20
    r = manager.register_source(spec(3), ControlledSource())  # 12 B at pageable
    fits = _explain(manager, EnsureResident(r, CUDA0))
    assert fits.feasible is True
    assert dict(fits.predicted_peak_bytes)[PAGEABLE_HOST] == 20
    big = manager.register_source(spec(4), ControlledSource())  # 16 B
    explanation = _explain(manager, EnsureResident(big, CUDA0))
    assert explanation.feasible is False
    assert explanation.reason == "Transition exceeds budget at pageable-host"
    assert explanation.actions[0].source == PAGEABLE_HOST
    assert explanation.actions[0].destination == CUDA0
    assert dict(explanation.predicted_peak_bytes)[PAGEABLE_HOST] == 24


def test_explanation_is_a_frozen_record(sim: Any) -> None:
    """Section 0: equality, hash, repr, pickling and immutability of the returned record."""
    import dataclasses
    import pickle

    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    plan = ResidencyPlan(
        "rec", reservations=[MemoryReservation(CUDA1, 2, "w")], enter=[EnsureResident(a, CUDA0)]
    )
    explanation = manager.explain(plan)
    assert isinstance(explanation, ResidencyPlanExplanation)
    plain = ResidencyPlanExplanation(
        explanation.plan_name,
        explanation.actions,
        explanation.reservations,
        explanation.predicted_peak_bytes,
        explanation.feasible,
        explanation.reason,
    )
    assert explanation == plain
    assert plain == explanation
    assert hash(explanation) == hash(plain)
    assert repr(explanation) == repr(plain)
    assert repr(explanation).startswith("ResidencyPlanExplanation(plan_name='rec', actions=(")
    assert pickle.loads(pickle.dumps(explanation)) == plain
    assert explanation == manager.explain(plan)
    assert explanation != ResidencyPlanExplanation("other", (), (), (), True, None)
    assert explanation != tuple(dataclasses.astuple(plain))
    for name in ("plan_name", "actions", "feasible", "reason", "predicted_peak_bytes"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(explanation, name, None)
    assert isinstance(explanation.actions, tuple)
    assert isinstance(explanation.actions[0], ResidencyActionExplanation)
