"""What `ResidencyController.run` keeps per step and per request: a staged step's holds
and deferred reads (`Staged`), and a request's derived shape (`Shape`). See
docs/concepts/controller.md#prefetch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from fhelium.residency._decided import StagedRuns
from fhelium.residency._engine import Engine
from fhelium.residency._runtime.base import StagedEvent
from fhelium.residency._use import Borrows, Controller
from fhelium.residency.lease import ResidencyReservation
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.model import ResidencyHandle
from fhelium.residency.plan import MemoryReservation, ResidencyPlan
from fhelium.residency.request import ResidencyRequest

__all__ = ["Shape", "Staged", "release_all", "shape_of"]


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
