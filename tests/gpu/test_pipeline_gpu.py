"""`controller.run` with prefetch on a real GPU (docs/concepts/controller.md#prefetch):
copies left in flight on a transfer stream are read only after they land (the consumer
stream waits on their events), every step computes on its own weights, and nothing is
left protected or reserved afterwards.

The speed side (makespan against the overlap bound and against a hand-written
double-buffered loop) is in tests/benchmarks/bench_gpu.py. Skipped without CUDA; the
same rules run in CI on the simulated runtime (tests/controller/test_pipeline*.py).
"""

from __future__ import annotations

import pytest
import torch

from fhelium.residency import (
    PINNED_HOST,
    MemoryReservation,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    cuda_location,
)
from fhelium.residency.schedule import ScheduleAwarePolicy
from fhelium.values import ResidentTensor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA0 = cuda_location("cuda:0")
WIDTH = 2048  # 16 MiB float32 layers: each copy takes long enough to still be in flight
LAYER_BYTES = WIDTH * WIDTH * 4


def _layers(manager: ResidencyManager, count: int) -> tuple[list[object], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    weights = [torch.randn(WIDTH, WIDTH, generator=generator) / WIDTH**0.5 for _ in range(count)]
    handles = [
        manager.adopt(
            ResidentTensor(weight.pin_memory()),
            at=PINNED_HOST,
            replica_mode=ReplicaMode.REPLICABLE,
        )
        for weight in weights
    ]
    return handles, weights


def _reference(weights: list[torch.Tensor], order: list[int], x: torch.Tensor) -> torch.Tensor:
    out = x.double()
    for layer in order:
        out = torch.tanh(out @ weights[layer].double())
    return out


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("aware", [False, True])
def test_every_step_reads_its_own_weights(prefetch: int, aware: bool) -> None:
    layers, passes = 6, 3
    manager = ResidencyManager(
        {CUDA0: 3 * LAYER_BYTES + (1 << 20), PINNED_HOST: layers * LAYER_BYTES}
    )
    handles, weights = _layers(manager, layers)
    order = [layer for _ in range(passes) for layer in range(layers)]
    requests = [
        ResidencyRequest(
            f"step-{step}",
            [ResidencyRequirement(handles[layer], CUDA0)],
            [MemoryReservation(CUDA0, 1 << 20, "activations")],
        )
        for step, layer in enumerate(order)
    ]
    policy = ScheduleAwarePolicy(requests) if aware else None
    controller = ResidencyController(manager, policy=policy)
    stream = torch.cuda.Stream(device=0)
    x = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(3))
    out = x.to("cuda:0")
    with controller.run(requests, prefetch=prefetch, consumer_streams={CUDA0: stream}) as steps:
        for step in steps:
            (requirement,) = step.request.requirements
            weight = step.value(requirement.handle, at=CUDA0)
            assert isinstance(weight, ResidentTensor)
            with torch.cuda.stream(stream):
                out = torch.tanh(out.double() @ weight.tensor.double()).float()
    stream.synchronize()
    expected = _reference(weights, order, x)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-4, atol=1e-4)
    assert manager._engine.core.transfer_count() == 0
    torch.cuda.synchronize()
    snapshot = manager.snapshot()
    for entry in snapshot.locations:
        assert (entry.use_count, entry.hold_count, entry.reserved_bytes) == (0, 0, 0)
        if entry.budget_bytes is not None:
            assert entry.peak_charged_bytes <= entry.budget_bytes
    manager.close()


def test_a_prefetched_copy_is_in_flight_until_its_step_waits_for_it() -> None:
    manager = ResidencyManager({CUDA0: 4 * LAYER_BYTES, PINNED_HOST: 4 * LAYER_BYTES})
    handles, weights = _layers(manager, 2)
    requests = [
        ResidencyRequest(f"step-{step}", [ResidencyRequirement(handle, CUDA0)])
        for step, handle in enumerate(handles)
    ]
    controller = ResidencyController(manager)
    stream = torch.cuda.Stream(device=0)
    with controller.run(requests, prefetch=1, consumer_streams={CUDA0: stream}) as steps:
        first = next(steps)
        assert steps.staged == (1,)
        # Keep the consumer stream busy, so the copy cannot have been waited for by it.
        with torch.cuda.stream(stream):
            weight = first.value(handles[0], at=CUDA0)
            assert isinstance(weight, ResidentTensor)
            for _ in range(20):
                weight.tensor @ weight.tensor
        second = next(steps)
        weight = second.value(handles[1], at=CUDA0)
        assert isinstance(weight, ResidentTensor)
        with torch.cuda.stream(stream):
            copied = weight.tensor.clone()
        stream.synchronize()
        torch.testing.assert_close(copied.cpu(), weights[1])
    manager.close()
