"""Schedule-aware eviction through the controller
(docs/concepts/controller.md#schedule-aware-eviction): for equal-size values it misses
exactly as often as the fewest misses any choice of victims allows, computed here by
exhaustive search, independently of the farthest-next-use rule; LRU misses every
request of a cyclic schedule that outgrows the budget."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fhelium.residency import (
    PAGEABLE_HOST,
    PINNED_HOST,
    DeterministicTieredLRU,
    EnsureResident,
    Recoverability,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyPolicy,
    ResidencyRequest,
    ResidencyRequirement,
    ResidencyValueSpec,
)
from fhelium.residency._runtime import SimulatedRuntime, use_runtime
from fhelium.residency.policy import ResidencyEvictionCandidate, ResidencyPolicyMetadata
from fhelium.residency.schedule import ScheduleAwarePolicy
from fhelium.values import ResidentTensor
from helpers.controller import fewest_misses

CHARGE = 32
SPEC = ResidencyValueSpec(
    ResidentTensor, CHARGE, CHARGE, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
)


class _Source:
    def load(self) -> ResidentTensor:
        return ResidentTensor(torch.zeros(CHARGE // 4))


def _misses(requests: tuple[int, ...], capacity: int, policy_of: Any) -> int:
    """Runs `requests` (one value each, at the pinned host under a budget of
    `capacity` values) through a controller; counts the loads into the pinned host."""
    with use_runtime(SimulatedRuntime(0)):
        manager = ResidencyManager({PINNED_HOST: capacity * CHARGE})
    values = 1 + max(requests, default=0)
    handles = [manager.register_source(SPEC, _Source()) for _ in range(values)]
    schedule = [
        ResidencyRequest(f"step-{step}", [ResidencyRequirement(handles[value], PINNED_HOST)])
        for step, value in enumerate(requests)
    ]
    controller = ResidencyController(manager, policy=policy_of(schedule))
    for request in schedule:
        with controller.use(request):
            pass
    trace = manager.trace()
    misses = sum(
        1
        for report in trace
        if isinstance(report.action, EnsureResident)
        and report.action.location == PINNED_HOST
        and not report.no_op
    )
    manager.close()
    _LAST_ACTIONS[:] = [
        (type(report.action).__name__, handles.index(report.action.handle)) for report in trace
    ]
    return misses


# The actions of the last `_misses` run, as (class name, value number): what two runs
# with the same decisions share.
_LAST_ACTIONS: list[tuple[str, int]] = []


class _ConsultedFromPython(ScheduleAwarePolicy):
    """A subclass: the controller consults it through `order_candidates`, not the
    core's native implementation of the same order."""

    __slots__ = ()


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(st.integers(0, 5), max_size=18).map(tuple),
    capacity=st.integers(1, 4),
)
def test_misses_are_the_fewest_possible_on_random_schedules(
    requests: tuple[int, ...], capacity: int
) -> None:
    misses = _misses(requests, capacity, ScheduleAwarePolicy)
    assert misses == fewest_misses(requests, capacity)


@settings(max_examples=20, deadline=None)
@given(cycle=st.integers(2, 6), passes=st.integers(1, 4), capacity=st.integers(1, 5))
def test_a_cyclic_schedule_misses_the_minimum_and_lru_misses_every_request(
    cycle: int, passes: int, capacity: int
) -> None:
    requests = tuple(value for _ in range(passes) for value in range(cycle))
    misses = _misses(requests, capacity, ScheduleAwarePolicy)
    assert misses == fewest_misses(requests, capacity)
    if cycle > capacity:
        assert _misses(requests, capacity, lambda _: DeterministicTieredLRU()) == len(requests)
        if passes > 1 and capacity > 1:
            assert misses < len(requests)


def _handles(count: int) -> list[Any]:
    manager = ResidencyManager()
    return [manager.register_source(SPEC, _Source()) for _ in range(count)]


def _candidate(handle: Any, index: int, priority: int = 0) -> ResidencyEvictionCandidate:
    return ResidencyEvictionCandidate(
        handle, PAGEABLE_HOST, CHARGE, index, None, ResidencyPolicyMetadata(priority=priority)
    )


def test_order_priority_then_never_used_then_farthest_then_the_tiered_lru() -> None:
    a, b, c, d = _handles(4)
    policy = ScheduleAwarePolicy([[a], [b], [c, a]])
    assert isinstance(policy, ResidencyPolicy)
    candidates = [_candidate(h, i) for i, h in enumerate((a, b, c, d))]
    assert [x.handle for x in policy.order_candidates(candidates)] == [d, c, b, a]
    assert policy.observe([a])  # step 0 used: a's next use is step 2, as c's
    assert policy.position == 1
    assert [x.handle for x in policy.order_candidates(candidates)] == [d, a, c, b]
    assert not policy.observe([c])  # not the step at the position: no move
    low = [_candidate(b, 1, priority=-1), *[_candidate(h, i) for i, h in ((0, a), (3, d))]]
    assert next(x.handle for x in policy.order_candidates(low)) == b
    policy.seek(0)
    assert policy.next_use(a) == 0
    assert policy.advance(10) == 3
    assert policy.next_use(a) is None


def test_arguments_and_identity() -> None:
    a, b = _handles(2)
    with pytest.raises(TypeError):
        ScheduleAwarePolicy(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ScheduleAwarePolicy([a])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        ScheduleAwarePolicy([["not a handle"]])  # type: ignore[list-item]
    policy = ScheduleAwarePolicy([[a], [b]])
    with pytest.raises(ValueError, match="position"):
        policy.seek(3)
    with pytest.raises(ValueError, match="steps"):
        policy.advance(-1)
    assert policy.name == "schedule-aware"
    same = ScheduleAwarePolicy([[a], [b]])
    same.advance()
    assert same.config_identity == policy.config_identity  # the position is not config
    assert ScheduleAwarePolicy([[b], [a]]).config_identity != policy.config_identity


@settings(max_examples=30, deadline=None)
@given(
    requests=st.lists(st.integers(0, 6), max_size=20).map(tuple),
    capacity=st.integers(1, 4),
)
def test_the_native_order_decides_as_the_policy_object_does(
    requests: tuple[int, ...], capacity: int
) -> None:
    native = _misses(requests, capacity, ScheduleAwarePolicy)
    native_actions = list(_LAST_ACTIONS)
    consulted = _misses(requests, capacity, _ConsultedFromPython)
    assert (native, native_actions) == (consulted, _LAST_ACTIONS)


@pytest.mark.parametrize("policy_class", [ScheduleAwarePolicy, _ConsultedFromPython])
def test_decisions_follow_the_schedule_across_a_discard(policy_class: Any) -> None:
    # The native path resolves the schedule's handles once; a discard makes it resolve
    # them again, and the discarded value drops out of the schedule.
    with use_runtime(SimulatedRuntime(0)):
        manager = ResidencyManager({PINNED_HOST: 2 * CHARGE})
    a, b, c, gone = (manager.register_source(SPEC, _Source()) for _ in range(4))

    def request(handle: Any) -> ResidencyRequest:
        return ResidencyRequest("step", [ResidencyRequirement(handle, PINNED_HOST)])

    policy = policy_class([[a], [b], [c], [a], [gone], [b]])
    controller = ResidencyController(manager, policy=policy)
    for handle in (a, b):
        with controller.use(request(handle)):
            pass
    assert policy.position == 2
    first = controller.decide(request(c))
    # a is next needed at step 3, b at step 5: b goes.
    assert [e.action.handle for e in first.evictions] == [b]
    manager.discard(gone)
    again = controller.decide(request(c))
    assert [e.action.handle for e in again.evictions] == [b]
    policy.seek(5)  # only b is needed again: a goes
    assert [e.action.handle for e in controller.decide(request(c)).evictions] == [a]
    manager.close()
