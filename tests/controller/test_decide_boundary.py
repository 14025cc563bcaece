"""`decide` crosses into the core once per request (docs/concepts/controller.md#decide):
the core call that holds the manager's gate runs the whole decision (reap, state read,
search, plan IR, explanation) and calls back into Python only to consult a policy that
is a Python object, once per list of candidates or location it asks about. The built-in
policies run natively, so no Python runs inside the core at all.

The test watches the calls with `sys.setprofile`: a Python function called from inside
a call to a method of the binding's manager is a call back from the core.

The controller checks and lowers the request before that call, outside the gate: a value
another thread discards in between makes it check the request again, so the decide
refuses the discarded value as if the discard had come first.
"""

from __future__ import annotations

import functools
import gc
import sys
import threading
import tracemalloc
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

import pytest

from fhelium._core import CoreManager
from fhelium.errors import ResidencyHandleError
from fhelium.residency.controller import ResidencyController
from fhelium.residency.location import PAGEABLE_HOST, ResidencyLocation
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.plan import DropResident, EnsureResident, MoveResident
from fhelium.residency.policy import DeterministicTieredLRU, ResidencyEvictionCandidate
from fhelium.residency.schedule import ScheduleAwarePolicy
from helpers.controller import adopt_at, replicated_at, request
from helpers.manager import CUDA0, sim_fixture  # noqa: F401

TIERS = {CUDA0: [PAGEABLE_HOST]}


class CountingPolicy(DeterministicTieredLRU):
    """The built-in order, consulted as a Python policy: counts each consultation."""

    __slots__ = ()
    consultations = 0

    def order_candidates(
        self, candidates: Iterable[ResidencyEvictionCandidate]
    ) -> tuple[ResidencyEvictionCandidate, ...]:
        type(self).consultations += 1
        return super().order_candidates(candidates)

    def fallback_locations(self, location: ResidencyLocation) -> tuple[ResidencyLocation, ...]:
        type(self).consultations += 1
        return super().fallback_locations(location)


def calls_back(action: Callable[[], Any]) -> tuple[Any, int, list[str]]:
    """Runs `action` with the collector off; returns its result, how many calls it made
    into the binding's manager, and the Python functions called from inside those calls
    (directly, not what those functions call in turn)."""
    core_calls = 0
    # Per active call: whether it is a call into the binding's manager.
    stack: list[bool] = []
    callbacks: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal core_calls
        if event == "c_call":
            into_core = isinstance(getattr(arg, "__self__", None), CoreManager)
            core_calls += into_core
            stack.append(into_core)
        elif event == "call":
            if stack and stack[-1]:
                callbacks.append(frame.f_code.co_qualname)
            stack.append(False)
        elif stack:  # a return, a C return or a C exception
            stack.pop()

    enabled = gc.isenabled()
    gc.disable()  # no finalizer runs inside a core call by chance
    sys.setprofile(profile)
    try:
        result = action()
    finally:
        sys.setprofile(None)
        if enabled:
            gc.enable()
    return result, core_calls, callbacks


def setup(sim: Any, policy: Any) -> tuple[ResidencyManager, ResidencyController, Any]:
    """cuda:0 holds 32 bytes: a replicated `a` and a sole copy `m`; `c` is requested
    there, so the search evicts (a drop of `a`, or a move of `m` to the host)."""
    manager = ResidencyManager({CUDA0: 32})
    a = replicated_at(manager, sim, PAGEABLE_HOST, CUDA0)
    m = adopt_at(manager, sim, CUDA0)
    c = replicated_at(manager, sim, PAGEABLE_HOST)
    if policy == "schedule":
        policy = ScheduleAwarePolicy([[c], [m], [a]], fallback_tiers=TIERS)
    controller = ResidencyController(manager, policy=policy)
    return manager, controller, (a, m, c)


@pytest.mark.parametrize("policy", ["lru", "schedule"])
def test_a_builtin_policy_decides_with_no_python_inside_the_core(sim: Any, policy: str) -> None:
    manager, controller, (a, m, c) = setup(
        sim, DeterministicTieredLRU(TIERS) if policy == "lru" else policy
    )
    with manager:
        decision, core_calls, callbacks = calls_back(
            lambda: controller.decide(request("c", (c, CUDA0)))
        )
        assert core_calls >= 1
        assert callbacks == []
        assert decision.plan.reclaim in (
            (DropResident(a, CUDA0),),
            (MoveResident(m, PAGEABLE_HOST, from_location=CUDA0),),
        )
        # The same again, the request's lowering cached: still one crossing, no callback.
        again, _, callbacks = calls_back(lambda: controller.decide(request("c", (c, CUDA0))))
        assert callbacks == []
        assert again.plan == decision.plan


def test_a_python_policy_is_the_only_python_the_core_calls(sim: Any) -> None:
    CountingPolicy.consultations = 0
    manager, controller, (_, m, c) = setup(sim, CountingPolicy(TIERS))
    with manager:
        # The sole copy `m` goes first, so the search asks for its fallback tiers too.
        controller.set_policy_metadata(m, priority=-1)
        decision, core_calls, callbacks = calls_back(
            lambda: controller.decide(request("c", (c, CUDA0)))
        )
        assert decision.plan.reclaim == (MoveResident(m, PAGEABLE_HOST, from_location=CUDA0),)
        assert core_calls >= 1
        # Each call back is one consultation of the policy (an ordering or a tier list),
        # never a per-request step of the controller.
        assert CountingPolicy.consultations >= 2
        assert len(callbacks) == CountingPolicy.consultations


def decide_until_refused(
    controller: ResidencyController, wanted: Any, kept: Any, value: Any
) -> None:
    """Decides `wanted` again and again, each plan checked, until the decide raises."""
    while True:
        decision = controller.decide(wanted)
        assert decision.plan.enter == (EnsureResident(kept, CUDA0), EnsureResident(value, CUDA0))


def test_a_discard_between_the_checks_and_the_core_call_is_refused_as_before(sim: Any) -> None:
    manager = ResidencyManager({CUDA0: 64})
    controller = ResidencyController(manager)
    kept = replicated_at(manager, sim, PAGEABLE_HOST)
    previous = sys.getswitchinterval()
    # Threads switch between almost any two bytecodes: the discard lands anywhere in the
    # decide, the window between the request's checks and the core call included.
    sys.setswitchinterval(1e-6)
    try:
        with manager:
            for _ in range(100):
                value = replicated_at(manager, sim, PAGEABLE_HOST)
                wanted = request("r", (kept, CUDA0), (value, CUDA0))
                started = threading.Event()

                def discard(value: Any = value, started: threading.Event = started) -> None:
                    started.wait()
                    manager.discard(value)

                thread = threading.Thread(target=discard)
                thread.start()
                started.set()
                with pytest.raises(ResidencyHandleError, match="is discarded"):
                    decide_until_refused(controller, wanted, kept, value)
                thread.join()
    finally:
        sys.setswitchinterval(previous)


def retained_blocks(action: Callable[[], Any]) -> tuple[Any, int]:
    """Runs `action` with the collector off; returns its result and how many Python
    memory blocks allocated during it are still held (by the result) afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        result = action()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
        if enabled:
            gc.enable()
    grown = sum(stat.count_diff for stat in after.compare_to(before, "filename"))
    return result, grown


@pytest.mark.parametrize("policy", ["lru", "schedule"])
def test_a_decision_holds_the_cores_answer_without_a_python_object_per_action(
    sim: Any, policy: str
) -> None:
    """What a decide keeps for its records to be built from is the core's answer as one
    object: an unread decision holds as many Python objects with one eviction as with
    eight (its plan, evictions and explanation are built when first read, as before)."""
    held: dict[int, int] = {}
    for count in (1, 8):
        manager = ResidencyManager({CUDA0: 16 * count})
        small = [replicated_at(manager, sim, PAGEABLE_HOST, CUDA0) for _ in range(count)]
        big = replicated_at(manager, sim, PAGEABLE_HOST, n=4 * count)
        wanted = request("big", (big, CUDA0))
        chosen: Any = (
            DeterministicTieredLRU(TIERS)
            if policy == "lru"
            else ScheduleAwarePolicy([[big], *([value] for value in small)], fallback_tiers=TIERS)
        )
        controller = ResidencyController(manager, policy=chosen)
        with manager:
            decide = functools.partial(controller.decide, wanted)
            decide()  # the request's lowering is kept from here on
            decision, held[count] = retained_blocks(decide)
            assert set(decision.plan.reclaim) == {DropResident(value, CUDA0) for value in small}
            assert decision.plan.enter == (EnsureResident(big, CUDA0),)
            assert len(decision.evictions) == count
            assert decision.explanation.feasible
    assert held[8] == held[1], held
