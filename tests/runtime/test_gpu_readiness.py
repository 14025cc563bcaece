"""Behaviours of real CUDA and PyTorch that the simulated runtime reproduces, so the CPU
suite guards the paths a first GPU run would otherwise be the first to exercise.

Zero-size tensor fields and pinned memory
(docs/concepts/locations-and-budgets.md#pinned-host): torch's pinned allocator returns
no storage for zero bytes, so an empty tensor never reports pinned memory.
"""

from __future__ import annotations

import threading

import pytest
import torch

from fhelium.residency import (
    PAGEABLE_HOST,
    PINNED_HOST,
    ReplicaMode,
    ResidencyManager,
    cuda_location,
)
from fhelium.residency._runtime import SimulatedRuntime, torch_runtime, use_runtime
from fhelium.values import ResidentTensor, TensorBundle
from helpers.manager import CUDA0, assert_balanced, mat_locs


def _with_empty_field() -> TensorBundle:
    return TensorBundle(keys=torch.arange(4.0), empty=torch.zeros(0))


def test_simulated_pinning_leaves_empty_tensors_unpinned_as_torch_does() -> None:
    runtime = SimulatedRuntime(1)
    pinned = runtime.pin(_with_empty_field())
    assert runtime.placement(pinned["keys"]) == PINNED_HOST
    # The empty field got no pinned storage: alone it reads as a plain host tensor...
    assert runtime.placement(pinned["empty"]) == PAGEABLE_HOST
    # ...and it neither makes nor breaks the value's pinning.
    assert runtime.placement(pinned) == PINNED_HOST
    assert runtime.value_is_pinned(pinned)
    assert runtime.pinning_is_uniform(pinned)
    assert runtime.measure(pinned).pinned is True


def test_a_value_with_an_empty_field_moves_through_pinned_host() -> None:
    runtime = SimulatedRuntime(1)
    with use_runtime(runtime):
        manager = ResidencyManager()
    handle = manager.adopt(_with_empty_field(), replica_mode=ReplicaMode.REPLICABLE)
    report = manager.ensure(handle, PINNED_HOST)
    assert report.destination == PINNED_HOST
    manager.move(handle, CUDA0, from_location=PINNED_HOST)
    manager.move(handle, PINNED_HOST, from_location=CUDA0)
    snapshot = manager.snapshot()
    assert set(mat_locs(snapshot, handle)) == {PAGEABLE_HOST, PINNED_HOST}
    assert_balanced(snapshot)
    with manager.acquire([handle], at=PINNED_HOST) as lease:
        borrowed = lease[handle]
        assert torch.equal(borrowed["keys"], torch.arange(4.0))
        assert borrowed["empty"].numel() == 0
    manager.close()


def test_a_pinned_value_with_an_empty_field_is_adopted_as_pinned() -> None:
    runtime = SimulatedRuntime(1)
    with use_runtime(runtime):
        manager = ResidencyManager()
    inferred = manager.adopt(runtime.pin(_with_empty_field()))
    explicit = manager.adopt(runtime.pin(_with_empty_field()), at=PINNED_HOST)
    snapshot = manager.snapshot()
    assert mat_locs(snapshot, inferred) == (PINNED_HOST,)
    assert mat_locs(snapshot, explicit) == (PINNED_HOST,)
    manager.close()


def test_a_value_without_storage_bytes_is_in_place_at_either_host_location() -> None:
    runtime = SimulatedRuntime(1)
    with use_runtime(runtime):
        manager = ResidencyManager()
    handle = manager.adopt(ResidentTensor(torch.zeros(0)), replica_mode=ReplicaMode.REPLICABLE)
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST,)
    manager.ensure(handle, PINNED_HOST)
    manager.ensure(handle, CUDA0)
    manager.drop(handle, PAGEABLE_HOST)
    manager.move(handle, PAGEABLE_HOST, from_location=PINNED_HOST)
    assert set(mat_locs(manager.snapshot(), handle)) == {PAGEABLE_HOST, CUDA0}
    pinned_empty = manager.adopt(runtime.pin(ResidentTensor(torch.zeros(0))), at=PINNED_HOST)
    assert mat_locs(manager.snapshot(), pinned_empty) == (PINNED_HOST,)
    manager.close()


def test_tensor_resident_pinning_ignores_empty_fields() -> None:
    # On this machine nothing is pinned; the property still treats empty fields as
    # neither pinned nor pageable, and a value of empty fields only is not pinned.
    assert not ResidentTensor(torch.zeros(0)).is_pinned
    assert not _with_empty_field().is_pinned


class _ReportsPinned(torch.Tensor):
    """A host tensor that reports page-locked memory, as a pinned one does on CUDA."""

    def is_pinned(self, device: object = None) -> bool:  # type: ignore[override]
        return True


def test_native_measurement_ignores_empty_fields_for_pinning() -> None:
    # The measurement the real runtime uses, with pinning possible: the pinned field
    # decides, the empty field (never pinned under torch) does not make it "mixed".
    from fhelium._core import measure_tensors

    pinned = torch.arange(4.0).as_subclass(_ReportsPinned)
    facts = measure_tensors((pinned, torch.zeros(0)), True)
    assert facts is not None
    assert facts[2] is True
    # A host value without storage bytes reads as pageable.
    empty_only = measure_tensors((torch.zeros(0), torch.zeros(0)), True)
    assert empty_only is not None
    assert empty_only[2] is False


# --------------------------------------------------------------------------------------------
# Default-stream handles of the CUDA stream protocol
# (docs/concepts/lifetimes.md#consumer-streams): 0 and 1 name the legacy default stream,
# 2 the per-thread one, always of the *current* device; cuda.core reports 1 for its
# default stream.
# --------------------------------------------------------------------------------------------


class _LegacyDefaultStream:
    """A foreign default stream that declares no device, as a bare protocol object."""

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, 1)


class _Device:
    def __init__(self, device_id: int) -> None:
        self.device_id = device_id


class _CudaCoreDefaultStream:
    """cuda.core's shape: handle 1, and the device it belongs to."""

    def __init__(self, device_id: int) -> None:
        self.device = _Device(device_id)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, 1)


def _pending_at(manager: ResidencyManager, location: object) -> int:
    (entry,) = [e for e in manager.snapshot().locations if e.location == location]
    return int(entry.pending_event_count)


def test_a_lease_keeps_the_device_of_its_default_stream_handle() -> None:
    # The consumer named "the default stream" while cuda:1 was current. The release
    # runs on a thread whose current device is cuda:0, and must still record its
    # event on cuda:1's default stream: recorded on cuda:0, protection would end
    # when cuda:0's unrelated work does.
    cuda1 = cuda_location("cuda:1")
    runtime = SimulatedRuntime(2)
    with use_runtime(runtime):
        manager = ResidencyManager()
    handle = manager.adopt(runtime.to_device(ResidentTensor(torch.arange(4.0)), "cuda:1"))
    runtime.set_device(1)
    lease = manager.acquire([handle], at=cuda1, consumer_stream=_LegacyDefaultStream())
    releaser = threading.Thread(target=lease.release)
    releaser.start()
    releaser.join()
    assert _pending_at(manager, cuda1) == 1
    runtime.synchronize_device(torch.device("cuda", 0))
    assert _pending_at(manager, cuda1) == 1, "the release event was recorded on cuda:0"
    runtime.synchronize_device(torch.device("cuda", 1))
    assert _pending_at(manager, cuda1) == 0
    manager.close()


def test_a_default_stream_handle_is_checked_against_the_current_device() -> None:
    runtime = SimulatedRuntime(2)
    with use_runtime(runtime):
        manager = ResidencyManager()
    handle = manager.adopt(runtime.to_device(ResidentTensor(torch.arange(4.0)), "cuda:1"))
    cuda1 = cuda_location("cuda:1")
    # cuda:0 is current: a bare default-stream handle is cuda:0's default stream.
    with pytest.raises(ValueError, match="cuda:0"):
        manager.acquire([handle], at=cuda1, consumer_stream=_LegacyDefaultStream())
    # A stream object that declares its device is taken at its word.
    with manager.acquire([handle], at=cuda1, consumer_stream=_CudaCoreDefaultStream(1)):
        pass
    manager.close()


def test_torch_runtime_maps_default_stream_handles_to_torch_default_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch refuses ExternalStream(1); the runtime never builds one for 0, 1 or 2.
    class _DefaultStream:
        def __init__(self, device: torch.device) -> None:
            self.device = device
            self.device_index = device.index

    def refuse(*args: object, **kwargs: object) -> object:
        raise RuntimeError("torch refuses this stream id")

    monkeypatch.setattr(torch_runtime, "_ExternalStream", refuse)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: _DefaultStream(device))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    runtime = torch_runtime.TorchCudaRuntime()
    cuda1 = torch.device("cuda", 1)
    bound = runtime.bind_stream(_LegacyDefaultStream(), cuda1)
    assert isinstance(bound, _DefaultStream)
    assert bound.device == cuda1
    # Unbound, a bare handle is the current device's; a declared device wins.
    assert runtime.stream_device(_LegacyDefaultStream()) == torch.device("cuda", 0)
    assert runtime.stream_device(_CudaCoreDefaultStream(1)) == cuda1


# --------------------------------------------------------------------------------------------
# Producer ordering (docs/concepts/values.md#cuda-values): a CUDA source is complete on its
# device's current stream; a copy on another stream waits for that stream first.
# --------------------------------------------------------------------------------------------


class _FakeStream:
    def __init__(self, name: str, index: int) -> None:
        self.name = name
        self.device_index = index
        self.device = torch.device("cuda", index)
        self.waited: list[_FakeStream] = []

    def wait_stream(self, other: _FakeStream) -> None:
        self.waited.append(other)


class _CudaValue:
    """Stands for a TensorResident on a CUDA device (only what the copy reads)."""

    def __init__(self, index: int) -> None:
        self.device = torch.device("cuda", index)

    def to(self, device: torch.device, *, copy: bool, non_blocking: bool) -> _CudaValue:
        return _CudaValue(device.index or 0)


@pytest.mark.parametrize("same_stream", [True, False])
def test_a_copy_on_another_stream_waits_for_the_source_devices_current_stream(
    monkeypatch: pytest.MonkeyPatch, same_stream: bool
) -> None:
    import contextlib

    current = {0: _FakeStream("current:0", 0), 1: _FakeStream("current:1", 1)}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[device.index])
    monkeypatch.setattr(torch_runtime, "_Stream", _FakeStream)
    monkeypatch.setattr(torch_runtime, "_device_guard", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch_runtime, "_stream_guard", lambda stream: contextlib.nullcontext())
    runtime = torch_runtime.TorchCudaRuntime()
    transfer = current[1] if same_stream else _FakeStream("transfer:1", 1)
    runtime.copy_to_cuda(
        _CudaValue(0),  # type: ignore[arg-type]
        torch.device("cuda", 1),
        transfer,
        non_blocking=True,
    )
    assert transfer.waited == [current[0]]
    # A copy within one device on its current stream needs no wait.
    runtime.copy_to_cuda(
        _CudaValue(1),  # type: ignore[arg-type]
        torch.device("cuda", 1),
        current[1],
        non_blocking=True,
    )
    assert current[1].waited == ([current[0]] if same_stream else [])
