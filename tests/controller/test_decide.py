"""`ResidencyController.decide` (docs/concepts/controller.md#decide, #search).

Request validation and its order, the empty plan of a satisfied request, the plan's
reservations, the attached feasible explanation, the absence of any side effect, the two
failure outcomes (exhausted search and state limit), a policy that breaks the ordering rule,
and determinism.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import pytest

from fhelium.errors import (
    ResidencyClosedError,
    ResidencyError,
    ResidencyHandleError,
    ResidencyOwnershipError,
    ResidencyPlanError,
    ResidencyReentrancyError,
    ResidencySearchLimitError,
    ResidencyStaleStateError,
)
from fhelium.residency.controller import ResidencyController, ResidencyDecision
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, cuda_location
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.model import ResidencyHandle
from fhelium.residency.plan import (
    DropResident,
    EnsureResident,
    MemoryReservation,
    MoveResident,
    ResidencyPlan,
)
from fhelium.residency.policy import DeterministicTieredLRU
from fhelium.residency.request import ResidencyRequest, ResidencyRequirement
from fhelium.residency.snapshot import ResidencyPlanExplanation
from helpers.controller import (
    DECISION_FIELDS,
    RecordingPolicy,
    adopt_at,
    check_against_reference,
    cuda_stream,
    replicated_at,
    request,
    sourced,
)
from helpers.controller_reference import planning_input, reference_decide
from helpers.lifetimes import assert_not_reaped, assert_reaped
from helpers.limits import capped
from helpers.manager import (
    CUDA0,
    CUDA1,
    EXCLUSIVE,
    Source,
    foreign_handle,
    sim_fixture,  # noqa: F401
    spec,
    state_key,
    tensor_value,
)
from helpers.records import check_frozen_record


def not_chained(error: BaseException) -> None:
    """Raised `from None` (or outside any handler): no cause and no visible context."""
    assert error.__cause__ is None
    assert error.__suppress_context__ or error.__context__ is None


class Basic:
    """cuda:0 budget 32 holding replicated `a` and `b`; `c` and sourced `s` off cuda:0."""

    def __init__(self, sim: Any, *, policy: Any = None, limit: int = 100_000) -> None:
        self.manager = ResidencyManager({CUDA0: 32})
        kwargs: dict[str, Any] = {"search_state_limit": limit}
        if policy is not None:
            kwargs["policy"] = policy
        self.controller = ResidencyController(self.manager, **kwargs)
        self.a = replicated_at(self.manager, sim, PAGEABLE_HOST, CUDA0)
        self.b = replicated_at(self.manager, sim, PAGEABLE_HOST, CUDA0)
        self.c = replicated_at(self.manager, sim, PAGEABLE_HOST)
        self.s, self.source = sourced(self.manager, sim, source_location=PINNED_HOST)


@pytest.fixture
def basic(sim: Any) -> Any:
    setup = Basic(sim)
    yield setup
    setup.manager.close()


# --------------------------------------------------------------------------------------------
# Argument and request validation (controller.md#decide, steps 1-3)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [None, "request", ResidencyPlan("p"), [ResidencyRequirement(foreign_handle(), PAGEABLE_HOST)]],
    ids=["None", "str", "plan", "list"],
)
def test_non_request(basic: Basic, bad: Any) -> None:
    with pytest.raises(TypeError):
        basic.controller.decide(bad)


def test_closed_manager(basic: Basic) -> None:
    req = request("r", (basic.a, PAGEABLE_HOST))
    basic.manager.close()
    with pytest.raises(ResidencyClosedError):
        basic.controller.decide(req)
    with pytest.raises(TypeError):  # the type check comes first
        basic.controller.decide(None)  # type: ignore[arg-type]


def test_during_a_source_callback(basic: Basic) -> None:
    outcome: dict[str, Any] = {}

    def hook() -> None:
        try:
            basic.controller.decide(request("r", (basic.a, PAGEABLE_HOST)))
        except BaseException as exc:
            outcome["error"] = exc

    handle = basic.manager.register_source(spec(), Source(tensor_value, before_load=hook))
    basic.manager.ensure(handle, PAGEABLE_HOST)
    assert isinstance(outcome.get("error"), ResidencyReentrancyError)


def test_foreign_handle(basic: Basic) -> None:
    with pytest.raises(ResidencyHandleError):
        basic.controller.decide(request("r", (basic.a, PAGEABLE_HOST), (foreign_handle(), CUDA0)))
    with ResidencyManager() as other:
        elsewhere = other.adopt(tensor_value())
        with pytest.raises(ResidencyHandleError):
            basic.controller.decide(request("r", (elsewhere, PAGEABLE_HOST)))
        other.discard(elsewhere)


def test_unknown_handle(basic: Basic) -> None:
    unknown = ResidencyHandle(basic.manager.manager_id, "no-such-handle", type(tensor_value()))
    with pytest.raises(ResidencyHandleError):
        basic.controller.decide(request("r", (unknown, PAGEABLE_HOST)))


def test_discarded_handle(basic: Basic) -> None:
    basic.manager.discard(basic.c)
    with pytest.raises(ResidencyHandleError):
        basic.controller.decide(request("r", (basic.a, PAGEABLE_HOST), (basic.c, PAGEABLE_HOST)))


def test_a_request_decided_again_after_a_discard_is_refused(basic: Basic) -> None:
    # The same request object, decided once while its values were live: the controller
    # keeps it lowered for the core, and a discard since must still refuse it.
    req = request("r", (basic.a, PAGEABLE_HOST), (basic.c, PAGEABLE_HOST))
    basic.controller.decide(req)
    basic.controller.decide(req)
    basic.manager.discard(basic.c)
    with pytest.raises(ResidencyHandleError, match="discarded"):
        basic.controller.decide(req)
    # Another request still decides, and the first stays refused.
    basic.controller.decide(request("r", (basic.a, PAGEABLE_HOST)))
    with pytest.raises(ResidencyHandleError, match="discarded"):
        basic.controller.decide(req)


def test_exclusive_at_two_locations(basic: Basic, sim: Any) -> None:
    x = adopt_at(basic.manager, sim, PAGEABLE_HOST, replica=EXCLUSIVE)
    version = basic.manager.state_version
    with pytest.raises(ResidencyOwnershipError):
        basic.controller.decide(request("r", (x, PAGEABLE_HOST), (x, PINNED_HOST)))
    assert basic.manager.state_version == version
    # the same for a sourced EXCLUSIVE value that is not resident anywhere
    y, source = sourced(basic.manager, sim, replica=EXCLUSIVE)
    with pytest.raises(ResidencyOwnershipError):
        basic.controller.decide(request("r", (y, CUDA1), (y, CUDA0)))
    assert source.calls == 0
    # REPLICABLE values may be required at several locations
    decision = basic.controller.decide(request("r", (basic.c, PINNED_HOST), (basic.c, CUDA1)))
    assert decision.plan.enter == (
        EnsureResident(basic.c, PINNED_HOST),
        EnsureResident(basic.c, CUDA1),
    )


def test_handle_checks_before_ownership_check(basic: Basic, sim: Any) -> None:
    x = adopt_at(basic.manager, sim, PAGEABLE_HOST, replica=EXCLUSIVE)
    unknown = ResidencyHandle(basic.manager.manager_id, "no-such-handle", type(tensor_value()))
    with pytest.raises(ResidencyHandleError):
        basic.controller.decide(
            request("r", (x, PAGEABLE_HOST), (x, PINNED_HOST), (unknown, PAGEABLE_HOST))
        )


def test_invalid_cuda_location_surfaces_through_explain(basic: Basic) -> None:
    with pytest.raises(ResidencyPlanError) as info:
        basic.controller.decide(request("far", (basic.c, cuda_location("cuda:5"))))
    assert type(info.value) is ResidencyPlanError
    far = MemoryReservation(cuda_location("cuda:7"), 4, "far")
    with pytest.raises(ResidencyPlanError) as info:
        basic.controller.decide(request("far", (basic.c, PAGEABLE_HOST), reservations=[far]))
    assert type(info.value) is ResidencyPlanError


def test_cuda_location_without_cuda() -> None:
    # no simulated runtime: the process has no CUDA, and the location is not validated
    # before the search; the explanation reports it as infeasible instead
    with ResidencyManager() as manager:
        handle = manager.adopt(tensor_value())
        controller = ResidencyController(manager)
        with pytest.raises(ResidencyPlanError) as info:
            controller.decide(request("gpu", (handle, cuda_location("cuda:0"))))
        assert type(info.value) is ResidencyPlanError


# --------------------------------------------------------------------------------------------
# Successful decisions (controller.md#decide, steps 4-8)
# --------------------------------------------------------------------------------------------


def check_decision(controller: ResidencyController, decision: ResidencyDecision, req: Any) -> None:
    manager = controller.manager
    assert isinstance(decision, ResidencyDecision)
    assert decision.manager_id == manager.manager_id
    assert decision.expected_state_version == manager.state_version
    assert decision.request == req
    assert decision.plan.name == req.name
    assert decision.plan.exit == ()
    assert decision.plan.reservations == req.reservations
    assert decision.policy_name == controller.policy.name
    assert decision.policy_config == tuple(controller.policy.config_identity)
    assert len(decision.evictions) == len(decision.plan.reclaim)
    for eviction, action in zip(decision.evictions, decision.plan.reclaim, strict=True):
        assert eviction.action == action
    assert decision.explored_states >= 1
    explanation = decision.explanation
    assert isinstance(explanation, ResidencyPlanExplanation)
    assert explanation.feasible is True
    assert explanation.plan_name == req.name
    assert explanation.reservations == req.reservations
    assert explanation == manager.explain(
        decision.plan, expected_state_version=decision.expected_state_version
    )


def test_satisfied_request_gives_an_empty_plan(basic: Basic) -> None:
    req = request("ready", (basic.a, CUDA0), (basic.b, PAGEABLE_HOST), (basic.a, PAGEABLE_HOST))
    decision = basic.controller.decide(req)
    check_decision(basic.controller, decision, req)
    check_frozen_record(decision, DECISION_FIELDS)
    assert decision.plan == ResidencyPlan("ready")
    assert decision.evictions == ()
    assert decision.explored_states == 1
    assert decision.explanation.actions == ()


def test_satisfied_request_with_reservation(basic: Basic) -> None:
    reservations = [MemoryReservation(PINNED_HOST, 100, "ws"), MemoryReservation(CUDA1, 0, "z")]
    req = request("ready", (basic.a, CUDA0), reservations=reservations)
    decision = basic.controller.decide(req)
    check_decision(basic.controller, decision, req)
    assert decision.plan.reservations == tuple(reservations)
    assert decision.plan.reclaim == decision.plan.enter == ()
    assert decision.explored_states == 1


def test_plain_enter_actions(basic: Basic, sim: Any) -> None:
    x = adopt_at(basic.manager, sim, PINNED_HOST, replica=EXCLUSIVE)
    req = request("enter", (basic.c, CUDA1), (x, CUDA1), (basic.s, CUDA1))
    decision = basic.controller.decide(req)
    check_decision(basic.controller, decision, req)
    assert decision.plan.reclaim == ()
    assert decision.plan.enter == (
        EnsureResident(basic.c, CUDA1),
        MoveResident(x, CUDA1, from_location=PINNED_HOST),
        EnsureResident(basic.s, CUDA1),
    )
    assert decision.explored_states == 1
    check_against_reference(basic.controller, decision)


def test_exclusive_reconstruction_moves_from_none(basic: Basic, sim: Any) -> None:
    y, source = sourced(basic.manager, sim, replica=EXCLUSIVE, source_location=PINNED_HOST)
    decision = basic.controller.decide(request("y", (y, CUDA1)))
    assert decision.plan.enter == (MoveResident(y, CUDA1, from_location=None),)
    assert source.calls == 0


def test_eviction_decision_fields(basic: Basic) -> None:
    req = request("need-c", (basic.c, CUDA0), reservations=[MemoryReservation(CUDA1, 8, "ws")])
    decision = basic.controller.decide(req)
    check_decision(basic.controller, decision, req)
    assert decision.plan.reclaim == (DropResident(basic.a, CUDA0),)
    assert decision.plan.enter == (EnsureResident(basic.c, CUDA0),)
    (eviction,) = decision.evictions
    assert eviction.rank == 0
    assert eviction.released_location == CUDA0
    assert eviction.released_nbytes == 16
    assert eviction.reason == "another materialization preserves the logical value"
    assert decision.explored_states == 2
    check_against_reference(basic.controller, decision)


def test_reservation_triggers_reclaim(basic: Basic) -> None:
    # a 20-byte reservation at cuda:0 needs both replicated copies gone
    req = request(
        "ws", (basic.c, PAGEABLE_HOST), reservations=[MemoryReservation(CUDA0, 20, "scratch")]
    )
    decision = basic.controller.decide(req)
    check_decision(basic.controller, decision, req)
    assert decision.plan.reclaim == (DropResident(basic.a, CUDA0), DropResident(basic.b, CUDA0))
    assert decision.plan.enter == ()
    assert [e.rank for e in decision.evictions] == [0, 0]
    assert decision.explored_states == 3
    check_against_reference(basic.controller, decision)


def test_decide_reaps_through_its_snapshot(basic: Basic, sim: Any) -> None:
    with basic.manager.acquire([basic.a], at=CUDA0, consumer_stream=cuda_stream(sim)):
        pass
    assert_not_reaped(basic.manager, sim)
    sim.complete_events()
    basic.controller.decide(request("r", (basic.c, PAGEABLE_HOST)))
    assert_reaped(basic.manager, sim)


def test_decide_changes_nothing(basic: Basic) -> None:
    basic.manager.drop(basic.b, CUDA0)
    req = request(
        "mixed",
        (basic.c, CUDA0),
        (basic.s, CUDA0),
        reservations=[MemoryReservation(PINNED_HOST, 8, "ws")],
    )
    before = state_key(basic.manager.snapshot())
    trace = basic.manager.trace()
    decision = basic.controller.decide(req)
    assert decision.plan.reclaim == (DropResident(basic.a, CUDA0),)
    assert decision.plan.enter == (EnsureResident(basic.c, CUDA0), EnsureResident(basic.s, CUDA0))
    assert state_key(basic.manager.snapshot()) == before  # same version, books and no lease
    assert basic.manager.trace() == trace
    assert basic.source.calls == 0
    assert basic.manager.snapshot().reservations == ()


def test_infeasible_request(sim: Any) -> None:
    with ResidencyManager({CUDA0: 16}) as manager:
        controller = ResidencyController(manager, search_state_limit=1)
        sole = adopt_at(manager, sim, CUDA0)  # MUST_PRESERVE, no tiers configured
        other = adopt_at(manager, sim, PAGEABLE_HOST)
        before = state_key(manager.snapshot())
        with pytest.raises(ResidencyPlanError) as info:
            controller.decide(request("blocked-request", (other, CUDA0)))
        error = info.value
        # exhausted after a single state: not a limit error even with limit 1
        assert type(error) is ResidencyPlanError
        assert repr("blocked-request") in str(error)
        not_chained(error)
        assert state_key(manager.snapshot()) == before
        assert sole is not None


def test_infeasible_request_too_big_for_budget(basic: Basic, sim: Any) -> None:
    big = replicated_at(basic.manager, sim, PAGEABLE_HOST, n=9)  # 36 > 32 bytes
    with pytest.raises(ResidencyPlanError) as info:
        basic.controller.decide(request("big", (big, CUDA0)))
    assert type(info.value) is ResidencyPlanError
    assert repr("big") in str(info.value)
    not_chained(info.value)


def test_protected_exclusive_source_is_rejected_by_explain(basic: Basic, sim: Any) -> None:
    x = adopt_at(basic.manager, sim, PINNED_HOST, replica=EXCLUSIVE)
    with basic.manager.hold([x], at=PINNED_HOST):
        with pytest.raises(ResidencyPlanError) as info:
            basic.controller.decide(request("x", (x, CUDA1)))
        assert type(info.value) is ResidencyPlanError
        assert "protected" in str(info.value)
    decision = basic.controller.decide(request("x", (x, CUDA1)))
    assert decision.plan.enter == (MoveResident(x, CUDA1, from_location=PINNED_HOST),)


# --------------------------------------------------------------------------------------------
# The search-state limit (controller.md#state-counter)
# --------------------------------------------------------------------------------------------


def cascade(sim: Any, limit: int) -> tuple[ResidencyManager, ResidencyController, ResidencyRequest]:
    """cuda:0 and pinned each hold one MUST_PRESERVE sole copy; tiers cuda:0 -> pinned ->
    pageable. Needing `b` at cuda:0 explores exactly three states (see the eviction tests)."""
    manager = ResidencyManager({CUDA0: 16, PINNED_HOST: 16})
    policy = DeterministicTieredLRU({CUDA0: [PINNED_HOST], PINNED_HOST: [PAGEABLE_HOST]})
    controller = ResidencyController(manager, policy=policy, search_state_limit=limit)
    adopt_at(manager, sim, CUDA0)
    adopt_at(manager, sim, PINNED_HOST)
    b = adopt_at(manager, sim, PAGEABLE_HOST)
    return manager, controller, request("cascade", (b, CUDA0))


def test_limit_equal_to_the_states_needed_succeeds(sim: Any) -> None:
    manager, controller, req = cascade(sim, 3)
    with manager:
        decision = controller.decide(req)
        assert decision.explored_states == 3
        assert len(decision.plan.reclaim) == 2


@pytest.mark.parametrize("limit", [1, 2])
def test_limit_reached(sim: Any, limit: int) -> None:
    manager, controller, req = cascade(sim, limit)
    with manager:
        before = state_key(manager.snapshot())
        with pytest.raises(ResidencySearchLimitError) as info:
            controller.decide(req)
        error = info.value
        assert error.request_name == "cascade"
        assert error.state_limit == limit
        assert error.explored_states == limit
        assert error.bound == "states"
        assert isinstance(error.detail, str)
        assert isinstance(error, ResidencyPlanError)
        assert repr("cascade") in str(error)
        assert f"state_limit={limit}" in str(error)
        assert f"explored_states={limit}" in str(error)
        not_chained(error)
        assert state_key(manager.snapshot()) == before


def test_limit_is_per_decide(sim: Any) -> None:
    manager, controller, req = cascade(sim, 3)
    with manager:
        first = controller.decide(req)
        second = controller.decide(req)  # a fresh memo and counter each time
        assert first == second
        assert second.explored_states == 3


# --------------------------------------------------------------------------------------------
# Policy ordering rule (controller.md#candidates)
# --------------------------------------------------------------------------------------------


class BrokenPolicy(RecordingPolicy):
    def __init__(self, mode: str) -> None:
        super().__init__(name="broken")
        self.mode = mode

    def order_candidates(self, candidates: Any) -> Any:
        listed = tuple(candidates)
        if not listed:
            return listed
        if self.mode == "drop":
            return listed[1:]
        if self.mode == "duplicate":
            return (*listed, listed[0])
        if self.mode == "swap-duplicate":
            return (listed[0], listed[0], *listed[2:])
        if self.mode == "reverse":
            return tuple(reversed(listed))
        raise AssertionError(self.mode)


@pytest.mark.parametrize("mode", ["drop", "duplicate", "swap-duplicate"])
def test_policy_breaking_the_ordering_rule(sim: Any, mode: str) -> None:
    setup = Basic(sim, policy=BrokenPolicy(mode))
    with setup.manager:
        before = state_key(setup.manager.snapshot())
        with pytest.raises(RuntimeError) as info:
            setup.controller.decide(request("need-c", (setup.c, CUDA0)))
        assert not isinstance(info.value, ResidencyError)
        assert state_key(setup.manager.snapshot()) == before


def test_policy_order_is_followed(sim: Any) -> None:
    setup = Basic(sim, policy=BrokenPolicy("reverse"))
    with setup.manager:
        decision = setup.controller.decide(request("need-c", (setup.c, CUDA0)))
        assert decision.plan.reclaim == (DropResident(setup.b, CUDA0),)
        assert decision.policy_name == "broken"
        check_against_reference(setup.controller, decision)


# --------------------------------------------------------------------------------------------
# Determinism and races (controller.md#decide)
# --------------------------------------------------------------------------------------------


def test_same_decision_twice_and_in_another_thread(basic: Basic) -> None:
    req = request(
        "need-c",
        (basic.c, CUDA0),
        (basic.s, CUDA1),
        reservations=[MemoryReservation(CUDA0, 4, "ws")],
    )
    first = basic.controller.decide(req)
    second = basic.controller.decide(req)
    assert first == second
    assert hash(first) == hash(second)
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(basic.controller.decide(req)))
    thread.start()
    thread.join(10)
    assert results == [first]
    other = ResidencyController(basic.manager)
    assert other.decide(req) == first


def test_reap_during_the_search(sim: Any) -> None:
    """An event completing mid-decide: either decide reports the stale state itself
    or its decision, bound to the state it planned on, is stale at scope entry
    (docs/concepts/controller.md#decide). It never plans on one version and reports another."""
    with ResidencyManager({CUDA0: 32}) as manager:
        a = replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
        replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
        c = replicated_at(manager, sim, PAGEABLE_HOST)
        with manager.acquire([a], at=CUDA0, consumer_stream=cuda_stream(sim)):
            pass
        version = manager.state_version  # a's lease is pending: its event has not completed

        class CompletingPolicy(RecordingPolicy):
            def order_candidates(self, candidates: Any) -> Any:
                sim.complete_events()
                return super().order_candidates(candidates)

        controller = ResidencyController(manager, policy=CompletingPolicy())
        try:
            decision = controller.decide(request("need-c", (c, CUDA0)))
        except ResidencyStaleStateError:
            return
        assert decision.expected_state_version == version
        assert manager.state_version > version
        with pytest.raises(ResidencyStaleStateError):
            controller.scope(decision).__enter__()


# --------------------------------------------------------------------------------------------
# A search that cycles (controller.md#search: the memo only holds exhausted states, so two
# tiers pointing at each other can move a sole copy back and forth until the limit)
# --------------------------------------------------------------------------------------------

CYCLE_SCRIPT = """
import sys, torch
from fhelium.errors import ResidencySearchLimitError
from fhelium.residency import (DeterministicTieredLRU, ResidencyController, ResidencyManager,
    ResidencyRequest, ResidencyRequirement, cuda_location)
from fhelium.residency._runtime import SimulatedRuntime, use_runtime
from fhelium.values import ResidentTensor
CUDA0, CUDA1 = cuda_location("cuda:0"), cuda_location("cuda:1")
runtime = SimulatedRuntime(device_count=2)
with use_runtime(runtime):
    manager = ResidencyManager({CUDA0: 16, CUDA1: 16})
    manager.adopt(runtime.to_device(ResidentTensor(torch.zeros(4)), "cuda:0"), at=CUDA0)
    y = manager.adopt(ResidentTensor(torch.zeros(4)))
    z = manager.adopt(ResidentTensor(torch.zeros(4)))
    controller = ResidencyController(
        manager, policy=DeterministicTieredLRU({CUDA0: [CUDA1], CUDA1: [CUDA0]}), **KWARGS
    )
    try:
        controller.decide(ResidencyRequest(
            "cycle", [ResidencyRequirement(y, CUDA0), ResidencyRequirement(z, CUDA1)]))
    except ResidencySearchLimitError as error:
        print("limit", error.state_limit, error.explored_states, error.bound)
"""


def cycle(sim: Any, limit: int) -> tuple[ResidencyManager, ResidencyController, ResidencyRequest]:
    """x fills cuda:0 (16 bytes), tiers cuda:0 <-> cuda:1; y is needed at cuda:0 and z at
    cuda:1. Moving x to cuda:1 frees cuda:0, the re-simulation then fails at cuda:1, where
    moving x back restores the first state, which is not exhausted yet: an endless cycle."""
    manager = ResidencyManager({CUDA0: 16, CUDA1: 16})
    policy = DeterministicTieredLRU({CUDA0: [CUDA1], CUDA1: [CUDA0]})
    controller = ResidencyController(manager, policy=policy, search_state_limit=limit)
    adopt_at(manager, sim, CUDA0)
    y = adopt_at(manager, sim, PAGEABLE_HOST)
    z = adopt_at(manager, sim, PAGEABLE_HOST)
    return manager, controller, request("cycle", (y, CUDA0), (z, CUDA1))


@pytest.mark.parametrize("limit", [7, 300, 1000])
def test_cycling_search_ends_at_the_limit(sim: Any, limit: int) -> None:
    manager, controller, req = cycle(sim, limit)
    with manager:
        with pytest.raises(ResidencySearchLimitError) as info:
            controller.decide(req)
        assert info.value.explored_states == limit
        if limit <= 300:
            planning = planning_input(
                manager, req, policy=controller.policy, search_state_limit=limit
            )
            outcome = reference_decide(planning)
            assert (outcome.kind, outcome.explored_states) == ("limit", limit)


def test_cycling_search_with_the_default_limit_does_not_crash() -> None:
    """The cycling search goes one level deeper per state; under the default limit (100_000,
    below the depth bound of 131072 open states, controller.md#search-bounds) it must end with
    `ResidencySearchLimitError` at exactly that limit, as the contract says, without
    overflowing a stack or running out of memory. Run in a subprocess (its address space
    capped) so that a crash fails this test instead of killing the test session."""
    script = CYCLE_SCRIPT.replace("**KWARGS", "")
    result = subprocess.run(
        capped([sys.executable, "-c", script]),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, (
        f"decide crashed: returncode={result.returncode}, stderr={result.stderr[-2000:]!r}"
    )
    assert result.stdout.split() == ["limit", "100000", "100000", "states"]


# --------------------------------------------------------------------------------------------
# The decided plan stays in the core's IR (controller.md#decide): nothing is lowered again
# --------------------------------------------------------------------------------------------


def test_decision_is_built_lazily_and_equals_the_plain_record(basic: Basic) -> None:
    import copy
    import pickle

    from fhelium.residency import _lowering

    req = request("need-c", (basic.c, CUDA0), reservations=[MemoryReservation(CUDA1, 8, "ws")])
    lazy = basic.controller.decide(req)
    other = basic.controller.decide(req)
    # Read in different orders: evictions first here, explanation first there.
    assert other.explanation.actions
    assert lazy.evictions[0].action is lazy.plan.reclaim[0]
    plain = ResidencyDecision(
        lazy.manager_id,
        lazy.expected_state_version,
        lazy.explored_states,
        lazy.request,
        ResidencyPlan(req.name, lazy.plan.enter, (), req.reservations, lazy.plan.reclaim),
        lazy.policy_name,
        lazy.policy_config,
        lazy.evictions,
        basic.manager.explain(lazy.plan, expected_state_version=lazy.expected_state_version),
    )
    assert lazy == plain
    assert plain == lazy
    assert lazy == other
    assert hash(lazy) == hash(plain) == hash(other)
    assert repr(lazy) == repr(plain)
    assert type(lazy).__name__ == type(lazy).__qualname__ == "ResidencyDecision"
    for restored in (pickle.loads(pickle.dumps(lazy)), copy.copy(lazy), copy.deepcopy(lazy)):
        assert restored == lazy
        assert hash(restored) == hash(lazy)
    # The plan carries the IR the core decided: its own lowering would give the same
    # handle table, and it is never asked for.
    lowered = lazy.plan._lowered()
    assert lowered.handles == _lowering.lower_plan(lazy.plan).handles


def test_decide_and_scope_never_lower_the_plan_again(
    basic: Basic, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fhelium.residency import _lowering

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a decided plan was lowered again")

    monkeypatch.setattr(_lowering, "lower_plan", refuse)
    monkeypatch.setattr(_lowering, "_lower", refuse)
    req = request("need-c", (basic.c, CUDA0))
    decision = basic.controller.decide(req)
    assert decision.explanation.feasible
    with basic.controller.scope(decision) as scope:
        pass
    assert scope.report is not None
    assert [t.action for t in scope.report.transitions] == [
        DropResident(basic.a, CUDA0),
        EnsureResident(basic.c, CUDA0),
    ]
