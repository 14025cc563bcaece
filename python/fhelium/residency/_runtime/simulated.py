"""`SimulatedRuntime`: pinned host and CUDA devices simulated with ordinary CPU tensors.

It lets CI, which has no GPU, drive every CUDA path of the manager: copies land in storages
the runtime registers as "on cuda:N" or "pinned", streams and events are plain objects whose
completion the test controls, and every call is counted and can be made to fail.

With a `Timeline` the runtime also keeps virtual time: copies and declared compute occupy
per-device engines for a modelled duration, events complete when the host clock reaches
them, and the timeline's spans predict how copies and compute overlap
(docs/concepts/simulation.md).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import inspect
import itertools
import math
import mmap
import threading
import weakref
from collections import _count_elements  # type: ignore[attr-defined]
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fhelium.residency._runtime._reuse import Clock, ReuseOrder
from fhelium.residency._runtime.base import DeviceRuntime, StagedEvent, ValueFacts
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, ResidencyLocation, cuda_location
from fhelium.values.tensor_resident import TensorResident, _layout_copy

__all__ = [
    "SimulatedCopy",
    "SimulatedEvent",
    "SimulatedHazard",
    "SimulatedRuntime",
    "SimulatedStream",
    "Timeline",
    "TimelineSpan",
]

_V = TypeVar("_V", bound=TensorResident)

_CPU: Final = torch.device("cpu")

# Every method of the seam, i.e. what `calls` counts and `fail_next` accepts. Derived from the
# Protocol so that a method added there is instrumented here without a second list to forget.
_SEAM_METHODS: Final = frozenset(
    name
    for name, member in vars(DeviceRuntime).items()
    if not name.startswith("_") and inspect.isfunction(member)
)

_PINNED_UNAVAILABLE: Final = (
    "pinned host storage is unavailable in this simulated runtime (built with pinned=False); "
    "use pageable CPU storage"
)

# The CUDA stream protocol's special handles: 0 and 1 (CU_STREAM_LEGACY) name the legacy
# default stream, 2 the per-thread default stream, both of the *current* device. Simulated
# streams get handles above them.
_DEFAULT_STREAM_HANDLES: Final = frozenset({0, 1, 2})
_FIRST_STREAM_HANDLE: Final = 0x1000

# The CUDA caching allocator rounds every block up to 512 bytes; reserved bytes do the same
# so that reserved >= allocated holds the way it does on a real device.
_BLOCK: Final = 512

# The engines of one simulated device in the timeline model, in track order: each runs one
# piece of work at a time, and the four run concurrently with one another.
_ENGINES: Final = ("h2d", "d2h", "d2d", "compute")
_COPY_LABELS: Final = {"h2d": "H2D", "d2h": "D2H", "d2d": "D2D"}


class TimelineSpan(NamedTuple):
    """One piece of work on a simulated device's engine, in virtual seconds: a named tuple.

    Attributes:
        device: The simulated CUDA device.
        engine: ``"h2d"``, ``"d2h"``, ``"d2d"`` or ``"compute"``.
        start: When the work starts, in virtual seconds.
        end: When it ends.
        nbytes: Bytes copied; 0 for compute.
        label: A description, such as ``"H2D 64.0 MiB"`` or a compute label.
    """

    device: torch.device
    engine: str
    start: float
    end: float
    # Bytes copied; 0 for compute.
    nbytes: int
    label: str


class Timeline:
    """A virtual-time model of a `SimulatedRuntime`'s copies and compute.

    Give one to ``SimulatedRuntime(timeline=...)``; it then belongs to that runtime. Each
    simulated device has four engines (``"h2d"``, ``"d2h"``, ``"d2d"``, ``"compute"``) that
    each run one piece of work at a time; a copy takes its storage bytes divided by the
    direction's bandwidth, compute takes what `SimulatedRuntime.compute` declares, and
    host-side work takes no virtual time. The defaults are about what a PCIe Gen5 x16 link
    sustains per direction and a round figure for device memory. The rules are in
    docs/concepts/simulation.md#the-timeline.

    Args:
        h2d_bytes_per_s: Host-to-device bandwidth, a finite number > 0.
        d2h_bytes_per_s: Device-to-host bandwidth, a finite number > 0.
        d2d_bytes_per_s: Device-to-device bandwidth, a finite number > 0.

    Raises:
        TypeError: A bandwidth that is not a number.
        ValueError: A bandwidth that is not finite and > 0.

    Example:
        ```python
        from fhelium.residency.simulation import SimulatedRuntime, Timeline

        timeline = Timeline(h2d_bytes_per_s=1e9)
        runtime = SimulatedRuntime(device_count=1, timeline=timeline)
        stream = runtime.create_stream(runtime.current_stream(0).device)
        span = runtime.compute(stream, 1e-3)
        assert (span.engine, span.end) == ("compute", 1e-3)
        assert timeline.now == 0.0 and timeline.makespan == 1e-3
        ```
    """

    __slots__ = (
        "_d2d",
        "_d2h",
        "_free",
        "_h2d",
        "_horizon",
        "_lock",
        "_now",
        "_owner",
        "_spans",
        "_tails",
    )

    def __init__(
        self,
        *,
        h2d_bytes_per_s: float = 55e9,
        d2h_bytes_per_s: float = 55e9,
        d2d_bytes_per_s: float = 2e12,
    ) -> None:
        self._h2d = _positive(h2d_bytes_per_s, "h2d_bytes_per_s")
        self._d2h = _positive(d2h_bytes_per_s, "d2h_bytes_per_s")
        self._d2d = _positive(d2d_bytes_per_s, "d2d_bytes_per_s")
        # Replaced by the owning runtime's lock when the timeline is attached to one.
        self._lock = threading.Lock()
        self._owner: weakref.ref[SimulatedRuntime] | None = None
        self._now = 0.0
        self._spans: list[TimelineSpan] = []
        # When the last work enqueued on each stream ends.
        self._tails: weakref.WeakKeyDictionary[SimulatedStream, float] = weakref.WeakKeyDictionary()
        # When each (device, engine) is next free.
        self._free: dict[tuple[torch.device, str], float] = {}
        # The latest tail any stream of each device has had, so that a device
        # synchronisation covers streams that have since been collected.
        self._horizon: dict[torch.device, float] = {}

    @property
    def h2d_bytes_per_s(self) -> float:
        """The host-to-device bandwidth, in bytes per second."""
        return self._h2d

    @property
    def d2h_bytes_per_s(self) -> float:
        """The device-to-host bandwidth, in bytes per second."""
        return self._d2h

    @property
    def d2d_bytes_per_s(self) -> float:
        """The device-to-device bandwidth, in bytes per second."""
        return self._d2d

    @property
    def now(self) -> float:
        """The host clock: virtual seconds the host has spent waiting for the devices."""
        with self._lock:
            return self._now

    @property
    def makespan(self) -> float:
        """When everything enqueued so far is done: the latest of `now` and every span's end."""
        with self._lock:
            return self._makespan_locked()

    @property
    def spans(self) -> tuple[TimelineSpan, ...]:
        """Every copy and compute span, in enqueue order."""
        with self._lock:
            return tuple(self._spans)

    def busy(self, engine: str, device: torch.device | str | int | None = None) -> float:
        """Return the total seconds of the spans on ``engine``, of one device or of every device.

        Args:
            engine: ``"h2d"``, ``"d2h"``, ``"d2d"`` or ``"compute"``.
            device: A CUDA device (``torch.device``, ``"cuda:N"`` or an index), or ``None`` for
                every device.

        Returns:
            The summed span durations, in virtual seconds.

        Raises:
            TypeError: ``engine`` is not a string.
            ValueError: An unknown engine, or a device that is not an indexed CUDA device.
        """
        if not isinstance(engine, str):
            raise TypeError(f"engine must be a str, got {type(engine).__name__}")
        if engine not in _ENGINES:
            raise ValueError(f"engine must be one of {_ENGINES}, got {engine!r}")
        target = None if device is None else _normalize_cuda(device)
        with self._lock:
            return sum(
                span.end - span.start
                for span in self._spans
                if span.engine == engine and (target is None or span.device == target)
            )

    def reset(self) -> None:
        """Forget every span and set every clock back to 0.

        Work enqueued before counts as done: events still pending complete.
        """
        owner = None if self._owner is None else self._owner()
        with self._lock:
            self._now = 0.0
            self._spans.clear()
            self._tails.clear()
            self._free.clear()
            self._horizon.clear()
            if owner is not None:
                owner._complete_pending_locked(lambda event: event._time is not None)

    def __repr__(self) -> str:
        with self._lock:
            now, count = self._now, len(self._spans)
        return (
            f"Timeline(h2d_bytes_per_s={self._h2d!r}, d2h_bytes_per_s={self._d2h!r}, "
            f"d2d_bytes_per_s={self._d2d!r}, now={now!r}, spans={count})"
        )

    def _snapshot(self) -> tuple[tuple[TimelineSpan, ...], float]:
        """(spans, now), read together."""
        with self._lock:
            return tuple(self._spans), self._now

    # --- used by the owning runtime, with its lock held -----------------------------
    def _attach(self, runtime: SimulatedRuntime) -> None:
        with self._lock:
            if self._owner is not None:
                raise ValueError("this Timeline already belongs to another SimulatedRuntime")
            self._owner = weakref.ref(runtime)
            self._lock = runtime._lock

    def _makespan_locked(self) -> float:
        return max([self._now, *(span.end for span in self._spans)])

    def _tail(self, stream: SimulatedStream) -> float:
        return self._tails.get(stream, 0.0)

    def _set_tail(self, stream: SimulatedStream, time: float) -> None:
        self._tails[stream] = time
        device = stream.device
        if time > self._horizon.get(device, 0.0):
            self._horizon[device] = time

    def _bandwidth(self, engine: str) -> float:
        if engine == "h2d":
            return self._h2d
        if engine == "d2h":
            return self._d2h
        return self._d2d

    def _occupy(
        self,
        device: torch.device,
        engine: str,
        ready: float,
        seconds: float,
        nbytes: int,
        label: str,
    ) -> TimelineSpan:
        """Runs work of ``seconds`` on ``(device, engine)`` once it is free and ``ready``."""
        key = (device, engine)
        start = max(ready, self._free.get(key, 0.0))
        span = TimelineSpan(device, engine, start, start + seconds, nbytes, label)
        self._free[key] = span.end
        self._spans.append(span)
        return span

    def _enqueue_copy(
        self, stream: SimulatedStream, engine: str, nbytes: int, *, blocking: bool
    ) -> None:
        span = self._occupy(
            stream.device,
            engine,
            max(self._now, self._tail(stream)),
            nbytes / self._bandwidth(engine),
            nbytes,
            _copy_label(engine, nbytes),
        )
        self._set_tail(stream, span.end)
        if blocking:
            self._now = max(self._now, span.end)

    def _download(self, default_stream: SimulatedStream, nbytes: int) -> None:
        # Synchronous, after the device's default stream: the host waits for it.
        span = self._occupy(
            default_stream.device,
            "d2h",
            max(self._now, self._tail(default_stream)),
            nbytes / self._d2h,
            nbytes,
            _copy_label("d2h", nbytes),
        )
        self._now = max(self._now, span.end)

    def _compute(self, stream: SimulatedStream, seconds: float, label: str) -> TimelineSpan:
        span = self._occupy(
            stream.device, "compute", max(self._now, self._tail(stream)), seconds, 0, label
        )
        self._set_tail(stream, span.end)
        return span

    def _wait(self, stream: SimulatedStream, time: float) -> None:
        if time > self._tail(stream):
            self._set_tail(stream, time)

    def _device_end(self, device: torch.device) -> float:
        ends = [self._horizon.get(device, 0.0)]
        ends += [self._free.get((device, engine), 0.0) for engine in _ENGINES]
        return max(ends)

    def _advance(self, time: float) -> None:
        self._now = max(self._now, time)


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

    def __init__(self, runtime: SimulatedRuntime, device: torch.device | str | int) -> None:
        if not isinstance(runtime, SimulatedRuntime):
            raise TypeError(f"runtime must be a SimulatedRuntime, got {type(runtime).__name__}")
        self._runtime = runtime
        self._device = runtime._cuda_device(device)
        self._handle = runtime._register_stream(self)
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
    def runtime(self) -> SimulatedRuntime:
        """The `SimulatedRuntime` the stream belongs to."""
        return self._runtime

    def __repr__(self) -> str:
        return f"SimulatedStream({self._device}, id={id(self):#x})"


class SimulatedHazard(NamedTuple):
    """A freed device block that an allocation may reuse while it is still read: a named tuple.

    Recorded in ``SimulatedRuntime.hazards`` (docs/concepts/simulation.md#memory-reuse).

    Attributes:
        device: The simulated device.
        stream: The stream that allocated, which owns the freed block.
        reader: A stream whose declared read of the block is not ordered before the
            allocation.
        nbytes: The freed block's bytes.
    """

    device: torch.device
    stream: SimulatedStream
    reader: SimulatedStream
    nbytes: int


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
        # None for an event built by hand, which orders nothing.
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


class _Entry(weakref.ref[torch.UntypedStorage]):
    """Where one registered storage lives: a weak reference to the storage whose callback
    reports its death, so the per-device byte counters follow frees without a scan.

    torch keeps a storage's Python object alive for as long as the storage itself (as it
    does a tensor's), so the reference dies, and the callback runs, exactly when the
    storage is freed. ``counted`` is whether the entry's bytes are still in its device's
    counters: a storage registered again replaces its entry and is counted once. The
    storage's C++ weak reference (``address``) keeps the identity unique: while the entry
    exists, no other storage can be allocated at its key.
    """

    __slots__ = ("address", "counted", "device", "key", "nbytes", "pinned")

    def __new__(
        cls,
        storage: torch.UntypedStorage,
        callback: Callable[[_Entry], object],
        device: torch.device,
        pinned: bool,
    ) -> _Entry:
        return super().__new__(cls, storage, callback)

    def __init__(
        self,
        storage: torch.UntypedStorage,
        callback: Callable[[_Entry], object],
        device: torch.device,
        pinned: bool,
    ) -> None:
        # `weakref.ref.__new__` made the reference (its `__init__` only checks arguments).
        self.address = StorageWeakRef(storage)  # type: ignore[no-untyped-call]
        self.key: int = storage._cdata
        self.device = device
        self.pinned = pinned
        self.nbytes: int = storage.nbytes()
        self.counted = False

    def alive(self) -> bool:
        return self() is not None


class _Fault:
    __slots__ = ("exc", "remaining")

    def __init__(self, exc: BaseException | type[BaseException], remaining: int) -> None:
        self.exc = exc
        self.remaining = remaining


class SimulatedRuntime:
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
        self._device_count = device_count
        self._pinned = pinned
        self._auto_complete = auto_complete
        self._devices = tuple(torch.device("cuda", index) for index in range(device_count))
        # Each device's location, made on its first copy (for the copy log).
        self._cuda_locations: dict[int, ResidencyLocation] = {}
        self._lock = threading.Lock()
        self._registry: dict[int, _Entry] = {}
        # Live simulated CUDA bytes per device, allocated and rounded up to the allocator's
        # block, kept as storages are registered and freed: an allocator reading is O(1).
        # A freed storage's entry lands in `_freed` (its weak reference's callback, which
        # may run on any thread, only appends) and leaves the registry and the counters
        # at the next registration or reading.
        self._allocated_bytes: dict[torch.device, int] = dict.fromkeys(self._devices, 0)
        self._reserved_bytes: dict[torch.device, int] = dict.fromkeys(self._devices, 0)
        self._freed: collections.deque[_Entry] = collections.deque()
        self._pending: weakref.WeakSet[SimulatedEvent] = weakref.WeakSet()
        self._faults: dict[str, collections.deque[_Fault]] = {}
        # Streams by simulated handle, for foreign objects that expose one through the
        # CUDA stream protocol; and each thread's current device (0 until changed).
        self._streams_by_handle: weakref.WeakValueDictionary[int, SimulatedStream] = (
            weakref.WeakValueDictionary()
        )
        self._next_handle = _FIRST_STREAM_HANDLE
        self._current = threading.local()
        self._default_streams = tuple(SimulatedStream(self, device) for device in self._devices)
        for default in self._default_streams:
            default._default = True
        self._cudart = _SimulatedCudart(self)
        self.calls: collections.Counter[str] = collections.Counter()
        self.copies: list[SimulatedCopy] = []
        self.waits: list[tuple[SimulatedStream, SimulatedEvent]] = []
        self.hazards: list[SimulatedHazard] = []
        self._order: ReuseOrder[SimulatedStream] = ReuseOrder()
        self._timeline: Timeline | None = None
        if timeline is not None:
            timeline._attach(self)
            self._timeline = timeline

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

    # --- instrumentation ------------------------------------------------------------
    def fail_next(
        self,
        method_name: str,
        exc: BaseException | type[BaseException] | None = None,
        count: int = 1,
    ) -> None:
        """Make the next ``count`` calls of seam method ``method_name`` raise ``exc``.

        ``exc`` may be an instance (re-raised each time) or a class (instantiated with a message
        each time); it defaults to `RuntimeError`. Successive calls for one method queue up in
        order. The failing call is still counted in ``calls``. See
        docs/concepts/simulation.md#fault-injection.

        Args:
            method_name: A seam method's name, such as ``"copy_to_cuda"``.
            exc: The exception instance or class, or ``None`` for `RuntimeError`.
            count: How many calls fail (an int >= 1).

        Raises:
            ValueError: An unknown seam method, or ``count < 1``.
            TypeError: ``count`` is not an int, or ``exc`` is neither an exception instance nor
                an exception class.
        """
        if method_name not in _SEAM_METHODS:
            raise ValueError(
                f"{method_name!r} is not a seam method; expected one of {sorted(_SEAM_METHODS)}"
            )
        if not isinstance(count, int) or isinstance(count, bool):
            raise TypeError(f"count must be an int, got {type(count).__name__}")
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if exc is None:
            exc = RuntimeError
        elif not isinstance(exc, BaseException) and not (
            isinstance(exc, type) and issubclass(exc, BaseException)
        ):
            raise TypeError(f"exc must be an exception or exception class, got {exc!r}")
        with self._lock:
            self._faults.setdefault(method_name, collections.deque()).append(_Fault(exc, count))

    def clear_faults(self) -> None:
        """Drop every pending injected failure."""
        with self._lock:
            self._faults.clear()

    def _enter(self, name: str) -> None:
        """Count a seam call and raise an injected failure if one is due."""
        if not self._faults:
            # The common case: counting only. The C counting helper updates the Counter
            # without running Python code in between, so counts stay exact under threads.
            _count_elements(self.calls, (name,))
            return
        with self._lock:
            _count_elements(self.calls, (name,))
            queue = self._faults.get(name)
            if not queue:
                return
            fault = queue[0]
            fault.remaining -= 1
            if fault.remaining == 0:
                queue.popleft()
                if not queue:
                    del self._faults[name]
        exc = fault.exc
        if isinstance(exc, BaseException):
            # Re-raising one instance would otherwise grow its traceback on every call.
            raise exc.with_traceback(None)
        raise exc(f"injected failure in SimulatedRuntime.{name}")

    # --- availability -------------------------------------------------------------
    def cuda_available(self) -> bool:
        """Whether CUDA is available: true when ``device_count > 0``.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Returns:
            Whether any simulated device exists.

        Raises:
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("cuda_available")
        return self._device_count > 0

    def device_count(self) -> int:
        """Return the number of simulated CUDA devices.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Returns:
            The ``device_count`` given at construction.

        Raises:
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("device_count")
        return self._device_count

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
        tensors = value._resident_tensors
        if len(tensors) == 1:
            # One tensor, one lookup: the same facts as the general pass below.
            (tensor,) = tensors
            storage = tensor.untyped_storage()
            entry = self._registry.get(storage._cdata)
            if entry is not None:
                device, pinned_here = entry.device, entry.pinned
            else:
                device = tensor.device
                pinned_here = device.type == "cpu" and tensor.is_pinned()
            size = storage.nbytes()
            code = -1 if device.type == "cpu" else (device.index or 0)
            return ValueFacts(
                device,
                code,
                bool(size) and code == -1 and pinned_here,
                tensor.nbytes,
                size,
                [(code, storage.data_ptr())] if size else [],
            )
        device = self._value_device(value)
        on_host = device.type == "cpu"
        code = -1 if on_host else (device.index or 0)
        pinning: set[bool] = set()
        logical = 0
        sizes: dict[int, int] = {}
        for tensor in value._resident_tensors:
            logical += tensor.nbytes
            storage = tensor.untyped_storage()
            size = storage.nbytes()
            if size and sizes.setdefault(storage.data_ptr(), size) != size:
                _ = value.storage_nbytes  # raises the documented RuntimeError
            if on_host and size:
                # Only memory can be pinned: an empty tensor is neither pinned nor
                # pageable, and an all-empty host value reads as pageable.
                pinning.add(self._tensor_facts(tensor)[1])
        pinned: bool | None = (True in pinning) if len(pinning) <= 1 else None
        return ValueFacts(
            device, code, pinned, logical, sum(sizes.values()), [(code, ptr) for ptr in sizes]
        )

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
        return self._value_device(value)

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
        # Like TensorResident.is_pinned: the device check comes first and raises the same way.
        if self._value_device(value).type != "cpu":
            return False
        pinning = [
            self._tensor_facts(tensor)[1]
            for tensor in value._resident_tensors
            if tensor.untyped_storage().nbytes() > 0
        ]
        return bool(pinning) and all(pinning)

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
        pinning = set()
        for tensor in value._resident_tensors:
            device, pinned = self._tensor_facts(tensor)
            if device.type == "cpu" and tensor.untyped_storage().nbytes() > 0:
                pinning.add(pinned)
        return len(pinning) <= 1

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
        keys: set[tuple[torch.device, int]] = set()
        for tensor in value._resident_tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() > 0:
                entry = self._registry.get(storage._cdata)
                device = tensor.device if entry is None else entry.device
                keys.add((device, storage.data_ptr()))
        return frozenset(keys)

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
        self._enter("copy_to_cuda")
        index = self._cuda_index(device)
        target = self._devices[index]
        if stream is None:
            stream = self._default_streams[index]
        else:
            # A default-stream handle means the target device's default stream here,
            # as the copy runs with the target device current.
            stream = self._resolve_stream(stream, index)
        if stream.device != target:
            raise ValueError(f"stream {stream!r} is on {stream.device}, not on {target}")
        timeline = self._timeline
        tensors = value._resident_tensors
        if timeline is None and len(tensors) == 1:
            return self._copy_one_to_cuda(value, tensors[0], index, target, stream, non_blocking)
        with self._lock:
            # The copy reads its source on `stream` (docs/concepts/simulation.md#memory-reuse).
            self._order.read(stream, self._device_storage_keys(tensors))
        result = self._cuda_copy(value, target, stream)
        if timeline is not None:
            by_device = self._storage_bytes_by_device(value)
            engine = "d2d" if any(d.type == "cuda" for d in by_device) else "h2d"
            with self._lock:
                timeline._enqueue_copy(
                    stream, engine, sum(by_device.values()), blocking=not non_blocking
                )
        location = self._cuda_locations.get(index)
        if location is None:
            location = self._cuda_locations[index] = cuda_location(target)
        self._log(location, stream, non_blocking=non_blocking)
        return result

    def _copy_one_to_cuda(
        self,
        value: _V,
        tensor: torch.Tensor,
        index: int,
        target: torch.device,
        stream: SimulatedStream,
        non_blocking: bool,
    ) -> _V:
        """`copy_to_cuda` of a one-tensor value without a timeline (most values): the
        same steps (the source read on ``stream``, the copy, its registration and the
        log entry), with the bookkeeping under one hold of the lock."""
        registry = self._registry
        source = registry.get(tensor.untyped_storage()._cdata)
        # `to(copy=True)` always clones, so even a CPU source gets new, independent
        # storage, exactly like a real host-to-device copy.
        result = value.to(_CPU, copy=True, non_blocking=False)
        location = self._cuda_locations.get(index)
        if location is None:
            location = self._cuda_locations[index] = cuda_location(target)
        copies = result._resident_tensors
        order = self._order
        with self._lock:
            # The copy reads its source on `stream` (docs/concepts/simulation.md#memory-reuse).
            order.read(
                stream,
                [source.key] if source is not None and source.device.type == "cuda" else [],
            )
            if len(copies) != 1:
                self._register_locked(copies, target, pinned=False, owner=stream)
            else:
                if self._freed:
                    self._drain_freed_locked()
                # An allocation on `stream` may reuse any block freed to its pool.
                for reader, nbytes in order.check(stream):
                    self.hazards.append(SimulatedHazard(target, stream, reader, nbytes))
                entry = _Entry(copies[0].untyped_storage(), self._freed.append, target, False)
                previous = registry.get(entry.key)
                if previous is not None and previous.alive():
                    self._uncount_locked(previous)
                registry[entry.key] = entry
                order.allocated(stream, entry.key)
                self._allocated_bytes[target] += entry.nbytes
                self._reserved_bytes[target] += _reserved_nbytes(entry.nbytes)
                entry.counted = True
            self.copies.append(SimulatedCopy(location, stream, non_blocking))
        return result

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
        buffer = _page_aligned(nbytes)
        self._register((buffer,), _CPU, pinned=True)
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
        self._register((buffer,), target, pinned=False, owner=resolved)
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
        to_device, pinned_host = self._tensor_facts(destination)
        from_device, pinned_source = self._tensor_facts(source)
        if (to_device.type == "cuda") == (from_device.type == "cuda"):
            raise ValueError("copy_bytes copies between host memory and a CUDA device")
        device = to_device if to_device.type == "cuda" else from_device
        if device != resolved.device:
            raise ValueError(f"stream {stream!r} is on {resolved.device}, not on {device}")
        if destination.shape != source.shape or destination.dtype != source.dtype:
            raise ValueError("copy_bytes needs two flat tensors of one dtype and length")
        destination.copy_(source)
        with self._lock:
            self._order.read(resolved, self._device_storage_keys((source,)))
        timeline = self._timeline
        engine = "h2d" if to_device.type == "cuda" else "d2h"
        host_pinned = pinned_source if engine == "h2d" else pinned_host
        if timeline is not None:
            with self._lock:
                timeline._enqueue_copy(
                    resolved, engine, destination.nbytes, blocking=not host_pinned
                )
        location = (
            cuda_location(device)
            if engine == "h2d"
            else (PINNED_HOST if host_pinned else PAGEABLE_HOST)
        )
        self._log(location, resolved, non_blocking=host_pinned)

    # --- streams and events -------------------------------------------------------
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
        return self._default_streams[self._cuda_index(device)]

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
        resolved = self._resolve_stream(stream, None)
        if type(event) is StagedEvent:
            event = event.resolve()
            if event is None:
                return
        self._wait(resolved, _check_event(event))

    def _wait(self, resolved: SimulatedStream, checked: SimulatedEvent) -> None:
        with self._lock:
            self.waits.append((resolved, checked))
            self._order.wait(resolved, checked._clock)
            if self._timeline is not None and checked._time is not None:
                self._timeline._wait(resolved, checked._time)

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
        timeline = self._timeline
        if timeline is None:
            self._complete_where(lambda event: event.stream is resolved)
            return
        with self._lock:
            timeline._advance(timeline._tail(resolved))
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
        timeline = self._timeline
        if timeline is None:
            self._complete_where(lambda event: event.device == target)
            return
        with self._lock:
            timeline._advance(timeline._device_end(target))
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
        self._enter("record_event")
        return self._record(
            stream if type(stream) is SimulatedStream else self._resolve_stream(stream, None)
        )

    def _record(self, stream: SimulatedStream) -> SimulatedEvent:
        # Built field by field: every CUDA lease release records one.
        event = object.__new__(SimulatedEvent)
        event._stream = stream
        timeline = self._timeline
        if timeline is not None:
            with self._lock:
                event._clock = self._order.clock(stream)
                time = timeline._tail(event._stream)
                event._time = time
                event._completed = time <= timeline._now
                if event._completed:
                    self._order.completed(event._clock)
                else:
                    self._pending.add(event)
            return event
        event._time = None
        event._completed = self._auto_complete
        with self._lock:
            if self._auto_complete:
                event._clock = self._order.clock_completed(stream)
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
        self._enter("event_query")
        if type(event) is StagedEvent:
            return event.query(self._query)
        return self._query(event)

    def _query(self, event: Any) -> bool:
        timeline = self._timeline
        if timeline is None:
            if type(event) is SimulatedEvent:
                return event._completed
            return _check_event(event).completed
        checked = _check_event(event)
        time = checked._time
        if time is None:
            return checked._completed
        with self._lock:
            if not checked._completed and time <= timeline._now:
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
        _check_event(event).complete()

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
        return self._allocated(device)

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
        return self._reserved(device)

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
        self._enter("memory_sample")
        index = self._device_index(device)
        if index is None:
            return None
        simulated = self._devices[index]
        with self._lock:
            if self._freed:
                self._drain_freed_locked()
            return self._allocated_bytes[simulated], self._reserved_bytes[simulated]

    def _allocated(self, device: torch.device) -> int | None:
        index = self._device_index(device)
        if index is None:
            return None
        with self._lock:
            self._drain_freed_locked()
            return self._allocated_bytes[self._devices[index]]

    def _reserved(self, device: torch.device) -> int | None:
        index = self._device_index(device)
        if index is None:
            return None
        with self._lock:
            self._drain_freed_locked()
            return self._reserved_bytes[self._devices[index]]

    # --- test helpers (not counted, never fault-injected) ---------------------------
    def current_device(self) -> int:
        """Return the calling thread's current simulated CUDA device (0 until `set_device`).

        Returns:
            The device index.
        """
        return int(getattr(self._current, "index", 0))

    def set_device(self, device: torch.device | str | int) -> None:
        """Make ``device`` the calling thread's current simulated CUDA device.

        Default-stream handles then name its stream.

        Args:
            device: A simulated CUDA device (a device, ``"cuda:N"`` or an index).

        Raises:
            ValueError: A device the runtime does not simulate.
        """
        self._current.index = self._cuda_index(device)

    @contextlib.contextmanager
    def device_guard(self, device: torch.device | str | int) -> Iterator[None]:
        """Make ``device`` the calling thread's current device for a ``with`` block.

        The previous current device comes back when the block ends, as with
        ``torch.cuda.device(device)``.

        Args:
            device: A simulated CUDA device (a device, ``"cuda:N"`` or an index).

        Yields:
            Nothing.

        Raises:
            ValueError: A device the runtime does not simulate.
        """
        index = self._cuda_index(device)
        previous = self.current_device()
        self._current.index = index
        try:
            yield
        finally:
            self._current.index = previous

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
        tensors = (value,) if isinstance(value, torch.Tensor) else value._resident_tensors
        facts = {self._tensor_facts(tensor) for tensor in tensors}
        if len(facts) > 1:
            # Empty tensors have no memory to pin: the others decide between the hosts.
            with_storage = {
                self._tensor_facts(tensor)
                for tensor in tensors
                if tensor.untyped_storage().nbytes() > 0
            }
            if len({device for device, _ in facts}) == 1 and len(with_storage) == 1:
                facts = with_storage
        if not facts:
            raise RuntimeError(f"{type(value).__name__} has no tensor fields, so no placement")
        if len(facts) > 1:
            raise RuntimeError(
                f"{type(value).__name__} has mixed placements: {sorted(map(str, facts))}"
            )
        ((device, pinned),) = facts
        if device.type == "cuda":
            return cuda_location(device)
        if device.type != "cpu":
            raise RuntimeError(f"{device} is not a residency location")
        return PINNED_HOST if pinned else PAGEABLE_HOST

    def complete_events(self) -> int:
        """Complete every pending event.

        With a `Timeline`, the host clock advances to the latest of their times, as a host
        synchronisation on all of them would.

        Returns:
            How many events were completed.
        """
        if self._timeline is None:
            return self._complete_where(lambda event: True)
        with self._lock:
            times = [event._time for event in self._pending if event._time is not None]
            self._timeline._advance(max(times, default=0.0))
            return self._complete_pending_locked(lambda event: True)

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
        timeline = self._timeline
        if timeline is None:
            raise RuntimeError(
                "compute needs a timeline: build the runtime with "
                "SimulatedRuntime(timeline=Timeline())"
            )
        duration = _non_negative(seconds, "seconds")
        if not isinstance(label, str):
            raise TypeError(f"label must be a str, got {type(label).__name__}")
        resolved = self._resolve_stream(stream, None)
        if reads is not None:
            self.read(resolved, reads)
        with self._lock:
            self._order.enqueue(resolved)
            return timeline._compute(resolved, duration, label)

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
            self._order.read(resolved, self._device_storage_keys(tensors))

    def pending_event_count(self) -> int:
        """Return how many events recorded by this runtime are still incomplete (not counted).

        Returns:
            The number of pending events.
        """
        with self._lock:
            return len(self._pending)

    # --- internals --------------------------------------------------------------------
    def _register_stream(self, stream: SimulatedStream) -> int:
        with self._lock:
            handle = self._next_handle
            self._next_handle += 1
            self._streams_by_handle[handle] = stream
        return handle

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
        if handle in _DEFAULT_STREAM_HANDLES:
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

    def _cuda_index(self, device: torch.device | str | int) -> int:
        """The index of the simulated CUDA device named by ``device`` (else ``ValueError``)."""
        if type(device) is torch.device:
            known = self._device_index(device)
            if known is not None:
                return known
        try:
            normalized = (
                torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            )
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"{device!r} is not a simulated CUDA device") from exc
        index = self._device_index(normalized)
        if index is None:
            raise ValueError(
                f"{normalized} is not a simulated CUDA device "
                f"(this runtime has {self._device_count})"
            )
        return index

    def _cuda_device(self, device: torch.device | str | int) -> torch.device:
        return self._devices[self._cuda_index(device)]

    def _device_index(self, device: torch.device) -> int | None:
        if not isinstance(device, torch.device) or device.type != "cuda":
            return None
        # An unindexed "cuda" means the current device, which the simulation fixes at 0.
        index = 0 if device.index is None else device.index
        return index if index < self._device_count else None

    def _tensor_facts(self, tensor: torch.Tensor) -> tuple[torch.device, bool]:
        """(simulated device, simulated pinning) of one tensor."""
        # A lock-free read: dict lookups are atomic, and a live storage's identity cannot be
        # re-registered while we hold it.
        entry = self._registry.get(tensor.untyped_storage()._cdata)
        if entry is not None:
            return entry.device, entry.pinned
        device = tensor.device
        return device, device.type == "cpu" and tensor.is_pinned()

    def _value_device(self, value: TensorResident) -> torch.device:
        tensors = value._resident_tensors
        if not tensors:
            raise RuntimeError(f"{type(value).__name__} has no tensor fields, so no device")
        device = self._tensor_facts(tensors[0])[0]
        for tensor in tensors[1:]:
            other = self._tensor_facts(tensor)[0]
            if other != device:
                raise RuntimeError(
                    f"{type(value).__name__} spans several devices ({device} and {other}); "
                    "every tensor field must share one device"
                )
        return device

    def _cuda_copy(self, value: _V, target: torch.device, owner: SimulatedStream) -> _V:
        # `to(copy=True)` always clones, so even a CPU source gets new, independent storage,
        # exactly like a real host-to-device copy.
        result = value.to(_CPU, copy=True, non_blocking=False)
        self._register(result._resident_tensors, target, pinned=False, owner=owner)
        return result

    def _device_storage_keys(self, tensors: Iterable[torch.Tensor]) -> list[int]:
        """The keys of the registered simulated device storages among ``tensors``'."""
        keys = []
        for tensor in tensors:
            entry = self._registry.get(tensor.untyped_storage()._cdata)
            if entry is not None and entry.device.type == "cuda":
                keys.append(entry.key)
        return keys

    def _pinned_copy(self, value: _V) -> _V:
        if not self._pinned:
            raise RuntimeError(_PINNED_UNAVAILABLE)
        # Mirrors TensorResident.pin_memory: the storage layout kept (each unique storage
        # copied once, every field rebuilt over it), a synchronous copy, the source's
        # requires_grad, no autograd tracking.
        clones = _layout_copy(value._resident_tensors, _CPU, _empty_host, _strided_clone)
        self._register(clones, _CPU, pinned=True)
        return value._with_resident_tensors(clones)

    def _register(
        self,
        tensors: Iterable[torch.Tensor],
        device: torch.device,
        *,
        pinned: bool,
        owner: SimulatedStream | None = None,
    ) -> None:
        with self._lock:
            self._register_locked(tensors, device, pinned=pinned, owner=owner)

    def _register_locked(
        self,
        tensors: Iterable[torch.Tensor],
        device: torch.device,
        *,
        pinned: bool,
        owner: SimulatedStream | None = None,
    ) -> None:
        freed = self._freed.append
        self._drain_freed_locked()
        if owner is not None:
            # An allocation on `owner` may reuse any block freed to its pool.
            for reader, nbytes in self._order.check(owner):
                self.hazards.append(SimulatedHazard(device, owner, reader, nbytes))
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if pinned and storage.nbytes() == 0:
                # As torch's pinned allocator: zero bytes get no pinned storage, so
                # an empty tensor stays a plain (pageable) CPU tensor.
                continue
            entry = _Entry(storage, freed, device, pinned)
            previous = self._registry.get(entry.key)
            if previous is not None and previous.alive():
                # The same storage again (a view of one already registered): the new
                # entry replaces it, and its bytes are counted once.
                self._uncount_locked(previous)
            self._registry[entry.key] = entry
            if device.type == "cuda":
                if owner is not None:
                    self._order.allocated(owner, entry.key)
                self._allocated_bytes[device] += entry.nbytes
                self._reserved_bytes[device] += _reserved_nbytes(entry.nbytes)
                entry.counted = True

    def _uncount_locked(self, entry: _Entry) -> None:
        if entry.counted:
            entry.counted = False
            self._allocated_bytes[entry.device] -= entry.nbytes
            self._reserved_bytes[entry.device] -= _reserved_nbytes(entry.nbytes)

    def _drain_freed_locked(self) -> None:
        """Takes the storages freed since the last call out of the registry and counters;
        the work is one step per storage freed, however many are alive."""
        freed = self._freed
        while freed:
            entry = freed.popleft()
            self._uncount_locked(entry)
            # A storage registered again has a newer entry there; no other storage can
            # have the key while this entry exists (its `address` holds it).
            if self._registry.get(entry.key) is entry:
                del self._registry[entry.key]
                if entry.device.type == "cuda":
                    self._order.freed(entry.key, entry.nbytes)

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
        timeline = self._timeline
        now = math.inf if timeline is None else timeline._now
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
        timeline = self._timeline
        with self._lock:
            if timeline is not None:
                timeline._advance(time)
            self._complete_pending_locked(predicate)

    def _storage_bytes_by_device(self, value: TensorResident) -> dict[torch.device, int]:
        """The value's unique non-empty storage bytes, by simulated device."""
        by_device: dict[torch.device, int] = {}
        seen: set[int] = set()
        for tensor in value._resident_tensors:
            device = self._tensor_facts(tensor)[0]
            by_device.setdefault(device, 0)
            storage = tensor.untyped_storage()
            size = storage.nbytes()
            if size and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                by_device[device] += size
        return by_device

    def _time_download(self, value: TensorResident) -> None:
        """A device-to-host copy of the value's simulated CUDA storages, one per device."""
        timeline = self._timeline
        assert timeline is not None
        by_device = self._storage_bytes_by_device(value)
        with self._lock:
            for device in sorted(
                (d for d in by_device if d.type == "cuda"), key=lambda d: d.index or 0
            ):
                index = self._device_index(device)
                if index is not None:
                    timeline._download(self._default_streams[index], by_device[device])

    def _log(
        self, destination: ResidencyLocation, stream: SimulatedStream | None, *, non_blocking: bool
    ) -> None:
        with self._lock:
            self.copies.append(SimulatedCopy(destination, stream, non_blocking))


class _CudaError(enum.IntEnum):
    """The ``cudaError_t`` codes `_SimulatedCudart` answers."""

    cudaSuccess = 0
    cudaErrorInvalidResourceHandle = 400
    cudaErrorNotReady = 600


class _SimulatedCudart:
    """The slice of ``cuda.bindings.runtime`` that the release events use
    (``fhelium.residency._runtime.cuda_events``), over a `SimulatedRuntime`, with the
    raw-handle semantics of the CUDA runtime
    (docs/concepts/simulation.md#current-device-and-default-streams):

    - a stream handle of 0, 1 or 2 names the default stream of the calling thread's
      *current* device, whichever device's default stream the caller had in mind;
      any other handle names the stream created with it;
    - an event belongs to the device current when it was created, and recording it on
      a stream of another device fails with ``cudaErrorInvalidResourceHandle``;
    - a stream may wait for an event of any device.

    Calls return tuples headed by a ``cudaError_t``, as cuda-python's do. They are not
    counted in ``calls``; waits are logged in the runtime's ``waits``.
    """

    cudaError_t = _CudaError
    cudaEventDisableTiming = 2

    def __init__(self, runtime: SimulatedRuntime) -> None:
        self._runtime = runtime
        self._handles = itertools.count(1)
        # Live event handles: (device index at creation, the last recorded event).
        self._events: dict[int, tuple[int, SimulatedEvent | None]] = {}

    def _stream(self, handle: int) -> SimulatedStream | None:
        runtime = self._runtime
        if handle in _DEFAULT_STREAM_HANDLES:
            return runtime._default_streams[runtime.current_device()]
        return runtime._streams_by_handle.get(handle)

    def cudaEventCreateWithFlags(self, flags: int) -> tuple[_CudaError, int]:
        handle = next(self._handles)
        self._events[handle] = (self._runtime.current_device(), None)
        return _CudaError.cudaSuccess, handle

    def cudaEventRecord(self, event: int, stream: int) -> tuple[_CudaError]:
        known = self._events.get(event)
        resolved = self._stream(stream)
        if known is None or resolved is None or resolved.device_index != known[0]:
            return (_CudaError.cudaErrorInvalidResourceHandle,)
        self._events[event] = (known[0], self._runtime._record(resolved))
        return (_CudaError.cudaSuccess,)

    def cudaEventQuery(self, event: int) -> tuple[_CudaError]:
        known = self._events.get(event)
        if known is None:
            return (_CudaError.cudaErrorInvalidResourceHandle,)
        recorded = known[1]
        done = recorded is None or self._runtime._query(recorded)
        return (_CudaError.cudaSuccess if done else _CudaError.cudaErrorNotReady,)

    def cudaEventSynchronize(self, event: int) -> tuple[_CudaError]:
        known = self._events.get(event)
        if known is None:
            return (_CudaError.cudaErrorInvalidResourceHandle,)
        if known[1] is not None:
            known[1].complete()
        return (_CudaError.cudaSuccess,)

    def cudaStreamWaitEvent(self, stream: int, event: int, flags: int) -> tuple[_CudaError]:
        known = self._events.get(event)
        resolved = self._stream(stream)
        if known is None or resolved is None:
            return (_CudaError.cudaErrorInvalidResourceHandle,)
        if known[1] is not None:
            self._runtime._wait(resolved, known[1])
        return (_CudaError.cudaSuccess,)

    def cudaEventDestroy(self, event: int) -> tuple[_CudaError]:
        if self._events.pop(event, None) is None:
            return (_CudaError.cudaErrorInvalidResourceHandle,)
        return (_CudaError.cudaSuccess,)


def _reserved_nbytes(nbytes: int) -> int:
    """A storage's bytes as the simulated allocator reserves them: whole blocks."""
    return -(-nbytes // _BLOCK) * _BLOCK


def _strided_clone(tensor: torch.Tensor) -> torch.Tensor:
    clone = tensor.to("cpu", copy=True)
    clone.requires_grad_(tensor.requires_grad)
    return clone


def _empty_host(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _page_aligned(nbytes: int) -> torch.Tensor:
    """A flat ``uint8`` buffer at a page-aligned address, as pinned allocators hand out
    (``cudaHostAlloc`` maps whole pages); zero bytes get an empty tensor."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def _check_event(event: object) -> SimulatedEvent:
    if not isinstance(event, SimulatedEvent):
        raise TypeError(f"expected a SimulatedEvent, got {type(event).__name__}")
    return event


def _number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return number


def _positive(value: object, name: str) -> float:
    number = _number(value, name)
    if number <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return number


def _non_negative(value: object, name: str) -> float:
    number = _number(value, name)
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return number


def _normalize_cuda(device: torch.device | str | int) -> torch.device:
    """``device`` as an indexed CUDA device (``ValueError`` for anything else)."""
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"device must be a torch.device, str or int, got {type(device).__name__}")
    try:
        normalized = (
            torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        )
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{device!r} is not a CUDA device") from exc
    if normalized.type != "cuda":
        raise ValueError(f"{device!r} is not a CUDA device")
    return torch.device("cuda", normalized.index or 0)


def _copy_label(engine: str, nbytes: int) -> str:
    return f"{_COPY_LABELS[engine]} {_format_bytes(nbytes)}"


def _format_bytes(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024.0
        if value < 1024.0:
            return f"{value:.1f} {unit}"
    return f"{value / 1024.0:.1f} PiB"


if TYPE_CHECKING:
    # Static proof that the simulation satisfies the seam it stands in for.
    _conforms: DeviceRuntime = SimulatedRuntime()
