"""`SimulatedRuntime`: pinned host and CUDA devices simulated with ordinary CPU tensors.

It lets CI, which has no GPU, drive every CUDA path of the manager: copies land in storages
the runtime registers as "on cuda:N" or "pinned", streams and events are plain objects whose
completion the test controls, and every call is counted and can be made to fail.

With a `Timeline` the runtime also keeps virtual time: copies and declared compute occupy
per-device engines for a modelled duration, events complete when the host clock reaches
them, and the timeline's spans predict how copies and compute overlap
(docs/concepts/simulation.md).

The runtime is built from parts, one module each: ``simulated_devices`` (the devices, each
thread's current device, call counting and fault injection), ``simulated_streams``
(streams, events and their order), ``simulated_storage`` (the registry of simulated
storages), ``timeline`` (virtual time) and ``simulated_cudart`` (the fake cuda-python
runtime). This module adds the seam's copies, buffers, value facts and memory readings.
"""

from __future__ import annotations

from collections import _count_elements  # type: ignore[attr-defined]
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeVar

import torch

from fhelium._core import SimulatedSeam
from fhelium.residency._runtime.base import DeviceRuntime, MeasuredCopies, ValueFacts
from fhelium.residency._runtime.simulated_cudart import SimulatedCudart
from fhelium.residency._runtime.simulated_storage import (
    SimulatedHazard,
    StorageRegistry,
    empty_host,
    page_aligned,
    strided_clone,
)
from fhelium.residency._runtime.simulated_streams import SimulatedStream, SimulatedStreams
from fhelium.residency._runtime.timeline import Timeline, TimelineSpan, non_negative
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, ResidencyLocation, cuda_location
from fhelium.values.tensor_resident import TensorResident, layout_copy

__all__ = ["SimulatedCopy", "SimulatedRuntime"]


_V = TypeVar("_V", bound=TensorResident)

_CPU: Final = torch.device("cpu")
# `calls`' key of the seam methods that count themselves (see `copy_to_cuda`).
_COPY_TO_CUDA: Final = ("copy_to_cuda",)
_MEMORY_SAMPLE: Final = ("memory_sample",)

# A named tuple built without its Python ``__new__`` frame (a copy logs one each).
_new_tuple: Final = tuple.__new__

# No device was given yet (`SimulatedRuntime._last_target`).
_NO_DEVICE: Final = object()

_PINNED_UNAVAILABLE: Final = (
    "pinned host storage is unavailable in this simulated runtime (built with pinned=False); "
    "use pageable CPU storage"
)


class SimulatedCopy(NamedTuple):
    """One copy the runtime performed, in call order (``SimulatedRuntime.copies``): a named tuple.

    Attributes:
        destination: Where the copy went, as a location.
        stream: The stream it ran on, or ``None`` for a host copy.
        non_blocking: Whether it was submitted without blocking.
    """

    destination: ResidencyLocation
    stream: SimulatedStream | None
    non_blocking: bool


class SimulatedRuntime(SimulatedStreams):
    """Simulated pinned host and ``device_count`` CUDA devices backed by CPU tensors.

    Install it with `use_runtime` (or `set_runtime`); managers built while it is installed
    use it for their whole life. Values stay ordinary CPU tensors: placement is a registry of
    the storages the runtime's own copies created, so a value copied to ``cuda:1`` reports
    ``cuda:1``; storages it did not create report their real torch placement.

    Test instrumentation: ``calls`` (a ``Counter``) counts every seam method called;
    `fail_next` makes the next call(s) of a method raise; ``copies`` logs every copy as a
    `SimulatedCopy` and ``waits`` every `wait_event`. The test helpers `to_device`, `pin`,
    `placement`, `complete_events`, `compute`, `current_device`, `set_device`,
    `device_guard` and `pending_event_count` are neither counted nor fault-injected. Each
    thread has a current device, and a default-stream handle names the current device's
    default stream (docs/concepts/simulation.md#current-device-and-default-streams).
    With ``timeline``, events complete by virtual time instead of by the test. See
    docs/concepts/simulation.md.

    Args:
        device_count: How many simulated CUDA devices, ``cuda:0`` up (an int >= 0).
        pinned: Whether pinned memory exists; without it, copies to pinned host raise
            `RuntimeError`.
        auto_complete: Complete every event as soon as it is recorded.
        timeline: A `Timeline` to model virtual time; not with ``auto_complete``.

    Raises:
        TypeError: ``device_count`` is not an int, a flag is not a ``bool``, or ``timeline``
            is not a `Timeline`.
        ValueError: A negative ``device_count``; ``timeline`` with ``auto_complete=True``; a
            timeline already attached to another runtime.

    Example:
        ```python
        import torch
        from fhelium.residency import PINNED_HOST, ResidencyManager, cuda_location
        from fhelium.residency.simulation import SimulatedRuntime, use_runtime
        from fhelium.values import ResidentTensor

        runtime = SimulatedRuntime(device_count=2, auto_complete=True)
        cuda1 = cuda_location("cuda:1")
        with use_runtime(runtime), ResidencyManager({cuda1: 1 << 20}) as manager:
            handle = manager.adopt(runtime.pin(ResidentTensor(torch.ones(256))))
            manager.move(handle, cuda1)
            with manager.acquire(
                [handle], at=cuda1, consumer_stream=runtime.current_stream(cuda1.device)
            ) as values:
                assert runtime.placement(values[handle]) == cuda1
        assert runtime.calls["copy_to_cuda"] == 1
        ```
    """

    # It takes a `StagedEvent` wherever it takes an event.
    staged_events = True

    def __init__(
        self,
        device_count: int = 2,
        *,
        pinned: bool = True,
        auto_complete: bool = False,
        timeline: Timeline | None = None,
    ) -> None:
        if not isinstance(device_count, int) or isinstance(device_count, bool):
            raise TypeError(f"device_count must be an int, got {type(device_count).__name__}")
        if device_count < 0:
            raise ValueError(f"device_count must be >= 0, got {device_count}")
        if not isinstance(pinned, bool) or not isinstance(auto_complete, bool):
            raise TypeError("pinned and auto_complete must be bools")
        if timeline is not None:
            if not isinstance(timeline, Timeline):
                raise TypeError(
                    f"timeline must be a Timeline or None, got {type(timeline).__name__}"
                )
            if auto_complete:
                raise ValueError(
                    "auto_complete cannot be combined with a timeline: with one, events "
                    "complete when the virtual host clock reaches them"
                )
        super().__init__(device_count, auto_complete=auto_complete, timeline=timeline)
        self._pinned = pinned
        # Each device's location, made on its first copy (for the copy log), by index.
        self._cuda_locations: list[ResidencyLocation | None] = [None] * device_count
        # The device object `_to_cuda` was last given, and its index.
        self._last_target: tuple[object, int] = (_NO_DEVICE, 0)
        self.copies: list[SimulatedCopy] = []
        self.hazards: list[SimulatedHazard] = []
        self._storage = StorageRegistry(self._lock, self._devices, self._order, self.hazards)
        self._cudart = SimulatedCudart(
            self.current_device, self._stream_for_handle, self._record, self._query, self._wait
        )
        # The common case of the hot seam methods, native, for this exact class (a
        # subclass may replace what they stand for): docs/concepts/simulation.md#native-calls.
        if type(self) is SimulatedRuntime:
            self._native = SimulatedSeam(self, _OWN_METHODS)

    @property
    def name(self) -> str:
        """The runtime's name, always ``"simulated"``."""
        return "simulated"

    @property
    def pinned_available(self) -> bool:
        """Whether the simulation has pinned host memory."""
        return self._pinned

    @property
    def auto_complete(self) -> bool:
        """Whether events complete as soon as they are recorded."""
        return self._auto_complete

    @property
    def timeline(self) -> Timeline | None:
        """The runtime's virtual-time model, or ``None`` when it has none."""
        return self._timeline

    def __repr__(self) -> str:
        timeline = "" if self._timeline is None else f", timeline={self._timeline!r}"
        return (
            f"SimulatedRuntime(device_count={self._device_count}, pinned={self._pinned}, "
            f"auto_complete={self._auto_complete}{timeline})"
        )

    # --- facts about values -------------------------------------------------------
    def measure(self, value: TensorResident) -> ValueFacts:
        """Measure a value's device, pinning and storage in one pass.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            value: The value.

        Returns:
            The value's facts (device, pinning, unique storage bytes).

        Raises:
            RuntimeError: A value with no tensors or spanning devices.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("measure")
        return self._storage.measure(value)

    def value_device(self, value: TensorResident) -> torch.device:
        """Return where a value lives in this simulation.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            value: The value.

        Returns:
            Its simulated device.

        Raises:
            RuntimeError: A value with no tensors or spanning devices.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("value_device")
        return self._storage.value_device(value)

    def value_is_pinned(self, value: TensorResident) -> bool:
        """Whether a host value is wholly in simulated pinned memory.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            value: The value.

        Returns:
            True only for a host value whose tensors with storage are all pinned.

        Raises:
            RuntimeError: A value with no tensors or spanning devices.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("value_is_pinned")
        return self._storage.is_pinned(value)

    def pinning_is_uniform(self, value: TensorResident) -> bool:
        """Whether a value's tensors are all pinned or all pageable.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            value: The value.

        Returns:
            False only for a value mixing pinned and pageable tensors.

        Raises:
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("pinning_is_uniform")
        return self._storage.pinning_is_uniform(value)

    def storage_keys(self, value: TensorResident) -> frozenset[tuple[torch.device, int]]:
        """Return the ``(device, storage address)`` of every non-empty storage of a value.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            value: The value.

        Returns:
            The keys of the storage-alias rule.

        Raises:
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("storage_keys")
        return self._storage.storage_keys(value)

    # --- movement -----------------------------------------------------------------
    def copy_to_pageable(self, value: TensorResident) -> TensorResident:
        """Copy a value into new pageable host storage.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            value: The value.

        Returns:
            The copy.

        Raises:
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("copy_to_pageable")
        # Fresh CPU storage is unregistered, hence pageable, whatever the source was.
        result = value.to(_CPU, copy=True, non_blocking=False)
        if self._timeline is not None:
            self._time_download(value)
        self._log(PAGEABLE_HOST, None, non_blocking=False)
        return result

    def copy_to_pinned(self, value: TensorResident) -> TensorResident:
        """Copy a value into new simulated pinned host storage.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            value: The value.

        Returns:
            The copy.

        Raises:
            RuntimeError: The runtime was built with ``pinned=False``.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("copy_to_pinned")
        result = self._pinned_copy(value)
        if self._timeline is not None:
            self._time_download(value)
        self._log(PINNED_HOST, None, non_blocking=False)
        return result

    def copy_to_cuda(
        self, value: TensorResident, device: torch.device, stream: Any, *, non_blocking: bool
    ) -> TensorResident:
        """Copy a value into new storage registered on a simulated CUDA device.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            value: The value.
            device: The destination device.
            stream: The stream to copy on; ``None`` for the device's default stream.
            non_blocking: Whether the copy is submitted without blocking (logged).

        Returns:
            The copy, placed on ``device``.

        Raises:
            ValueError: A stream of another device (a misplaced real copy would be unordered with
                the caller's work), or a device the runtime does not simulate.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        native = self._native
        if native is not None:
            made = native.copy(self, value, device, stream, non_blocking)
            if made is not None:
                return made[0]  # type: ignore[no-any-return]
        # `_enter`, inline for the common case (no failure queued).
        if self._faults:
            self._enter("copy_to_cuda")
        else:
            _count_elements(self.calls, _COPY_TO_CUDA)
        index = self._cuda_index(device)
        return self._to_cuda(value, index, self._copy_stream(stream, index), non_blocking, False)[0]

    def copy_to_cuda_measured(
        self, value: TensorResident, device: torch.device, stream: Any, *, non_blocking: bool
    ) -> tuple[TensorResident, ValueFacts | None]:
        """`copy_to_cuda`, with the copy's facts: exactly what `measure` of the copy returns.

        The optional capability of the seam that spares the manager a second call to
        measure what the runtime has just made (docs/architecture.md#the-device-seam).
        It is the same seam call as `copy_to_cuda`: counted in `calls` as
        ``"copy_to_cuda"``, and ``fail_next("copy_to_cuda")`` makes it raise. In a
        subclass (or on an instance) that replaces `copy_to_cuda` or `measure`, it
        returns that `copy_to_cuda`'s copy without facts, for that `measure` to measure.

        Args:
            value: The value.
            device: The destination device.
            stream: The stream to copy on; ``None`` for the device's default stream.
            non_blocking: Whether the copy is submitted without blocking (logged).

        Returns:
            ``(copy, facts)``: the copy, placed on ``device``, and its `ValueFacts`, or
            ``None`` where `copy_to_cuda` or `measure` is replaced.

        Raises:
            ValueError: A stream of another device, or a device the runtime does not simulate.
            Exception: The failure queued by `fail_next` for ``copy_to_cuda``, if any.
        """
        # Replaced by a subclass, on the class, or on the instance (a test's spy):
        # theirs, then.
        try:
            own = (
                # The class's own functions as defined (`_OWN_METHODS`): one replaced on
                # the class is not its own either.
                self.copy_to_cuda.__func__ is _OWN_METHODS[1]  # type: ignore[attr-defined]
                and self.measure.__func__ is _OWN_METHODS[2]  # type: ignore[attr-defined]
            )
        except AttributeError:  # not a method: a function set on the instance
            own = False
        if not own:
            return self.copy_to_cuda(value, device, stream, non_blocking=non_blocking), None
        native = self._native
        if native is not None:
            made = native.copy(self, value, device, stream, non_blocking)
            if made is not None:
                return made
        # `_enter`, inline for the common case (no failure queued).
        if self._faults:
            self._enter("copy_to_cuda")
        else:
            _count_elements(self.calls, _COPY_TO_CUDA)
        # The device copied to last by identity (a caller names one device with one
        # object), else a simulated device by lookup (`_cuda_index` does the rest).
        last = self._last_target
        if device is last[0]:
            index = last[1]
        else:
            known = self._indices.get(device) if type(device) is torch.device else None
            index = self._cuda_index(device) if known is None else known
            self._last_target = (device, index)
        return self._to_cuda(value, index, self._copy_stream(stream, index), non_blocking, True)

    def _to_cuda(
        self,
        value: _V,
        index: int,
        stream: SimulatedStream,
        non_blocking: bool,
        measured: bool,
    ) -> tuple[_V, ValueFacts | None]:
        """`copy_to_cuda`'s copy of ``value`` to device ``index`` on ``stream``, with its
        facts when ``measured``: the source read, the copy (`to`'s), its registration,
        timing and log entry. (The common case is the native seam's,
        `fhelium._core.SimulatedSeam.copy`.)"""
        tensors = value._resident_tensors
        target = self._devices[index]
        with self._lock:
            # The copy reads its source on `stream` (docs/concepts/simulation.md#memory-reuse).
            self._order.read(stream, self._storage.device_storage_keys(tensors))
        result = self._cuda_copy(value, target, stream)
        timeline = self._timing
        if timeline is not None:
            by_device = self._storage.bytes_by_device(value)
            engine = "d2d" if any(d.type == "cuda" for d in by_device) else "h2d"
            with self._lock:
                timeline.enqueue_copy(
                    stream, engine, sum(by_device.values()), blocking=not non_blocking
                )
        location = self._cuda_locations[index]
        if location is None:
            location = self._cuda_locations[index] = cuda_location(target)
        self._log(location, stream, non_blocking=non_blocking)
        return result, (self._storage.measure(result) if measured else None)

    # --- byte buffers (the disk tier's staging) -------------------------------------
    def empty_pinned(self, nbytes: int) -> torch.Tensor:
        """Allocate an uninitialised pinned byte buffer (the disk tier's staging).

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            nbytes: The buffer size.

        Returns:
            A ``uint8`` tensor registered as pinned.

        Raises:
            RuntimeError: The runtime was built with ``pinned=False``.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("empty_pinned")
        if not self._pinned:
            raise RuntimeError(_PINNED_UNAVAILABLE)
        # Page-aligned, as real pinned memory is (the disk tier relies on it for direct I/O).
        buffer = page_aligned(nbytes)
        self._storage.register((buffer,), _CPU, pinned=True)
        return buffer

    def empty_cuda(self, nbytes: int, device: torch.device, stream: Any) -> torch.Tensor:
        """Allocate an uninitialised byte buffer on a simulated device, on a stream.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            nbytes: The buffer size.
            device: The device.
            stream: A `SimulatedStream`, or an object exposing its handle through
                ``__cuda_stream__``.

        Returns:
            A ``uint8`` tensor registered on ``device``.

        Raises:
            ValueError: A stream of another device, or an unknown device.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("empty_cuda")
        target = self._devices[self._cuda_index(device)]
        resolved = self._resolve_stream(stream, target.index)
        if resolved.device != target:
            raise ValueError(f"stream {stream!r} is on {resolved.device}, not on {target}")
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self._storage.register((buffer,), target, pinned=False, owner=resolved)
        return buffer

    def copy_bytes(self, destination: torch.Tensor, source: torch.Tensor, stream: Any) -> None:
        """Copy bytes between a host buffer and a device buffer at once.

        With a timeline, the copy occupies the stream's device's H2D engine (to the device) or D2H
        engine (from it) without blocking the host, unless the host side is pageable.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            destination: The tensor to write.
            source: The tensor to read; same shape and dtype.
            stream: A `SimulatedStream`, or an object exposing its handle through
                ``__cuda_stream__``.

        Raises:
            ValueError: Both sides on the host or both on a device, a stream of another device, or
                tensors of different shape or dtype.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("copy_bytes")
        resolved = self._resolve_stream(stream, None)
        to_device, pinned_host = self._storage.facts(destination)
        from_device, pinned_source = self._storage.facts(source)
        if (to_device.type == "cuda") == (from_device.type == "cuda"):
            raise ValueError("copy_bytes copies between host memory and a CUDA device")
        device = to_device if to_device.type == "cuda" else from_device
        if device != resolved.device:
            raise ValueError(f"stream {stream!r} is on {resolved.device}, not on {device}")
        if destination.shape != source.shape or destination.dtype != source.dtype:
            raise ValueError("copy_bytes needs two flat tensors of one dtype and length")
        destination.copy_(source)
        with self._lock:
            self._order.read(resolved, self._storage.device_storage_keys((source,)))
        timeline = self._timing
        engine = "h2d" if to_device.type == "cuda" else "d2h"
        host_pinned = pinned_source if engine == "h2d" else pinned_host
        if timeline is not None:
            with self._lock:
                timeline.enqueue_copy(
                    resolved, engine, destination.nbytes, blocking=not host_pinned
                )
        location = (
            cuda_location(device)
            if engine == "h2d"
            else (PINNED_HOST if host_pinned else PAGEABLE_HOST)
        )
        self._log(location, resolved, non_blocking=host_pinned)

    # --- observations ---------------------------------------------------------------
    def memory_allocated(self, device: torch.device) -> int | None:
        """Return the bytes of live simulated storage on a device.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            device: A simulated CUDA device.

        Returns:
            The byte count, or ``None`` for a device the runtime does not simulate.

        Raises:
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("memory_allocated")
        return self._reading(device, 0)

    def memory_reserved(self, device: torch.device) -> int | None:
        """Return the simulated allocator's reserved bytes on a device.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            device: A simulated CUDA device.

        Returns:
            The byte count, or ``None`` for a device the runtime does not simulate.

        Raises:
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("memory_reserved")
        return self._reading(device, 1)

    def memory_sample(self, device: torch.device) -> tuple[int, int] | None:
        """Return both allocator readings of a device from one query.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            device: A simulated CUDA device.

        Returns:
            ``(allocated, reserved)``, or ``None`` for a device the runtime does not simulate.

        Raises:
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        native = self._native
        if native is not None:
            sample = native.memory_sample(self, device)
            if sample is not None:
                return sample
        # `_enter`, inline for the common case (no failure queued).
        if self._faults:
            self._enter("memory_sample")
        else:
            _count_elements(self.calls, _MEMORY_SAMPLE)
        # A simulated device by lookup first (`_device_index` does the rest).
        index = self._indices.get(device) if type(device) is torch.device else None
        if index is None:
            index = self._device_index(device)
        return None if index is None else self._storage.sample(index)

    def _reading(self, device: torch.device, which: int) -> int | None:
        """One allocator reading of a device: 0 allocated, 1 reserved."""
        index = self._device_index(device)
        return None if index is None else self._storage.sample(index)[which]

    # --- test helpers (not counted, never fault-injected) ---------------------------
    def to_device(self, value: _V, device: torch.device | str | int) -> _V:
        """Return a copy of ``value`` in new storage on simulated CUDA ``device``: a test helper.

        Args:
            value: The value to copy.
            device: A simulated CUDA device (a device, ``"cuda:N"`` or an index).

        Returns:
            The copy, placed on ``device``.

        Raises:
            ValueError: A device the runtime does not simulate.
        """
        target = self._cuda_device(device)
        return self._cuda_copy(value, target, self._default_streams[target.index or 0])

    def pin(self, value: _V) -> _V:
        """Return a copy of ``value`` in new simulated pinned host storage: a test helper.

        Args:
            value: The value to copy.

        Returns:
            The pinned copy.

        Raises:
            RuntimeError: The runtime was built with ``pinned=False``.
        """
        return self._pinned_copy(value)

    def placement(self, value: TensorResident | torch.Tensor) -> ResidencyLocation:
        """Return where a value (or one tensor) lives in this simulation, as a location.

        Args:
            value: A value or a tensor.

        Returns:
            `PAGEABLE_HOST`, `PINNED_HOST` or a CUDA location.

        Raises:
            RuntimeError: A value with no tensors, spanning devices, or mixing pinned and
                pageable host tensors.
        """
        return self._storage.placement(value)

    def compute(
        self,
        stream: Any,
        seconds: float,
        *,
        label: str = "compute",
        reads: TensorResident | torch.Tensor | None = None,
    ) -> TimelineSpan:
        """Declare that ``seconds`` of kernels are enqueued on ``stream``, and return the span.

        The work occupies the stream's device's compute engine after everything enqueued on the
        stream before it, without blocking the host.

        Args:
            stream: The stream the kernels run on.
            seconds: Their duration, a finite number >= 0.
            label: The span's label.
            reads: A value (or tensor) the kernels read, declared as `read` does.

        Returns:
            The `TimelineSpan` of the work.

        Raises:
            RuntimeError: The runtime has no `Timeline`.
            TypeError: ``seconds`` is not a number, ``label`` not a string, or ``stream`` not a
                stream of this runtime.
            ValueError: ``seconds`` is negative or not finite.
        """
        timeline = self._timing
        if timeline is None:
            raise RuntimeError(
                "compute needs a timeline: build the runtime with "
                "SimulatedRuntime(timeline=Timeline())"
            )
        duration = non_negative(seconds, "seconds")
        if not isinstance(label, str):
            raise TypeError(f"label must be a str, got {type(label).__name__}")
        resolved = self._resolve_stream(stream, None)
        if reads is not None:
            self.read(resolved, reads)
        with self._lock:
            self._order.enqueue(resolved)
            return timeline.compute(resolved, duration, label)

    def read(self, stream: Any, value: TensorResident | torch.Tensor) -> None:
        """Declare that the work enqueued on ``stream`` now reads ``value``: a test helper.

        See docs/concepts/simulation.md#memory-reuse. A freed block keeps its readers; the
        next allocation on the stream that owns it records a `SimulatedHazard` in `hazards`
        for a reader it is not ordered after.

        Args:
            stream: The stream whose work reads the value.
            value: A `TensorResident` or a tensor; only simulated device storages count.

        Raises:
            TypeError: ``stream`` is not a stream of this runtime, or ``value`` is neither.
        """
        resolved = self._resolve_stream(stream, None)
        if isinstance(value, torch.Tensor):
            tensors: Iterable[torch.Tensor] = (value,)
        elif isinstance(value, TensorResident):
            tensors = value._resident_tensors
        else:
            raise TypeError(
                f"value must be a TensorResident or a tensor, got {type(value).__name__}"
            )
        with self._lock:
            self._order.read(resolved, self._storage.device_storage_keys(tensors))

    # --- internals --------------------------------------------------------------------
    def _cuda_copy(self, value: _V, target: torch.device, owner: SimulatedStream) -> _V:
        # `to(copy=True)` always clones, so even a CPU source gets new, independent storage,
        # exactly like a real host-to-device copy.
        result = value.to(_CPU, copy=True, non_blocking=False)
        self._storage.register(result._resident_tensors, target, pinned=False, owner=owner)
        return result

    def _pinned_copy(self, value: _V) -> _V:
        if not self._pinned:
            raise RuntimeError(_PINNED_UNAVAILABLE)
        # Mirrors TensorResident.pin_memory: the storage layout kept (each unique storage
        # copied once, every field rebuilt over it), a synchronous copy, the source's
        # requires_grad, no autograd tracking.
        clones = layout_copy(value._resident_tensors, _CPU, empty_host, strided_clone)
        self._storage.register(clones, _CPU, pinned=True)
        return value._with_resident_tensors(clones)

    def _time_download(self, value: TensorResident) -> None:
        """A device-to-host copy of the value's simulated CUDA storages, one per device."""
        timeline = self._timing
        assert timeline is not None
        by_device = self._storage.bytes_by_device(value)
        with self._lock:
            for device in sorted(
                (d for d in by_device if d.type == "cuda"), key=lambda d: d.index or 0
            ):
                index = self._device_index(device)
                if index is not None:
                    timeline.download(self._default_streams[index], by_device[device])

    def _log(
        self, destination: ResidencyLocation, stream: SimulatedStream | None, *, non_blocking: bool
    ) -> None:
        with self._lock:
            self.copies.append(SimulatedCopy(destination, stream, non_blocking))


# What `SimulatedSeam` stands for, in its order: the class's own seam methods, taken
# before anything may replace them.
_OWN_METHODS: Final = (
    SimulatedRuntime.copy_to_cuda_measured,
    SimulatedRuntime.copy_to_cuda,
    SimulatedRuntime.measure,
    SimulatedRuntime.record_event,
    SimulatedRuntime.event_query,
    SimulatedRuntime.memory_sample,
)

if TYPE_CHECKING:
    # Static proof that the simulation satisfies the seam it stands in for, and has the
    # optional measured copies.
    _conforms: DeviceRuntime = SimulatedRuntime()
    _measures: MeasuredCopies = SimulatedRuntime()
