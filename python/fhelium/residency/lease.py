"""Lifetime objects: leases (borrowed values), holds and reservations.

Each wraps a token the core keeps. Releasing one is idempotent; abandoning one is
caught by a finalizer that releases it safely and warns, and a lease whose safe
release fails keeps its manager alive forever rather than let CUDA memory be reused
while a kernel may still read it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from fhelium.residency._lifetime import (
    FinalizedLifetime,
    Lifetime,
    LifetimeOwner,
    require_active,
)
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.model import ResidencyHandle
from fhelium.values.tensor_resident import TensorResident

__all__ = ["BorrowedValues", "ResidencyHold", "ResidencyLease", "ResidencyReservation"]

# Internal: `new_hold`, `new_reservation` (the engine's constructors), `check_borrowed`,
# `enter_new`, `borrowed_value`, `protecting_tokens` and `release_deferred` (what uses
# and pipelines ask of lifetimes).

# Managers (and their engines) whose abandoned leases could not be released safely. A
# strong root: their storage must never be freed while a CUDA kernel may still read it.
_RETAINED: list[object] = []


def _warn_abandoned(kind: str, engine: LifetimeOwner, location: object, outcome: str) -> None:
    warnings.warn(
        f"an abandoned {kind} of residency manager {engine.manager_id!r} at {location} "
        f"was never released; {outcome}. Release {kind}s explicitly (or use them as "
        "context managers).",
        ResourceWarning,
        stacklevel=2,
    )


def finalize_lease(
    engine: LifetimeOwner, token: int, location: ResidencyLocation, streams: list[Any]
) -> None:
    """Releases an abandoned lease safely and warns (the manager's weak reference to an
    unreleased lease calls this when the lease is collected)."""
    try:
        engine.release_lease(token, location, streams, wait=True, finalizing=True)
    except BaseException:
        _RETAINED.append(engine)
        # The public manager too: users observe it, and it owns the engine anyway.
        owner = engine.owner()
        if owner is not None:
            _RETAINED.append(owner)
        _warn_abandoned(
            "lease",
            engine,
            location,
            "its protection could not be released safely, so the manager and its storage "
            "are retained for the rest of the process",
        )
        return
    _warn_abandoned(
        "lease", engine, location, "its consumer streams were synchronised and it was released"
    )


def _finalize_hold(engine: LifetimeOwner, token: int, location: ResidencyLocation) -> None:
    try:
        engine.release_hold(token, finalizing=True)
    except BaseException:
        _warn_abandoned("hold", engine, location, "releasing it failed")
        return
    _warn_abandoned("hold", engine, location, "it was released")


def _finalize_reservation(engine: LifetimeOwner, token: int, location: ResidencyLocation) -> None:
    try:
        engine.release_reservation(token, finalizing=True)
    except BaseException:
        _warn_abandoned("reservation", engine, location, "releasing it failed")
        return
    _warn_abandoned("reservation", engine, location, "it was released")


class BorrowedValues(Mapping[ResidencyHandle[Any], TensorResident]):
    """The managed objects a lease borrows, by handle: a read-only mapping.

    Lookups return the managed object itself, not a copy: read it while the lease is active,
    never mutate it, and do not keep it after release. Iteration yields the lease's handles
    in order; every lookup, ``len``, ``in``, ``get`` and ``items`` checks the lease first.
    Constructed by the manager (through `ResidencyLease.values` or ``with lease as values:``).
    See docs/concepts/lifetimes.md#borrowed-values.

    Raises:
        ResidencyLifetimeClosedError: Any use after the lease was released.
        KeyError: A handle that is not in the lease.
        ResidencyUnavailableError: The lease record no longer matches (after a forced close).
    """

    __slots__ = ("_lease",)

    def __init__(self, lease: ResidencyLease) -> None:
        self._lease = lease

    def __getitem__(self, handle: ResidencyHandle[Any]) -> TensorResident:
        lease = self._lease
        require_active(lease)
        # Unset until the first lookup: many leases are never looked into.
        handle_set = getattr(lease, "_handle_set", None)
        if handle_set is None:
            handle_set = lease._handle_set = frozenset(lease._handles)
        if handle not in handle_set:
            raise KeyError(handle)
        return lease._engine.borrowed(lease._token, handle, lease._location)

    def __iter__(self) -> Iterator[ResidencyHandle[Any]]:
        lease = self._lease
        for handle in lease._handles:
            require_active(lease)
            yield handle

    def __len__(self) -> int:
        require_active(self._lease)
        return len(self._lease._handles)

    def __repr__(self) -> str:
        return f"BorrowedValues({self._lease!r})"


class ResidencyLease(Lifetime):
    """An immutable borrow of materialisations at one location, made by `ResidencyManager.acquire`.

    While active, each borrowed materialisation has a use token and cannot be removed. For a
    CUDA location, release records an event on every consumer stream and keeps the memory
    protected until those events complete (pending, reaped later); no device-wide
    synchronisation is needed. ``with lease as values:`` gives the `BorrowedValues` and
    releases with ``wait=False`` on exit. Constructed by the manager; a lease collected while
    active is released by a finalizer with a `ResourceWarning`. See
    docs/concepts/lifetimes.md#leases.

    Raises:
        ResidencyLifetimeClosedError: Entering a released lease.
        RuntimeError: Entering a lease twice.
    """

    __slots__ = (
        "_engine",
        "_handle_set",
        "_handles",
        "_location",
        "_streams",
        "_token",
    )

    def __init__(
        self,
        *,
        manager: LifetimeOwner,
        token: int,
        handles: tuple[ResidencyHandle[Any], ...],
        location: ResidencyLocation,
        consumer_streams: list[Any],
    ) -> None:
        self._engine = manager
        self._token = token
        self._handles = handles
        # Built on the first borrowed lookup: many leases are never looked into.
        self._handle_set: frozenset[ResidencyHandle[Any]] | None = None
        self._location = location
        # The finalizer reads this very list, so streams added later are honoured.
        self._streams = consumer_streams
        self._entered = False
        self._track()

    def _track(self) -> None:
        # Leases are tracked by their manager's core, until released; collected
        # still active, the core's weak reference finalizes them.
        self._active = True
        engine = self._engine
        engine.track_lease(self._token, self, engine, self._location, self._streams)

    def _untrack(self) -> None:
        self._active = False
        self._engine.untrack_lease(self._token)

    def _finalize(self) -> None:
        finalize_lease(self._engine, self._token, self._location, self._streams)

    @property
    def handles(self) -> tuple[ResidencyHandle[Any], ...]:
        """The borrowed handles, in the order given (duplicates collapsed)."""
        return self._handles

    @property
    def location(self) -> ResidencyLocation:
        """The location the values are borrowed at."""
        return self._location

    @property
    def values(self) -> BorrowedValues:
        """A new `BorrowedValues` mapping over the borrowed objects.

        Raises:
            ResidencyLifetimeClosedError: The lease was released.
        """
        require_active(self)
        return BorrowedValues(self)

    def _closed_message(self) -> str:
        return f"this lease of {len(self._handles)} value(s) at {self._location} was released"

    def add_consumer_stream(self, stream: Any) -> None:
        """Register another CUDA stream that reads the borrowed values.

        Release then records an event on it too. A stream already registered (the same object) is
        ignored. A value a prefetch is still copying in is ordered before the new stream. See
        docs/concepts/lifetimes.md#cuda-consumer-streams.

        Args:
            stream: A ``torch.cuda.Stream`` or an object with ``__cuda_stream__``, on the lease's
                device.

        Raises:
            ResidencyLifetimeClosedError: The lease was released.
            ValueError: A host lease, or a stream on another device.
            TypeError: ``stream`` is not a CUDA stream.
        """
        require_active(self)
        if self._location.kind != "cuda":
            raise ValueError(f"consumer streams apply to CUDA leases, not {self._location}")
        bound = self._engine.check_stream(stream, self._location)
        if not any(known is bound for known in self._streams):
            # A value a prefetch is still copying in is read after its copy.
            self._engine.wait_transfers(self._handles, self._location, bound)
            self._streams.append(bound)

    def release(self, *, wait: bool = False) -> None:
        """End the borrow; idempotent (``close`` is the same method).

        A host lease's use tokens go at once. A CUDA lease records an event on each consumer
        stream, and its materialisations stay protected until those events complete (reaped by a
        later operation), or until this call waits for them with ``wait=True``. If the manager side
        raises, the lease stays active. A release from another thread during a source callback
        is queued. See docs/concepts/lifetimes.md#lease-release.

        Args:
            wait: For a CUDA lease, synchronise the release events and drop the protection now.

        Raises:
            ResidencyReentrancyError: Called on the thread running a source callback.
        """
        if not self._active:
            return
        engine = self._engine
        if self._location.kind == "cuda":
            engine.release_lease(self._token, self._location, self._streams, wait=wait)
        elif not engine.release_host_lease_now(self._token):
            # The gate is busy or releases are queued: the waiting path.
            engine.release_host_lease(self._token)
        # The core stopped tracking the lease as it released it.
        self._active = False

    close = release

    def __enter__(self) -> BorrowedValues:
        self._enter_once("lease")
        return BorrowedValues(self)

    def __repr__(self) -> str:
        state = "active" if self._active else "released"
        return f"ResidencyLease({len(self._handles)} value(s) at {self._location}, {state})"


class ResidencyHold(FinalizedLifetime):
    """Protection of materialisations at one location from removal, made by `ResidencyManager.hold`.

    Like a lease without values or streams: evaluation still needs a lease. ``with hold:``
    returns the hold and releases it on exit. Constructed by the manager; a hold collected
    while active is released by a finalizer with a `ResourceWarning`. See
    docs/concepts/lifetimes.md#holds.

    Raises:
        ResidencyLifetimeClosedError: Entering a released hold.
        RuntimeError: Entering a hold twice.
    """

    __slots__ = ("_engine", "_handles", "_location", "_token")

    def __init__(
        self,
        *,
        manager: LifetimeOwner,
        token: int,
        handles: tuple[ResidencyHandle[Any], ...],
        location: ResidencyLocation,
    ) -> None:
        self._engine = manager
        self._token = token
        self._handles = tuple(handles)
        self._location = location
        self._entered = False
        self._track()

    def _finalize(self) -> None:
        _finalize_hold(self._engine, self._token, self._location)

    @property
    def handles(self) -> tuple[ResidencyHandle[Any], ...]:
        """The held handles, in the order given (duplicates collapsed)."""
        return self._handles

    @property
    def location(self) -> ResidencyLocation:
        """The location the values are held at."""
        return self._location

    def release(self) -> None:
        """Remove the hold's protection; idempotent (``close`` is the same method).

        Advances the state version. See docs/concepts/lifetimes.md#holds.

        Raises:
            ResidencyReentrancyError: Called on the thread running a source callback.
        """
        if not self._active:
            return
        self._engine.release_hold(self._token)
        self._untrack()

    close = release

    def _closed_message(self) -> str:
        return f"this hold at {self._location} was released"

    def __enter__(self) -> ResidencyHold:
        self._enter_once("hold")
        return self

    def __repr__(self) -> str:
        state = "active" if self._active else "released"
        return f"ResidencyHold({len(self._handles)} value(s) at {self._location}, {state})"


class ResidencyReservation(FinalizedLifetime):
    """Accounting headroom charged at one location, made by `ResidencyManager.reserve`.

    It allocates nothing; ``with reservation:`` returns it and releases it on exit.
    Constructed by the manager; one collected while active is released by a finalizer with a
    `ResourceWarning`. See docs/concepts/lifetimes.md#reservations.

    Attributes:
        location: Where the bytes are reserved.
        nbytes: How many bytes are reserved.
        label: The reservation's name, as shown in snapshots.

    Raises:
        ResidencyLifetimeClosedError: Entering a released reservation.
        RuntimeError: Entering a reservation twice.
    """

    __slots__ = ("_engine", "_token", "label", "location", "nbytes")

    def __init__(
        self,
        *,
        manager: LifetimeOwner,
        token: int,
        location: ResidencyLocation,
        nbytes: int,
        label: str,
    ) -> None:
        self._engine = manager
        self._token = token
        self.location = location
        self.nbytes = nbytes
        self.label = label
        self._entered = False
        self._track()

    def _finalize(self) -> None:
        _finalize_reservation(self._engine, self._token, self.location)

    def release(self) -> None:
        """Return the reserved bytes to the location; idempotent (``close`` is the same method).

        Advances the state version. See docs/concepts/lifetimes.md#reservations.

        Raises:
            ResidencyReentrancyError: Called on the thread running a source callback.
        """
        if not self._active:
            return
        self._engine.release_reservation(self._token)
        self._untrack()

    close = release

    def _closed_message(self) -> str:
        return f"reservation {self.label!r} at {self.location} was released"

    def __enter__(self) -> ResidencyReservation:
        self._enter_once("reservation")
        return self

    def __repr__(self) -> str:
        state = "active" if self._active else "released"
        return (
            f"ResidencyReservation(label={self.label!r}, location={self.location}, "
            f"nbytes={self.nbytes}, {state})"
        )


_new_object = object.__new__


def new_lease(
    engine: LifetimeOwner,
    token: int,
    handles: tuple[ResidencyHandle[Any], ...],
    location: ResidencyLocation,
    consumer_streams: list[Any],
) -> ResidencyLease:
    """The manager's constructor for leases it has just admitted: the state
    ``ResidencyLease.__init__`` sets, without the tracking the manager does itself.
    ``_entered`` and ``_handle_set`` stay unset until first used."""
    lease: ResidencyLease = _new_object(ResidencyLease)
    lease._engine = engine
    lease._token = token
    lease._handles = handles
    lease._location = location
    lease._streams = consumer_streams
    lease._active = True
    return lease


def new_hold(
    engine: LifetimeOwner,
    token: int,
    handles: tuple[ResidencyHandle[Any], ...],
    location: ResidencyLocation,
) -> ResidencyHold:
    """The manager's constructor for holds it has just admitted (``handles`` the tuple
    it normalized): the state ``ResidencyHold.__init__`` sets, without its keyword
    call."""
    hold: ResidencyHold = _new_object(ResidencyHold)
    hold._engine = engine
    hold._token = token
    hold._handles = handles
    hold._location = location
    hold._entered = False
    hold._track()
    return hold


def new_reservation(
    engine: LifetimeOwner, token: int, location: ResidencyLocation, nbytes: int, label: str
) -> ResidencyReservation:
    """The manager's constructor for reservations it has just admitted."""
    return ResidencyReservation(
        manager=engine, token=token, location=location, nbytes=nbytes, label=label
    )


def enter_new(lease: ResidencyLease) -> BorrowedValues:
    """``lease.__enter__()`` for a lease the manager has just admitted under the gate
    this thread holds: active and never entered, so there is nothing to check."""
    lease._entered = True
    values: BorrowedValues = _new_object(BorrowedValues)
    values._lease = lease
    return values


def borrowed_value(values: BorrowedValues, handle: ResidencyHandle[Any]) -> TensorResident:
    """``values[handle]`` for a handle known to be one the lease borrows (a
    requirement's, looked up by identity)."""
    lease = values._lease
    if not lease._active:
        require_active(lease)  # raises
    return lease._engine.borrowed(lease._token, handle, lease._location)


def check_borrowed(values: BorrowedValues) -> None:
    """ResidencyLifetimeClosedError once the lease behind ``values`` was released."""
    require_active(values._lease)


def protecting_tokens(leases: list[ResidencyLease]) -> list[int]:
    """The tokens that protect the values of the CUDA leases among ``leases`` until they
    complete: each one's own, and those of the copies still in flight into them."""
    tokens: list[int] = []
    for lease in leases:
        location = lease._location
        if location.kind == "cuda":
            tokens.append(lease._token)
            tokens += lease._engine.transfers_into(lease._handles, location)
    return tokens


def release_deferred(lifetime: ResidencyLease | ResidencyHold | ResidencyReservation) -> None:
    """Releases as a finalizer does, without its warning: queued while this thread
    cannot enter the manager (docs/concepts/lifetimes.md#deferred-releases)."""
    if not lifetime._active:
        return
    engine = lifetime._engine
    if isinstance(lifetime, ResidencyLease):
        if lifetime._location.kind == "cuda":
            engine.release_lease(
                lifetime._token, lifetime._location, lifetime._streams, wait=False, finalizing=True
            )
        else:
            engine.release_host_lease(lifetime._token, finalizing=True)
        # The core stopped tracking the lease as it released it.
        lifetime._active = False
    elif isinstance(lifetime, ResidencyHold):
        engine.release_hold(lifetime._token, finalizing=True)
        lifetime._untrack()
    else:
        engine.release_reservation(lifetime._token, finalizing=True)
        lifetime._untrack()
