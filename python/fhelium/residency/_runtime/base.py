"""The device seam: everything the manager needs to know or do about devices.

The manager never touches CUDA directly; it asks the installed runtime. The real
`TorchCudaRuntime` is the default; `SimulatedRuntime` is installed explicitly by tests
and dry runs so that CI, which has no GPU, exercises every CUDA path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from fhelium.values.tensor_resident import TensorResident

__all__ = ["DeviceRuntime", "MeasuredCopies", "StagedEvent", "StorageKey", "ValueFacts"]

# (device, untyped_storage().data_ptr()) of one non-empty backing storage.
StorageKey = tuple[torch.device, int]


class ValueFacts(NamedTuple):
    """Everything the manager measures about a value, gathered in one pass."""

    device: torch.device
    # -1 on the host, the CUDA index otherwise.
    device_code: int
    # True: every tensor pinned; False: none pinned (always False off the host);
    # None: a host value mixing pinned and pageable tensors.
    pinned: bool | None
    logical_nbytes: int
    storage_nbytes: int
    # (device code, data pointer) per unique non-empty storage: -1 for host memory,
    # the CUDA index otherwise. This is the form the core's alias index takes.
    storage_keys: list[tuple[int, int]]


class StagedEvent:
    """The event of copies another thread is still enqueueing: a read from disk to a
    device that the disk tier's I/O thread runs, a chunk at a time
    (docs/concepts/locations-and-budgets.md#staging-and-direct-io). Once that thread has
    enqueued the last copy it sets `event`, the runtime's own event recorded after it,
    or `error` when the read failed (its copies then completed, waited for there).

    A runtime that sets ``staged_events = True`` accepts one wherever it takes an event:
    ``event_query`` is false until the copies are enqueued and then asks `event`;
    ``synchronize_event`` and ``wait_event`` first wait on the host until they are
    enqueued. A failed read is the business of whoever issued it, who `claim`s its
    error: until then ``event_query`` says false (what it wrote stays protected) and
    ``synchronize_event`` and ``wait_event`` raise the error (no consumer reads it);
    after that they have nothing to wait for."""

    __slots__ = ("_claimed", "_enqueued", "error", "event", "value")

    def __init__(self) -> None:
        self._enqueued = threading.Event()
        self._claimed = False
        self.event: Any = None
        self.error: BaseException | None = None
        # The value the copies fill (set by the tier, for whoever must find it).
        self.value: Any = None

    def finish(self, event: Any, error: BaseException | None) -> None:
        """Called once by the thread that enqueued the copies."""
        self.event = event
        self.error = error
        self._enqueued.set()

    def enqueued(self) -> bool:
        return self._enqueued.is_set()

    def wait_enqueued(self) -> None:
        self._enqueued.wait()

    def claim(self) -> BaseException | None:
        """Waits until the copies are enqueued; the read's error (None when it
        succeeded), now the caller's to raise: from here on the event is complete."""
        self._enqueued.wait()
        if self.error is not None:
            self._claimed = True
        return self.error

    def query(self, query: Callable[[Any], bool]) -> bool:
        if not self._enqueued.is_set():
            return False
        if self.error is not None:
            return self._claimed
        return self.event is None or bool(query(self.event))

    def resolve(self) -> Any:
        """The runtime's event to wait for, once enqueued (None: nothing to wait for);
        raises the read's error while it is not claimed."""
        self._enqueued.wait()
        if self.error is None:
            return self.event
        if self._claimed:
            return None
        raise self.error

    def __repr__(self) -> str:
        state = (
            "enqueueing"
            if not self._enqueued.is_set()
            else "failed"
            if self.error is not None
            else "enqueued"
        )
        return f"StagedEvent({state})"


@runtime_checkable
class DeviceRuntime(Protocol):
    """Facts about values and devices, copies, streams and events."""

    @property
    def name(self) -> str:
        """A short diagnostic name, such as ``"torch-cuda"`` or ``"simulated"``."""
        ...

    # --- availability -------------------------------------------------------------
    def cuda_available(self) -> bool: ...
    def device_count(self) -> int: ...

    # --- facts about values -------------------------------------------------------
    def measure(self, value: TensorResident) -> ValueFacts:
        """Device, pinning, byte counts and storage keys in one pass over the tensors.

        Raises RuntimeError where ``value.device`` or ``value.storage_nbytes`` would.
        """
        ...

    def value_device(self, value: TensorResident) -> torch.device:
        """The device the value lives on (raises RuntimeError like ``value.device``)."""
        ...

    def value_is_pinned(self, value: TensorResident) -> bool:
        """True when every tensor is in pinned host memory (false for CUDA values)."""
        ...

    def pinning_is_uniform(self, value: TensorResident) -> bool:
        """``fhelium.values.tensor_resident.cpu_pinning_is_uniform`` for this runtime."""
        ...

    def storage_keys(self, value: TensorResident) -> frozenset[StorageKey]:
        """Identities of the value's non-empty backing storages."""
        ...

    # --- movement -----------------------------------------------------------------
    def copy_to_pageable(self, value: TensorResident) -> TensorResident:
        """A synchronous copy into new, independent pageable host storage."""
        ...

    def copy_to_pinned(self, value: TensorResident) -> TensorResident:
        """A synchronous copy into new pinned host storage (RuntimeError if unavailable)."""
        ...

    def copy_to_cuda(
        self, value: TensorResident, device: torch.device, stream: Any, *, non_blocking: bool
    ) -> TensorResident:
        """Enqueues a copy onto ``stream`` with ``device`` current; does not synchronise."""
        ...

    # --- byte buffers (the disk tier's staging) -------------------------------------
    def empty_pinned(self, nbytes: int) -> torch.Tensor:
        """A new flat ``uint8`` tensor of ``nbytes`` in pinned host memory (RuntimeError
        if pinning is unavailable)."""
        ...

    def empty_cuda(self, nbytes: int, device: torch.device, stream: Any) -> torch.Tensor:
        """A new flat ``uint8`` tensor of ``nbytes`` on CUDA ``device``, allocated for
        use on ``stream``."""
        ...

    def copy_bytes(self, destination: torch.Tensor, source: torch.Tensor, stream: Any) -> None:
        """Enqueues ``destination.copy_(source)`` on ``stream`` without synchronising:
        two flat ``uint8`` tensors of one length, one in pinned (or pageable) host
        memory and the other on ``stream``'s CUDA device. The host side must stay
        untouched until an event recorded on ``stream`` afterwards completes."""
        ...

    # --- streams and events -------------------------------------------------------
    def is_stream(self, obj: object) -> bool:
        """True for the runtime's CUDA stream type (``torch.cuda.Stream`` for torch)."""
        ...

    def stream_device(self, stream: Any) -> torch.device: ...
    def bind_stream(self, stream: Any, device: torch.device) -> Any:
        """The stream the manager keeps for ``stream`` once it was checked to be on
        ``device``: the stream itself, or a stream of the runtime's own type standing
        for it. A default-stream handle of the CUDA stream protocol (0, 1, 2) names
        "the current device's default stream"; bound, it stays ``device``'s default
        stream whatever device is current later (a lease released from another thread
        records its event on the lease's device)."""
        ...

    def current_stream(self, device: torch.device) -> Any: ...
    def synchronize_stream(self, stream: Any) -> None: ...
    def synchronize_device(self, device: torch.device) -> None: ...
    def record_event(self, stream: Any) -> Any:
        """Records a new event on ``stream`` (with the stream's device current)."""
        ...

    def event_query(self, event: Any) -> bool: ...
    def wait_event(self, stream: Any, event: Any) -> None:
        """Makes ``stream`` wait for ``event`` on the device, without blocking the host:
        work enqueued on ``stream`` afterwards runs after the event's work."""
        ...

    def create_stream(self, device: torch.device) -> Any:
        """A new stream on CUDA ``device`` (transfer streams a caller did not supply)."""
        ...

    def synchronize_event(self, event: Any) -> None: ...

    # --- observations ---------------------------------------------------------------
    def memory_allocated(self, device: torch.device) -> int | None:
        """Process-wide allocator reading, or None when unavailable."""
        ...

    def memory_reserved(self, device: torch.device) -> int | None: ...
    def memory_sample(self, device: torch.device) -> tuple[int, int] | None:
        """``(memory_allocated, memory_reserved)`` read together in one call, or None
        when unavailable. Transitions and snapshots sample through this one method, so
        a reading costs one allocator query, not two."""
        ...


class MeasuredCopies(Protocol):
    """An optional capability of a `DeviceRuntime`: a CUDA copy with its facts.

    The manager measures every copy it installs; a runtime that knows a copy's facts as
    it makes it (the simulated one does) gives them with the copy, and the manager
    skips the second call. A runtime without the method is measured as usual
    (docs/architecture.md#the-device-seam).
    """

    def copy_to_cuda_measured(
        self, value: TensorResident, device: torch.device, stream: Any, *, non_blocking: bool
    ) -> tuple[TensorResident, ValueFacts | None]:
        """`copy_to_cuda`, and the copy's facts: exactly what ``measure`` of the copy
        returns (the manager charges them), or ``None`` when the runtime cannot say (the
        manager then measures the copy once it is waited for). It is the same seam call
        as `copy_to_cuda` and fails as it does."""
        ...
