"""`TorchCudaRuntime` on a real GPU: copies, stream ordering, events and foreign streams.

Skipped without CUDA; the device-independent seam tests live in tests/runtime/test_contract.py.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import pytest
import torch

from fhelium.residency._runtime import TorchCudaRuntime
from fhelium.residency._runtime.cuda_events import CudaEvent, cuda_bindings_available
from fhelium.values import ResidentTensor, TensorBundle

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA0 = torch.device("cuda", 0)
CUDA1 = torch.device("cuda", 1)
# About a quarter second at an H200's boost clock (1.98 GHz), 1.5 s at its idle clock:
# far longer than the microseconds between the launch and the first query.
SLEEP_CYCLES = 500_000_000

needs_two = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)


@pytest.fixture
def runtime() -> TorchCudaRuntime:
    return TorchCudaRuntime()


class ForeignStream:
    """Only the CUDA stream protocol, as a CuPy or cuda.core stream would offer it."""

    def __init__(self, handle: int) -> None:
        self._handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._handle)


def _busy(stream: torch.cuda.Stream) -> None:
    # _sleep launches on the current device's current stream, so make both the stream's.
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)


def test_host_and_device_copies(runtime: TorchCudaRuntime) -> None:
    source = TensorBundle(a=torch.arange(6.0).reshape(2, 3), b=torch.ones(3, dtype=torch.int64))
    stream = torch.cuda.Stream(CUDA0)
    on_cuda = runtime.copy_to_cuda(source, CUDA0, stream, non_blocking=False)
    runtime.synchronize_stream(stream)
    assert runtime.value_device(on_cuda) == CUDA0
    assert on_cuda.is_cuda

    pinned = runtime.copy_to_pinned(on_cuda)
    assert runtime.value_is_pinned(pinned)
    assert pinned.is_pinned

    back = runtime.copy_to_cuda(pinned, CUDA0, stream, non_blocking=True)
    runtime.synchronize_stream(stream)
    pageable = runtime.copy_to_pageable(back)
    assert pageable.is_cpu
    assert not runtime.value_is_pinned(pageable)
    for name in source.names:
        assert torch.equal(pageable[name], source[name])  # type: ignore[index]
    keys = [runtime.storage_keys(v) for v in (source, on_cuda, pinned, back, pageable)]
    for i, first in enumerate(keys):
        for second in keys[i + 1 :]:
            assert first.isdisjoint(second)


def test_copy_is_ordered_on_the_given_stream(runtime: TorchCudaRuntime) -> None:
    # The source is overwritten on `stream` after a long sleep. Only a copy enqueued on that
    # same stream is guaranteed to see the new contents.
    source = ResidentTensor(torch.zeros(1 << 20, device=CUDA0))
    stream = torch.cuda.Stream(CUDA0)
    torch.cuda.synchronize(CUDA0)
    _busy(stream)
    with torch.cuda.stream(stream):
        source.tensor.fill_(7.0)
    copy = runtime.copy_to_cuda(source, CUDA0, stream, non_blocking=True)
    runtime.synchronize_stream(stream)
    assert isinstance(copy, ResidentTensor)
    assert bool((copy.tensor == 7.0).all())


def test_copy_restores_current_device_and_stream(runtime: TorchCudaRuntime) -> None:
    device_before = torch.cuda.current_device()
    stream_before = torch.cuda.current_stream()
    stream = torch.cuda.Stream(CUDA0)
    runtime.copy_to_cuda(ResidentTensor(torch.ones(4)), CUDA0, stream, non_blocking=False)
    runtime.synchronize_stream(stream)
    assert torch.cuda.current_device() == device_before
    assert torch.cuda.current_stream() == stream_before


def test_event_on_busy_stream(runtime: TorchCudaRuntime) -> None:
    stream = torch.cuda.Stream(CUDA0)
    _busy(stream)
    event = runtime.record_event(stream)
    # Release events come from cuda-python's pool where it works, else from torch
    # (docs/architecture.md#the-device-seam).
    if cuda_bindings_available():
        assert isinstance(event, CudaEvent)
    else:
        assert isinstance(event, torch.cuda.Event)
    assert runtime.event_query(event) is False
    runtime.synchronize_event(event)
    assert runtime.event_query(event) is True


def test_event_on_busy_stream_synchronize_stream(runtime: TorchCudaRuntime) -> None:
    stream = torch.cuda.Stream(CUDA0)
    _busy(stream)
    event = runtime.record_event(stream)
    assert runtime.event_query(event) is False
    runtime.synchronize_stream(stream)
    assert runtime.event_query(event) is True


def test_foreign_protocol_stream(runtime: TorchCudaRuntime) -> None:
    backing = torch.cuda.Stream(CUDA0)
    foreign = ForeignStream(backing.cuda_stream)
    assert runtime.is_stream(foreign)
    assert runtime.stream_device(foreign) == CUDA0

    _busy(backing)
    event = runtime.record_event(foreign)
    assert runtime.event_query(event) is False
    runtime.synchronize_stream(foreign)
    assert runtime.event_query(event) is True

    # A copy through the protocol stream is ordered after work on the backing stream.
    source = ResidentTensor(torch.zeros(1 << 20, device=CUDA0))
    torch.cuda.synchronize(CUDA0)
    _busy(backing)
    with torch.cuda.stream(backing):
        source.tensor.fill_(3.0)
    copy = runtime.copy_to_cuda(source, CUDA0, foreign, non_blocking=True)
    runtime.synchronize_stream(foreign)
    assert isinstance(copy, ResidentTensor)
    assert bool((copy.tensor == 3.0).all())


def test_default_stream_handles_belong_to_the_current_device(runtime: TorchCudaRuntime) -> None:
    for handle in (0, 1, 2):
        assert runtime.stream_device(ForeignStream(handle)) == torch.device(
            "cuda", torch.cuda.current_device()
        )


def test_cuda_core_stream(runtime: TorchCudaRuntime) -> None:
    core: Any = None
    for module in ("cuda.core", "cuda.core.experimental"):
        try:
            # Some cuda-core releases deprecate `cuda.core.experimental` on import, which
            # filterwarnings = ["error"] would turn into a failure of this test.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                core = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(core, "Device"):
            break
    if core is None or not hasattr(core, "Device"):
        pytest.skip("cuda.core is not installed")
    device = core.Device(0)
    device.set_current()
    stream = device.create_stream()
    assert runtime.is_stream(stream)
    assert runtime.stream_device(stream) == CUDA0
    event = runtime.record_event(stream)
    runtime.synchronize_event(event)
    assert runtime.event_query(event) is True


def test_allocator_readings(runtime: TorchCudaRuntime) -> None:
    # torch reads {} for any device before CUDA is initialised (0 bytes, not an error),
    # so make this test independent of the ones that ran before it.
    torch.zeros(1, device=CUDA0)
    allocated = runtime.memory_allocated(CUDA0)
    reserved = runtime.memory_reserved(CUDA0)
    assert isinstance(allocated, int)
    assert isinstance(reserved, int)
    assert reserved >= allocated
    beyond = torch.device("cuda", torch.cuda.device_count() + 1)
    assert runtime.memory_allocated(beyond) is None
    assert runtime.memory_reserved(beyond) is None


@needs_two
def test_second_device(runtime: TorchCudaRuntime) -> None:
    with torch.cuda.device(CUDA0):
        stream = torch.cuda.Stream(CUDA1)
        assert runtime.stream_device(stream) == CUDA1
        # The driver, not the current device, decides where a foreign stream lives.
        assert runtime.stream_device(ForeignStream(stream.cuda_stream)) == CUDA1
        copy = runtime.copy_to_cuda(
            ResidentTensor(torch.ones(4)), CUDA1, stream, non_blocking=False
        )
        _busy(stream)
        event = runtime.record_event(stream)
        assert runtime.event_query(event) is False
        runtime.synchronize_device(CUDA1)
        assert runtime.event_query(event) is True
        assert runtime.value_device(copy) == CUDA1
        with pytest.raises(ValueError, match="not on"):
            runtime.copy_to_cuda(copy, CUDA0, stream, non_blocking=True)
