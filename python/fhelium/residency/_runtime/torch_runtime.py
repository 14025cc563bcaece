"""`TorchCudaRuntime`: the default device seam, backed by real torch CUDA and pinned memory.

Movement goes through `TensorResident` (docs/concepts/transitions.md#copies-and-streams);
streams are `torch.cuda.Stream` or any object exposing the CUDA stream protocol
(`__cuda_stream__`).
"""

from __future__ import annotations

import functools
from typing import Any, Final, NoReturn

import torch

from fhelium._core import measure_tensors as _measure_tensors
from fhelium.residency._runtime.base import StagedEvent, ValueFacts
from fhelium.residency._runtime.cuda_events import CudaEvent, CudaEventPool, cuda_bindings_available
from fhelium.values import tensor_resident
from fhelium.values.tensor_resident import TensorResident

__all__ = ["TorchCudaRuntime"]

# Module-level aliases: the manager calls these on every transition and lease, so one global
# lookup each beats walking `torch.cuda.<name>` every time.
_Stream: Final = torch.cuda.Stream
_ExternalStream: Final = torch.cuda.ExternalStream
_Event: Final = torch.cuda.Event
_device_guard: Final = torch.cuda.device
_stream_guard: Final = torch.cuda.stream

# Special handles of the protocol: the legacy default stream (0 and CU_STREAM_LEGACY) and the
# per-thread default stream. They name "the default stream of the current context", so they
# belong to whichever device is current, and the driver cannot be asked about them.
_DEFAULT_STREAM_HANDLES: Final = frozenset({0, 1, 2})
_EVENT_POOL: Final = CudaEventPool()


class TorchCudaRuntime:
    """The real runtime: torch tensors, torch CUDA streams and ``torch.cuda.Event``.

    Stateless, so one process-wide instance serves every manager.
    """

    __slots__ = ()
    # It takes a `StagedEvent` wherever it takes an event.
    staged_events = True

    @property
    def name(self) -> str:
        return "torch-cuda"

    def __repr__(self) -> str:
        return "TorchCudaRuntime()"

    # --- availability -------------------------------------------------------------
    def cuda_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    # --- facts about values -------------------------------------------------------
    def measure(self, value: TensorResident) -> ValueFacts:
        facts = _measure_tensors(value._resident_tensors, pinning_possible())
        if facts is None:
            return _raise_like(value)
        return _facts(ValueFacts, facts)

    def value_device(self, value: TensorResident) -> torch.device:
        return value.device

    def value_is_pinned(self, value: TensorResident) -> bool:
        return value.is_pinned

    def pinning_is_uniform(self, value: TensorResident) -> bool:
        return tensor_resident.cpu_pinning_is_uniform(value)

    def storage_keys(self, value: TensorResident) -> frozenset[tuple[torch.device, int]]:
        return tensor_resident.storage_keys(value)

    # --- movement -----------------------------------------------------------------
    def copy_to_pageable(self, value: TensorResident) -> TensorResident:
        return value.to("cpu", copy=True, non_blocking=False)

    def copy_to_pinned(self, value: TensorResident) -> TensorResident:
        # TensorResident.pin_memory raises RuntimeError when pinning is unavailable; it
        # propagates unchanged (docs/concepts/transitions.md#copies-and-streams).
        return value.pin_memory(copy=True)

    def copy_to_cuda(
        self, value: TensorResident, device: torch.device, stream: Any, *, non_blocking: bool
    ) -> TensorResident:
        """Enqueues ``value.to(device, copy=True)`` on ``stream`` (None: the current stream).

        Raises ``ValueError`` when the stream belongs to another device: enqueuing there
        would make the copy unordered with the work the caller synchronises on.

        A CUDA source is complete on its device's current stream (the rule for every
        value the manager is given, docs/concepts/values.md#cuda-values); a copy on any
        other stream first waits for that stream, as torch requires of a tensor used
        on a stream other than the one that produced it.
        """
        cuda_stream = (
            torch.cuda.current_stream(device) if stream is None else _as_stream(stream, device)
        )
        if cuda_stream.device_index != device.index:
            raise ValueError(f"stream {stream!r} is on {cuda_stream.device}, not on {device}")
        source = value.device
        if source.type == "cuda":
            producer = torch.cuda.current_stream(source)
            if producer != cuda_stream:
                cuda_stream.wait_stream(producer)
        with _device_guard(device), _stream_guard(cuda_stream):
            return value.to(device, copy=True, non_blocking=non_blocking)

    # --- byte buffers (the disk tier's staging) -------------------------------------
    def empty_pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def empty_cuda(self, nbytes: int, device: torch.device, stream: Any) -> torch.Tensor:
        # Allocated with the copy's stream current, so the caching allocator ties the
        # block to the stream that writes it (as `copy_to_cuda` does).
        cuda_stream = _as_stream(stream, device)
        with _device_guard(device), _stream_guard(cuda_stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy_bytes(self, destination: torch.Tensor, source: torch.Tensor, stream: Any) -> None:
        cuda_stream = _as_stream(stream)
        with _device_guard(cuda_stream.device_index), _stream_guard(cuda_stream):
            # Non-blocking from and to pinned memory; a pageable host side makes the
            # copy synchronous with the host, which is still correct.
            destination.copy_(source, non_blocking=True)

    # --- streams and events -------------------------------------------------------
    def is_stream(self, obj: object) -> bool:
        # torch streams first (the common case); they also implement the protocol.
        # The protocol is looked up on the type, as Python does for special methods.
        return isinstance(obj, _Stream) or hasattr(type(obj), "__cuda_stream__")

    def stream_device(self, stream: Any) -> torch.device:
        if isinstance(stream, _Stream):
            return stream.device
        return _protocol_stream_device(stream, _protocol_handle(stream))

    def bind_stream(self, stream: Any, device: torch.device) -> torch.cuda.Stream:
        return _as_stream(stream, device)

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def synchronize_stream(self, stream: Any) -> None:
        _as_stream(stream).synchronize()

    def synchronize_device(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def record_event(self, stream: Any) -> CudaEvent | torch.cuda.Event:
        cuda_stream = _as_stream(stream)
        # Release events are recorded with the stream's device current
        # (docs/concepts/lifetimes.md#lease-release), so the event is created on that
        # device whatever the calling thread has current.
        with _device_guard(cuda_stream.device_index):
            if cuda_bindings_available():
                # Timing-free events from a pool, through cuda-python
                # (docs/architecture.md#the-device-seam).
                return _EVENT_POOL.record(cuda_stream.cuda_stream, cuda_stream.device_index)
            event = _Event()  # type: ignore[no-untyped-call]
            event.record(cuda_stream)
            return event

    def event_query(self, event: CudaEvent | torch.cuda.Event | StagedEvent) -> bool:
        if isinstance(event, StagedEvent):
            return event.query(self.event_query)
        return bool(event.query())

    def synchronize_event(self, event: CudaEvent | torch.cuda.Event | StagedEvent) -> None:
        if isinstance(event, StagedEvent):
            resolved: CudaEvent | torch.cuda.Event | None = event.resolve()
            if resolved is None:
                return
            event = resolved
        event.synchronize()

    def wait_event(self, stream: Any, event: CudaEvent | torch.cuda.Event | StagedEvent) -> None:
        cuda_stream = _as_stream(stream)
        if isinstance(event, StagedEvent):
            # Once its copies are enqueued (a failed read raises here).
            resolved: CudaEvent | torch.cuda.Event | None = event.resolve()
            if resolved is None:
                return
            event = resolved
        if isinstance(event, CudaEvent):
            # A default stream's raw handle is 0 on every device, and the CUDA runtime
            # reads 0 as the *current* device's default stream: the wait is enqueued with
            # the stream's device current, as `record_event` records
            # (docs/concepts/simulation.md#current-device-and-default-streams).
            with _device_guard(cuda_stream.device_index):
                event.wait_on(cuda_stream.cuda_stream)
        else:
            # torch's `Stream.wait_event` makes the stream's device current itself.
            cuda_stream.wait_event(event)

    def create_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    # --- observations ---------------------------------------------------------------
    def memory_allocated(self, device: torch.device) -> int | None:
        sample = self.memory_sample(device)
        return None if sample is None else sample[0]

    def memory_reserved(self, device: torch.device) -> int | None:
        sample = self.memory_sample(device)
        return None if sample is None else sample[1]

    def memory_sample(self, device: torch.device) -> tuple[int, int] | None:
        # Sampling never fails a transition (docs/concepts/transitions.md#telemetry): any
        # failure reads as "no reading". One query of the allocator's nested statistics
        # gives both figures: `torch.cuda.memory_allocated` and `memory_reserved` each
        # flatten and sort the whole statistics dictionary, which costs more than a
        # small copy, and a transition samples twice.
        try:
            if device.type != "cuda" or not torch.cuda.is_available():
                return None
            if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
                # What torch reports before CUDA is initialised, without initialising it.
                return 0, 0
            stats = _memory_stats(device.index)
            if stats is None:
                return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
            return (
                int(stats["allocated_bytes"]["all"]["current"]),
                int(stats["reserved_bytes"]["all"]["current"]),
            )
        except Exception:
            return None


def _memory_stats(index: int | None) -> dict[str, Any] | None:
    """The allocator's nested statistics for device ``index`` in one call, or None where
    this torch has no such call (then the public per-figure functions are used)."""
    nested = getattr(torch._C, "_cuda_memoryStats", None)
    if nested is None:
        return None
    return nested(index)  # type: ignore[no-any-return]


@functools.cache
def pinning_possible() -> bool:
    """Whether any tensor in this process can be in pinned memory.

    Pinned host memory comes from an accelerator's host allocator; with none
    available (a CPU-only machine), every host tensor is pageable.
    """
    if torch.cuda.is_available():
        return True
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator is not None and accelerator.is_available())


# Builds the NamedTuple from the core's plain tuple without re-packing the fields.
_facts = tuple.__new__


def _raise_like(value: TensorResident) -> NoReturn:
    """Raises exactly what the TensorResident measurement properties raise."""
    _ = value.device
    _ = value.storage_nbytes
    raise AssertionError("measure() found an inconsistency the properties did not")


def _as_stream(stream: object, device: torch.device | None = None) -> torch.cuda.Stream:
    """``stream`` itself when it is a torch stream, else a torch view of a protocol stream.

    A default-stream handle (0 and 1, the legacy default stream; 2, the per-thread
    default stream) becomes torch's default stream of ``device`` when given, else of
    the device the handle names now: torch refuses to wrap these handles as an
    ``ExternalStream``. The per-thread default stream is blocking with respect to the
    legacy one, so work ordered on the legacy stream is ordered after it too.
    """
    if isinstance(stream, _Stream):
        return stream
    handle = _protocol_handle(stream)
    if handle in _DEFAULT_STREAM_HANDLES:
        target = _protocol_stream_device(stream, handle) if device is None else device
        return torch.cuda.default_stream(target)
    device = _protocol_stream_device(stream, handle)
    # ExternalStream only wraps the handle; it neither owns nor destroys the stream, so a
    # fresh wrapper per call is correct and costs no CUDA work.
    return _ExternalStream(handle, device=device)  # type: ignore[no-untyped-call]


def _protocol_handle(stream: object) -> int:
    """The ``cudaStream_t`` address from the CUDA stream protocol (version 0)."""
    if not hasattr(type(stream), "__cuda_stream__"):
        raise TypeError(
            "expected a torch.cuda.Stream or an object implementing __cuda_stream__, "
            f"got {type(stream).__name__}"
        )
    protocol = stream.__cuda_stream__  # type: ignore[attr-defined]
    # The protocol is a method; early adopters exposed the tuple as a property.
    described = protocol() if callable(protocol) else protocol
    if (
        not isinstance(described, tuple)
        or len(described) != 2
        or not all(isinstance(part, int) and not isinstance(part, bool) for part in described)
    ):
        raise TypeError(
            f"{type(stream).__name__}.__cuda_stream__ must give a (version, handle) tuple "
            f"of ints, got {described!r}"
        )
    version, handle = described
    if version != 0:
        raise TypeError(f"unsupported CUDA stream protocol version {version}")
    return int(handle)


def _protocol_stream_device(stream: object, handle: int) -> torch.device:
    """The device a foreign stream was created on.

    The driver is authoritative; the object's own ``device`` / ``device_id`` (as CuPy and
    cuda.core expose them) is the fallback for drivers older than ``cuStreamGetDevice``.
    """
    if handle in _DEFAULT_STREAM_HANDLES:
        # "The default stream of the current device", unless the object says which
        # device it belongs to (cuda.core's default stream reports handle 1).
        declared = _declared_device_index(stream)
        return torch.device("cuda", torch.cuda.current_device() if declared is None else declared)
    index = _driver_stream_device(handle)
    if index is None:
        index = _declared_device_index(stream)
    if index is None:
        raise ValueError(
            f"cannot determine the CUDA device of {type(stream).__name__} stream {handle:#x}"
        )
    return torch.device("cuda", index)


def _driver_stream_device(handle: int) -> int | None:
    """Ask the CUDA driver which device ``handle`` was created on; None if it cannot say."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python before 12.6
        except ImportError:
            return None
    success = driver.CUresult.CUDA_SUCCESS
    try:
        cu_stream = driver.CUstream(handle)
    except Exception:
        return None
    try:
        error, device = driver.cuStreamGetDevice(cu_stream)
        if error == success:
            return int(device)
    except Exception:
        # No driver library, or a driver / bindings older than cuStreamGetDevice (12.8).
        pass
    try:
        # The older route: the stream's context knows its device.
        error, context = driver.cuStreamGetCtx(cu_stream)
        if error != success:
            return None
        (error,) = driver.cuCtxPushCurrent(context)
        if error != success:
            return None
        try:
            error, device = driver.cuCtxGetDevice()
        finally:
            driver.cuCtxPopCurrent()
        if error == success:
            return int(device)
    except Exception:
        pass
    return None


def _declared_device_index(stream: object) -> int | None:
    declared = getattr(stream, "device", None)
    if declared is None:
        declared = getattr(stream, "device_id", None)
    if isinstance(declared, torch.device):
        return declared.index if declared.type == "cuda" else None
    if isinstance(declared, int) and not isinstance(declared, bool):
        return declared
    # cuda.core's Device object carries its ordinal as `device_id`.
    nested = getattr(declared, "device_id", None)
    if isinstance(nested, int) and not isinstance(nested, bool):
        return nested
    return None
