"""An interrupt (`KeyboardInterrupt`, as a SIGINT handler raises it) that arrives as a
pipeline step's manager call returns leaves nothing held: the staging's hold tokens are
in the staged step's list before its plan call returns, and a staged step's entry takes
them out of that list before anything can be interrupted
(docs/concepts/controller.md#staging).

Python runs a pending signal handler as a call returns, so each test wraps the engine's
call to raise `KeyboardInterrupt` right after (or right before) the manager did its
part, at a chosen step; then the pipeline is closed and the manager must hold no hold,
no lease and no reservation, every value still readable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

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
LAYERS = 6
HELD = 3
STEPS = 18


def _setup(
    cyclic: bool = False,
) -> tuple[ResidencyManager, list[Any], list[ResidencyRequest], Any, Any]:
    runtime = SimulatedRuntime(1, auto_complete=True)
    stream = runtime.current_stream(torch.device("cuda", 0))
    with use_runtime(runtime):
        manager = ResidencyManager({CUDA: HELD * 32, PINNED_HOST: LAYERS * 32})
    layers = [
        manager.adopt(
            runtime.pin(ResidentTensor(torch.full((8,), float(layer)))),
            at=PINNED_HOST,
            replica_mode=ReplicaMode.REPLICABLE,
        )
        for layer in range(LAYERS)
    ]
    requests = [
        ResidencyRequest(f"step-{step}", [ResidencyRequirement(layers[step % LAYERS], CUDA)])
        for step in range(STEPS)
    ]
    if cyclic:
        # The same request objects pass after pass: from the second pass on, a staging
        # that decides what the last one decided runs its plan in the same manager call.
        requests = requests[:LAYERS] * (STEPS // LAYERS)
    return manager, layers, requests, ResidencyController(manager), stream


def _run(controller: ResidencyController, requests: list[ResidencyRequest], stream: Any) -> None:
    with controller.run(requests, prefetch=1, consumer_streams={CUDA: stream}) as steps:
        for step in steps:
            step.value(step.request.requirements[0].handle, at=CUDA)


def _interrupting(
    call: Callable[..., Any], at_call: int, before: bool
) -> tuple[Callable[..., Any], list[int]]:
    """``call``, raising KeyboardInterrupt at its ``at_call``-th call: before it runs
    with ``before``, else once it has returned."""
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at_call and before:
            raise KeyboardInterrupt
        result = call(*args, **kwargs)
        if calls[0] == at_call:
            raise KeyboardInterrupt
        return result

    return wrapped, calls


def _assert_nothing_held(manager: ResidencyManager, layers: list[Any]) -> None:
    snapshot = manager.snapshot()
    for location in snapshot.locations:
        assert (location.hold_count, location.use_count, location.reservation_count) == (
            0,
            0,
            0,
        ), location
    assert snapshot.reservations == ()
    # Every value can still be dropped from the device: nothing protects it.
    for value in snapshot.values:
        if any(mat.location == CUDA for mat in value.materializations):
            manager.drop(value.handle, CUDA)
    assert len(layers) == LAYERS


@pytest.mark.parametrize("at_call", [1, 2, 5])
def test_an_interrupt_as_a_staging_plan_returns_leaves_no_hold(at_call: int) -> None:
    manager, layers, requests, controller, stream = _setup()
    engine = engine_of(manager)
    engine.execute_plan, calls = _interrupting(engine.execute_plan, at_call, before=False)
    with pytest.raises(KeyboardInterrupt):
        _run(controller, requests, stream)
    assert calls[0] >= at_call
    _assert_nothing_held(manager, layers)
    manager.close()


@pytest.mark.parametrize("at_call", [1, 2, 5])
def test_an_interrupt_as_a_repeated_staging_returns_leaves_no_hold(at_call: int) -> None:
    manager, layers, requests, controller, stream = _setup(cyclic=True)
    engine = engine_of(manager)
    engine.stage_request, calls = _interrupting(engine.stage_request, at_call, before=False)
    with pytest.raises(KeyboardInterrupt):
        _run(controller, requests, stream)
    assert calls[0] == at_call
    _assert_nothing_held(manager, layers)
    manager.close()


@pytest.mark.parametrize("at_call", [1, 4])
def test_an_interrupt_before_a_staged_entry_leaves_no_hold(at_call: int) -> None:
    # (An interrupt after it drops lease objects, which their finalizers release.)
    manager, layers, requests, controller, stream = _setup()
    engine = engine_of(manager)
    engine.enter_step, calls = _interrupting(engine.enter_step, at_call, before=True)
    with pytest.raises(KeyboardInterrupt):
        _run(controller, requests, stream)
    assert calls[0] == at_call
    _assert_nothing_held(manager, layers)
    manager.close()
