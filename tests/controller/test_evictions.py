"""Eviction semantics of the controller search on small, hand-computed scenarios
(docs/concepts/controller.md#search).

Each scenario states the expected reclaim and enter actions, the evictions (action, rank,
released location, bytes, reason) and the number of explored states, worked out by hand from
the documented search. Each is also checked against the transcription in
`controller_reference.py`, and most are executed through `controller.scope` to show the plan
really satisfies the request.

All values are 16 bytes (four float32s) unless stated otherwise.
"""

from __future__ import annotations

from typing import Any

import pytest

from fhelium.errors import ResidencyPlanError
from fhelium.residency.controller import ResidencyController, ResidencyDecision
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.model import ReplicaMode
from fhelium.residency.plan import DropResident, EnsureResident, MemoryReservation, MoveResident
from fhelium.residency.policy import DeterministicTieredLRU, ResidencyPolicyMetadata
from helpers.controller import (
    RecordingPolicy,
    adopt_at,
    check_against_reference,
    cuda_stream,
    eviction_tuples,
    replicated_at,
    request,
    sourced,
)
from helpers.controller_reference import (
    DROP_REPLICATED,
    DROP_SOURCE,
    move_reason,
    planning_input,
    reference_decide,
)
from helpers.manager import (
    CUDA0,
    CUDA1,
    EXCLUSIVE,
    mat_locs,
    sim_fixture,  # noqa: F401
)


def execute(controller: ResidencyController, decision: ResidencyDecision) -> None:
    """Run the decision's plan and check every requirement holds inside the scope."""
    manager = controller.manager
    with controller.scope(decision) as scope:
        snap = manager.snapshot()
        for requirement in decision.request.requirements:
            assert requirement.location in mat_locs(snap, requirement.handle), requirement
        held = {(r.location, r.nbytes, r.label) for r in snap.reservations}
        for reservation in decision.request.reservations:
            assert (reservation.location, reservation.nbytes, reservation.label) in held
    assert scope.report is not None
    assert [t.action for t in scope.report.transitions] == [
        *decision.plan.reclaim,
        *decision.plan.enter,
    ]
    assert manager.snapshot().reservations == ()


def make(budgets: dict[Any, int], policy: Any = None, **kwargs: Any) -> Any:
    manager = ResidencyManager(budgets)
    if policy is not None:
        kwargs["policy"] = policy
    return manager, ResidencyController(manager, **kwargs)


# --------------------------------------------------------------------------------------------
# Drop options
# --------------------------------------------------------------------------------------------


def test_drop_of_a_replicated_copy(sim: Any) -> None:
    manager, controller = make({CUDA0: 16})
    with manager:
        a = replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
        b = replicated_at(manager, sim, PAGEABLE_HOST)
        decision = controller.decide(request("b", (b, CUDA0)))
        drop = DropResident(a, CUDA0)
        assert decision.plan.reclaim == (drop,)
        assert decision.plan.enter == (EnsureResident(b, CUDA0),)
        assert eviction_tuples(decision) == ((drop, 0, CUDA0, 16, DROP_REPLICATED),)
        assert decision.explored_states == 2
        check_against_reference(controller, decision)
        execute(controller, decision)
        assert mat_locs(manager.snapshot(), a) == (PAGEABLE_HOST,)


def test_drop_of_a_reconstructible_sole_copy(sim: Any) -> None:
    manager, controller = make({CUDA0: 16})
    with manager:
        s, source = sourced(manager, sim, CUDA0)
        assert mat_locs(manager.snapshot(), s) == (CUDA0,)
        b = replicated_at(manager, sim, PAGEABLE_HOST)
        calls = source.calls
        decision = controller.decide(request("b", (b, CUDA0)))
        drop = DropResident(s, CUDA0)
        assert decision.plan.reclaim == (drop,)
        assert eviction_tuples(decision) == ((drop, 0, CUDA0, 16, DROP_SOURCE),)
        assert decision.explored_states == 2
        assert source.calls == calls
        check_against_reference(controller, decision)
        execute(controller, decision)
        assert mat_locs(manager.snapshot(), s) == ()


def test_released_bytes_are_the_charge(sim: Any) -> None:
    manager, controller = make({CUDA0: 40})
    with manager:
        # logical 16 bytes, charged 40 (the spec's storage bytes)
        s, _ = sourced(manager, sim, CUDA0, storage=40)
        b = replicated_at(manager, sim, PAGEABLE_HOST)
        decision = controller.decide(request("b", (b, CUDA0)))
        assert eviction_tuples(decision) == ((DropResident(s, CUDA0), 0, CUDA0, 40, DROP_SOURCE),)


# --------------------------------------------------------------------------------------------
# MUST_PRESERVE sole copies: fallback tiers and cascading offload
# --------------------------------------------------------------------------------------------


def test_sole_copy_without_tiers_is_never_spilled(sim: Any) -> None:
    manager, controller = make({CUDA0: 16})
    with manager:
        adopt_at(manager, sim, CUDA0)
        b = replicated_at(manager, sim, PAGEABLE_HOST)
        with pytest.raises(ResidencyPlanError):  # pinned and pageable are free but not tiers
            controller.decide(request("b", (b, CUDA0)))


@pytest.mark.parametrize("replica", ["REPLICABLE", "EXCLUSIVE"])
def test_sole_copy_offloaded_to_a_fallback_tier(sim: Any, replica: str) -> None:
    policy = DeterministicTieredLRU({CUDA0: [PINNED_HOST]})
    manager, controller = make({CUDA0: 16}, policy)
    with manager:
        a = adopt_at(manager, sim, CUDA0, replica=ReplicaMode(replica.lower()))
        b = replicated_at(manager, sim, PAGEABLE_HOST)
        decision = controller.decide(request("b", (b, CUDA0)))
        move = MoveResident(a, PINNED_HOST, from_location=CUDA0)
        assert decision.plan.reclaim == (move,)
        assert decision.plan.enter == (EnsureResident(b, CUDA0),)
        assert eviction_tuples(decision) == ((move, 0, CUDA0, 16, move_reason(PINNED_HOST)),)
        assert "pinned-host" in decision.evictions[0].reason
        assert decision.explored_states == 2
        check_against_reference(controller, decision)
        execute(controller, decision)
        assert mat_locs(manager.snapshot(), a) == (PINNED_HOST,)


def test_cascading_offload(sim: Any) -> None:
    policy = DeterministicTieredLRU({CUDA0: [PINNED_HOST], PINNED_HOST: [PAGEABLE_HOST]})
    manager, controller = make({CUDA0: 16, PINNED_HOST: 16}, policy)
    with manager:
        a = adopt_at(manager, sim, CUDA0)
        p = adopt_at(manager, sim, PINNED_HOST)
        b = adopt_at(manager, sim, PAGEABLE_HOST)
        decision = controller.decide(request("b", (b, CUDA0)))
        first = MoveResident(p, PAGEABLE_HOST, from_location=PINNED_HOST)
        second = MoveResident(a, PINNED_HOST, from_location=CUDA0)
        assert decision.plan.reclaim == (first, second)
        assert decision.plan.enter == (EnsureResident(b, CUDA0),)
        assert eviction_tuples(decision) == (
            (first, 0, PINNED_HOST, 16, move_reason(PAGEABLE_HOST)),
            (second, 0, CUDA0, 16, move_reason(PINNED_HOST)),
        )
        assert decision.explored_states == 3
        check_against_reference(controller, decision)
        execute(controller, decision)
        snap = manager.snapshot()
        assert mat_locs(snap, p) == (PAGEABLE_HOST,)
        assert mat_locs(snap, a) == (PINNED_HOST,)


def test_full_tier_falls_through_to_the_next_tier(sim: Any) -> None:
    policy = DeterministicTieredLRU({CUDA0: [PINNED_HOST, PAGEABLE_HOST]})
    manager, controller = make({CUDA0: 16, PINNED_HOST: 16}, policy)
    with manager:
        a = adopt_at(manager, sim, CUDA0)
        adopt_at(manager, sim, PINNED_HOST)  # pinned is full and has no tier of its own
        b = adopt_at(manager, sim, PAGEABLE_HOST)
        decision = controller.decide(request("b", (b, CUDA0)))
        move = MoveResident(a, PAGEABLE_HOST, from_location=CUDA0)
        assert eviction_tuples(decision) == ((move, 0, CUDA0, 16, move_reason(PAGEABLE_HOST)),)
        # root, the failed capacity search at pinned, the successful trial
        assert decision.explored_states == 3
        check_against_reference(controller, decision)
        execute(controller, decision)


def test_cascade_prefers_a_replicated_victim_at_the_tier(sim: Any) -> None:
    policy = DeterministicTieredLRU({CUDA0: [PINNED_HOST]})
    manager, controller = make({CUDA0: 16, PINNED_HOST: 32}, policy)
    with manager:
        a = adopt_at(manager, sim, CUDA0)
        adopt_at(manager, sim, PINNED_HOST)  # sole copy at pinned: no option
        r = replicated_at(manager, sim, PAGEABLE_HOST, PINNED_HOST)
        b = adopt_at(manager, sim, PAGEABLE_HOST)
        decision = controller.decide(request("b", (b, CUDA0)))
        drop = DropResident(r, PINNED_HOST)
        move = MoveResident(a, PINNED_HOST, from_location=CUDA0)
        # at pinned the sole copy is ordered first (registered earlier) and yields nothing,
        # so the replicated copy is the victim, with rank 1
        assert eviction_tuples(decision) == (
            (drop, 1, PINNED_HOST, 16, DROP_REPLICATED),
            (move, 0, CUDA0, 16, move_reason(PINNED_HOST)),
        )
        check_against_reference(controller, decision)
        execute(controller, decision)


# --------------------------------------------------------------------------------------------
# Endpoint restoration and sourced sole copies
# --------------------------------------------------------------------------------------------


def test_endpoint_restoration_of_an_exclusive_value(sim: Any) -> None:
    manager, controller = make({CUDA0: 16})
    with manager:
        x = adopt_at(manager, sim, CUDA0, replica=EXCLUSIVE)
        b = replicated_at(manager, sim, PAGEABLE_HOST)
        decision = controller.decide(request("r", (b, CUDA0), (x, CUDA1)))
        move = MoveResident(x, CUDA1, from_location=CUDA0)
        assert decision.plan.reclaim == (move,)
        assert decision.plan.enter == (EnsureResident(b, CUDA0),)
        assert eviction_tuples(decision) == ((move, 0, CUDA0, 16, move_reason(CUDA1)),)
        assert decision.explored_states == 2
        check_against_reference(controller, decision)
        execute(controller, decision)


def test_endpoints_come_before_fallback_tiers(sim: Any) -> None:
    policy = DeterministicTieredLRU({CUDA0: [PINNED_HOST]})
    manager, controller = make({CUDA0: 16}, policy)
    with manager:
        a = adopt_at(manager, sim, CUDA0)
        b = replicated_at(manager, sim, PAGEABLE_HOST)
        decision = controller.decide(request("r", (b, CUDA0), (a, CUDA1)))
        move = MoveResident(a, CUDA1, from_location=CUDA0)
        assert eviction_tuples(decision) == ((move, 0, CUDA0, 16, move_reason(CUDA1)),)
        # a REPLICABLE value already at CUDA1 needs no enter action for that requirement
        assert decision.plan.enter == (EnsureResident(b, CUDA0),)
        check_against_reference(controller, decision)


def test_sourced_sole_copy_tries_moves_after_the_drop(sim: Any) -> None:
    # dropping `s` first looks fine, but `s` is also required at cuda:1 and reconstructing it
    # needs 16 bytes at its full pinned source location; the move option restores it instead
    manager, controller = make({CUDA0: 16, PINNED_HOST: 16})
    with manager:
        s, source = sourced(manager, sim, CUDA0, source_location=PINNED_HOST)
        adopt_at(manager, sim, PINNED_HOST)
        b = replicated_at(manager, sim, PAGEABLE_HOST)
        calls = source.calls
        decision = controller.decide(request("r", (b, CUDA0), (s, CUDA1)))
        move = MoveResident(s, CUDA1, from_location=CUDA0)
        assert decision.plan.reclaim == (move,)
        assert decision.plan.enter == (EnsureResident(b, CUDA0),)
        assert eviction_tuples(decision) == ((move, 0, CUDA0, 16, move_reason(CUDA1)),)
        # root, the failed drop trial, the successful move trial
        assert decision.explored_states == 3
        assert source.calls == calls
        check_against_reference(controller, decision)
        execute(controller, decision)
        assert source.calls == calls


def test_temporary_reconstruction_charge_reclaims_at_the_source_location(sim: Any) -> None:
    manager, controller = make({PINNED_HOST: 24})
    with manager:
        r = replicated_at(manager, sim, PAGEABLE_HOST, PINNED_HOST)
        s, source = sourced(manager, sim, source_location=PINNED_HOST)
        decision = controller.decide(request("s", (s, CUDA1)))
        drop = DropResident(r, PINNED_HOST)
        assert decision.plan.reclaim == (drop,)
        assert decision.plan.enter == (EnsureResident(s, CUDA1),)
        assert eviction_tuples(decision) == ((drop, 0, PINNED_HOST, 16, DROP_REPLICATED),)
        assert decision.explored_states == 2
        check_against_reference(controller, decision)
        execute(controller, decision)
        assert source.calls == 1
        assert mat_locs(manager.snapshot(), s) == (CUDA1,)


def test_reconstruction_at_its_own_source_location_is_charged_once(sim: Any) -> None:
    manager, controller = make({PINNED_HOST: 16})
    with manager:
        s, _ = sourced(manager, sim, source_location=PINNED_HOST, replica=EXCLUSIVE)
        decision = controller.decide(request("s", (s, PINNED_HOST)))
        assert decision.plan.reclaim == ()
        assert decision.plan.enter == (MoveResident(s, PINNED_HOST, from_location=None),)
        assert decision.explored_states == 1
        execute(controller, decision)


# --------------------------------------------------------------------------------------------
# Who may be a victim, and in which order
# --------------------------------------------------------------------------------------------


def test_protected_materialisations_are_never_victims(sim: Any) -> None:
    manager, controller = make({CUDA0: 48})
    with manager:
        held = replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
        leased = replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
        free = replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
        c = replicated_at(manager, sim, PAGEABLE_HOST)
        with manager.acquire([leased], at=CUDA0, consumer_stream=cuda_stream(sim)):
            pass  # released with wait=False: still protected by a pending event
        with manager.hold([held], at=CUDA0):
            policy = RecordingPolicy()
            controller = ResidencyController(manager, policy=policy)
            decision = controller.decide(request("c", (c, CUDA0)))
            assert decision.plan.reclaim == (DropResident(free, CUDA0),)
            assert {cand.handle for cand in policy.seen()} == {free}
            check_against_reference(controller, decision)
            # nothing unprotected left: infeasible rather than waiting
            with manager.hold([free], at=CUDA0), pytest.raises(ResidencyPlanError):
                controller.decide(request("c", (c, CUDA0)))
        sim.complete_events()


def test_required_endpoints_are_considered_last(sim: Any) -> None:
    policy = RecordingPolicy()
    manager, controller = make({CUDA0: 48}, policy)
    with manager:
        a = replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
        b = replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
        d = replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
        c = replicated_at(manager, sim, PAGEABLE_HOST)
        # a and d are required where they are: b is the only ordinary candidate
        decision = controller.decide(request("r", (a, CUDA0), (c, CUDA0), (d, CUDA0)))
        assert decision.plan.reclaim == (DropResident(b, CUDA0),)
        assert decision.evictions[0].rank == 0
        first_two = [tuple(cand.handle for cand in call) for call in policy.calls[:2]]
        assert first_two == [(b,), (a, d)]
        check_against_reference(controller, decision)


def test_required_endpoints_are_still_candidates(sim: Any) -> None:
    policy = RecordingPolicy()
    manager, controller = make({CUDA0: 32}, policy)
    with manager:
        a = replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
        m = adopt_at(manager, sim, CUDA0)  # an unmovable sole copy
        c = replicated_at(manager, sim, PAGEABLE_HOST)
        controller.set_policy_metadata(m, priority=-5)
        req = request("r", (a, CUDA0), (c, CUDA0))
        # 16 (m) + 16 (a) + 16 (c) never fit in 32: m yields nothing, dropping the required
        # endpoint a (the last resort) only makes the re-simulation restore it
        with pytest.raises(ResidencyPlanError):
            controller.decide(req)
        first_two = [tuple(cand.handle for cand in call) for call in policy.calls[:2]]
        assert first_two == [(m,), (a,)]
        planning = planning_input(
            manager, req, policy=policy, metadata={m: ResidencyPolicyMetadata(priority=-5)}
        )
        assert reference_decide(planning).kind == "infeasible"


def test_rank_is_the_position_in_the_ordered_list(sim: Any) -> None:
    manager, controller = make({CUDA0: 32})
    with manager:
        m = adopt_at(manager, sim, CUDA0)  # sole copy, no tiers: yields nothing
        r = replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
        c = replicated_at(manager, sim, PAGEABLE_HOST)
        controller.set_policy_metadata(r, priority=3)  # m is ordered first anyway
        decision = controller.decide(request("c", (c, CUDA0)))
        drop = DropResident(r, CUDA0)
        assert eviction_tuples(decision) == ((drop, 1, CUDA0, 16, DROP_REPLICATED),)
        assert decision.explored_states == 2
        check_against_reference(
            controller, decision, metadata={r: ResidencyPolicyMetadata(priority=3)}
        )
        assert m is not None


def test_policy_order_decides_every_drop(sim: Any) -> None:
    manager, controller = make({CUDA0: 48})
    with manager:
        x = replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
        y = replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
        z = replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
        w = replicated_at(manager, sim, PAGEABLE_HOST)
        metadata = {
            x: ResidencyPolicyMetadata(priority=2),
            y: ResidencyPolicyMetadata(stable_key="k"),
        }
        for handle, meta in metadata.items():
            controller.set_policy_metadata(
                handle, priority=meta.priority, stable_key=meta.stable_key
            )
        with controller.use(request("touch-z", (z, PAGEABLE_HOST))):
            pass
        # the whole of cuda:0 is needed: y (keyed), then z (accessed, unkeyed), then x (high
        # priority); each drop is the first candidate of a fresh ordering, so every rank is 0
        req = request("all", (w, PAGEABLE_HOST), reservations=[MemoryReservation(CUDA0, 48, "x")])
        decision = controller.decide(req)
        assert decision.plan.reclaim == (
            DropResident(y, CUDA0),
            DropResident(z, CUDA0),
            DropResident(x, CUDA0),
        )
        assert [e.rank for e in decision.evictions] == [0, 0, 0]
        assert decision.explored_states == 4
        check_against_reference(controller, decision, metadata=metadata, epochs={z: 1})
        execute(controller, decision)


def test_exclusive_requirement_with_a_full_destination(sim: Any) -> None:
    manager, controller = make({CUDA0: 16})
    with manager:
        r = replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
        x = adopt_at(manager, sim, PINNED_HOST, replica=EXCLUSIVE)
        decision = controller.decide(request("x", (x, CUDA0)))
        assert decision.plan.reclaim == (DropResident(r, CUDA0),)
        assert decision.plan.enter == (MoveResident(x, CUDA0, from_location=PINNED_HOST),)
        check_against_reference(controller, decision)
        execute(controller, decision)
        assert mat_locs(manager.snapshot(), x) == (CUDA0,)


def test_existing_reservations_count_against_the_budget(sim: Any) -> None:
    manager, controller = make({CUDA0: 48})
    with manager:
        a = replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
        replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
        c = replicated_at(manager, sim, PAGEABLE_HOST)
        with manager.reserve(CUDA0, 16, label="outside"):
            decision = controller.decide(request("c", (c, CUDA0)))
            assert decision.plan.reclaim == (DropResident(a, CUDA0),)
            check_against_reference(controller, decision)
        decision = controller.decide(request("c", (c, CUDA0)))
        assert decision.plan.reclaim == ()
