"""The simulated runtime's memory-reuse check (docs/concepts/simulation.md#memory-reuse).

Order between streams is tracked with vector clocks: each stream counts the work
enqueued on it, and knows, per other stream, how much of that stream's work it is
ordered after (through `wait_event`, or through the host having seen an event
complete before it enqueued). A freed device storage keeps its readers' positions in
the pool of the stream that allocated it; the next allocation on that stream checks
that every such reader is ordered before it. Every method is called under the
runtime's lock.
"""

from __future__ import annotations

from typing import Generic, NamedTuple, Protocol, TypeVar


class _Stream(Protocol):
    """What the check needs of a stream: its simulated handle."""

    _handle: int


# The simulated runtime's stream type (the check never imports the runtime).
SimulatedStream = TypeVar("SimulatedStream", bound=_Stream)

__all__ = ["Clock", "ReuseOrder"]

# Per stream (by simulated handle): how many of its enqueued operations are covered.
Clock = dict[int, int]


class _Freed(NamedTuple):
    readers: Clock
    nbytes: int


def _merge(into: Clock, other: Clock) -> None:
    for stream, position in other.items():
        if into.get(stream, 0) < position:
            into[stream] = position


class ReuseOrder(Generic[SimulatedStream]):
    """Happens-before between simulated streams and the host, the readers of each live
    device storage, and each stream's pool of freed blocks. The owning stream of a
    storage is the caller's to keep (the registry keeps it on the storage's entry) and
    to give back with `freed`."""

    __slots__ = ("_host", "_knows", "_pools", "_seq", "_streams", "clean", "readers")

    def __init__(self) -> None:
        self._seq: Clock = {}
        self._knows: dict[int, Clock] = {}
        self._host: Clock = {}
        self._streams: dict[int, SimulatedStream] = {}
        # By storage key: the readers' last positions (empty while nothing was read:
        # `freed` has nothing to do then).
        self.readers: dict[int, Clock] = {}
        # By owning stream: freed blocks whose readers were not yet seen ordered.
        self._pools: dict[int, list[_Freed]] = {}
        # The streams whose work, and what it is ordered after, the host has taken in
        # (`drained`) since anything was last enqueued on them or they last waited:
        # `drained` of one of them changes nothing. Read without the lock by the
        # runtime, to skip it (a membership test is atomic).
        self.clean: set[int] = set()

    def _catch_up(self, stream: SimulatedStream) -> Clock:
        """What ``stream`` is ordered after now: work enqueued from here on also follows
        everything the host has seen complete."""
        handle = stream._handle
        knows = self._knows.get(handle)
        if knows is None:
            knows = self._knows[handle] = {}
        _merge(knows, self._host)
        return knows

    def enqueue(self, stream: SimulatedStream) -> int:
        """One operation enqueued on ``stream``; its position there.

        What the stream is ordered after is not brought up to date here: it only grows,
        and is read only by `clock` and `check`, which first take in everything the
        host has seen complete (`_catch_up`), so taking it in earlier changes nothing."""
        handle = stream._handle
        seq = self._seq
        position = seq[handle] = seq.get(handle, 0) + 1
        self.clean.discard(handle)
        return position

    def clock(self, stream: SimulatedStream) -> Clock:
        """An event recorded on ``stream`` now: everything enqueued there, and everything
        that is ordered before it."""
        clock = self._catch_up(stream).copy()
        clock[stream._handle] = self._seq.get(stream._handle, 0)
        return clock

    def wait(self, stream: SimulatedStream, clock: Clock | None) -> None:
        if clock is not None:
            _merge(self._catch_up(stream), clock)
            self.clean.discard(stream._handle)

    def completed(self, clock: Clock | None) -> None:
        """The host saw an event complete."""
        if clock is not None:
            _merge(self._host, clock)

    def drained(self, stream: SimulatedStream) -> None:
        """The host waited for everything enqueued on ``stream`` (or saw an event
        recorded there now complete): `completed` of `clock`, without building the clock.
        Nothing to do for a stream in `clean`, which it then is.
        """
        handle = stream._handle
        clean = self.clean
        if handle in clean:
            return
        clean.add(handle)
        host = self._host
        knows = self._knows.get(handle)
        if knows:
            for other, position in knows.items():
                if host.get(other, 0) < position:
                    host[other] = position
        position = self._seq.get(handle, 0)
        if host.get(handle, 0) < position:
            host[handle] = position

    def read(self, stream: SimulatedStream, keys: list[int]) -> None:
        """Work enqueued on ``stream`` now reads the storages ``keys``."""
        position = self.enqueue(stream)
        handle = stream._handle
        self._streams[handle] = stream
        for key in keys:
            self.readers.setdefault(key, {})[handle] = position

    @staticmethod
    def owner(stream: SimulatedStream) -> int:
        """What `freed` takes for a storage allocated on ``stream``: its handle."""
        return stream._handle

    def copied(
        self, stream: SimulatedStream, source: int | None
    ) -> tuple[int, list[tuple[SimulatedStream, int]] | None]:
        """A copy enqueued on ``stream`` now: it reads the device storage ``source``
        (``None``: host memory, not tracked, so the copy is only enqueued) and allocates
        on ``stream``. `read` (or `enqueue`) and `check` in one step; returns the
        allocation's `owner` and `check`'s hazards (``None`` when no stream has a pool
        to check)."""
        handle = stream._handle
        seq = self._seq
        position = seq[handle] = seq.get(handle, 0) + 1
        self.clean.discard(handle)
        if source is not None:
            self._streams[handle] = stream
            readers = self.readers.get(source)
            if readers is None:
                readers = self.readers[source] = {}
            readers[handle] = position
        return handle, (self.check(stream) if self._pools else None)

    def freed(self, key: int, nbytes: int, owner: int | None) -> None:
        """The device storage ``key`` of ``nbytes``, allocated on the stream whose
        `owner` is ``owner`` (``None``: none), was freed: its readers go to that
        stream's pool."""
        readers = self.readers.pop(key, None)
        if readers and owner is not None:
            self._pools.setdefault(owner, []).append(_Freed(readers, nbytes))

    def check(self, stream: SimulatedStream) -> list[tuple[SimulatedStream, int]]:
        """An allocation on ``stream``: empties its pool, returning ``(reader, nbytes)``
        for each freed block with a reader not ordered before it."""
        pool = self._pools.pop(stream._handle, None)
        if not pool:
            return []
        knows = self._catch_up(stream)
        handle = stream._handle
        hazards: list[tuple[SimulatedStream, int]] = []
        for block in pool:
            for reader, position in block.readers.items():
                if reader != handle and knows.get(reader, 0) < position:
                    hazards.append((self._streams[reader], block.nbytes))
                    break
        return hazards
