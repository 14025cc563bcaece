"""The pipeline in virtual time (docs/concepts/controller.md#prefetch,
docs/concepts/simulation.md#the-timeline): with a budget of two steps' working set and
`prefetch=1`, each step's copy runs while the previous step computes, and the predicted
makespan is within 5% of the first step's transfer plus the larger of the total compute
and the busiest copy engine's total; without prefetch, on the consumer's stream, it is
their sum. Hand-computed schedules pin the exact spans."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from fhelium.residency import (
    PINNED_HOST,
    Recoverability,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    ResidencyValueSpec,
    cuda_location,
)
from fhelium.residency.schedule import ScheduleAwarePolicy
from fhelium.residency.simulation import SimulatedRuntime, Timeline, use_runtime
from fhelium.values import ResidentTensor

CUDA = cuda_location("cuda:0")
DEVICE = torch.device("cuda", 0)
N = 250_000  # float32s: 1 MB per value, 1 ms per copy at 1 GB/s
SIZE = 4 * N
MS = 1e-3
SPEC = ResidencyValueSpec(
    ResidentTensor, SIZE, SIZE, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
)


class _PinnedSource:
    def __init__(self, runtime: SimulatedRuntime, index: int) -> None:
        self.runtime = runtime
        self.index = index

    def load(self) -> ResidentTensor:
        return self.runtime.pin(ResidentTensor(torch.full((N,), float(self.index))))


@pytest.fixture
def runtime() -> Iterator[SimulatedRuntime]:
    simulated = SimulatedRuntime(1, timeline=Timeline(h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9))
    with use_runtime(simulated):
        yield simulated


def _workload(
    runtime: SimulatedRuntime, *, slots: int, values: int, steps: int
) -> tuple[ResidencyManager, list[ResidencyRequest]]:
    manager = ResidencyManager({CUDA: slots * SIZE, PINNED_HOST: 4 * SIZE})
    handles = [
        manager.register_source(SPEC, _PinnedSource(runtime, index), source_location=PINNED_HOST)
        for index in range(values)
    ]
    requests = [
        ResidencyRequest(f"step-{step}", (ResidencyRequirement(handles[step % values], CUDA),))
        for step in range(steps)
    ]
    return manager, requests


def _stream(runtime: SimulatedRuntime) -> object:
    return runtime.current_stream(DEVICE)


def _run(
    runtime: SimulatedRuntime,
    controller: ResidencyController,
    requests: list[ResidencyRequest],
    *,
    prefetch: int,
    compute: float,
) -> list[float]:
    stream = _stream(runtime)
    seen = []
    with controller.run(requests, prefetch=prefetch, consumer_streams={CUDA: stream}) as steps:
        for step in steps:
            (requirement,) = step.request.requirements
            seen.append(float(step.value(requirement.handle, at=CUDA).tensor[0]))
            runtime.compute(stream, compute, label=step.request.name)
    runtime.synchronize_device(DEVICE)
    return seen


def _spans(runtime: SimulatedRuntime, engine: str) -> list[tuple[float, float]]:
    timeline = runtime.timeline
    assert timeline is not None
    return [
        (round(span.start / MS, 6), round(span.end / MS, 6))
        for span in timeline.spans
        if span.engine == engine
    ]


def test_hand_computed_schedule_with_prefetch(runtime: SimulatedRuntime) -> None:
    manager, requests = _workload(runtime, slots=2, values=3, steps=3)
    controller = ResidencyController(manager)
    assert _run(runtime, controller, requests, prefetch=1, compute=2 * MS) == [0.0, 1.0, 2.0]
    # Step 0's own copy is waited for; step 1's is issued before step 0 computes; step
    # 2's must first evict step 0's value, so it waits for step 0's compute to end.
    assert _spans(runtime, "h2d") == [(0, 1), (1, 2), (3, 4)]
    assert _spans(runtime, "compute") == [(1, 3), (3, 5), (5, 7)]
    assert runtime.timeline is not None
    assert runtime.timeline.makespan == pytest.approx(7 * MS)


def test_hand_computed_schedule_without_prefetch(runtime: SimulatedRuntime) -> None:
    manager, requests = _workload(runtime, slots=2, values=3, steps=3)
    controller = ResidencyController(manager)
    assert _run(runtime, controller, requests, prefetch=0, compute=2 * MS) == [0.0, 1.0, 2.0]
    # Copies go on the device's current stream, which is also the consumer's: each copy
    # waits for the compute before it.
    assert _spans(runtime, "h2d") == [(0, 1), (3, 4), (6, 7)]
    assert _spans(runtime, "compute") == [(1, 3), (4, 6), (7, 9)]


def test_prefetch_two_runs_copies_back_to_back_when_three_steps_fit(
    runtime: SimulatedRuntime,
) -> None:
    manager, requests = _workload(runtime, slots=3, values=4, steps=4)
    controller = ResidencyController(manager)
    _run(runtime, controller, requests, prefetch=2, compute=MS / 2)
    # Copy-bound: the copy engine never idles once started.
    assert _spans(runtime, "h2d") == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert runtime.timeline is not None
    assert runtime.timeline.makespan == pytest.approx(4.5 * MS)


@pytest.mark.parametrize(
    ("compute", "steps"),
    [(2.0, 24), (1.0, 24), (0.5, 40), (3.0, 12)],
    ids=["compute-bound", "balanced", "copy-bound", "heavy-compute"],
)
@pytest.mark.parametrize("aware", [False, True], ids=["lru", "schedule-aware"])
def test_prefetch_one_hides_copies_behind_compute(
    runtime: SimulatedRuntime, compute: float, steps: int, aware: bool
) -> None:
    manager, requests = _workload(runtime, slots=2, values=5, steps=steps)
    policy = ScheduleAwarePolicy(requests) if aware else None
    controller = ResidencyController(manager, policy=policy)
    seen = _run(runtime, controller, requests, prefetch=1, compute=compute * MS)
    assert seen == [float(step % 5) for step in range(steps)]
    timeline = runtime.timeline
    assert timeline is not None
    first_transfer = 1 * MS
    total_compute = timeline.busy("compute")
    busiest_copy = max(timeline.busy("h2d"), timeline.busy("d2h"))
    assert total_compute == pytest.approx(steps * compute * MS)
    bound = first_transfer + max(total_compute, busiest_copy)
    assert timeline.makespan <= 1.05 * bound
    # And it is a real overlap: far below running copies and compute one after another.
    assert timeline.makespan < 0.8 * (total_compute + busiest_copy)


@pytest.mark.parametrize("compute", [0.5, 2.0])
def test_without_prefetch_the_makespan_is_the_sum(
    runtime: SimulatedRuntime, compute: float
) -> None:
    manager, requests = _workload(runtime, slots=2, values=5, steps=20)
    controller = ResidencyController(manager)
    _run(runtime, controller, requests, prefetch=0, compute=compute * MS)
    timeline = runtime.timeline
    assert timeline is not None
    total = timeline.busy("compute") + timeline.busy("h2d")
    assert timeline.makespan == pytest.approx(total)


def test_schedule_aware_moves_less_than_lru_on_a_cyclic_workload(
    runtime: SimulatedRuntime,
) -> None:
    # Five values cycled through three slots: LRU misses every step; MIN keeps two of
    # them and misses 1 in 3 of the cycle's steps after the first pass.
    copies = {}
    for aware in (False, True):
        simulated = SimulatedRuntime(1, timeline=Timeline(h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9))
        with use_runtime(simulated):
            manager, requests = _workload(simulated, slots=3, values=5, steps=30)
            policy = ScheduleAwarePolicy(requests) if aware else None
            _run(
                simulated,
                ResidencyController(manager, policy=policy),
                requests,
                prefetch=1,
                compute=MS,
            )
            assert simulated.timeline is not None
            copies[aware] = len(_spans(simulated, "h2d"))
    assert copies[False] == 30
    assert copies[True] < copies[False]
