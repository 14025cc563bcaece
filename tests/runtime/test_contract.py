"""The device seam's contract, run against every runtime (docs/architecture.md#the-device-seam).

The simulated runtime runs every case; `TorchCudaRuntime` runs the host cases everywhere and
its CUDA cases only where torch sees a GPU. Simulation-only instrumentation and the
process-wide runtime selection are tested at the end.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from fhelium.residency._runtime import (
    DeviceRuntime,
    SimulatedCopy,
    SimulatedEvent,
    SimulatedRuntime,
    SimulatedStream,
    TorchCudaRuntime,
    current_runtime,
    set_runtime,
    use_runtime,
)
from fhelium.residency._runtime import torch_runtime as torch_runtime_module
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, cuda_location
from fhelium.values import ResidentTensor, TensorBundle, TensorResident
from fhelium.values.tensor_resident import cpu_pinning_is_uniform, storage_keys
from helpers.records import Empty

CUDA = torch.cuda.is_available()
CPU = torch.device("cpu")
CUDA0 = torch.device("cuda", 0)
CUDA1 = torch.device("cuda", 1)


def _real_pinning_available() -> bool:
    try:
        return torch.empty(1, pin_memory=True).is_pinned()
    except RuntimeError:
        return False


# --------------------------------------------------------------------------------------------
# One harness per runtime: how a test obtains CUDA / pinned values, streams and busy work.
# --------------------------------------------------------------------------------------------


@dataclass
class Harness:
    kind: str
    runtime: DeviceRuntime
    cuda_devices: tuple[torch.device, ...]
    pinned: bool

    def require_cuda(self, count: int = 1) -> None:
        if len(self.cuda_devices) < count:
            pytest.skip(f"{self.kind} runtime has fewer than {count} CUDA device(s) here")

    def require_pinned(self) -> None:
        if not self.pinned:
            pytest.skip(f"{self.kind} runtime has no pinned host memory here")

    def to_cuda(self, value: TensorResident, device: torch.device) -> TensorResident:
        if isinstance(self.runtime, SimulatedRuntime):
            return self.runtime.to_device(value, device)
        return value.to(device, copy=True)

    def pin(self, value: TensorResident) -> TensorResident:
        if isinstance(self.runtime, SimulatedRuntime):
            return self.runtime.pin(value)
        return value.pin_memory(copy=True)

    def new_stream(self, device: torch.device) -> Any:
        if isinstance(self.runtime, SimulatedRuntime):
            return SimulatedStream(self.runtime, device)
        return torch.cuda.Stream(device)

    def make_busy(self, stream: Any) -> None:
        """Enqueue work that keeps events recorded after it incomplete for a while."""
        if isinstance(self.runtime, SimulatedRuntime):
            return  # simulated events stay incomplete until the test completes them
        # _sleep launches on the current device's current stream, so make both the stream's.
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000_000)  # about a second of GPU time

    def is_cuda_tensor(self, tensor: torch.Tensor) -> bool:
        value = ResidentTensor(tensor)
        return self.runtime.value_device(value).type == "cuda"


def _simulated() -> Harness:
    return Harness("simulated", SimulatedRuntime(2), (CUDA0, CUDA1), pinned=True)


def _torch() -> Harness:
    count = torch.cuda.device_count() if CUDA else 0
    devices = tuple(torch.device("cuda", index) for index in range(count))
    return Harness("torch", TorchCudaRuntime(), devices, pinned=_real_pinning_available())


@pytest.fixture(params=["simulated", "torch"])
def harness(request: pytest.FixtureRequest) -> Harness:
    return _simulated() if request.param == "simulated" else _torch()


@pytest.fixture
def sim() -> SimulatedRuntime:
    return SimulatedRuntime(2)


def _value() -> TensorBundle:
    return TensorBundle(
        weight=torch.arange(12, dtype=torch.float32).reshape(3, 4), bias=torch.ones(4)
    )


def _tensors(value: TensorResident) -> tuple[torch.Tensor, ...]:
    return value._resident_tensors


def _host(value: TensorResident) -> tuple[torch.Tensor, ...]:
    return tuple(tensor.cpu() for tensor in _tensors(value))


def _assert_same_data(a: TensorResident, b: TensorResident) -> None:
    for x, y in zip(_host(a), _host(b), strict=True):
        assert torch.equal(x, y)


def _assert_independent(runtime: DeviceRuntime, a: TensorResident, b: TensorResident) -> None:
    """No storage shared, and mutating one value leaves the other unchanged."""
    assert runtime.storage_keys(a).isdisjoint(runtime.storage_keys(b))
    before = _host(b)
    with torch.no_grad():
        for tensor in _tensors(a):
            tensor.add_(1)
    for old, new in zip(before, _host(b), strict=True):
        assert torch.equal(old, new)


# --------------------------------------------------------------------------------------------
# Identity and availability.
# --------------------------------------------------------------------------------------------


def test_runtime_satisfies_protocol(harness: Harness) -> None:
    assert isinstance(harness.runtime, DeviceRuntime)
    assert isinstance(harness.runtime.name, str)
    assert harness.runtime.name


def test_names() -> None:
    assert TorchCudaRuntime().name == "torch-cuda"
    assert SimulatedRuntime().name == "simulated"


def test_availability(harness: Harness) -> None:
    runtime = harness.runtime
    assert runtime.device_count() == len(harness.cuda_devices)
    assert runtime.cuda_available() is (len(harness.cuda_devices) > 0)


def test_torch_availability_matches_torch() -> None:
    runtime = TorchCudaRuntime()
    assert runtime.cuda_available() is torch.cuda.is_available()
    assert runtime.device_count() == torch.cuda.device_count()


def test_simulated_without_devices() -> None:
    runtime = SimulatedRuntime(0)
    assert runtime.cuda_available() is False
    assert runtime.device_count() == 0
    with pytest.raises(ValueError, match="not a simulated CUDA device"):
        runtime.current_stream(CUDA0)


# --------------------------------------------------------------------------------------------
# Facts about values.
# --------------------------------------------------------------------------------------------


def test_pageable_facts(harness: Harness) -> None:
    runtime, value = harness.runtime, _value()
    assert runtime.value_device(value) == CPU
    assert runtime.value_is_pinned(value) is False
    assert runtime.pinning_is_uniform(value) is True
    assert runtime.storage_keys(value) == storage_keys(value)
    assert cpu_pinning_is_uniform(value)


def test_pinned_facts(harness: Harness) -> None:
    harness.require_pinned()
    runtime = harness.runtime
    pinned = harness.pin(_value())
    assert runtime.value_device(pinned) == CPU
    assert runtime.value_is_pinned(pinned) is True
    assert runtime.pinning_is_uniform(pinned) is True
    assert {device for device, _ in runtime.storage_keys(pinned)} == {CPU}


def test_mixed_pinning_is_not_uniform(harness: Harness) -> None:
    harness.require_pinned()
    runtime = harness.runtime
    pinned = harness.pin(ResidentTensor(torch.ones(3)))
    mixed = TensorBundle(a=_tensors(pinned)[0], b=torch.zeros(2))
    assert runtime.value_device(mixed) == CPU
    assert runtime.pinning_is_uniform(mixed) is False
    assert runtime.value_is_pinned(mixed) is False


def test_cuda_facts(harness: Harness) -> None:
    harness.require_cuda()
    runtime = harness.runtime
    for device in harness.cuda_devices:
        value = harness.to_cuda(_value(), device)
        assert runtime.value_device(value) == device
        assert runtime.value_is_pinned(value) is False
        assert runtime.pinning_is_uniform(value) is True
        assert {key_device for key_device, _ in runtime.storage_keys(value)} == {device}


def test_value_device_without_tensors_raises(harness: Harness) -> None:
    with pytest.raises(RuntimeError):
        harness.runtime.value_device(Empty())
    with pytest.raises(RuntimeError):
        harness.runtime.value_is_pinned(Empty())
    assert harness.runtime.pinning_is_uniform(Empty()) is True
    assert harness.runtime.storage_keys(Empty()) == frozenset()


def test_value_device_mixed_devices_raises(harness: Harness) -> None:
    harness.require_cuda()
    runtime = harness.runtime
    on_cuda = _tensors(harness.to_cuda(ResidentTensor(torch.ones(2)), harness.cuda_devices[0]))
    mixed = TensorBundle(a=on_cuda[0], b=torch.ones(2))
    with pytest.raises(RuntimeError, match="several devices"):
        runtime.value_device(mixed)
    with pytest.raises(RuntimeError, match="several devices"):
        runtime.value_is_pinned(mixed)
    # Only host tensors take part in the pinning rule.
    assert runtime.pinning_is_uniform(mixed) is True


def test_value_device_two_cuda_devices_raises(harness: Harness) -> None:
    harness.require_cuda(2)
    first = _tensors(harness.to_cuda(ResidentTensor(torch.ones(2)), harness.cuda_devices[0]))
    second = _tensors(harness.to_cuda(ResidentTensor(torch.ones(2)), harness.cuda_devices[1]))
    with pytest.raises(RuntimeError, match="several devices"):
        harness.runtime.value_device(TensorBundle(a=first[0], b=second[0]))


# --------------------------------------------------------------------------------------------
# Storage keys.
# --------------------------------------------------------------------------------------------


def _views_of_one_storage(harness: Harness, device: torch.device | None) -> TensorBundle:
    base = ResidentTensor(torch.arange(16, dtype=torch.float32))
    if device is not None:
        base = harness.to_cuda(base, device)  # type: ignore[assignment]
    whole = _tensors(base)[0]
    return TensorBundle(head=whole[:4], tail=whole[8:], same=whole)


@pytest.mark.parametrize("on_cuda", [False, True], ids=["host", "cuda"])
def test_views_share_one_key(harness: Harness, on_cuda: bool) -> None:
    device = None
    if on_cuda:
        harness.require_cuda()
        device = harness.cuda_devices[0]
    value = _views_of_one_storage(harness, device)
    keys = harness.runtime.storage_keys(value)
    whole = value["same"]
    assert keys == {(device or CPU, whole.untyped_storage().data_ptr())}


def test_distinct_storages_have_distinct_keys(harness: Harness) -> None:
    runtime = harness.runtime
    value = TensorBundle(a=torch.ones(3), b=torch.ones(3))
    assert len(runtime.storage_keys(value)) == 2


def test_empty_storage_has_no_key(harness: Harness) -> None:
    runtime = harness.runtime
    value = TensorBundle(a=torch.empty(0), b=torch.ones(2))
    assert runtime.storage_keys(value) == {(CPU, value["b"].untyped_storage().data_ptr())}
    if harness.cuda_devices:
        on_cuda = harness.to_cuda(ResidentTensor(torch.empty(0)), harness.cuda_devices[0])
        assert runtime.storage_keys(on_cuda) == frozenset()


def test_keys_on_two_devices_never_collide(harness: Harness) -> None:
    harness.require_cuda(2)
    runtime = harness.runtime
    source = _value()
    first = harness.to_cuda(source, harness.cuda_devices[0])
    second = harness.to_cuda(source, harness.cuda_devices[1])
    keys_first, keys_second = runtime.storage_keys(first), runtime.storage_keys(second)
    assert keys_first.isdisjoint(keys_second)
    assert keys_first.isdisjoint(runtime.storage_keys(source))
    assert {device for device, _ in keys_first} == {harness.cuda_devices[0]}
    assert {device for device, _ in keys_second} == {harness.cuda_devices[1]}


# --------------------------------------------------------------------------------------------
# Movement.
# --------------------------------------------------------------------------------------------


def _sources(harness: Harness) -> list[tuple[str, TensorResident]]:
    sources: list[tuple[str, TensorResident]] = [("pageable", _value())]
    if harness.pinned:
        sources.append(("pinned", harness.pin(_value())))
    sources.extend(
        (str(device), harness.to_cuda(_value(), device)) for device in harness.cuda_devices
    )
    return sources


def test_copy_to_pageable(harness: Harness) -> None:
    runtime = harness.runtime
    for label, source in _sources(harness):
        copy = runtime.copy_to_pageable(source)
        assert type(copy) is type(source), label
        assert copy is not source
        assert copy.names == source.names  # type: ignore[attr-defined]
        assert runtime.value_device(copy) == CPU, label
        assert runtime.value_is_pinned(copy) is False, label
        _assert_same_data(copy, source)
        _assert_independent(runtime, copy, source)
        _assert_independent(runtime, source, copy)


def test_copy_to_pinned(harness: Harness) -> None:
    harness.require_pinned()
    runtime = harness.runtime
    for label, source in _sources(harness):
        copy = runtime.copy_to_pinned(source)
        assert type(copy) is type(source), label
        assert runtime.value_device(copy) == CPU, label
        assert runtime.value_is_pinned(copy) is True, label
        assert runtime.pinning_is_uniform(copy) is True
        _assert_same_data(copy, source)
        _assert_independent(runtime, copy, source)


def test_copy_to_pinned_keeps_strides_and_requires_grad(harness: Harness) -> None:
    harness.require_pinned()
    transposed = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    leaf = torch.ones(3, requires_grad=True)
    copy = harness.runtime.copy_to_pinned(TensorBundle(t=transposed, leaf=leaf))
    assert isinstance(copy, TensorBundle)
    assert copy["t"].stride() == transposed.stride()
    assert torch.equal(copy["t"], transposed)
    assert copy["leaf"].requires_grad
    assert copy["leaf"].grad_fn is None  # copied without autograd tracking


def test_copy_to_pinned_unavailable_raises(harness: Harness) -> None:
    if harness.pinned:
        pytest.skip("pinned memory is available here")
    with pytest.raises(RuntimeError, match="pinned"):
        harness.runtime.copy_to_pinned(_value())


def test_simulated_without_pinning_raises() -> None:
    runtime = SimulatedRuntime(2, pinned=False)
    assert runtime.pinned_available is False
    with pytest.raises(RuntimeError, match="pinned"):
        runtime.copy_to_pinned(_value())
    with pytest.raises(RuntimeError, match="pinned"):
        runtime.pin(_value())


def test_copy_to_cuda(harness: Harness) -> None:
    harness.require_cuda()
    runtime = harness.runtime
    for device in harness.cuda_devices:
        stream = harness.new_stream(device)
        for label, source in _sources(harness):
            non_blocking = label != "pageable"
            copy = runtime.copy_to_cuda(source, device, stream, non_blocking=non_blocking)
            runtime.synchronize_stream(stream)
            assert type(copy) is type(source)
            assert runtime.value_device(copy) == device, label
            assert runtime.value_is_pinned(copy) is False
            _assert_same_data(copy, source)
            _assert_independent(runtime, copy, source)
            _assert_independent(runtime, source, copy)


def test_copy_to_cuda_from_same_device_is_new_storage(harness: Harness) -> None:
    harness.require_cuda()
    runtime, device = harness.runtime, harness.cuda_devices[0]
    source = harness.to_cuda(_value(), device)
    copy = runtime.copy_to_cuda(source, device, runtime.current_stream(device), non_blocking=True)
    runtime.synchronize_stream(runtime.current_stream(device))
    assert runtime.value_device(copy) == device
    _assert_independent(runtime, copy, source)


def test_copy_to_cuda_default_stream(harness: Harness) -> None:
    harness.require_cuda()
    runtime, device = harness.runtime, harness.cuda_devices[-1]
    copy = runtime.copy_to_cuda(_value(), device, None, non_blocking=False)
    runtime.synchronize_device(device)
    assert runtime.value_device(copy) == device


def test_copy_to_cuda_rejects_stream_of_other_device(harness: Harness) -> None:
    harness.require_cuda(2)
    runtime = harness.runtime
    first, second = harness.cuda_devices[:2]
    with pytest.raises(ValueError, match="not on"):
        runtime.copy_to_cuda(_value(), first, harness.new_stream(second), non_blocking=False)


# --------------------------------------------------------------------------------------------
# Byte buffers and byte copies (the disk tier's staging).
# --------------------------------------------------------------------------------------------


def test_empty_pinned_is_a_flat_pinned_byte_buffer(harness: Harness) -> None:
    harness.require_pinned()
    buffer = harness.runtime.empty_pinned(4096)
    assert (buffer.dtype, tuple(buffer.shape), buffer.device) == (torch.uint8, (4096,), CPU)
    assert harness.runtime.value_is_pinned(ResidentTensor(buffer))


def test_copy_bytes_round_trips_through_a_device(harness: Harness) -> None:
    harness.require_cuda()
    harness.require_pinned()
    runtime = harness.runtime
    for device in harness.cuda_devices:
        stream = harness.new_stream(device)
        source = runtime.empty_pinned(10_000)
        source.copy_(torch.arange(10_000) % 251)
        on_device = runtime.empty_cuda(10_000, device, stream)
        assert runtime.value_device(ResidentTensor(on_device)) == device
        back = runtime.empty_pinned(10_000)
        runtime.copy_bytes(on_device[100:], source[100:], stream)  # byte ranges of a buffer
        runtime.copy_bytes(on_device[:100], source[:100], stream)
        runtime.copy_bytes(back, on_device, stream)
        runtime.synchronize_event(runtime.record_event(stream))
        assert torch.equal(back, source)


# --------------------------------------------------------------------------------------------
# Streams and events.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "obj", [None, object(), 3, "cuda:0", torch.ones(1)], ids=["None", "object", "int", "str", "t"]
)
def test_non_streams(harness: Harness, obj: object) -> None:
    assert harness.runtime.is_stream(obj) is False


def test_streams_and_their_devices(harness: Harness) -> None:
    harness.require_cuda()
    runtime = harness.runtime
    for device in harness.cuda_devices:
        current = runtime.current_stream(device)
        assert runtime.is_stream(current)
        assert runtime.stream_device(current) == device
        assert runtime.current_stream(device) == current
        stream = harness.new_stream(device)
        assert runtime.is_stream(stream)
        assert runtime.stream_device(stream) == device


def test_stream_device_mismatch_is_visible(harness: Harness) -> None:
    harness.require_cuda(2)
    runtime = harness.runtime
    first, second = harness.cuda_devices[:2]
    stream = harness.new_stream(second)
    assert runtime.stream_device(stream) != first
    assert runtime.current_stream(first) != runtime.current_stream(second)


def test_event_incomplete_until_synchronize_event(harness: Harness) -> None:
    harness.require_cuda()
    runtime = harness.runtime
    stream = harness.new_stream(harness.cuda_devices[0])
    harness.make_busy(stream)
    event = runtime.record_event(stream)
    assert runtime.event_query(event) is False
    runtime.synchronize_event(event)
    assert runtime.event_query(event) is True


def test_event_completed_by_synchronize_stream(harness: Harness) -> None:
    harness.require_cuda()
    runtime = harness.runtime
    stream = harness.new_stream(harness.cuda_devices[0])
    harness.make_busy(stream)
    event = runtime.record_event(stream)
    assert runtime.event_query(event) is False
    runtime.synchronize_stream(stream)
    assert runtime.event_query(event) is True


def test_event_completed_by_synchronize_device(harness: Harness) -> None:
    harness.require_cuda()
    runtime = harness.runtime
    device = harness.cuda_devices[-1]
    stream = harness.new_stream(device)
    harness.make_busy(stream)
    event = runtime.record_event(stream)
    assert runtime.event_query(event) is False
    runtime.synchronize_device(device)
    assert runtime.event_query(event) is True


def test_events_on_each_device(harness: Harness) -> None:
    harness.require_cuda()
    runtime = harness.runtime
    for device in harness.cuda_devices:
        event = runtime.record_event(runtime.current_stream(device))
        runtime.synchronize_event(event)
        assert runtime.event_query(event) is True


# --------------------------------------------------------------------------------------------
# Allocator readings.
# --------------------------------------------------------------------------------------------


def test_allocator_readings_track_cuda_storage(harness: Harness) -> None:
    harness.require_cuda()
    runtime, device = harness.runtime, harness.cuda_devices[0]
    gc.collect()
    allocated, reserved = runtime.memory_allocated(device), runtime.memory_reserved(device)
    assert isinstance(allocated, int)
    assert isinstance(reserved, int)
    assert reserved >= allocated
    nbytes = 1 << 20
    value = harness.to_cuda(ResidentTensor(torch.zeros(nbytes, dtype=torch.uint8)), device)
    grown = runtime.memory_allocated(device)
    grown_reserved = runtime.memory_reserved(device)
    assert grown is not None
    assert grown_reserved is not None
    assert grown - allocated >= nbytes
    assert grown_reserved >= grown
    del value
    gc.collect()
    assert runtime.memory_allocated(device) == allocated


def test_allocator_readings_none_off_device(harness: Harness) -> None:
    runtime = harness.runtime
    beyond = torch.device("cuda", len(harness.cuda_devices) + 3)
    for device in (CPU, beyond):
        assert runtime.memory_allocated(device) is None
        assert runtime.memory_reserved(device) is None


def test_torch_allocator_readings_without_cuda() -> None:
    if CUDA:
        pytest.skip("CUDA is available here")
    runtime = TorchCudaRuntime()
    assert runtime.memory_allocated(CUDA0) is None
    assert runtime.memory_reserved(CUDA0) is None


def test_torch_allocator_sampling_failure_reads_none(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object) -> int:
        raise RuntimeError("allocator exploded")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", boom, raising=False)
    runtime = TorchCudaRuntime()
    assert runtime.memory_allocated(CUDA0) is None
    assert runtime.memory_reserved(CUDA0) is None
    assert runtime.memory_sample(CUDA0) is None


def _nested_stats(allocated: int, reserved: int) -> dict[str, object]:
    """The shape of torch's nested allocator statistics, the two figures read here."""
    return {
        "allocated_bytes": {"all": {"current": allocated, "peak": allocated}},
        "reserved_bytes": {"all": {"current": reserved, "peak": reserved}},
    }


def test_torch_allocator_sample_is_one_query(monkeypatch: pytest.MonkeyPatch) -> None:
    # Both figures come from one query of the nested statistics; the public per-figure
    # functions (each flattens and sorts the whole dictionary) are never called.
    queried: list[object] = []

    def nested(index: object) -> dict[str, object]:
        queried.append(index)
        return _nested_stats(1024, 4096)

    def flattening(*args: object) -> int:
        raise AssertionError("the flattening statistics call was used")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", nested, raising=False)
    for name in ("memory_stats", "memory_allocated", "memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, flattening)
    runtime = TorchCudaRuntime()
    assert runtime.memory_sample(torch.device("cuda", 1)) == (1024, 4096)
    assert queried == [1]
    assert runtime.memory_allocated(CUDA0) == 1024
    assert runtime.memory_reserved(CUDA0) == 4096


def test_torch_allocator_sample_before_cuda_initialises(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch reports zero before CUDA is initialised; sampling does not initialise it.
    def initialising(*args: object) -> object:
        raise AssertionError("sampling queried (and so initialised) CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", initialising, raising=False)
    assert TorchCudaRuntime().memory_sample(CUDA0) == (0, 0)


def test_torch_allocator_sample_without_the_nested_query(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.delattr(torch._C, "_cuda_memoryStats", raising=False)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 7)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 512)
    assert TorchCudaRuntime().memory_sample(CUDA0) == (7, 512)


# --------------------------------------------------------------------------------------------
# TorchCudaRuntime: the CUDA stream protocol (host-side parts; the real device in tests/gpu).
# --------------------------------------------------------------------------------------------


class ProtocolStream:
    """A foreign stream in the style of CuPy / cuda.core."""

    def __init__(self, handle: int, device_id: int | None = None, version: int = 0) -> None:
        self.handle = handle
        self.version = version
        if device_id is not None:
            self.device_id = device_id

    def __cuda_stream__(self) -> tuple[int, int]:
        return (self.version, self.handle)


class Plain:
    pass


class MalformedStream:
    def __init__(self, described: object) -> None:
        self.described = described

    def __cuda_stream__(self) -> object:
        return self.described


def test_protocol_object_is_a_stream() -> None:
    runtime = TorchCudaRuntime()
    assert runtime.is_stream(ProtocolStream(0x1234)) is True
    # The protocol is looked up on the type, as for any special method.
    instance_only = Plain()
    instance_only.__cuda_stream__ = lambda: (0, 0x1234)  # type: ignore[attr-defined]
    assert runtime.is_stream(instance_only) is False


def test_protocol_stream_device_falls_back_to_declared_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without a driver answer, the object's own device ordinal is used.
    monkeypatch.setattr(torch_runtime_module, "_driver_stream_device", lambda handle: None)
    runtime = TorchCudaRuntime()
    assert runtime.stream_device(ProtocolStream(0x1234, device_id=3)) == torch.device("cuda", 3)
    with pytest.raises(ValueError, match="cannot determine"):
        runtime.stream_device(ProtocolStream(0x1234))


def test_protocol_stream_device_prefers_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_runtime_module, "_driver_stream_device", lambda handle: 1)
    runtime = TorchCudaRuntime()
    assert runtime.stream_device(ProtocolStream(0x1234, device_id=3)) == CUDA1


@pytest.mark.parametrize(
    "described",
    [(1, 0x1234), (0,), [0, 0x1234], (0, "0x1234"), (True, 0x1234), None],
    ids=["version-1", "short", "list", "str-handle", "bool-version", "None"],
)
def test_protocol_stream_malformed(described: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_runtime_module, "_driver_stream_device", lambda handle: 0)
    with pytest.raises(TypeError):
        TorchCudaRuntime().stream_device(MalformedStream(described))


def test_torch_stream_operations_reject_non_streams() -> None:
    runtime = TorchCudaRuntime()
    with pytest.raises(TypeError):
        runtime.stream_device(object())
    with pytest.raises(TypeError):
        runtime.synchronize_stream(object())
    with pytest.raises(TypeError):
        runtime.record_event("stream")


def test_torch_value_facts_are_the_value_helpers() -> None:
    runtime = TorchCudaRuntime()
    value = TensorBundle(a=torch.ones(2), b=torch.ones(2)[1:])
    assert runtime.value_device(value) == value.device
    assert runtime.value_is_pinned(value) == value.is_pinned
    assert runtime.pinning_is_uniform(value) == cpu_pinning_is_uniform(value)
    assert runtime.storage_keys(value) == storage_keys(value)


# --------------------------------------------------------------------------------------------
# SimulatedRuntime: placement registry.
# --------------------------------------------------------------------------------------------


def test_simulated_placements(sim: SimulatedRuntime) -> None:
    value = _value()
    assert sim.placement(value) == PAGEABLE_HOST
    assert sim.placement(sim.pin(value)) == PINNED_HOST
    assert sim.placement(sim.to_device(value, 1)) == cuda_location(CUDA1)
    assert sim.placement(sim.to_device(value, "cuda:0")) == cuda_location(CUDA0)
    assert sim.placement(value["weight"]) == PAGEABLE_HOST
    # The backing tensors really are ordinary CPU tensors.
    assert all(tensor.device == CPU for tensor in _tensors(sim.to_device(value, 1)))


def test_simulated_placement_rejects_ambiguous_values(sim: SimulatedRuntime) -> None:
    with pytest.raises(RuntimeError):
        sim.placement(Empty())
    on_cuda = _tensors(sim.to_device(ResidentTensor(torch.ones(2)), 0))[0]
    with pytest.raises(RuntimeError, match="mixed"):
        sim.placement(TensorBundle(a=on_cuda, b=torch.ones(2)))


def test_simulated_helpers_reject_unknown_devices(sim: SimulatedRuntime) -> None:
    for device in (2, "cuda:5", "cpu", torch.device("cpu"), "nonsense", -1):
        with pytest.raises(ValueError, match="not a simulated CUDA device"):
            sim.to_device(_value(), device)
        with pytest.raises(ValueError, match="not a simulated CUDA device"):
            SimulatedStream(sim, device)


def test_simulated_views_and_clones_of_registered_storage(sim: SimulatedRuntime) -> None:
    on_cuda = sim.to_device(ResidentTensor(torch.arange(8.0)), 1).tensor
    view = on_cuda[2:5]
    assert sim.placement(view) == cuda_location(CUDA1)
    # A clone made outside the runtime is new host storage, not simulated CUDA storage.
    assert sim.placement(view.clone()) == PAGEABLE_HOST


def test_simulated_address_reuse_is_not_mistaken_for_registered(sim: SimulatedRuntime) -> None:
    # Free a simulated CUDA storage, then allocate same-sized host tensors (kept alive, so the
    # allocator must hand out other free blocks) until one lands on the freed address.
    numel = 1024
    for _ in range(20):
        source = torch.zeros(numel)
        value = sim.to_device(ResidentTensor(source), 0)
        address = value.tensor.untyped_storage().data_ptr()
        del value
        kept = []
        for _ in range(64):
            fresh = torch.ones(numel)
            kept.append(fresh)
            assert sim.placement(fresh) == PAGEABLE_HOST
            assert sim.storage_keys(ResidentTensor(fresh)) == {
                (CPU, fresh.untyped_storage().data_ptr())
            }
            if fresh.untyped_storage().data_ptr() == address:
                assert sim.value_device(ResidentTensor(fresh)) == CPU
                assert sim.memory_allocated(CUDA0) == 0
                return
    pytest.skip("the host allocator never reused a freed address")


def test_simulated_registry_does_not_grow_without_bound(sim: SimulatedRuntime) -> None:
    for _ in range(500):
        sim.to_device(ResidentTensor(torch.ones(4)), 0)
    gc.collect()
    assert sim.memory_allocated(CUDA0) == 0
    assert len(sim._storage.entries) < 200


def test_simulated_copy_to_cuda_from_cpu_clones(sim: SimulatedRuntime) -> None:
    source = ResidentTensor(torch.ones(4))
    copy = sim.copy_to_cuda(source, CUDA0, sim.current_stream(CUDA0), non_blocking=False)
    assert isinstance(copy, ResidentTensor)
    assert copy.tensor.untyped_storage().data_ptr() != source.tensor.untyped_storage().data_ptr()
    assert sim.placement(source) == PAGEABLE_HOST
    assert sim.placement(copy) == cuda_location(CUDA0)


def test_simulated_copy_to_cuda_rejects_foreign_streams(sim: SimulatedRuntime) -> None:
    with pytest.raises(TypeError):
        sim.copy_to_cuda(_value(), CUDA0, object(), non_blocking=False)
    with pytest.raises(ValueError, match="not a simulated CUDA device"):
        sim.copy_to_cuda(_value(), torch.device("cuda", 7), None, non_blocking=False)


def test_simulated_copies_log(sim: SimulatedRuntime) -> None:
    stream = SimulatedStream(sim, 1)
    pinned = sim.copy_to_pinned(_value())
    sim.copy_to_cuda(pinned, CUDA1, stream, non_blocking=True)
    sim.copy_to_pageable(pinned)
    assert sim.copies == [
        SimulatedCopy(PINNED_HOST, None, non_blocking=False),
        SimulatedCopy(cuda_location(CUDA1), stream, non_blocking=True),
        SimulatedCopy(PAGEABLE_HOST, None, non_blocking=False),
    ]


def test_simulated_allocator_readings(sim: SimulatedRuntime) -> None:
    assert sim.memory_allocated(CUDA0) == 0
    assert sim.memory_reserved(CUDA0) == 0
    value = sim.to_device(ResidentTensor(torch.zeros(100, dtype=torch.uint8)), 0)
    pinned = sim.pin(ResidentTensor(torch.zeros(1000, dtype=torch.uint8)))
    assert sim.memory_allocated(CUDA0) == 100
    assert sim.memory_reserved(CUDA0) == 512
    assert sim.memory_allocated(CUDA1) == 0
    del value
    gc.collect()
    assert sim.memory_allocated(CUDA0) == 0
    assert sim.memory_reserved(CUDA0) == 0
    assert sim.placement(pinned) == PINNED_HOST
    for device in (CPU, torch.device("cuda", 2)):
        assert sim.memory_allocated(device) is None
        assert sim.memory_reserved(device) is None


# --------------------------------------------------------------------------------------------
# SimulatedRuntime: streams and events under test control.
# --------------------------------------------------------------------------------------------


def test_simulated_stream_objects(sim: SimulatedRuntime) -> None:
    stream = SimulatedStream(sim, "cuda:1")
    assert stream.device == CUDA1
    assert stream.runtime is sim
    assert sim.current_stream(CUDA0) is sim.current_stream(torch.device("cuda", 0))
    assert sim.current_stream(CUDA0) is not sim.current_stream(CUDA1)
    assert sim.is_stream(torch.cuda.Stream) is False
    # The seam is the only way to synchronise or query: no torch-style shortcuts.
    assert not hasattr(stream, "synchronize")
    assert not hasattr(sim.record_event(stream), "query")
    with pytest.raises(TypeError):
        SimulatedStream(object(), 0)  # type: ignore[arg-type]


def test_simulated_events_wait_for_the_test(sim: SimulatedRuntime) -> None:
    stream = SimulatedStream(sim, 0)
    first, second = sim.record_event(stream), sim.record_event(stream)
    assert isinstance(first, SimulatedEvent)
    assert first.device == CUDA0
    assert first.stream is stream
    assert sim.pending_event_count() == 2
    assert not sim.event_query(first)
    first.complete()
    assert sim.event_query(first)
    assert not sim.event_query(second)
    assert sim.pending_event_count() == 1
    assert sim.complete_events() == 1
    assert sim.event_query(second)
    assert sim.complete_events() == 0


def test_simulated_synchronize_stream_is_per_stream(sim: SimulatedRuntime) -> None:
    a, b = SimulatedStream(sim, 0), SimulatedStream(sim, 0)
    on_a, on_b = sim.record_event(a), sim.record_event(b)
    sim.synchronize_stream(a)
    assert sim.event_query(on_a)
    assert not sim.event_query(on_b)


def test_simulated_synchronize_device_is_per_device(sim: SimulatedRuntime) -> None:
    on_0 = sim.record_event(sim.current_stream(CUDA0))
    on_1 = sim.record_event(SimulatedStream(sim, 1))
    sim.synchronize_device(CUDA1)
    assert sim.event_query(on_1)
    assert not sim.event_query(on_0)
    with pytest.raises(ValueError, match="not a simulated CUDA device"):
        sim.synchronize_device(torch.device("cuda", 2))


def test_simulated_auto_complete() -> None:
    runtime = SimulatedRuntime(1, auto_complete=True)
    event = runtime.record_event(runtime.current_stream(CUDA0))
    assert runtime.event_query(event)
    assert runtime.pending_event_count() == 0


def test_simulated_rejects_foreign_streams_and_events(sim: SimulatedRuntime) -> None:
    with pytest.raises(TypeError):
        sim.record_event(object())
    with pytest.raises(TypeError):
        sim.stream_device("cuda:0")
    with pytest.raises(TypeError):
        sim.synchronize_stream(None)
    with pytest.raises(TypeError):
        sim.event_query(object())
    with pytest.raises(TypeError):
        sim.synchronize_event(None)


def test_simulated_events_are_not_kept_alive(sim: SimulatedRuntime) -> None:
    sim.record_event(sim.current_stream(CUDA0))
    gc.collect()
    assert sim.pending_event_count() == 0


# --------------------------------------------------------------------------------------------
# SimulatedRuntime: instrumentation.
# --------------------------------------------------------------------------------------------


def test_calls_counter(sim: SimulatedRuntime) -> None:
    value = sim.to_device(_value(), 0)  # test helpers are not counted
    sim.pin(value)
    sim.placement(value)
    assert sim.calls == {}
    stream = sim.current_stream(CUDA0)
    copy = sim.copy_to_cuda(value, CUDA0, stream, non_blocking=True)
    sim.synchronize_event(sim.record_event(stream))
    sim.value_device(copy)
    sim.value_device(copy)
    assert sim.calls == {
        "current_stream": 1,
        "copy_to_cuda": 1,
        "record_event": 1,
        "synchronize_event": 1,
        "value_device": 2,
    }
    assert sim.calls["synchronize_device"] == 0


def test_fail_next_once(sim: SimulatedRuntime) -> None:
    sim.fail_next("copy_to_cuda")
    allocated = sim.memory_allocated(CUDA0)
    with pytest.raises(RuntimeError, match="injected"):
        sim.copy_to_cuda(_value(), CUDA0, None, non_blocking=False)
    # A failed copy leaves nothing behind and is still counted.
    assert sim.memory_allocated(CUDA0) == allocated
    assert sim.copies == []
    assert sim.calls["copy_to_cuda"] == 1
    copy = sim.copy_to_cuda(_value(), CUDA0, None, non_blocking=False)
    assert sim.placement(copy) == cuda_location(CUDA0)


def test_fail_next_count_instance_and_class(sim: SimulatedRuntime) -> None:
    error = OSError("disk on fire")
    sim.fail_next("event_query", error, count=2)
    sim.fail_next("event_query", KeyError)
    event = sim.record_event(sim.current_stream(CUDA0))
    for _ in range(2):
        with pytest.raises(OSError, match="disk on fire") as caught:
            sim.event_query(event)
        assert caught.value is error
    with pytest.raises(KeyError):
        sim.event_query(event)
    assert sim.event_query(event) is False
    assert sim.calls["event_query"] == 4


def test_fail_next_every_seam_method(sim: SimulatedRuntime) -> None:
    stream = sim.current_stream(CUDA0)
    event = sim.record_event(stream)
    value = _value()
    sim.calls.clear()
    calls: dict[str, Callable[[], object]] = {
        "cuda_available": sim.cuda_available,
        "device_count": sim.device_count,
        "value_device": lambda: sim.value_device(value),
        "value_is_pinned": lambda: sim.value_is_pinned(value),
        "pinning_is_uniform": lambda: sim.pinning_is_uniform(value),
        "storage_keys": lambda: sim.storage_keys(value),
        "copy_to_pageable": lambda: sim.copy_to_pageable(value),
        "copy_to_pinned": lambda: sim.copy_to_pinned(value),
        "copy_to_cuda": lambda: sim.copy_to_cuda(value, CUDA0, stream, non_blocking=False),
        "is_stream": lambda: sim.is_stream(stream),
        "stream_device": lambda: sim.stream_device(stream),
        "current_stream": lambda: sim.current_stream(CUDA0),
        "synchronize_stream": lambda: sim.synchronize_stream(stream),
        "synchronize_device": lambda: sim.synchronize_device(CUDA0),
        "record_event": lambda: sim.record_event(stream),
        "event_query": lambda: sim.event_query(event),
        "synchronize_event": lambda: sim.synchronize_event(event),
        "memory_allocated": lambda: sim.memory_allocated(CUDA0),
        "memory_reserved": lambda: sim.memory_reserved(CUDA0),
        "memory_sample": lambda: sim.memory_sample(CUDA0),
    }
    for name, call in calls.items():
        sim.fail_next(name, ArithmeticError)
        with pytest.raises(ArithmeticError):
            call()
        call()  # the fault was used up
    assert sim.calls == dict.fromkeys(calls, 2)


def test_fail_next_validation(sim: SimulatedRuntime) -> None:
    with pytest.raises(ValueError, match="not a seam method"):
        sim.fail_next("copy_to_gpu")
    with pytest.raises(ValueError, match="not a seam method"):
        sim.fail_next("to_device")
    with pytest.raises(ValueError, match="count must be >= 1"):
        sim.fail_next("copy_to_cuda", count=0)
    with pytest.raises(TypeError):
        sim.fail_next("copy_to_cuda", count=True)
    with pytest.raises(TypeError):
        sim.fail_next("copy_to_cuda", "boom")  # type: ignore[arg-type]


def test_clear_faults(sim: SimulatedRuntime) -> None:
    sim.fail_next("device_count", count=5)
    sim.clear_faults()
    assert sim.device_count() == 2


def test_simulated_constructor_validation() -> None:
    with pytest.raises(TypeError):
        SimulatedRuntime(True)
    with pytest.raises(TypeError):
        SimulatedRuntime(2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device_count must be >= 0"):
        SimulatedRuntime(-1)
    with pytest.raises(TypeError):
        SimulatedRuntime(1, pinned=1)  # type: ignore[arg-type]
    assert "device_count=3" in repr(SimulatedRuntime(3))


def test_simulated_is_thread_safe_enough(sim: SimulatedRuntime) -> None:
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            for _ in range(50):
                device = torch.device("cuda", index % 2)
                copy = sim.copy_to_cuda(_value(), device, None, non_blocking=False)
                assert sim.value_device(copy) == device
                sim.synchronize_event(sim.record_event(sim.current_stream(device)))
        except BaseException as exc:  # collected and re-raised on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sim.calls["copy_to_cuda"] == 200


# --------------------------------------------------------------------------------------------
# Process-wide runtime selection.
# --------------------------------------------------------------------------------------------


@pytest.fixture
def clean_runtime() -> Iterator[None]:
    previous = set_runtime(None)
    try:
        yield
    finally:
        set_runtime(previous)


@pytest.mark.usefixtures("clean_runtime")
def test_default_runtime_is_one_torch_runtime() -> None:
    default = current_runtime()
    assert isinstance(default, TorchCudaRuntime)
    assert current_runtime() is default


@pytest.mark.usefixtures("clean_runtime")
def test_set_runtime_returns_previous() -> None:
    default = current_runtime()
    first, second = SimulatedRuntime(), SimulatedRuntime(1)
    assert set_runtime(first) is None
    assert current_runtime() is first
    assert set_runtime(second) is first
    assert current_runtime() is second
    assert set_runtime(None) is second
    assert current_runtime() is default


@pytest.mark.usefixtures("clean_runtime")
def test_set_runtime_rejects_non_runtimes() -> None:
    with pytest.raises(TypeError):
        set_runtime(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError), use_runtime("simulated"):  # type: ignore[arg-type]
        pass
    assert isinstance(current_runtime(), TorchCudaRuntime)


@pytest.mark.usefixtures("clean_runtime")
def test_use_runtime_nests_and_restores() -> None:
    default = current_runtime()
    outer, inner = SimulatedRuntime(), SimulatedRuntime(1)
    with use_runtime(outer) as installed:
        assert installed is outer
        assert current_runtime() is outer
        with use_runtime(inner):
            assert current_runtime() is inner
        assert current_runtime() is outer
    assert current_runtime() is default


@pytest.mark.usefixtures("clean_runtime")
def test_use_runtime_restores_on_error() -> None:
    outer = SimulatedRuntime()
    set_runtime(outer)
    with pytest.raises(ZeroDivisionError), use_runtime(SimulatedRuntime(1)):
        raise ZeroDivisionError
    assert current_runtime() is outer


@pytest.mark.usefixtures("clean_runtime")
def test_use_runtime_is_process_wide() -> None:
    seen: list[DeviceRuntime] = []
    runtime = SimulatedRuntime()
    with use_runtime(runtime):
        thread = threading.Thread(target=lambda: seen.append(current_runtime()))
        thread.start()
        thread.join()
    assert seen == [runtime]


def test_simulated_copy_bytes_rules(sim: SimulatedRuntime) -> None:
    stream = sim.current_stream(CUDA0)
    host = sim.empty_pinned(64)
    device = sim.empty_cuda(64, CUDA0, stream)
    with pytest.raises(ValueError, match="between host memory and a CUDA device"):
        sim.copy_bytes(host, sim.empty_pinned(64), stream)
    with pytest.raises(ValueError, match="not on"):
        sim.copy_bytes(device, host, sim.current_stream(CUDA1))
    with pytest.raises(ValueError, match="one dtype and length"):
        sim.copy_bytes(device[:32], host, stream)
    with pytest.raises(ValueError, match="not on"):
        sim.empty_cuda(64, CUDA0, sim.current_stream(CUDA1))
    sim.copies.clear()
    sim.copy_bytes(device, host, stream)
    sim.copy_bytes(torch.empty(64, dtype=torch.uint8), device, stream)  # to pageable memory
    assert sim.copies == [
        SimulatedCopy(cuda_location(CUDA0), stream, non_blocking=True),
        SimulatedCopy(PAGEABLE_HOST, stream, non_blocking=False),
    ]
    sim.fail_next("copy_bytes")
    with pytest.raises(RuntimeError, match="injected"):
        sim.copy_bytes(device, host, stream)
    unpinned = SimulatedRuntime(1, pinned=False)
    with pytest.raises(RuntimeError, match="pinned"):
        unpinned.empty_pinned(8)
