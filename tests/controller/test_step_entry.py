"""A staged pipeline step keeps its leases as one native object (`_core.StepEntry`)
rather than a `ResidencyLease` each (docs/concepts/controller.md#steps). Its values,
its release and its finalization must be exactly a lease's: looked up by the request's
own objects or by equal ones, refused once released or force-closed, released with an
event on the consumer stream, and, when its release failed, finalized as a collected
lease is (released safely, with a `ResourceWarning`), at exit too."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
import torch

from fhelium.errors import ResidencyUnavailableError
from fhelium.residency import (
    PINNED_HOST,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    cuda_location,
)
from fhelium.residency._runtime import SimulatedRuntime, use_runtime
from fhelium.residency._scope import engine_of
from fhelium.values import ResidentTensor

CUDA = cuda_location("cuda:0")
LAYERS = 4


class _Env:
    def __init__(self) -> None:
        self.runtime = SimulatedRuntime(1, auto_complete=True)
        self.stream = self.runtime.current_stream(torch.device("cuda", 0))
        with use_runtime(self.runtime):
            self.manager = ResidencyManager({CUDA: 2 * 32, PINNED_HOST: LAYERS * 32})
        self.layers = [
            self.manager.adopt(
                self.runtime.pin(ResidentTensor(torch.full((8,), float(layer)))),
                at=PINNED_HOST,
                replica_mode=ReplicaMode.REPLICABLE,
            )
            for layer in range(LAYERS)
        ]
        self.requests = [
            ResidencyRequest(f"step-{step}", [ResidencyRequirement(self.layers[step], CUDA)])
            for step in range(LAYERS)
        ]
        self.controller = ResidencyController(self.manager)

    def run(self) -> Any:
        return self.controller.run(self.requests, prefetch=1, consumer_streams={CUDA: self.stream})

    def cuda_uses(self) -> int:
        (location,) = [
            location for location in self.manager.snapshot().locations if location.location == CUDA
        ]
        return location.use_count


def _staged_step(steps: Any) -> Any:
    next(steps)
    step = next(steps)  # prefetched while step 0 ran: entered from its staging
    assert step._entry is not None, "the step was not entered from its staging"
    return step


def test_a_staged_steps_values_are_its_leases_values() -> None:
    env = _Env()
    with env.run() as steps:
        step = _staged_step(steps)
        handle = env.layers[1]
        value = step.value(handle, at=CUDA)
        assert torch.equal(value.tensor, torch.full((8,), 1.0))
        # An equal requirement built anew finds the same object, and so does the map.
        (requirement,) = step.request.requirements
        equal = ResidencyRequirement(handle, cuda_location("cuda:0"))
        assert step.values[equal] is value
        assert list(step.values) == [requirement]
        assert len(step.values) == 1
        with pytest.raises(KeyError):
            step.values[ResidencyRequirement(env.layers[0], CUDA)]
        with pytest.raises(KeyError):
            step.value(env.layers[0], at=CUDA)
        assert env.cuda_uses() == 1
        step.__exit__(None, None, None)
        with pytest.raises(RuntimeError, match="only inside the active use"):
            step.value(handle, at=CUDA)
        # Released with an event on the consumer stream: pending until it completes.
        assert env.cuda_uses() == 0
    env.manager.close()


def test_a_forced_close_ends_a_staged_steps_borrow() -> None:
    env = _Env()
    steps = env.run()
    step = _staged_step(steps)
    env.manager.close(force=True)
    with pytest.raises(ResidencyUnavailableError, match="no longer borrowed"):
        step.value(env.layers[1], at=CUDA)
    steps.close()


def test_a_staged_step_whose_release_failed_is_finalized_when_collected() -> None:
    env = _Env()
    steps = env.run()
    _staged_step(steps)
    # The step's release records an event on its consumer stream, and, when that
    # fails, synchronises the stream instead: both fail, so the lease stays active, as
    # a `ResidencyLease` whose release raised stays active.
    env.runtime.fail_next("record_event")
    env.runtime.fail_next("synchronize_stream", RuntimeError("injected sync failure"))
    # (Caught here rather than by `pytest.raises`, whose record of the error would
    # keep the step alive through its traceback.)
    failure = None
    try:
        next(steps)
    except RuntimeError as error:
        failure = str(error)
    assert failure == "injected sync failure"
    assert env.cuda_uses() == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del steps
        gc.collect()
    assert [str(warning.message) for warning in caught if warning.category is ResourceWarning]
    assert "abandoned lease" in str(caught[-1].message)
    assert env.cuda_uses() == 0
    env.manager.close()


def test_a_staged_step_alive_at_exit_is_abandoned_as_a_lease() -> None:
    env = _Env()
    steps = env.run()
    step = _staged_step(steps)
    engine = engine_of(env.manager)
    (live,) = engine.live_leases()
    assert live is step._entry
    # What the interpreter's exit hook does for each live lease.
    with pytest.warns(ResourceWarning, match="abandoned lease"):
        live._abandon()
    assert env.cuda_uses() == 0
    assert engine.live_leases() == []
    with pytest.raises(Exception, match="was released"):
        step.value(env.layers[1], at=CUDA)
    steps.close()
    env.manager.close()


def test_staged_steps_and_uses_take_access_epochs_from_one_counter() -> None:
    # A staged step records its access epochs natively as it enters, a use through the
    # controller's own path: both advance the one epoch counter, so the tiered LRU
    # evicts by the true order of use (docs/concepts/controller.md#access-epochs).
    runtime = SimulatedRuntime(1, auto_complete=True)
    stream = runtime.current_stream(torch.device("cuda", 0))
    with use_runtime(runtime):
        manager = ResidencyManager({CUDA: 3 * 32, PINNED_HOST: 4 * 32})
    # Registered first, so a tie of epochs would make it the first victim.
    late, early, other, new = (
        manager.adopt(
            runtime.pin(ResidentTensor(torch.full((8,), float(value)))),
            at=PINNED_HOST,
            replica_mode=ReplicaMode.REPLICABLE,
        )
        for value in range(4)
    )
    controller = ResidencyController(manager)

    def request(handle: Any) -> ResidencyRequest:
        return ResidencyRequest("r", [ResidencyRequirement(handle, CUDA)])

    consumers = {CUDA: stream}
    with controller.use(request(early), consumer_streams=consumers):
        pass
    steps = [request(late), request(late)]
    with controller.run(steps, prefetch=1, consumer_streams=consumers) as run:
        entered = [step._entry is not None for step in run]
    assert entered == [False, True], "the second step was not entered from its staging"
    with controller.use(request(other), consumer_streams=consumers):
        pass
    (eviction,) = controller.decide(request(new)).evictions
    assert eviction.action.handle is early
    manager.close()
