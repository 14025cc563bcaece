"""What `ResidencyController.run` keeps per step and per request: a staged step's holds
and deferred reads (`Staged`), and a request's derived shape (`Shape`). See
docs/concepts/controller.md#prefetch.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Mapping
from typing import Any, Final

from fhelium.errors import ResidencyClosedError, ResidencyReentrancyError
from fhelium.residency._decided import StagedRuns
from fhelium.residency._engine import Engine
from fhelium.residency._runtime.base import StagedEvent
from fhelium.residency._use import Borrows, Controller
from fhelium.residency.lease import ResidencyReservation
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.model import ResidencyHandle
from fhelium.residency.plan import MemoryReservation, ResidencyPlan
from fhelium.residency.request import ResidencyRequest

__all__ = [
    "Shape",
    "Staged",
    "blocks_host",
    "extra_headroom",
    "release_all",
    "release_on_device",
    "settle_transfers",
    "shape_of",
    "streams_for",
    "transfer_streams",
    "wait_oldest",
]


class Staged:
    """What keeps a prefetched step's values until its turn: a hold per location (the
    hold tokens the plan's run took, `Shape.holds`). Its request's reservations count
    toward the pipeline's headroom guard."""

    __slots__ = ("engine", "holds", "needs", "reads", "request", "shape", "streams")

    def __init__(
        self, shape: Shape, streams: tuple[dict[Any, Any], dict[Any, Any]], engine: Engine
    ) -> None:
        self.engine = engine
        self.holds: list[int] = []
        self.needs = shape.needs
        self.request = shape.request
        # Its request's shape, and its consumer and transfer streams in the pipeline.
        self.shape = shape
        self.streams = streams
        # The events of its reads from disk that the disk tier's I/O thread runs.
        self.reads: list[StagedEvent] = []

    def release(self) -> None:
        """Releases every hold, all of them even when one raises."""
        holds, self.holds = self.holds, []
        release = self.engine.release_hold
        error: BaseException | None = None
        for token in holds:
            try:
                release(token)
            except BaseException as failure:
                error = error or failure
        if error is not None:
            raise error

    def release_deferred(self) -> None:
        """`release` as finalizers release: queued while this thread cannot enter the
        manager (docs/concepts/lifetimes.md#deferred-releases)."""
        holds, self.holds = self.holds, []
        for token in holds:
            self.engine.release_hold(token, finalizing=True)

    def failure(self) -> BaseException | None:
        """Waits until its deferred reads have enqueued their copies (or failed); the
        first failure, claimed (docs/concepts/controller.md#staging)."""
        reads, self.reads = self.reads, []
        error = None
        for read in reads:
            error = read.claim() or error
        return error


def release_all(lifetimes: Iterable[ResidencyReservation]) -> None:
    error: BaseException | None = None
    for lifetime in lifetimes:
        try:
            lifetime.release()
        except BaseException as failure:
            error = error or failure
    if error is not None:
        raise error


def _needs(request: ResidencyRequest) -> dict[ResidencyLocation, int]:
    """A request's reservation bytes per location."""
    needs: dict[ResidencyLocation, int] = {}
    for reservation in request.reservations:
        needs[reservation.location] = needs.get(reservation.location, 0) + reservation.nbytes
    return needs


# The most requests a controller keeps the shape of (see `shape_of`); past it, the cache
# starts again empty.
_SHAPES: Final = 4096
# The most staging requests a shape keeps, one per headroom met; past it, it starts
# again empty.
_STAGINGS: Final = 64


class Shape:
    """What a pipeline derives from one request, once per request object (a request is
    immutable): its reservation bytes per location, its handles per location, its CUDA
    locations, and its staging requests by headroom."""

    __slots__ = (
        "_empty",
        "by_location",
        "cuda",
        "devices",
        "entry",
        "grouped",
        "holds",
        "needs",
        "request",
        "runs",
        "staging",
        "used",
    )

    def __init__(self, request: ResidencyRequest) -> None:
        self.request = request
        self.needs = _needs(request)
        by_location: dict[ResidencyLocation, list[ResidencyHandle[Any]]] = {}
        for requirement in request.requirements:
            by_location.setdefault(requirement.location, []).append(requirement.handle)
        # As tuples: what the manager takes without normalizing them again.
        self.by_location = {location: tuple(handles) for location, handles in by_location.items()}
        # Its requirements by location, as a use borrows them.
        self.grouped = Borrows(request)
        # What its staging holds and its staged entry leases, as the manager's calls
        # take them: (handles, location) and (location, handles) pairs.
        self.holds = tuple([(handles, location) for location, handles in self.by_location.items()])
        self.entry = tuple([(location, handles) for location, handles, _ in self.grouped.groups])
        self.cuda = tuple(location for location in self.by_location if location.kind == "cuda")
        # The same as device indices, which name CUDA locations one to one: a key
        # hashed without calling the records' hash.
        self.devices = tuple([location.device.index for location in self.cuda])
        # The request to stage with each headroom (its items), made once.
        self.staging: dict[tuple[tuple[ResidencyLocation, int], ...], ResidencyRequest] = {}
        self._empty: ResidencyPlan | None = None
        # What its last staging ran (`_decided.staged_run`).
        self.runs = StagedRuns()
        # Its handles as a set: what the schedule-aware policy observes of its use.
        self.used = frozenset([requirement.handle for requirement in request.requirements])

    @property
    def empty_plan(self) -> ResidencyPlan:
        """The plan `decide` gives the request when it is already satisfied and has no
        reservations: no action, made once."""
        plan = self._empty
        if plan is None:
            plan = self._empty = ResidencyPlan(self.request.name)
        return plan

    def staging_request(self, extra: dict[ResidencyLocation, int]) -> ResidencyRequest:
        """The request the staging decides: the step's values, with the headroom its
        reservations (and the staged steps') would find missing at its entry."""
        request = self.request
        if not extra and not request.reservations:
            return request
        key = tuple(extra.items())
        staging = self.staging.get(key)
        if staging is None:
            if len(self.staging) >= _STAGINGS:
                self.staging.clear()
            staging = self.staging[key] = ResidencyRequest(
                request.name,
                request.requirements,
                tuple(
                    MemoryReservation(location, nbytes, "prefetch headroom")
                    for location, nbytes in key
                ),
            )
        return staging


def shape_of(controller: Controller, request: ResidencyRequest) -> Shape:
    """``request``'s shape, kept by the controller per request object."""
    shapes: dict[int, Shape] = controller.shapes
    shape = shapes.get(id(request))
    if shape is None or shape.request is not request:
        if len(shapes) >= _SHAPES:
            shapes.clear()
        shape = shapes[id(request)] = Shape(request)
    return shape


def extra_headroom(
    needs: dict[ResidencyLocation, int],
    staged: Iterable[Staged],
    active: dict[ResidencyLocation, int],
    guard: dict[ResidencyLocation, list[ResidencyReservation]],
) -> dict[ResidencyLocation, int]:
    """Per location, the headroom the ``staged`` steps (and a step needing ``needs``)
    would find missing at their entry, beyond the active step's reservation
    (``active``) and the ``guard``: each staged step must find the largest of their
    reservations free (docs/concepts/controller.md#staging)."""
    wanted: dict[ResidencyLocation, int] = dict(needs)
    for step in staged:
        for location, nbytes in step.needs.items():
            wanted[location] = max(wanted.get(location, 0), nbytes)
    extra: dict[ResidencyLocation, int] = {}
    for location, nbytes in wanted.items():
        kept = sum(reservation.nbytes for reservation in guard.get(location, ()))
        missing = nbytes - active.get(location, 0) - kept
        if missing > 0:
            extra[location] = missing
    return extra


def streams_for(
    request: ResidencyRequest, streams: Mapping[ResidencyLocation, Any]
) -> dict[ResidencyLocation, Any]:
    """The streams of ``streams`` at the request's CUDA locations."""
    wanted = {
        requirement.location
        for requirement in request.requirements
        if requirement.location.kind == "cuda"
    }
    return {location: stream for location, stream in streams.items() if location in wanted}


def transfer_streams(
    request: ResidencyRequest,
    transfers: Mapping[ResidencyLocation, Any],
    prefetch: int,
    created: dict[ResidencyLocation, Any],
    engine: Engine,
) -> dict[ResidencyLocation, Any]:
    """A pipeline's transfer streams for ``request``: the caller's (``transfers``),
    else, when prefetching, one the pipeline created per CUDA location, kept in
    ``created`` (copies then leave the consumer's stream free)."""
    streams = streams_for(request, transfers)
    if prefetch == 0:
        return streams
    runtime = engine.runtime
    for requirement in request.requirements:
        location = requirement.location
        if location.kind != "cuda" or location in streams:
            continue
        stream = created.get(location)
        if stream is None:
            stream = created[location] = runtime.create_stream(location.device)
        streams[location] = stream
    return streams


def release_on_device(engine: Engine, ended: collections.deque[list[int]]) -> bool:
    """Releases a pipeline's ended steps' pending leases (``ended``, their tokens,
    oldest first) behind device waits of their values' owning streams, keeping in
    ``ended`` what needs a host wait; False when nothing was released."""
    if not ended:
        return False
    tokens = [token for step in ended for token in step]
    left = set(engine.settle_on_device(tokens))
    if len(left) == len(tokens):
        return False
    kept = [[token for token in step if token in left] for step in ended]
    ended.clear()
    ended.extend(step for step in kept if step)
    return True


def wait_oldest(engine: Engine, ended: collections.deque[list[int]]) -> bool:
    """Waits for the oldest ended step's leases and releases them; False when no
    ended step is left to wait for."""
    if not ended:
        return False
    engine.settle(ended.popleft())
    return True


def blocks_host(
    engine: Engine,
    by_location: dict[ResidencyLocation, tuple[ResidencyHandle[Any], ...]],
    deferred: bool,
) -> bool:
    """Whether staging the values ``by_location`` would block the host on a copy: a
    copy from pageable memory would, and, before a step's body, delay its kernels. A
    read from disk to a device does not where the runtime takes deferred events
    (``deferred``): the disk tier's I/O thread runs it."""
    check = engine.blocks_host
    return any(
        check(handles, location, disk_deferred=deferred)
        for location, handles in by_location.items()
    )


# Closing waits for copies in flight; another thread's source callback refuses the gate
# meanwhile, so the wait is retried this often, this long apart.
_SETTLE_RETRIES: Final = 2000
_SETTLE_PAUSE_S: Final = 0.0005


def settle_transfers(engine: Engine) -> None:
    """Waits for every copy in flight and releases its protections (a pipeline's end).
    While another thread's source callback runs the gate refuses; the wait is tried
    again for up to a second, and after that the protections are reaped as their events
    complete, like a released lease's."""
    for _ in range(_SETTLE_RETRIES):
        try:
            engine.settle([], transfers=True)
            return
        except ResidencyClosedError:
            return  # a closed manager holds nothing any more
        except ResidencyReentrancyError:
            if engine.blocked_here():
                # This thread's own transition (or callback): waiting cannot help; the
                # protections are reaped as their events complete.
                return
            time.sleep(_SETTLE_PAUSE_S)
