"""Current-device semantics, and the device guards that depend on them
(docs/concepts/simulation.md#current-device-and-default-streams).

On a real machine each thread has a current CUDA device, the default stream of every
device has the raw handle 0, and the CUDA runtime reads a raw 0 as the *current*
device's default stream. A call that hands a default stream's raw handle to CUDA must
therefore make the stream's device current first, and a stream object that names "the
default stream" without a device must be bound to a device once, when it is checked.
The simulated runtime models exactly this, so these tests fail without the guards:

- `TorchCudaRuntime.wait_event` through cuda-python makes the consumer's device current
  (driven here over the simulated runtime's CUDA runtime API and device guard);
- the manager's copies, events and synchronisations use the stream as bound to the
  location's device, for direct calls and for plans.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from fhelium.residency import (
    EnsureResident,
    ReplicaMode,
    ResidencyManager,
    ResidencyPlan,
    ResidencyRequest,
    ResidencyRequirement,
    cuda_location,
)
from fhelium.residency._runtime import (
    SimulatedRuntime,
    SimulatedStream,
    Timeline,
    TorchCudaRuntime,
    cuda_events,
    torch_runtime,
    use_runtime,
)
from fhelium.residency._runtime.cuda_events import CudaEvent, CudaEventPool
from fhelium.residency.controller import ResidencyController
from fhelium.values import ResidentTensor

CUDA0 = cuda_location("cuda:0")
CUDA1 = cuda_location("cuda:1")
DEV0 = torch.device("cuda", 0)
DEV1 = torch.device("cuda", 1)


class DefaultStreamHandle:
    """A foreign library's default stream: the protocol's handle 0 and no declared device,
    so it names the default stream of whichever device is current."""

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, 0)


# --------------------------------------------------------------------------------------------
# The model itself.
# --------------------------------------------------------------------------------------------


def test_default_streams_have_raw_handle_zero_on_every_device() -> None:
    runtime = SimulatedRuntime(2)
    default0, default1 = runtime.current_stream(DEV0), runtime.current_stream(DEV1)
    # As torch.cuda.default_stream(i).cuda_stream: 0 on every device, yet two streams.
    assert default0.cuda_stream == default1.cuda_stream == 0
    assert (default0.device_index, default1.device_index) == (0, 1)
    assert default0 is not default1
    side = runtime.create_stream(DEV1)
    assert side.cuda_stream == side.handle not in (0, 1, 2)


def test_current_device_is_per_thread_and_guards_restore_it() -> None:
    runtime = SimulatedRuntime(3)
    assert runtime.current_device() == 0
    with runtime.device_guard(2):
        assert runtime.current_device() == 2
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(runtime.current_device()))
        thread.start()
        thread.join()
        assert seen == [0]  # another thread keeps its own current device
        with runtime.device_guard("cuda:1"):
            assert runtime.current_device() == 1
        assert runtime.current_device() == 2
    assert runtime.current_device() == 0
    with pytest.raises(ValueError, match="not a simulated CUDA device"), runtime.device_guard(3):
        pass
    assert runtime.current_device() == 0


def test_a_raw_zero_names_the_current_devices_default_stream() -> None:
    runtime = SimulatedRuntime(2)
    cudart = runtime._cudart
    errors = cudart.cudaError_t
    with runtime.device_guard(1):
        error, event = cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming)
        assert error == errors.cudaSuccess
        assert cudart.cudaEventRecord(event, 0) == (errors.cudaSuccess,)
    # The event belongs to cuda:1; with cuda:0 current, a raw 0 is cuda:0's default stream.
    assert cudart.cudaEventRecord(event, 0) == (errors.cudaErrorInvalidResourceHandle,)
    assert cudart.cudaStreamWaitEvent(0, event, 0) == (errors.cudaSuccess,)
    assert runtime.waits[-1][0] is runtime.current_stream(DEV0)
    with runtime.device_guard(1):
        cudart.cudaStreamWaitEvent(0, event, 0)
    assert runtime.waits[-1][0] is runtime.current_stream(DEV1)
    # Other handles name their own stream whatever is current.
    side = runtime.create_stream(DEV1)
    cudart.cudaStreamWaitEvent(side.handle, event, 0)
    assert runtime.waits[-1][0] is side
    assert cudart.cudaEventDestroy(event) == (errors.cudaSuccess,)


def test_protocol_default_handle_follows_the_current_device() -> None:
    runtime = SimulatedRuntime(2)
    handle = DefaultStreamHandle()
    assert runtime.stream_device(handle) == DEV0
    with runtime.device_guard(1):
        assert runtime.stream_device(handle) == DEV1
        # Bound to a device, it stays that device's default stream.
        bound = runtime.bind_stream(handle, DEV1)
    assert bound is runtime.current_stream(DEV1)
    assert runtime.record_event(handle).stream is runtime.current_stream(DEV0)


# --------------------------------------------------------------------------------------------
# TorchCudaRuntime's events through cuda-python, over the simulated CUDA runtime.
# --------------------------------------------------------------------------------------------


class SimulatedEventPool(CudaEventPool):
    """The event pool, giving every event back to the simulation's CUDA runtime API, also
    when it is collected after the test (never to a real CUDA runtime)."""

    def __init__(self, simulation: SimulatedRuntime) -> None:
        super().__init__()
        self.cudart = simulation._cudart

    def _give_back(self, handle: Any, device_index: int, *, completed: bool) -> None:
        self.cudart.cudaEventDestroy(handle)


@pytest.fixture
def torch_over_simulation(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[SimulatedRuntime, TorchCudaRuntime]:
    """`TorchCudaRuntime` with its CUDA underneath replaced by the simulation: simulated
    streams stand for torch streams (same `device_index` and `cuda_stream`), the
    simulation's guard for `torch.cuda.device`, its CUDA runtime API for cuda-python."""
    simulation = SimulatedRuntime(2, timeline=Timeline(h2d_bytes_per_s=1e6))
    monkeypatch.setattr(torch_runtime, "_Stream", SimulatedStream)
    monkeypatch.setattr(torch_runtime, "_device_guard", simulation.device_guard)
    monkeypatch.setattr(torch_runtime, "cuda_bindings_available", lambda: True)
    monkeypatch.setattr(torch_runtime, "_EVENT_POOL", SimulatedEventPool(simulation))
    monkeypatch.setattr(cuda_events, "_cudart", simulation._cudart)
    return simulation, TorchCudaRuntime()


def test_torch_record_event_on_another_devices_default_stream(
    torch_over_simulation: tuple[SimulatedRuntime, TorchCudaRuntime],
) -> None:
    simulation, runtime = torch_over_simulation
    default1 = simulation.current_stream(DEV1)
    simulation.compute(default1, 1.0)  # a second of work on cuda:1's default stream
    assert simulation.current_device() == 0
    event = runtime.record_event(default1)
    assert isinstance(event, CudaEvent)
    assert event.device_index == 1
    # Recorded after the work on cuda:1, not on cuda:0's idle default stream.
    assert runtime.event_query(event) is False
    simulation.synchronize_device(DEV1)
    assert runtime.event_query(event) is True
    assert simulation.current_device() == 0


def test_torch_wait_event_on_another_devices_default_stream(
    torch_over_simulation: tuple[SimulatedRuntime, TorchCudaRuntime],
) -> None:
    simulation, runtime = torch_over_simulation
    producer = simulation.create_stream(DEV1)
    simulation.compute(producer, 1.0)
    event = runtime.record_event(producer)
    consumer = simulation.current_stream(DEV1)  # raw handle 0, on cuda:1
    assert simulation.current_device() == 0
    runtime.wait_event(consumer, event)
    # cuda:1's default stream waits; without the guard cuda:0's would, a silent race.
    ((waiting, _),) = simulation.waits
    assert waiting is consumer
    assert simulation.current_device() == 0
    # Work enqueued on the consumer afterwards runs after the producer's.
    assert simulation.compute(consumer, 0.5).start == pytest.approx(1.0)


# --------------------------------------------------------------------------------------------
# The manager uses the stream as bound to the location's device.
# --------------------------------------------------------------------------------------------


def _pinned(runtime: SimulatedRuntime, n: int = 1000) -> ResidentTensor:
    return runtime.pin(ResidentTensor(torch.arange(n, dtype=torch.float32)))


def test_direct_copies_and_events_use_the_bound_stream() -> None:
    # 4000 bytes at 1 MB/s: each copy takes 4 ms of virtual time.
    timeline = Timeline(h2d_bytes_per_s=1e6)
    runtime = SimulatedRuntime(2, timeline=timeline)
    default = DefaultStreamHandle()
    with use_runtime(runtime), ResidencyManager({CUDA1: 1 << 20}) as manager:
        first = manager.adopt(_pinned(runtime), replica_mode=ReplicaMode.REPLICABLE)
        with runtime.device_guard(1):  # checked with cuda:1 current: cuda:1's default stream
            manager.ensure(first, CUDA1, stream=default)
        assert timeline.now == pytest.approx(0.004)
        # The manager remembers the checked stream; cuda:0 is current now.
        second = manager.adopt(_pinned(runtime), replica_mode=ReplicaMode.REPLICABLE)
        manager.ensure(second, CUDA1, stream=default)
        copy = runtime.copies[-1]
        assert copy.stream is runtime.current_stream(DEV1)
        # The synchronous ensure waited for its copy: the event was recorded on the copy's
        # stream (cuda:1's default stream), not on the current device's.
        assert timeline.now == pytest.approx(0.008)
        third = manager.adopt(_pinned(runtime), replica_mode=ReplicaMode.REPLICABLE)
        manager.move(third, CUDA1, stream=default)
        assert timeline.now == pytest.approx(0.012)


def test_a_failed_copy_synchronizes_the_bound_stream() -> None:
    timeline = Timeline(h2d_bytes_per_s=1e6)
    runtime = SimulatedRuntime(2, timeline=timeline)
    default = DefaultStreamHandle()
    with use_runtime(runtime), ResidencyManager({CUDA1: 1 << 20}) as manager:
        first = manager.adopt(_pinned(runtime), replica_mode=ReplicaMode.REPLICABLE)
        with runtime.device_guard(1):
            manager.ensure(first, CUDA1, stream=default)
        runtime.compute(runtime.current_stream(DEV1), 1.0)
        runtime.fail_next("record_event")
        second = manager.adopt(_pinned(runtime), replica_mode=ReplicaMode.REPLICABLE)
        with pytest.raises(RuntimeError, match="injected"):
            manager.ensure(second, CUDA1, stream=default)
        # The clean-up waited for cuda:1's default stream, where the copy ran.
        assert timeline.now == pytest.approx(1.008)


def test_plan_streams_stay_bound_until_the_scope_exits() -> None:
    timeline = Timeline(h2d_bytes_per_s=1e6)
    runtime = SimulatedRuntime(2, timeline=timeline)
    default = DefaultStreamHandle()
    with use_runtime(runtime), ResidencyManager({CUDA0: 1 << 20, CUDA1: 1 << 20}) as manager:
        entering = manager.adopt(_pinned(runtime), replica_mode=ReplicaMode.REPLICABLE)
        leaving = manager.adopt(_pinned(runtime), replica_mode=ReplicaMode.REPLICABLE)
        other = manager.adopt(_pinned(runtime, 4), replica_mode=ReplicaMode.REPLICABLE)
        plan = ResidencyPlan(
            "stage", enter=[EnsureResident(entering, CUDA1)], exit=[EnsureResident(leaving, CUDA1)]
        )
        with runtime.device_guard(1):
            scope = manager.scope(plan, transfer_streams={CUDA1: default})
            scope.__enter__()
        try:
            # cuda:0 is current now, and enough other streams were checked since that the
            # manager no longer remembers the plan's.
            manager.ensure(other, CUDA0)
            for _ in range(9):
                manager.ensure(other, CUDA0, stream=runtime.create_stream(DEV0))
        finally:
            scope.__exit__(None, None, None)
        copy = runtime.copies[-1]
        assert copy.destination == CUDA1
        assert copy.stream is runtime.current_stream(DEV1)
        # The scope's exit waited for that copy.
        assert timeline.now == pytest.approx(timeline.makespan)


def test_use_and_pipeline_streams_stay_bound_until_they_run() -> None:
    timeline = Timeline(h2d_bytes_per_s=1e6)
    runtime = SimulatedRuntime(2, timeline=timeline)
    default = DefaultStreamHandle()
    with use_runtime(runtime), ResidencyManager({CUDA1: 1 << 20}) as manager:
        controller = ResidencyController(manager)
        requests = [
            ResidencyRequest(
                f"step{i}",
                [ResidencyRequirement(manager.adopt(_pinned(runtime)), CUDA1)],
            )
            for i in range(3)
        ]
        streams = {CUDA1: default}
        with runtime.device_guard(1):  # made with cuda:1 current: cuda:1's default stream
            use = controller.use(requests[0], consumer_streams=streams, transfer_streams=streams)
            pipeline = controller.run(
                requests[1:], consumer_streams=streams, transfer_streams=streams
            )
        # Run with cuda:0 current.
        with use:
            (value,) = use.values.values()
            assert runtime.placement(value) == CUDA1
        assert runtime.copies[-1].stream is runtime.current_stream(DEV1)
        with pipeline:
            for step in pipeline:
                (value,) = step.values.values()
                assert runtime.placement(value) == CUDA1
                assert runtime.copies[-1].stream is runtime.current_stream(DEV1)
        # Each copy ran on cuda:1's default stream, and its use waited for it there.
        assert timeline.now == pytest.approx(0.012)
