"""An unfinished pipeline collected inside a source's `load()`
(docs/concepts/controller.md#ending-a-pipeline, docs/concepts/lifetimes.md#deferred-releases).

The thread running `load()` is inside a transition of the manager and cannot enter it:
the pipeline's releases are queued, never waited for on that thread and never reported
as an ignored exception, and they are applied as soon as the `load()` returns.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from fhelium.residency import (
    PINNED_HOST,
    MemoryReservation,
    Recoverability,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    ResidencyValueSpec,
    cuda_location,
)
from fhelium.residency._runtime import SimulatedRuntime, use_runtime
from fhelium.values import ResidentTensor
from helpers.controller import leftovers
from helpers.manager import assert_balanced

CUDA = cuda_location("cuda:0")
N = 256
SIZE = 4 * N
SPEC = ResidencyValueSpec(
    ResidentTensor, SIZE, SIZE, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
)


class _Source:
    def __init__(self, runtime: SimulatedRuntime, fill: float) -> None:
        self.runtime = runtime
        self.fill = fill
        self.during: Any = None
        self.seconds: float | None = None

    def load(self) -> ResidentTensor:
        if self.during is not None:
            started = time.monotonic()
            self.during()
            self.seconds = time.monotonic() - started
        return self.runtime.pin(ResidentTensor(torch.full((N,), self.fill)))


@pytest.fixture
def runtime() -> Iterator[SimulatedRuntime]:
    simulated = SimulatedRuntime(1, pinned=True)
    with use_runtime(simulated):
        yield simulated


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_pipeline_collected_inside_load_is_deferred(
    runtime: SimulatedRuntime, prefetch: int, capfd: pytest.CaptureFixture[str]
) -> None:
    manager = ResidencyManager({CUDA: 8 * SIZE, PINNED_HOST: 64 * SIZE})
    controller = ResidencyController(manager)
    handles = [
        manager.register_source(SPEC, _Source(runtime, float(index)), source_location=PINNED_HOST)
        for index in range(4)
    ]
    loader = _Source(runtime, 9.0)
    other = manager.register_source(SPEC, loader, source_location=PINNED_HOST)
    stream = runtime.current_stream(torch.device("cuda", 0))
    requests = [
        ResidencyRequest(
            f"step-{index}",
            [ResidencyRequirement(handle, CUDA)],
            [MemoryReservation(CUDA, SIZE, "scratch")],
        )
        for index, handle in enumerate(handles)
    ]
    unraisable: list[Any] = []
    hook = sys.unraisablehook
    collecting = gc.isenabled()
    gc.disable()  # nothing collects the cycle before the load does
    try:
        sys.unraisablehook = unraisable.append
        pipeline = controller.run(requests, prefetch=prefetch, consumer_streams={CUDA: stream})
        step = next(pipeline)
        assert step.value(handles[0], at=CUDA).tensor[0] == 0.0
        assert pipeline.staged == tuple(range(1, 1 + prefetch))
        # Left unfinished, in a reference cycle: only the cyclic collector frees it.
        cycle: list[Any] = [pipeline]
        cycle.append(cycle)
        del pipeline, step, cycle
        assert leftovers(manager) != (0, 0, 0)
        # Everything made since `gc.disable()` is in the youngest generation: collecting
        # it alone keeps the time measured to the pipeline's own finalization.
        loader.during = lambda: gc.collect(0)
        manager.ensure(other, at=PINNED_HOST)
    finally:
        sys.unraisablehook = hook
        if collecting:
            gc.enable()
    # The collection ran inside load() and neither waited nor failed.
    assert loader.seconds is not None
    assert loader.seconds < 0.2, loader.seconds
    assert unraisable == [], [str(entry.exc_value) for entry in unraisable]
    assert "Exception ignored" not in capfd.readouterr().err
    # The queued releases were applied when load() returned.
    assert leftovers(manager) == (0, 0, 0)
    snapshot = manager.snapshot()
    assert_balanced(snapshot)
    assert snapshot.reservations == ()
    # The copies still in flight stay protected until their events complete.
    runtime.complete_events()
    snapshot = manager.snapshot()
    assert all(entry.pending_event_count == 0 for entry in snapshot.locations)
    assert_balanced(snapshot)
    manager.close()
