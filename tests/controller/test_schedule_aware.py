"""Schedule-aware eviction through the controller
(docs/concepts/controller.md#schedule-aware-eviction): for equal-size values it misses
exactly as often as the fewest misses any choice of victims allows, computed here by
exhaustive search, independently of the farthest-next-use rule; LRU misses every
request of a cyclic schedule that outgrows the budget. A cyclic policy given one pass
loads, in each of several passes, what Belady's rule over the passes written out loads
(simulated here); a one-pass policy that runs out says so, once, and counts the steps
that followed as misses."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fhelium.errors import ResidencyScheduleExhaustedWarning
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


# --- cyclic schedules and exhaustion ------------------------------------------------------------


def _passes(
    one_pass: tuple[tuple[int, ...], ...],
    capacity: int,
    policy: Any,
    *,
    executed: tuple[tuple[int, ...], ...] | None = None,
    prefetch: int | None = None,
) -> tuple[list[int], list[tuple[str, int]]]:
    """Serves ``executed`` (default: ``one_pass``), one value set per step, at the pinned
    host under a budget of ``capacity`` values, with ``policy(one_pass requests)``; with
    ``prefetch``, as one pipeline. Returns the loads of each ``len(one_pass)`` steps and
    the actions, as ``_misses`` names them."""
    executed = one_pass if executed is None else executed
    with use_runtime(SimulatedRuntime(0)):
        manager = ResidencyManager({PINNED_HOST: capacity * CHARGE})
    values = 1 + max((value for step in (*one_pass, *executed) for value in step), default=0)
    handles = [manager.register_source(SPEC, _Source()) for _ in range(values)]

    def request(step: tuple[int, ...]) -> ResidencyRequest:
        return ResidencyRequest(
            "step", [ResidencyRequirement(handles[value], PINNED_HOST) for value in step]
        )

    controller = ResidencyController(manager, policy=policy([request(s) for s in one_pass]))
    loads: list[int] = []

    def count_loads() -> None:
        loads.append(
            sum(
                1
                for report in manager.trace()
                if isinstance(report.action, EnsureResident)
                and report.action.location == PINNED_HOST
                and not report.no_op
            )
            - sum(loads)
        )

    requests = [request(step) for step in executed]
    if prefetch is None:
        for number, each in enumerate(requests, 1):
            with controller.use(each):
                pass
            if number % len(one_pass) == 0:
                count_loads()
    else:
        with controller.run(requests, prefetch=prefetch) as steps:
            for _ in steps:
                pass
        count_loads()
    actions = [
        (type(report.action).__name__, handles.index(report.action.handle))
        for report in manager.trace()
    ]
    manager.close()
    return loads, actions


def _belady_loads(requests: tuple[int, ...], capacity: int, period: int) -> list[int]:
    """Loads of each ``period`` requests of a cache of ``capacity`` equal values that
    evicts the value whose next request in ``requests`` is farthest ahead (never
    requested again first): Belady's MIN, written out here over the whole sequence."""
    cached: set[int] = set()
    loads = [0] * math.ceil(len(requests) / period)
    for step, value in enumerate(requests):
        if value in cached:
            continue
        loads[step // period] += 1
        if len(cached) == capacity:

            def ahead(kept: int, after: int = step) -> float:
                return next(
                    (at for at in range(after + 1, len(requests)) if requests[at] == kept),
                    math.inf,
                )

            cached.remove(max(sorted(cached), key=ahead))
        cached.add(value)
    return loads


def _cyclic(schedule: Any) -> ScheduleAwarePolicy:
    return ScheduleAwarePolicy(schedule, cyclic=True)


def _cyclic_python(schedule: Any) -> ScheduleAwarePolicy:
    return _ConsultedFromPython(schedule, cyclic=True)


def test_a_cyclic_position_wraps_and_next_uses_count_across_the_wrap() -> None:
    handles = _handles(4)
    once, used, repeated, absent = handles
    # Eight steps: `once` only at step 2, `repeated` at 0 and 6, `used` elsewhere.
    steps = [[repeated], [used], [once], [used], [used], [used], [repeated], [used]]
    policy = ScheduleAwarePolicy(steps, cyclic=True)
    single = ScheduleAwarePolicy(steps)
    assert (policy.cyclic, single.cyclic) == (True, False)
    assert policy.config_identity != single.config_identity
    assert ("cyclic", True) in policy.config_identity
    policy.seek(5)
    single.seek(5)
    # Standing at 5 of 8: `once` is next used at step 2 of the next pass, 10, five
    # steps ahead; the one-pass schedule has no use of it left.
    assert (policy.next_use(once), single.next_use(once)) == (10, None)
    assert (policy.next_use(repeated), single.next_use(repeated)) == (6, 6)
    assert policy.next_use(absent) is None  # no step requests it: never
    candidates = [_candidate(h, i) for i, h in enumerate(handles)]
    # Never first, then the farthest across the wrap: once (10), repeated (6), used (5).
    order = [c.handle for c in policy.order_candidates(candidates)]
    assert order == [absent, once, repeated, used]
    assert policy.advance(2) == 7
    assert policy.next_use(repeated) == 8  # step 0 of the next pass
    assert policy.observe([used])
    assert policy.position == 0  # the last step wraps
    assert policy.advance(19) == 3  # modulo the length
    policy.seek(8)
    assert policy.position == 0  # len(schedule) is the next pass's first step
    assert not policy.exhausted
    assert "cyclic=True" in repr(policy)
    assert single.advance(10) == 8
    assert single.exhausted
    with pytest.raises(TypeError, match="cyclic"):
        ScheduleAwarePolicy(steps, cyclic=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="position"):
        policy.seek(9)
    empty = ScheduleAwarePolicy([], cyclic=True)
    assert (empty.advance(3), empty.exhausted, empty.next_use(once)) == (0, False, None)


@settings(max_examples=25, deadline=None)
@given(one_pass=st.lists(st.integers(0, 7), min_size=2, max_size=8).map(tuple))
def test_passes_of_a_cyclic_schedule_load_exactly_beladys_count_per_pass(
    one_pass: tuple[int, ...],
) -> None:
    # A budget for half the values the schedule requests.
    capacity = max(1, len(set(one_pass)) // 2)
    passes = 3
    requests = one_pass * passes
    expected = _belady_loads(requests, capacity, len(one_pass))
    # The simulation above is the optimum: no choice of victims loads less.
    assert sum(expected) == fewest_misses(requests, capacity)
    steps = tuple((value,) for value in one_pass)
    for policy in (_cyclic, _cyclic_python):
        loads, _ = _passes(steps, capacity, policy, executed=steps * passes)
        assert loads == expected


def test_a_cyclic_layer_stream_beats_a_one_pass_schedule_run_out() -> None:
    # Six layers, room for three, three passes: the LRU fallback of an exhausted
    # schedule loads every layer of the later passes.
    steps = tuple((value,) for value in range(6))
    expected = _belady_loads(tuple(range(6)) * 3, 3, 6)
    assert expected == [6, 3, 3]
    loads, _ = _passes(steps, 3, _cyclic, executed=steps * 3)
    assert loads == expected
    with pytest.warns(ResidencyScheduleExhaustedWarning) as record:
        one_pass, _ = _passes(steps, 3, ScheduleAwarePolicy, executed=steps * 3)
    assert len(record) == 1
    assert one_pass[0] == loads[0]
    assert one_pass[1:] == [6, 6]


@settings(max_examples=30, deadline=None)
@given(
    one_pass=st.lists(
        st.lists(st.integers(0, 5), min_size=1, max_size=2, unique=True).map(tuple),
        min_size=1,
        max_size=6,
    ).map(tuple),
    detours=st.lists(
        st.tuples(
            st.integers(0, 17),
            st.lists(st.integers(0, 6), min_size=1, max_size=2, unique=True).map(tuple),
        ),
        max_size=3,
    ),
    capacity=st.integers(2, 4),
    prefetch=st.sampled_from([None, None, 0, 1, 2]),
)
def test_the_native_cyclic_order_decides_as_the_policy_object_does(
    one_pass: tuple[tuple[int, ...], ...],
    detours: list[tuple[int, tuple[int, ...]]],
    capacity: int,
    prefetch: int | None,
) -> None:
    # Three passes with a few steps replaced by others (off the schedule), steps of one
    # or two values (ties in next use fall to the tiered LRU), through `use` or a
    # pipeline staging steps ahead across the wrap.
    executed = list(one_pass * 3)
    for at, step in detours:
        executed[at % len(executed)] = step
    native = _passes(one_pass, capacity, _cyclic, executed=tuple(executed), prefetch=prefetch)
    consulted = _passes(
        one_pass, capacity, _cyclic_python, executed=tuple(executed), prefetch=prefetch
    )
    assert native == consulted


def _use_all(controller: ResidencyController, requests: list[ResidencyRequest]) -> None:
    for request in requests:
        with controller.use(request):
            pass


def test_an_exhausted_schedule_warns_once_per_exhaustion_and_counts_misses() -> None:
    with use_runtime(SimulatedRuntime(0)):
        manager = ResidencyManager({PINNED_HOST: 2 * CHARGE})
    handles = [manager.register_source(SPEC, _Source()) for _ in range(4)]
    requests = [
        ResidencyRequest(f"step-{i}", [ResidencyRequirement(h, PINNED_HOST)])
        for i, h in enumerate(handles)
    ]
    policy = ScheduleAwarePolicy(requests)
    controller = ResidencyController(manager, policy=policy)
    _use_all(controller, requests)  # one pass: no warning (filterwarnings=error)
    assert (policy.exhausted, policy.position, policy.misses) == (True, 4, 0)
    with pytest.warns(ResidencyScheduleExhaustedWarning) as record:
        _use_all(controller, [*requests, *requests])
    assert len(record) == 1  # once, however many decisions follow
    warning = record[0]
    assert warning.filename == __file__  # attributed to the caller outside fhelium
    assert "cyclic=True" in str(warning.message)
    assert "seek(0)" in str(warning.message)
    assert "LRU" in str(warning.message)
    assert policy.misses == 8  # every step after the end is off the schedule
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        controller.decide(requests[0])  # said once: the later decisions are quiet
    # A new pass: quiet until it runs out again, then warned again.
    policy.seek(0)
    assert not policy.exhausted
    _use_all(controller, requests)
    with pytest.warns(ResidencyScheduleExhaustedWarning) as record:
        _use_all(controller, requests[1:3])
    assert len(record) == 1
    assert policy.misses == 10
    manager.close()


def test_misses_count_steps_used_off_the_schedule() -> None:
    with use_runtime(SimulatedRuntime(0)):
        manager = ResidencyManager({PINNED_HOST: 4 * CHARGE})
    a, b, c = (manager.register_source(SPEC, _Source()) for _ in range(3))

    def request(*handles: Any) -> ResidencyRequest:
        return ResidencyRequest("step", [ResidencyRequirement(h, PINNED_HOST) for h in handles])

    policy = ScheduleAwarePolicy([[a], [b]], cyclic=True)
    controller = ResidencyController(manager, policy=policy)
    _use_all(controller, [request(a), request(b), request(a)])
    assert (policy.position, policy.misses) == (1, 0)
    _use_all(controller, [request(c), request(a, b), request(a)])  # none is step 1's
    assert (policy.position, policy.misses) == (1, 3)
    _use_all(controller, [request(b)])
    assert (policy.position, policy.misses) == (0, 3)
    assert not policy.observe([c])
    assert policy.misses == 4
    assert "misses=4" in repr(policy)
    manager.close()


def test_a_pipeline_warns_once_when_it_outruns_a_one_pass_schedule() -> None:
    steps = tuple((value,) for value in range(4))
    # A cyclic schedule follows three passes in a pipeline without a word (an
    # exhaustion warning would fail this test: filterwarnings=error).
    _passes(steps, 2, _cyclic, executed=steps * 3, prefetch=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _passes(steps, 2, ScheduleAwarePolicy, executed=steps * 3, prefetch=1)
    exhausted = [w for w in record if issubclass(w.category, ResidencyScheduleExhaustedWarning)]
    assert len(exhausted) == 1
    assert len(record) == 1
    assert exhausted[0].filename == __file__


def test_the_warning_is_a_user_warning_exported_by_fhelium_errors() -> None:
    import fhelium.errors

    assert issubclass(ResidencyScheduleExhaustedWarning, UserWarning)
    assert not issubclass(ResidencyScheduleExhaustedWarning, fhelium.errors.ResidencyError)
    assert ResidencyScheduleExhaustedWarning.__module__ == "fhelium.errors"
    assert "ResidencyScheduleExhaustedWarning" in fhelium.errors.__all__
