"""Lifetime objects: leases (borrowed values), holds and reservations.

Each wraps a token the core keeps. Releasing one is idempotent; abandoning one is
caught by a finalizer that releases it safely and warns, and a lease whose safe
release fails keeps its manager alive forever rather than let CUDA memory be reused
while a kernel may still read it.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from fhelium.errors import ResidencyLifetimeClosedError
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.model import ResidencyHandle
from fhelium.values.tensor_resident import TensorResident

if TYPE_CHECKING:
    from fhelium.residency.manager import ResidencyManager

__all__ = ["BorrowedValues", "ResidencyHold", "ResidencyLease", "ResidencyReservation"]

# Managers whose abandoned leases could not be released safely. A strong root: their
# storage must never be freed while a CUDA kernel may still be reading it.
_RETAINED_MANAGERS: list[ResidencyManager] = []


def _warn_abandoned(kind: str, manager: ResidencyManager, location: object, outcome: str) -> None:
    warnings.warn(
        f"an abandoned {kind} of residency manager {manager.manager_id!r} at {location} "
        f"was never released; {outcome}. Release {kind}s explicitly (or use them as "
        "context managers).",
        ResourceWarning,
        stacklevel=2,
    )


def _finalize_lease(
    manager: ResidencyManager, token: int, location: ResidencyLocation, streams: list[Any]
) -> None:
    try:
        manager._release_lease(token, location, streams, wait=True, finalizing=True)
    except BaseException:
        _RETAINED_MANAGERS.append(manager)
        _warn_abandoned(
            "lease",
            manager,
            location,
            "its protection could not be released safely, so the manager and its storage "
            "are retained for the rest of the process",
        )
        return
    _warn_abandoned(
        "lease", manager, location, "its consumer streams were synchronised and it was released"
    )


def _finalize_hold(manager: ResidencyManager, token: int, location: ResidencyLocation) -> None:
    try:
        manager._release_hold(token, finalizing=True)
    except BaseException:
        _warn_abandoned("hold", manager, location, "releasing it failed")
        return
    _warn_abandoned("hold", manager, location, "it was released")


def _finalize_reservation(
    manager: ResidencyManager, token: int, location: ResidencyLocation
) -> None:
    try:
        manager._release_reservation(token, finalizing=True)
    except BaseException:
        _warn_abandoned("reservation", manager, location, "releasing it failed")
        return
    _warn_abandoned("reservation", manager, location, "it was released")


class BorrowedValues(Mapping[ResidencyHandle[Any], TensorResident]):
    """The managed objects a lease borrows, by handle. Valid only while it is active.

    Lookups return the managed object itself, not a copy: read it while the lease is
    active, never mutate it, and do not keep it after release.
    """

    __slots__ = ("_lease",)

    def __init__(self, lease: ResidencyLease) -> None:
        self._lease = lease

    def __getitem__(self, handle: ResidencyHandle[Any]) -> TensorResident:
        lease = self._lease
        lease._require_active()
        if handle not in lease._handle_set:
            raise KeyError(handle)
        return lease._manager._borrowed(lease._token, handle, lease._location)

    def __iter__(self) -> Iterator[ResidencyHandle[Any]]:
        lease = self._lease
        for handle in lease._handles:
            lease._require_active()
            yield handle

    def __len__(self) -> int:
        self._lease._require_active()
        return len(self._lease._handles)

    def __repr__(self) -> str:
        return f"BorrowedValues({self._lease!r})"


class ResidencyLease:
    """An immutable borrow of materialisations at one location.

    For CUDA locations, release records an event on every consumer stream and keeps
    the memory protected until those events complete; no device-wide
    synchronisation is needed.
    """

    __slots__ = (
        "__weakref__",
        "_active",
        "_entered",
        "_finalizer",
        "_handle_set",
        "_handles",
        "_location",
        "_manager",
        "_streams",
        "_token",
    )

    def __init__(
        self,
        *,
        manager: ResidencyManager,
        token: int,
        handles: tuple[ResidencyHandle[Any], ...],
        location: ResidencyLocation,
        consumer_streams: list[Any],
    ) -> None:
        self._manager = manager
        self._token = token
        self._handles = tuple(handles)
        self._handle_set = frozenset(self._handles)
        self._location = location
        # The finalizer shares this very list, so streams added later are honoured.
        self._streams = consumer_streams
        self._active = True
        self._entered = False
        self._finalizer = weakref.finalize(
            self, _finalize_lease, manager, token, location, consumer_streams
        )

    @property
    def active(self) -> bool:
        return self._active

    @property
    def handles(self) -> tuple[ResidencyHandle[Any], ...]:
        return self._handles

    @property
    def location(self) -> ResidencyLocation:
        return self._location

    @property
    def values(self) -> BorrowedValues:
        self._require_active()
        return BorrowedValues(self)

    def _require_active(self) -> None:
        if not self._active:
            raise ResidencyLifetimeClosedError(
                f"this lease of {len(self._handles)} value(s) at {self._location} was released"
            )

    def add_consumer_stream(self, stream: Any) -> None:
        """Register another CUDA stream that reads the borrowed values."""
        self._require_active()
        if self._location.kind != "cuda":
            raise ValueError(f"consumer streams apply to CUDA leases, not {self._location}")
        self._manager._check_stream(stream, self._location)
        if not any(known is stream for known in self._streams):
            self._streams.append(stream)

    def release(self, *, wait: bool = False) -> None:
        """End the borrow. CUDA: protection lasts until the consumer streams pass the
        release point (`wait=True` waits for that). Idempotent."""
        if not self._active:
            return
        self._manager._release_lease(self._token, self._location, self._streams, wait=wait)
        self._active = False
        self._finalizer.detach()

    close = release

    def __enter__(self) -> BorrowedValues:
        self._require_active()
        if self._entered:
            raise RuntimeError("a lease can be entered only once")
        self._entered = True
        return BorrowedValues(self)

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "active" if self._active else "released"
        return f"ResidencyLease({len(self._handles)} value(s) at {self._location}, {state})"


class ResidencyHold:
    """Longer-lived retention of materialisations at one location; exposes no values."""

    __slots__ = (
        "__weakref__",
        "_active",
        "_entered",
        "_finalizer",
        "_handles",
        "_location",
        "_manager",
        "_token",
    )

    def __init__(
        self,
        *,
        manager: ResidencyManager,
        token: int,
        handles: tuple[ResidencyHandle[Any], ...],
        location: ResidencyLocation,
    ) -> None:
        self._manager = manager
        self._token = token
        self._handles = tuple(handles)
        self._location = location
        self._active = True
        self._entered = False
        self._finalizer = weakref.finalize(self, _finalize_hold, manager, token, location)

    @property
    def active(self) -> bool:
        return self._active

    @property
    def handles(self) -> tuple[ResidencyHandle[Any], ...]:
        return self._handles

    @property
    def location(self) -> ResidencyLocation:
        return self._location

    def release(self) -> None:
        """Remove the hold's protection. Idempotent."""
        if not self._active:
            return
        self._manager._release_hold(self._token)
        self._active = False
        self._finalizer.detach()

    close = release

    def __enter__(self) -> ResidencyHold:
        if not self._active:
            raise ResidencyLifetimeClosedError(f"this hold at {self._location} was released")
        if self._entered:
            raise RuntimeError("a hold can be entered only once")
        self._entered = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "active" if self._active else "released"
        return f"ResidencyHold({len(self._handles)} value(s) at {self._location}, {state})"


class ResidencyReservation:
    """Accounting headroom at one location; allocates nothing."""

    __slots__ = (
        "__weakref__",
        "_active",
        "_entered",
        "_finalizer",
        "_manager",
        "_token",
        "label",
        "location",
        "nbytes",
    )

    def __init__(
        self,
        *,
        manager: ResidencyManager,
        token: int,
        location: ResidencyLocation,
        nbytes: int,
        label: str,
    ) -> None:
        self._manager = manager
        self._token = token
        self.location = location
        self.nbytes = nbytes
        self.label = label
        self._active = True
        self._entered = False
        self._finalizer = weakref.finalize(self, _finalize_reservation, manager, token, location)

    @property
    def active(self) -> bool:
        return self._active

    def release(self) -> None:
        """Return the reserved bytes to the location. Idempotent."""
        if not self._active:
            return
        self._manager._release_reservation(self._token)
        self._active = False
        self._finalizer.detach()

    close = release

    def __enter__(self) -> ResidencyReservation:
        if not self._active:
            raise ResidencyLifetimeClosedError(
                f"reservation {self.label!r} at {self.location} was released"
            )
        if self._entered:
            raise RuntimeError("a reservation can be entered only once")
        self._entered = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "active" if self._active else "released"
        return (
            f"ResidencyReservation(label={self.label!r}, location={self.location}, "
            f"nbytes={self.nbytes}, {state})"
        )
