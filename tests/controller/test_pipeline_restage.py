"""A step staged again (its request staged before, in a repeating run) follows the
staging rules of a first staging (docs/concepts/controller.md#staging): where its
victims are still read by the device before the body, it is not staged then, and no
error is raised; after the body it waits for the ended steps and is staged."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fhelium.errors import ResidencyHandleError
from fhelium.residency import (
    PINNED_HOST,
    DeterministicTieredLRU,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    cuda_location,
)
from fhelium.residency._runtime import SimulatedRuntime, use_runtime
from fhelium.residency.schedule import ScheduleAwarePolicy
from fhelium.values import ResidentTensor

CUDA = cuda_location("cuda:0")
NBYTES = 32  # torch.zeros(8)


def _pinned_cycle(
    manager: ResidencyManager, runtime: SimulatedRuntime, values: list[torch.Tensor], steps: int
) -> tuple[list[Any], list[ResidencyRequest]]:
    """``values`` adopted in simulated pinned memory, and the requests of one pass: step
    ``i`` requires value ``i`` on cuda:0, for the first ``steps`` values."""
    handles = [
        manager.adopt(
            runtime.pin(ResidentTensor(value.clone())),
            at=PINNED_HOST,
            replica_mode=ReplicaMode.REPLICABLE,
        )
        for value in values
    ]
    cycle = [
        ResidencyRequest(f"step-{i}", [ResidencyRequirement(handles[i], CUDA)])
        for i in range(steps)
    ]
    return handles, cycle


def test_a_restaging_that_does_not_fit_before_the_body_waits_until_after_it() -> None:
    # Events complete only when the host waits: an ended step's values stay protected.
    runtime = SimulatedRuntime(1, auto_complete=False)
    stream = runtime.current_stream(torch.device("cuda", 0))
    with use_runtime(runtime):
        manager = ResidencyManager({CUDA: 2 * NBYTES, PINNED_HOST: 3 * NBYTES})
    with manager:
        values = [torch.full((8,), float(i)) for i in range(3)]
        handles, cycle = _pinned_cycle(manager, runtime, values, 3)
        controller = ResidencyController(manager, policy=DeterministicTieredLRU())
        requests = cycle * 3  # the same request objects again: staged again
        seen = []
        staged_before_body = []
        with controller.run(requests, prefetch=1, consumer_streams={CUDA: stream}) as pipe:
            for step in pipe:
                staged_before_body.append(pipe.staged)
                handle = step.request.requirements[0].handle
                got = step.value(handle, at=CUDA)
                seen.append(torch.equal(got.tensor, values[handles.index(handle)]))
        assert seen == [True] * len(requests)
        # Two values fit: the step after each one needs the value of the step before it
        # evicted, which the device still reads before the body (so it is not staged
        # then), in the first pass and when staged again in the later ones.
        assert staged_before_body[-1] == ()
        assert staged_before_body.count(()) >= len(requests) - 2


def _cycle_with_a_discard(policy_name: str, discard: int, at_step: int) -> tuple[list[Any], Any]:
    """Four values cycle through a device that holds two (each step stages the next and
    runs its last staging's plan again once the cycle repeats); during step
    ``at_step``'s body, value ``discard`` is discarded. Returns, per step, whether it read
    its value's bytes and whether a step was staged during its body, and the error the
    run raised (or None)."""
    runtime = SimulatedRuntime(1, auto_complete=True)
    stream = runtime.current_stream(torch.device("cuda", 0))
    with use_runtime(runtime):
        manager = ResidencyManager({CUDA: 2 * NBYTES, PINNED_HOST: 5 * NBYTES})
    seen: list[Any] = []
    error = None
    with manager:
        values = [torch.full((8,), float(i)) for i in range(5)]
        handles, cycle = _pinned_cycle(manager, runtime, values, 4)
        requests = cycle * 4
        policy: Any = (
            DeterministicTieredLRU() if policy_name == "lru" else ScheduleAwarePolicy(requests)
        )
        controller = ResidencyController(manager, policy=policy)
        try:
            with controller.run(requests, prefetch=1, consumer_streams={CUDA: stream}) as pipe:
                for index, step in enumerate(pipe):
                    handle = step.request.requirements[0].handle
                    got = step.value(handle, at=CUDA)
                    seen.append(
                        (torch.equal(got.tensor, values[handles.index(handle)]), bool(pipe.staged))
                    )
                    if index == at_step:
                        manager.discard(handles[discard])
        except ResidencyHandleError as failure:
            error = failure
    return seen, error


@pytest.mark.parametrize("policy_name", ["lru", "schedule-aware"])
def test_a_discard_mid_run_leaves_the_restaged_steps_right(policy_name: str) -> None:
    # A value no step uses is discarded: the kept staging arguments are refused as stale
    # by the core, the step is decided afresh, and the later passes are staged again.
    seen, error = _cycle_with_a_discard(policy_name, discard=4, at_step=6)
    assert error is None
    assert seen == [(True, True)] * 15 + [(True, False)]


@pytest.mark.parametrize("policy_name", ["lru", "schedule-aware"])
def test_a_value_discarded_mid_run_is_refused_at_its_step(policy_name: str) -> None:
    # The value of the step two ahead is discarded during a body in the second pass (its
    # request was staged and run again before): its staging is refused, so the step
    # before it stages nothing, and the step itself raises the handle error.
    seen, error = _cycle_with_a_discard(policy_name, discard=3, at_step=9)
    assert isinstance(error, ResidencyHandleError)
    assert "is discarded" in str(error)
    assert seen == [(True, True)] * 10 + [(True, False)]
