"""`controller.run` with prefetch on a real GPU (docs/concepts/controller.md#prefetch):
copies left in flight on a transfer stream are read only after they land (the consumer
stream waits on their events), every step computes on its own weights, and nothing is
left protected or reserved afterwards.

Each copy can be delayed by a `torch.cuda._sleep` enqueued before it on its stream, and
each consumer by one before its reads, so these tests fail if the consumer does not
wait for the copy, or if a copy reuses an evicted value's memory before the kernels
reading it have run (docs/concepts/controller.md#evicting-around-reads-in-flight).

The speed side (makespan against the overlap bound and against a hand-written
double-buffered loop) is in tests/benchmarks/bench_gpu.py. Skipped without CUDA; the
same rules run in CI on the simulated runtime (tests/controller/test_pipeline*.py).
"""

from __future__ import annotations

import time

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
from fhelium.residency._runtime.torch_runtime import TorchCudaRuntime, _as_stream
from fhelium.residency.schedule import ScheduleAwarePolicy
from fhelium.values import ResidentTensor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA0 = cuda_location("cuda:0")
WIDTH = 2048  # 16 MiB float32 layers: each copy takes long enough to still be in flight
LAYER_BYTES = WIDTH * WIDTH * 4
# About 10 ms of GPU time at 2 GHz: far longer than a 16 MiB copy or a step's kernels.
SLEEP_CYCLES = 20_000_000


def _sleep_on(stream: torch.cuda.Stream, cycles: int = SLEEP_CYCLES) -> None:
    # _sleep launches on the current device's current stream.
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


@pytest.fixture
def delayed_copies(monkeypatch: pytest.MonkeyPatch) -> list[torch.cuda.Stream]:
    """Every copy to a device first sleeps on its stream, so it lands long after the
    host enqueued it; yields the streams the copies went on."""
    real = TorchCudaRuntime.copy_to_cuda
    streams: list[torch.cuda.Stream] = []

    def delayed(
        self: TorchCudaRuntime,
        value: object,
        device: torch.device,
        stream: object,
        *,
        non_blocking: bool,
    ) -> object:
        cuda_stream = (
            torch.cuda.current_stream(device) if stream is None else _as_stream(stream, device)
        )
        streams.append(cuda_stream)
        _sleep_on(cuda_stream)
        return real(self, value, device, stream, non_blocking=non_blocking)  # type: ignore[arg-type]

    monkeypatch.setattr(TorchCudaRuntime, "copy_to_cuda", delayed)
    return streams


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


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("aware", [False, True])
def test_a_consumer_waits_for_a_delayed_copy(
    delayed_copies: list[torch.cuda.Stream], prefetch: int, aware: bool
) -> None:
    # Every copy sleeps on the transfer stream before it writes: a consumer that read
    # a value before its copy landed would read the block's previous bytes.
    layers, passes = 4, 2
    manager = ResidencyManager({CUDA0: 3 * LAYER_BYTES, PINNED_HOST: layers * LAYER_BYTES})
    handles, weights = _layers(manager, layers)
    order = [layer for _ in range(passes) for layer in range(layers)]
    requests = [
        ResidencyRequest(f"step-{step}", [ResidencyRequirement(handles[layer], CUDA0)])
        for step, layer in enumerate(order)
    ]
    controller = ResidencyController(
        manager, policy=ScheduleAwarePolicy(requests) if aware else None
    )
    consumer = torch.cuda.Stream(device=0)
    sums = []
    with controller.run(requests, prefetch=prefetch, consumer_streams={CUDA0: consumer}) as steps:
        for step in steps:
            (requirement,) = step.request.requirements
            weight = step.value(requirement.handle, at=CUDA0)
            assert isinstance(weight, ResidentTensor)
            with torch.cuda.stream(consumer):
                sums.append(weight.tensor.view(torch.int32).to(torch.int64).sum())
    torch.cuda.synchronize()
    assert any(stream != consumer for stream in delayed_copies)  # copies were prefetched
    for index, total in enumerate(sums):
        expected = weights[order[index]].view(torch.int32).to(torch.int64).sum()
        assert int(total) == int(expected), index
    assert manager._engine.core.transfer_count() == 0
    manager.close()


@pytest.mark.parametrize("aware", [False, True])
def test_an_evicted_value_is_not_overwritten_before_its_readers_run(aware: bool) -> None:
    # Two layers fit. Each step's kernels sleep before they read, so the consumer runs
    # steps behind the host: the copy that reuses an evicted layer's memory is issued
    # while the kernels of the step that read it are still queued, and only the
    # transfer stream's device-side wait keeps it from overwriting the bytes first.
    # The host never waits for those kernels, so the loop ends long before the device.
    layers, passes = 4, 3
    manager = ResidencyManager({CUDA0: 2 * LAYER_BYTES, PINNED_HOST: layers * LAYER_BYTES})
    handles, weights = _layers(manager, layers)
    order = [layer for _ in range(passes) for layer in range(layers)]
    requests = [
        ResidencyRequest(f"step-{step}", [ResidencyRequirement(handles[layer], CUDA0)])
        for step, layer in enumerate(order)
    ]
    controller = ResidencyController(
        manager, policy=ScheduleAwarePolicy(requests) if aware else None
    )
    consumer = torch.cuda.Stream(device=0)
    # How long one sleep takes on this device.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(consumer)
    _sleep_on(consumer)
    end.record(consumer)
    end.synchronize()
    sleep_s = start.elapsed_time(end) / 1e3
    sums = []
    began = time.perf_counter()
    with controller.run(requests, prefetch=1, consumer_streams={CUDA0: consumer}) as steps:
        for index, step in enumerate(steps):
            (requirement,) = step.request.requirements
            weight = step.value(requirement.handle, at=CUDA0)
            assert isinstance(weight, ResidentTensor)
            _sleep_on(consumer)
            with torch.cuda.stream(consumer):
                sums.append(weight.tensor.view(torch.int32).to(torch.int64).sum())
            if index == len(order) - 2:
                # The host is ahead of the device: the last steps' kernels are queued.
                host_s = time.perf_counter() - began
                assert host_s < 0.5 * len(order) * sleep_s, (host_s, sleep_s)
    torch.cuda.synchronize()
    for index, total in enumerate(sums):
        expected = weights[order[index]].view(torch.int32).to(torch.int64).sum()
        assert int(total) == int(expected), index
    snapshot = manager.snapshot()
    (device,) = [entry for entry in snapshot.locations if entry.location == CUDA0]
    assert device.peak_charged_bytes <= 2 * LAYER_BYTES
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
