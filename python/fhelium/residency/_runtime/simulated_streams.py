"""Simulated streams and events, and the part of `SimulatedRuntime` that orders work with them.

`SimulatedStream` and `SimulatedEvent` are plain objects; `SimulatedStreams`, the base
of the runtime, keeps the streams by handle (for foreign objects speaking the CUDA
stream protocol), the pending events, the happens-before order of the memory-reuse
check (docs/concepts/simulation.md#memory-reuse), and with a `Timeline` the virtual
time events complete at (docs/concepts/simulation.md#streams-and-events).
"""

from __future__ import annotations

import math
import weakref
from collections import _count_elements  # type: ignore[attr-defined]
from collections.abc import Callable
from typing import Any, Final

import torch

from fhelium._core import SimulatedSeam
from fhelium.residency._runtime._reuse import Clock, ReuseOrder
from fhelium.residency._runtime.base import StagedEvent
from fhelium.residency._runtime.simulated_devices import SimulatedDevices
from fhelium.residency._runtime.timeline import Timeline, TimelineClock, attach

__all__ = ["DEFAULT_STREAM_HANDLES", "SimulatedEvent", "SimulatedStream", "SimulatedStreams"]

# The CUDA stream protocol's special handles: 0 and 1 (CU_STREAM_LEGACY) name the legacy
# default stream, 2 the per-thread default stream, both of the *current* device. Simulated
# streams get handles above them.
DEFAULT_STREAM_HANDLES: Final = frozenset({0, 1, 2})
_FIRST_STREAM_HANDLE: Final = 0x1000
# `calls`' key of the seam methods that count themselves (see `record_event`).
_RECORD_EVENT: Final = ("record_event",)
_EVENT_QUERY: Final = ("event_query",)

_new_object: Final = object.__new__


class SimulatedStream:
    """A simulated CUDA stream on one simulated device.

    Each device has a default stream (`SimulatedRuntime.current_stream`); this constructor
    and `SimulatedRuntime.create_stream` make new ones. It deliberately has no
    ``synchronize``/``query`` of its own: code under test must go through the runtime, which
    is what `SimulatedRuntime.calls` observes. See
    docs/concepts/simulation.md#streams-and-events.

    Args:
        runtime: The `SimulatedRuntime` it belongs to.
        device: One of the runtime's simulated CUDA devices (a device, ``"cuda:N"`` or an
            index).

    Raises:
        TypeError: ``runtime`` is not a `SimulatedRuntime`.
        ValueError: A device the runtime does not simulate.
    """

    __slots__ = ("__weakref__", "_default", "_device", "_handle", "_runtime")

    def __init__(self, runtime: SimulatedStreams, device: torch.device | str | int) -> None:
        if not isinstance(runtime, SimulatedStreams):
            raise TypeError(f"runtime must be a SimulatedRuntime, got {type(runtime).__name__}")
        self._runtime = runtime
        self._device, self._handle = runtime._register_stream(self, device)
        self._default = False

    @property
    def handle(self) -> int:
        """The stream's simulated ``cudaStream_t``.

        What a foreign library wrapping this stream reports through the CUDA stream protocol;
        never 0, 1 or 2, which name default streams.
        """
        return self._handle

    @property
    def device(self) -> torch.device:
        """The simulated CUDA device the stream belongs to."""
        return self._device

    @property
    def device_index(self) -> int:
        """The index of the stream's device, as ``torch.cuda.Stream.device_index``."""
        return self._device.index or 0

    @property
    def cuda_stream(self) -> int:
        """The raw handle, as ``torch.cuda.Stream.cuda_stream``: 0 for a device's default
        stream, on every device, as in torch; `handle` otherwise.

        A raw 0 names the *current* device's default stream (see `device_guard`), so code
        handing it to the CUDA runtime must make the stream's device current first.
        """
        return 0 if self._default else self._handle

    @property
    def runtime(self) -> SimulatedStreams:
        """The `SimulatedRuntime` the stream belongs to."""
        return self._runtime

    def __repr__(self) -> str:
        return f"SimulatedStream({self._device}, id={id(self):#x})"


class SimulatedEvent:
    """An event recorded on a `SimulatedStream`; incomplete until something completes it.

    Completed by `complete`, by `SimulatedRuntime.complete_events`, by the runtime's event,
    stream or device synchronisation, or (with a `Timeline`) when the host clock reaches its
    time. Made by `SimulatedRuntime.record_event`.

    Args:
        stream: The stream it is recorded on.
        completed: Whether it starts complete.
    """

    __slots__ = ("__weakref__", "_clock", "_completed", "_stream", "_time")

    def __init__(self, stream: SimulatedStream, *, completed: bool = False) -> None:
        self._stream = stream
        self._completed = completed
        self._time: float | None = None
        # What the event orders after it (docs/concepts/simulation.md#memory-reuse);
        # None for an event built by hand, which orders nothing, and for an event
        # complete when recorded, whose order the host took in then (a wait for it adds
        # nothing: what a stream is ordered after always includes the host's).
        self._clock: Clock | None = None

    @property
    def stream(self) -> SimulatedStream:
        """The stream the event was recorded on."""
        return self._stream

    @property
    def device(self) -> torch.device:
        """The simulated CUDA device of its stream."""
        return self._stream.device

    @property
    def completed(self) -> bool:
        """Whether the simulated work before the event has finished (reading it is not counted)."""
        return self._completed

    @property
    def time(self) -> float | None:
        """With a `Timeline`: the virtual time at which the work before the event ends.

        The event completes once the host clock reaches it; ``None`` without a timeline.
        """
        return self._time

    def complete(self) -> None:
        """Finish the simulated work before this event.

        With a `Timeline`, the host clock advances to the event's time, as a host
        synchronisation on the event would; an event already complete returns at once.
        """
        if self._completed:
            return
        if self._time is None:
            self._completed = True
            self._stream.runtime._forget_event(self)
        else:
            self._stream.runtime._sync_timeline(self._time, lambda event: event is self)

    def __repr__(self) -> str:
        state = "complete" if self._completed else "pending"
        return f"SimulatedEvent({self._stream.device}, {state})"


class SimulatedStreams(SimulatedDevices):
    """The streams and events of the simulated devices: the base of `SimulatedRuntime`
    that creates, resolves, waits for and synchronises them.

    Args:
        device_count: How many simulated CUDA devices.
        auto_complete: Complete every event as soon as it is recorded.
        timeline: A `Timeline` to model virtual time (checked by the caller).
    """

    def __init__(
        self, device_count: int, *, auto_complete: bool, timeline: Timeline | None
    ) -> None:
        super().__init__(device_count)
        self._auto_complete = auto_complete
        self._pending: weakref.WeakSet[SimulatedEvent] = weakref.WeakSet()
        # Streams by simulated handle, for foreign objects that expose one through the
        # CUDA stream protocol.
        self._streams_by_handle: weakref.WeakValueDictionary[int, SimulatedStream] = (
            weakref.WeakValueDictionary()
        )
        self._next_handle = _FIRST_STREAM_HANDLE
        self._default_streams = tuple(SimulatedStream(self, device) for device in self._devices)
        for default in self._default_streams:
            default._default = True
        self._default_by_device = dict(zip(self._devices, self._default_streams, strict=True))
        self.waits: list[tuple[SimulatedStream, SimulatedEvent]] = []
        self._order = ReuseOrder()
        self._timeline: Timeline | None = None
        self._timing: TimelineClock | None = None
        # The native common case of the hot seam methods (`SimulatedRuntime` sets it).
        self._native: SimulatedSeam | None = None
        if timeline is not None:
            self._timing = attach(timeline, self._lock, self._complete_timed_locked)
            self._timeline = timeline

    # --- streams and events ---------------------------------------------------------
    def is_stream(self, obj: object) -> bool:
        """Whether an object is a stream: a `SimulatedStream` or a ``__cuda_stream__`` object.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            obj: Any object.

        Returns:
            Whether the manager may treat it as a stream.

        Raises:
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("is_stream")
        return isinstance(obj, SimulatedStream) or hasattr(type(obj), "__cuda_stream__")

    def stream_device(self, stream: Any) -> torch.device:
        """Return the device of a stream.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            stream: A `SimulatedStream`, or an object exposing its handle through
                ``__cuda_stream__``.

        Returns:
            Its simulated CUDA device.

        Raises:
            TypeError: ``stream`` is not a stream of this runtime.
            ValueError: A protocol handle that names no stream of this runtime.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("stream_device")
        return self._resolve_stream(stream, None).device

    def bind_stream(self, stream: Any, device: torch.device) -> SimulatedStream:
        """Resolve a stream for one device, fixing a default-stream handle to that device.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            stream: A `SimulatedStream`, or an object exposing its handle through
                ``__cuda_stream__``.
            device: A simulated CUDA device.

        Returns:
            The `SimulatedStream`.

        Raises:
            TypeError: ``stream`` is not a stream of this runtime.
            ValueError: A device that is not one of the simulated CUDA devices.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("bind_stream")
        return self._resolve_stream(stream, self._cuda_index(device))

    def current_stream(self, device: torch.device) -> SimulatedStream:
        """Return the default stream of a simulated device.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            device: A simulated CUDA device.

        Returns:
            Its default `SimulatedStream`.

        Raises:
            ValueError: A device that is not one of the simulated CUDA devices.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("current_stream")
        # A simulated device by lookup first (`_cuda_index` does the rest).
        found = self._default_by_device.get(device) if type(device) is torch.device else None
        return self._default_streams[self._cuda_index(device)] if found is None else found

    def create_stream(self, device: torch.device) -> SimulatedStream:
        """Create a new stream on a simulated device.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            device: A simulated CUDA device.

        Returns:
            The new `SimulatedStream`.

        Raises:
            ValueError: A device that is not one of the simulated CUDA devices.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("create_stream")
        return SimulatedStream(self, device)

    def wait_event(self, stream: Any, event: Any) -> None:
        """Order later work on ``stream`` after ``event``, without blocking the host.

        Logged in ``waits``.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            stream: A `SimulatedStream`, or an object exposing its handle through
                ``__cuda_stream__``.
            event: A `SimulatedEvent` of this runtime, or a `StagedEvent` around one.

        Raises:
            TypeError: ``stream`` is not a stream of this runtime.
            TypeError: ``event`` is not a `SimulatedEvent`.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("wait_event")
        resolved = stream if type(stream) is SimulatedStream else self._resolve_stream(stream, None)
        if type(event) is not SimulatedEvent:
            if type(event) is StagedEvent:
                event = event.resolve()
                if event is None:
                    return
            event = check_event(event)
        self._wait(resolved, event)

    def _wait(self, resolved: SimulatedStream, checked: SimulatedEvent) -> None:
        timing = self._timing
        # `with self._lock`, spelled out (as in `record_event`): every wait takes it.
        lock = self._lock
        lock.acquire()
        try:
            self.waits.append((resolved, checked))
            self._order.wait(resolved, checked._clock)
            if timing is not None and checked._time is not None:
                timing.wait(resolved, checked._time)
        finally:
            lock.release()

    def synchronize_stream(self, stream: Any) -> None:
        """Wait on the host for everything enqueued on a stream; its events complete.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            stream: A `SimulatedStream`, or an object exposing its handle through
                ``__cuda_stream__``.

        Raises:
            TypeError: ``stream`` is not a stream of this runtime.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("synchronize_stream")
        resolved = self._resolve_stream(stream, None)
        with self._lock:
            self._order.drained(resolved)
        timing = self._timing
        if timing is None:
            self._complete_where(lambda event: event.stream is resolved)
            return
        with self._lock:
            timing.advance(timing.tail(resolved))
            self._complete_pending_locked(lambda event: event.stream is resolved)

    def synchronize_device(self, device: torch.device) -> None:
        """Wait on the host for everything enqueued on a device; its events complete.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            device: A simulated CUDA device.

        Raises:
            ValueError: A device that is not one of the simulated CUDA devices.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("synchronize_device")
        target = self._cuda_device(device)
        streams = [*self._default_streams, *self._streams_by_handle.values()]
        with self._lock:
            for each in streams:
                if each.device == target:
                    self._order.drained(each)
        timing = self._timing
        if timing is None:
            self._complete_where(lambda event: event.device == target)
            return
        with self._lock:
            timing.advance(timing.device_end(target))
            self._complete_pending_locked(lambda event: event.device == target)

    def record_event(self, stream: Any) -> SimulatedEvent:
        """Record an event on a stream, after the work enqueued there.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            stream: A `SimulatedStream`, or an object exposing its handle through
                ``__cuda_stream__``.

        Returns:
            The new `SimulatedEvent` (complete at once with ``auto_complete``).

        Raises:
            TypeError: ``stream`` is not a stream of this runtime.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        native = self._native
        if native is not None:
            made = native.record_event(self, stream)
            if made is not None:
                return made  # type: ignore[no-any-return]
        # `_enter`, inline for the common case (no failure queued): every copy records one.
        if self._faults:
            self._enter("record_event")
        else:
            _count_elements(self.calls, _RECORD_EVENT)
        if type(stream) is not SimulatedStream:
            stream = self._resolve_stream(stream, None)
        if self._timing is not None:
            return self._record(stream)
        # `_record` without a timeline, inline.
        event = _new_object(SimulatedEvent)
        event._stream = stream
        event._time = None
        if self._auto_complete:
            # Complete at once: the host takes in its order now, so a wait for it adds
            # nothing and it keeps no clock; a stream the host has taken in since its
            # last work (`ReuseOrder.clean`) needs neither that nor the lock.
            event._completed = True
            event._clock = None
            if not self._order.is_clean(stream):
                # `with self._lock`, spelled out: the same hold, in half the time.
                lock = self._lock
                lock.acquire()
                try:
                    self._order.drained(stream)
                finally:
                    lock.release()
            return event
        event._completed = False
        lock = self._lock
        lock.acquire()
        try:
            event._clock = self._order.clock(stream)
            self._pending.add(event)
        finally:
            lock.release()
        return event

    def _record(self, stream: SimulatedStream) -> SimulatedEvent:
        # Built field by field: every CUDA lease release records one.
        event = _new_object(SimulatedEvent)
        event._stream = stream
        timing = self._timing
        if timing is not None:
            with self._lock:
                event._clock = self._order.clock(stream)
                time = timing.tail(stream)
                event._time = time
                event._completed = time <= timing.now
                if event._completed:
                    self._order.completed(event._clock)
                else:
                    self._pending.add(event)
            return event
        event._time = None
        event._completed = auto = self._auto_complete
        with self._lock:
            if auto:
                # As in `record_event`: the host takes in its order now.
                event._clock = None
                self._order.drained(stream)
            else:
                event._clock = self._order.clock(stream)
                self._pending.add(event)
        return event

    def event_query(self, event: Any) -> bool:
        """Whether an event has completed (with a timeline: whether the host clock reached it).

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            event: A `SimulatedEvent` of this runtime, or a `StagedEvent` around one.

        Returns:
            Whether it is complete.

        Raises:
            TypeError: ``event`` is not a `SimulatedEvent`.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        native = self._native
        if native is not None:
            completed = native.event_query(self, event)
            if completed is not None:
                return completed
        # `_enter`, inline for the common case (no failure queued).
        if self._faults:
            self._enter("event_query")
        else:
            _count_elements(self.calls, _EVENT_QUERY)
        if type(event) is SimulatedEvent and self._timing is None:
            # `_query`'s first case, without its frame: most queries are this one.
            return event._completed
        if type(event) is StagedEvent:
            return event.query(self._query)
        return self._query(event)

    def _query(self, event: Any) -> bool:
        timing = self._timing
        if timing is None:
            if type(event) is SimulatedEvent:
                return event._completed
            return check_event(event).completed
        checked = check_event(event)
        time = checked._time
        if time is None:
            return checked._completed
        with self._lock:
            if not checked._completed and time <= timing.now:
                checked._completed = True
                self._pending.discard(checked)
                self._order.completed(checked._clock)
            return checked._completed

    def synchronize_event(self, event: Any) -> None:
        """Wait on the host for an event; it completes.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Args:
            event: A `SimulatedEvent` of this runtime, or a `StagedEvent` around one.

        Raises:
            TypeError: ``event`` is not a `SimulatedEvent`.
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("synchronize_event")
        if type(event) is StagedEvent:
            event = event.resolve()
            if event is None:
                return
        check_event(event).complete()

    def complete_events(self) -> int:
        """Complete every pending event.

        With a `Timeline`, the host clock advances to the latest of their times, as a host
        synchronisation on all of them would.

        Returns:
            How many events were completed.
        """
        timing = self._timing
        if timing is None:
            return self._complete_where(lambda event: True)
        with self._lock:
            times = [event._time for event in self._pending if event._time is not None]
            timing.advance(max(times, default=0.0))
            return self._complete_pending_locked(lambda event: True)

    def pending_event_count(self) -> int:
        """Return how many events recorded by this runtime are still incomplete (not counted).

        Returns:
            The number of pending events.
        """
        with self._lock:
            return len(self._pending)

    # --- internals --------------------------------------------------------------------
    def _register_stream(
        self, stream: SimulatedStream, device: torch.device | str | int
    ) -> tuple[torch.device, int]:
        """(the simulated device, a new handle) of a stream being built."""
        target = self._cuda_device(device)
        with self._lock:
            handle = self._next_handle
            self._next_handle += 1
            self._streams_by_handle[handle] = stream
        return target, handle

    def _resolve_stream(self, stream: object, device_index: int | None) -> SimulatedStream:
        """The simulated stream ``stream`` names: itself, or the stream behind a CUDA
        stream protocol handle. A default-stream handle (0, 1, 2) names the default
        stream of ``device_index`` when given, else of the object's declared device
        (``device``/``device_id``, as cuda.core and CuPy expose), else of the calling
        thread's current device, as with real CUDA."""
        if type(stream) is SimulatedStream:
            return stream
        if not hasattr(type(stream), "__cuda_stream__"):
            raise TypeError(
                "expected a SimulatedStream or an object implementing __cuda_stream__, "
                f"got {type(stream).__name__}"
            )
        protocol = stream.__cuda_stream__  # type: ignore[attr-defined]
        version, handle = protocol() if callable(protocol) else protocol
        if version != 0:
            raise TypeError(f"unsupported CUDA stream protocol version {version}")
        if handle in DEFAULT_STREAM_HANDLES:
            if device_index is None:
                declared = getattr(stream, "device", None)
                if declared is None:
                    declared = getattr(stream, "device_id", None)
                if declared is not None and not isinstance(declared, (int, str, torch.device)):
                    declared = getattr(declared, "device_id", declared)  # cuda.core's Device
                device_index = (
                    self.current_device() if declared is None else self._cuda_index(declared)
                )
            return self._default_streams[device_index]
        found = self._streams_by_handle.get(handle)
        if found is None:
            raise ValueError(f"{handle:#x} is not a stream of this simulated runtime")
        return found

    def _copy_stream(self, stream: object, index: int) -> SimulatedStream:
        """The stream a copy to the simulated device of index ``index`` runs on: the
        device's default stream for ``None``, else the stream ``stream`` names (a
        default-stream handle: the target device's, as the copy runs with the target
        device current), which must be on that device (else ``ValueError``: a
        misplaced real copy would be unordered with the caller's work)."""
        # This runtime's streams are on its `_devices` (`_register_stream`): identity first.
        target = self._devices[index]
        if type(stream) is SimulatedStream:
            if stream._device is target:
                return stream
            resolved = stream
        elif stream is None:
            return self._default_streams[index]
        else:
            resolved = self._resolve_stream(stream, index)
        device = resolved._device
        if device is not target and device != target:
            raise ValueError(f"stream {resolved!r} is on {device}, not on {target}")
        return resolved

    def _stream_for_handle(self, handle: int) -> SimulatedStream | None:
        """The stream a raw handle names, as the CUDA runtime reads it: a default-stream
        handle names the calling thread's current device's default stream."""
        if handle in DEFAULT_STREAM_HANDLES:
            return self._default_streams[self.current_device()]
        return self._streams_by_handle.get(handle)

    def _complete_where(self, predicate: Callable[[SimulatedEvent], bool]) -> int:
        with self._lock:
            done = [event for event in self._pending if predicate(event)]
            for event in done:
                event._completed = True
                self._pending.discard(event)
                self._order.completed(event._clock)
        return len(done)

    def _forget_event(self, event: SimulatedEvent) -> None:
        with self._lock:
            self._pending.discard(event)
            self._order.completed(event._clock)

    def _complete_pending_locked(self, predicate: Callable[[SimulatedEvent], bool]) -> int:
        """With the timeline's clock moved: completes the pending events it has reached,
        and those ``predicate`` selects."""
        timing = self._timing
        now = math.inf if timing is None else timing.now
        done = [
            event
            for event in self._pending
            if (event._time is not None and event._time <= now) or predicate(event)
        ]
        for event in done:
            event._completed = True
            self._pending.discard(event)
            self._order.completed(event._clock)
        return len(done)

    def _sync_timeline(self, time: float, predicate: Callable[[SimulatedEvent], bool]) -> None:
        """The host waits until virtual ``time``."""
        timing = self._timing
        with self._lock:
            if timing is not None:
                timing.advance(time)
            self._complete_pending_locked(predicate)

    def _complete_timed_locked(self) -> None:
        """The timeline was reset: the events it timed count as done."""
        self._complete_pending_locked(lambda event: event._time is not None)


def check_event(event: object) -> SimulatedEvent:
    if not isinstance(event, SimulatedEvent):
        raise TypeError(f"expected a SimulatedEvent, got {type(event).__name__}")
    return event
