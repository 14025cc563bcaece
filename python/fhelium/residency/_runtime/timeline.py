"""The timeline model of the simulated devices: copies and compute in virtual time.

`Timeline` is the public face (docs/concepts/simulation.md#the-timeline); `TimelineClock`
is its state, which the owning `SimulatedRuntime` drives under its own lock once
`attach` has given the timeline to it. Each simulated device has four engines that each
run one piece of work at a time, and run concurrently with one another. The timeline
needs nothing of a stream but its device, so it imports none of the runtime.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from typing import Final, NamedTuple, Protocol

import torch

__all__ = [
    "ENGINES",
    "TimedStream",
    "Timeline",
    "TimelineClock",
    "TimelineSpan",
    "attach",
    "finite_number",
    "non_negative",
    "normalize_cuda",
    "positive",
    "spans_and_now",
]

ENGINES: Final = ("h2d", "d2h", "d2d", "compute")
"""The engines of one simulated device, in track order."""

_COPY_LABELS: Final = {"h2d": "H2D", "d2h": "D2H", "d2d": "D2D"}


class TimedStream(Protocol):
    """What the timeline needs of a simulated stream: its device (and to be weakly
    referenced and hashed, as every object is by default)."""

    @property
    def device(self) -> torch.device: ...


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


class TimelineClock:
    """The state of one `Timeline`: the host clock, the spans, each stream's tail and each
    engine's next free time. Once attached, every method runs under the owning runtime's
    lock (``lock``); the runtime reads ``now`` directly."""

    __slots__ = (
        "d2d",
        "d2h",
        "free",
        "h2d",
        "horizon",
        "lock",
        "now",
        "on_reset",
        "owned",
        "spans",
        "tails",
    )

    def __init__(self, h2d: float, d2h: float, d2d: float) -> None:
        self.h2d = h2d
        self.d2h = d2h
        self.d2d = d2d
        # Replaced by the owning runtime's lock when the timeline is attached to one.
        self.lock = threading.Lock()
        self.owned = False
        # The owner's "complete every timed pending event", weakly: the runtime may go first.
        self.on_reset: weakref.WeakMethod[Callable[[], object]] | None = None
        self.now = 0.0
        self.spans: list[TimelineSpan] = []
        # When the last work enqueued on each stream ends.
        self.tails: weakref.WeakKeyDictionary[TimedStream, float] = weakref.WeakKeyDictionary()
        # When each (device, engine) is next free.
        self.free: dict[tuple[torch.device, str], float] = {}
        # The latest tail any stream of each device has had, so that a device
        # synchronisation covers streams that have since been collected.
        self.horizon: dict[torch.device, float] = {}

    def makespan(self) -> float:
        return max([self.now, *(span.end for span in self.spans)])

    def reset(self) -> None:
        """Forget every span and clock (lock held); work enqueued before counts as done."""
        self.now = 0.0
        self.spans.clear()
        self.tails.clear()
        self.free.clear()
        self.horizon.clear()
        complete = None if self.on_reset is None else self.on_reset()
        if complete is not None:
            complete()

    def tail(self, stream: TimedStream) -> float:
        return self.tails.get(stream, 0.0)

    def set_tail(self, stream: TimedStream, time: float) -> None:
        self.tails[stream] = time
        device = stream.device
        if time > self.horizon.get(device, 0.0):
            self.horizon[device] = time

    def bandwidth(self, engine: str) -> float:
        if engine == "h2d":
            return self.h2d
        if engine == "d2h":
            return self.d2h
        return self.d2d

    def occupy(
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
        start = max(ready, self.free.get(key, 0.0))
        span = TimelineSpan(device, engine, start, start + seconds, nbytes, label)
        self.free[key] = span.end
        self.spans.append(span)
        return span

    def enqueue_copy(
        self, stream: TimedStream, engine: str, nbytes: int, *, blocking: bool
    ) -> None:
        span = self.occupy(
            stream.device,
            engine,
            max(self.now, self.tail(stream)),
            nbytes / self.bandwidth(engine),
            nbytes,
            _copy_label(engine, nbytes),
        )
        self.set_tail(stream, span.end)
        if blocking:
            self.now = max(self.now, span.end)

    def download(self, default_stream: TimedStream, nbytes: int) -> None:
        # Synchronous, after the device's default stream: the host waits for it.
        span = self.occupy(
            default_stream.device,
            "d2h",
            max(self.now, self.tail(default_stream)),
            nbytes / self.d2h,
            nbytes,
            _copy_label("d2h", nbytes),
        )
        self.now = max(self.now, span.end)

    def compute(self, stream: TimedStream, seconds: float, label: str) -> TimelineSpan:
        span = self.occupy(
            stream.device, "compute", max(self.now, self.tail(stream)), seconds, 0, label
        )
        self.set_tail(stream, span.end)
        return span

    def wait(self, stream: TimedStream, time: float) -> None:
        if time > self.tail(stream):
            self.set_tail(stream, time)

    def device_end(self, device: torch.device) -> float:
        ends = [self.horizon.get(device, 0.0)]
        ends += [self.free.get((device, engine), 0.0) for engine in ENGINES]
        return max(ends)

    def advance(self, time: float) -> None:
        self.now = max(self.now, time)


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

    __slots__ = ("_clock",)

    def __init__(
        self,
        *,
        h2d_bytes_per_s: float = 55e9,
        d2h_bytes_per_s: float = 55e9,
        d2d_bytes_per_s: float = 2e12,
    ) -> None:
        self._clock = TimelineClock(
            positive(h2d_bytes_per_s, "h2d_bytes_per_s"),
            positive(d2h_bytes_per_s, "d2h_bytes_per_s"),
            positive(d2d_bytes_per_s, "d2d_bytes_per_s"),
        )

    @property
    def h2d_bytes_per_s(self) -> float:
        """The host-to-device bandwidth, in bytes per second."""
        return self._clock.h2d

    @property
    def d2h_bytes_per_s(self) -> float:
        """The device-to-host bandwidth, in bytes per second."""
        return self._clock.d2h

    @property
    def d2d_bytes_per_s(self) -> float:
        """The device-to-device bandwidth, in bytes per second."""
        return self._clock.d2d

    @property
    def now(self) -> float:
        """The host clock: virtual seconds the host has spent waiting for the devices."""
        clock = self._clock
        with clock.lock:
            return clock.now

    @property
    def makespan(self) -> float:
        """When everything enqueued so far is done: the latest of `now` and every span's end."""
        clock = self._clock
        with clock.lock:
            return clock.makespan()

    @property
    def spans(self) -> tuple[TimelineSpan, ...]:
        """Every copy and compute span, in enqueue order."""
        clock = self._clock
        with clock.lock:
            return tuple(clock.spans)

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
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        target = None if device is None else normalize_cuda(device)
        clock = self._clock
        with clock.lock:
            return sum(
                span.end - span.start
                for span in clock.spans
                if span.engine == engine and (target is None or span.device == target)
            )

    def reset(self) -> None:
        """Forget every span and set every clock back to 0.

        Work enqueued before counts as done: events still pending complete.
        """
        clock = self._clock
        with clock.lock:
            clock.reset()

    def __repr__(self) -> str:
        clock = self._clock
        with clock.lock:
            now, count = clock.now, len(clock.spans)
        return (
            f"Timeline(h2d_bytes_per_s={clock.h2d!r}, d2h_bytes_per_s={clock.d2h!r}, "
            f"d2d_bytes_per_s={clock.d2d!r}, now={now!r}, spans={count})"
        )


def spans_and_now(timeline: Timeline) -> tuple[tuple[TimelineSpan, ...], float]:
    """``timeline``'s spans and its current time, read together (under its lock)."""
    clock = timeline._clock
    with clock.lock:
        return tuple(clock.spans), clock.now


def attach(
    timeline: Timeline, lock: threading.Lock, on_reset: Callable[[], object]
) -> TimelineClock:
    """Give ``timeline`` to a runtime: from now on its state is guarded by ``lock``, and
    `Timeline.reset` calls ``on_reset`` (a bound method, held weakly) with it held.

    Raises:
        ValueError: The timeline already belongs to a runtime.
    """
    clock = timeline._clock
    with clock.lock:
        if clock.owned:
            raise ValueError("this Timeline already belongs to another SimulatedRuntime")
        clock.owned = True
        clock.on_reset = weakref.WeakMethod(on_reset)
        clock.lock = lock
    return clock


def finite_number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return number


def positive(value: object, name: str) -> float:
    number = finite_number(value, name)
    if number <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return number


def non_negative(value: object, name: str) -> float:
    number = finite_number(value, name)
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return number


def normalize_cuda(device: torch.device | str | int) -> torch.device:
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
