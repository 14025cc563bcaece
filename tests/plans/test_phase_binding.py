"""Plan lowering and plan phases as single core calls (docs/architecture.md).

Lowering reads the action and reservation records in the core; a phase runs in the core,
falling back to the engine's general path per action. These tests pin what the glue did
before either moved: handle interning by hash and equality, the kinds of subclassed
actions, the errors of malformed input, and the committed prefix of a phase that fails
on a host action after general-path ones (and the other way round).
"""

from __future__ import annotations

import dataclasses
import signal
import time
from typing import Any

import pytest

from fhelium.residency import _lowering
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
from fhelium.values import ResidentTensor
from helpers.manager import (
    CUDA0,
    REPLICABLE,
    mat_locs,
    sim_fixture,  # noqa: F401
    spec,
    stream,
    tensor_value,
)
from helpers.plans import ControlledSource, check_execution_error, raises_exec
from helpers.records import make_handle


class _SubEnsure(EnsureResident[Any]):
    __slots__ = ()


class _SubMove(MoveResident[Any]):
    __slots__ = ()


class _NotAnAction:
    """Has a handle, as an action does, but is none of the four."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __repr__(self) -> str:
        return "<not an action>"


# --------------------------------------------------------------------------------------------
# Lowering
# --------------------------------------------------------------------------------------------


def test_equal_handles_share_a_slot_held_by_the_first_object() -> None:
    first = make_handle(handle_id="h1")
    twin = dataclasses.replace(first)
    other = make_handle(handle_id="h2")
    assert twin == first
    assert twin is not first
    lowered = _lowering.lower_plan(
        ResidencyPlan(
            "p",
            enter=[EnsureResident(twin, PAGEABLE_HOST), EnsureResident(other, PINNED_HOST)],
            exit=[DropResident(first, PAGEABLE_HOST), DiscardValue(other)],
            reclaim=[DropResident(first, PINNED_HOST)],
        )
    )
    # Reclaim is lowered first, so `first` takes slot 0 and `twin` shares it.
    assert len(lowered.handles) == 2
    assert lowered.handles[0] is first
    assert lowered.handles[1] is other
    assert "handles=2, reclaim=1, enter=2, exit=2, reservations=0" in repr(lowered.ir)


def test_handles_differing_only_in_value_type_take_separate_slots() -> None:
    first = make_handle(handle_id="h1")
    retyped = make_handle(handle_id="h1", value_type=ResidentTensor)
    lowered = _lowering.lower_actions(
        "p", [EnsureResident(first, PAGEABLE_HOST), EnsureResident(retyped, PAGEABLE_HOST)]
    )
    assert lowered.handles == (first, retyped)


def test_subclassed_actions_lower_as_their_base_class() -> None:
    handle = make_handle()
    lowered = _lowering.lower_plan(
        ResidencyPlan(
            "p",
            enter=[_SubEnsure(handle, cuda_location(3))],
            exit=[_SubMove(handle, PAGEABLE_HOST, cuda_location(3))],
            reservations=[MemoryReservation(cuda_location(3), 1 << 70, "r\ud800")],
        )
    )
    assert lowered.handles == (handle,)


def test_a_record_that_is_not_an_action_is_a_type_error() -> None:
    handle = make_handle()
    with pytest.raises(TypeError, match=r"^not a residency action: <not an action>$"):
        _lowering.lower_actions("p", [EnsureResident(handle, PAGEABLE_HOST), _NotAnAction(handle)])


def test_an_object_without_a_handle_fails_reading_it() -> None:
    with pytest.raises(AttributeError):
        _lowering.lower_actions("p", [object()])


def test_any_iterable_of_actions_is_lowered() -> None:
    handle = make_handle()
    lowered = _lowering.lower_actions(
        "p", (EnsureResident(handle, location) for location in (PAGEABLE_HOST, PINNED_HOST))
    )
    assert lowered.handles == (handle,)
    assert "enter=2" in repr(lowered.ir)


# --------------------------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------------------------


def test_host_failure_after_general_path_actions_keeps_the_prefix(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    source = ControlledSource()
    r = manager.register_source(spec(3), source)
    source.raise_next = OSError("host load")
    # A CUDA ensure (general path), a host ensure (one-call path), then the failing
    # host reconstruction and an action that never runs.
    actions = [
        EnsureResident(a, CUDA0),
        EnsureResident(a, PINNED_HOST),
        EnsureResident(r, PAGEABLE_HOST),
        DropResident(a, CUDA0),
    ]
    t0 = time.time_ns()
    error = raises_exec(lambda: manager.execute_actions(actions, name="mixed"))
    check_execution_error(
        error,
        plan_name="mixed",
        phase="execute",
        committed=actions[:2],
        failed_action=actions[2],
        failed_action_index=2,
        cause_type=OSError,
        started_after=t0,
    )
    assert set(mat_locs(manager.snapshot(), a)) == {PAGEABLE_HOST, PINNED_HOST, CUDA0}
    assert mat_locs(manager.snapshot(), r) == ()


def test_general_path_failure_after_host_actions_keeps_the_prefix(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    actions = [
        EnsureResident(a, PINNED_HOST),
        DropResident(a, PINNED_HOST),
        EnsureResident(a, CUDA0),
    ]
    sim.fail_next("copy_to_cuda", exc=RuntimeError("device copy"))
    t0 = time.time_ns()
    error = raises_exec(lambda: manager.execute_actions(actions, name="mixed"))
    check_execution_error(
        error,
        plan_name="mixed",
        phase="execute",
        committed=actions[:2],
        failed_action=actions[2],
        failed_action_index=2,
        cause_type=RuntimeError,
        started_after=t0,
    )
    assert mat_locs(manager.snapshot(), a) == (PAGEABLE_HOST,)


def test_streams_reach_only_the_actions_whose_destination_has_one(sim: Any) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    s0 = stream(sim, 0)
    actions = [
        EnsureResident(a, PINNED_HOST),
        _SubEnsure(a, CUDA0),
        DropResident(a, CUDA0),
        _SubMove(a, CUDA0, PINNED_HOST),
    ]
    report = manager.execute_actions(actions, transfer_streams={CUDA0: s0})
    assert [t.action for t in report.transitions] == actions
    # The host copy has no stream; both copies to CUDA0 (subclassed actions) have its.
    assert [copy.stream for copy in sim.copies] == [None, s0, s0]
    assert set(mat_locs(manager.snapshot(), a)) == {PAGEABLE_HOST, CUDA0}


def test_a_signal_handler_error_between_host_actions_is_wrapped(sim: Any) -> None:
    manager = ResidencyManager()
    handles = [manager.adopt(tensor_value(), replica_mode=REPLICABLE) for _ in range(3)]
    actions = [EnsureResident(handle, PINNED_HOST) for handle in handles]
    raised: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        raised.append(signum)
        raise RuntimeError("from a signal handler")

    # SIGUSR1 is raised inside the second action's load: its handler runs in Python
    # code there, or in the core between actions, and fails action 1 or 2.
    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        source = ControlledSource()
        r = manager.register_source(spec(3), source)
        source.hook = lambda: signal.raise_signal(signal.SIGUSR1)
        started = time.time_ns()
        error = raises_exec(
            lambda: manager.execute_actions(
                [actions[0], EnsureResident(r, PAGEABLE_HOST), *actions[1:]]
            )
        )
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert raised == [signal.SIGUSR1]
    assert error.failed_action_index in (1, 2)
    assert len(error.partial_report.transitions) == error.failed_action_index
    assert error.partial_report.started_at_ns >= started
    assert isinstance(error.__cause__, RuntimeError)


def test_handles_with_equal_hashes_are_told_apart_by_equality() -> None:
    class Colliding(ResidencyHandle[Any]):
        __slots__ = ()

        def __hash__(self) -> int:
            return 7

    first, second, third = (Colliding("m", f"h{index}", ResidentTensor) for index in range(3))
    twin = Colliding("m", "h1", ResidentTensor)
    actions = [EnsureResident(handle, PAGEABLE_HOST) for handle in (first, second, twin, third)]
    lowered = _lowering.lower_actions("p", [*actions, DropResident(second, PAGEABLE_HOST)])
    assert len(lowered.handles) == 3
    assert lowered.handles[0] is first
    assert lowered.handles[1] is second
    assert lowered.handles[2] is third
