"""A step staged again (its request staged before, in a repeating run) follows the
staging rules of a first staging (docs/concepts/controller.md#staging): where its
victims are still read by the device before the body, it is not staged then, and no
error is raised; after the body it waits for the ended steps and is staged."""

from __future__ import annotations

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
from fhelium.values import ResidentTensor

CUDA = cuda_location("cuda:0")
NBYTES = 32  # torch.zeros(8)


def test_a_restaging_that_does_not_fit_before_the_body_waits_until_after_it() -> None:
    # Events complete only when the host waits: an ended step's values stay protected.
    runtime = SimulatedRuntime(1, auto_complete=False)
    stream = runtime.current_stream(torch.device("cuda", 0))
    with use_runtime(runtime):
        manager = ResidencyManager({CUDA: 2 * NBYTES, PINNED_HOST: 3 * NBYTES})
    with manager:
        values = [torch.full((8,), float(i)) for i in range(3)]
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
            for i in range(3)
        ]
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
