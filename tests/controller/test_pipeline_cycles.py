"""A pipeline step's objects (its use, scope, leases, decision and report, the staging's
plan run and hooks) form no reference cycle: each is freed by reference counting as soon
as it is dropped, never left for the collector, whose runs would then cost every step
(docs/project.md#per-step-cost)."""

from __future__ import annotations

import gc

import pytest
import torch

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
from fhelium.residency.policy import ResidencyPolicy
from fhelium.residency.schedule import ScheduleAwarePolicy
from fhelium.values import ResidentTensor

CUDA = cuda_location("cuda:0")
NBYTES = 32  # torch.zeros(8)
VALUES = 6
HELD = 3


def _ours(obj: object) -> bool:
    """Whether ``obj`` is one of the library's objects."""
    module = type(obj).__dict__.get("__module__", "")
    return isinstance(module, str) and module.startswith("fhelium.")


@pytest.mark.parametrize("policy_name", ["lru", "aware"])
@pytest.mark.parametrize("reads", [False, True])
def test_pipeline_steps_leave_no_reference_cycle(policy_name: str, reads: bool) -> None:
    runtime = SimulatedRuntime(1, auto_complete=True)
    stream = runtime.current_stream(torch.device("cuda", 0))
    with use_runtime(runtime):
        manager = ResidencyManager({CUDA: HELD * NBYTES, PINNED_HOST: VALUES * NBYTES})
    with manager:
        handles = [
            manager.adopt(
                runtime.pin(ResidentTensor(torch.zeros(8))),
                at=PINNED_HOST,
                replica_mode=ReplicaMode.REPLICABLE,
            )
            for _ in range(VALUES)
        ]
        requests = [
            ResidencyRequest(f"step-{step}", [ResidencyRequirement(handles[step % VALUES], CUDA)])
            for step in range(4 * VALUES)
        ]
        policy: ResidencyPolicy = (
            DeterministicTieredLRU() if policy_name == "lru" else ScheduleAwarePolicy(requests)
        )
        controller = ResidencyController(manager, policy=policy)

        def run() -> int:
            steps = 0
            with controller.run(requests, prefetch=1, consumer_streams={CUDA: stream}) as pipe:
                for step in pipe:
                    assert step.value(step.request.requirements[0].handle, at=CUDA) is not None
                    if reads:
                        decision = step.decision
                        assert decision.plan.name == step.request.name
                        assert len(decision.evictions) <= 1
                        assert decision.explanation.feasible
                    steps += 1
            return steps

        if isinstance(policy, ScheduleAwarePolicy):
            run()  # the first pass records nothing new; the second starts over
            policy.seek(0)
        else:
            run()
        gc.collect()
        # The library's objects alive now (earlier tests' runtimes, say, that another
        # thread may still hold and drop meanwhile) are not the steps'.
        before = {id(obj) for obj in gc.get_objects() if _ours(obj)}
        collecting = gc.isenabled()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            assert run() == len(requests)
            # Everything the steps made and dropped was freed by reference counting:
            # the collector finds nothing of the library's unreachable. (Other threads
            # left by earlier tests may drop cycles of their own meanwhile: only the
            # library's objects count.)
            gc.collect()
            unreachable = [
                type(obj).__qualname__ for obj in gc.garbage if _ours(obj) and id(obj) not in before
            ]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            if collecting:
                gc.enable()
        assert unreachable == []
