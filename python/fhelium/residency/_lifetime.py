"""The lifetime base shared by leases, holds, reservations and scopes.

An object still active when it is collected, or alive at interpreter exit, is
released safely and warned about (see docs/concepts/lifetimes.md, finalizers).
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from fhelium.errors import ResidencyLifetimeClosedError
from fhelium.values.tensor_resident import TensorResident

__all__ = ["ENGINES", "LIVE", "Lifetime", "LifetimeOwner", "chain_context", "require_active"]


class LifetimeOwner(Protocol):
    """What a lease, hold or reservation asks of the manager engine that issued it.

    Lifetimes name this shape rather than the engine class, so the engine can build
    them without the two modules importing each other.
    """

    manager_id: str
    owner: Callable[[], object | None]

    def check_stream(self, stream: object, location: Any) -> object: ...
    def track_lease(
        self, token: int, lease: Any, engine: Any, location: Any, streams: Any
    ) -> None: ...
    def untrack_lease(self, token: int) -> None: ...
    def wait_transfers(self, handles: Any, location: Any, stream: object) -> None: ...
    def transfers_into(self, handles: Any, location: Any) -> list[int]: ...
    def release_host_lease_now(self, token: int) -> bool: ...
    def borrowed(self, token: int, handle: Any, location: Any) -> TensorResident: ...
    def release_lease(
        self,
        token: int,
        location: Any,
        streams: list[Any],
        *,
        wait: bool,
        finalizing: bool = False,
    ) -> None: ...
    def release_host_lease(self, token: int, finalizing: bool = False) -> None: ...
    def release_hold(self, token: int, *, finalizing: bool = False) -> None: ...
    def release_reservation(self, token: int, *, finalizing: bool = False) -> None: ...


# Every live lifetime object other than a lease, so that those still active at
# interpreter exit are finalized while the runtime still works (weakref.finalize's
# atexit behaviour, without its per-object cost). Keyed by id(): an entry leaves on
# release or on collection, never outlives its object.
LIVE: dict[int, weakref.ref[Lifetime]] = {}

# Every manager engine. Each tracks its own unreleased leases in the core (the
# acquire/release hot path pays no Python bookkeeping for it), and hands them over
# at interpreter exit.
ENGINES: weakref.WeakSet[Any] = weakref.WeakSet()


class _Fork:
    """How many forks separate this process from the one that started the count: a
    lifetime made before a fork belongs to the parent's manager, and the child must
    never release or finalize it (docs/concepts/lifetimes.md#fork)."""

    generation = 0


def _forget_inherited() -> None:
    # The parent's managers and lifetimes are the parent's: the child's exit hooks and
    # finalizers leave them (and their files) alone. Explicit use still reaches the
    # core, which refuses it with ResidencyForkedError.
    _Fork.generation += 1
    ENGINES.clear()
    LIVE.clear()


os.register_at_fork(after_in_child=_forget_inherited)


@atexit.register
def _finalize_at_exit() -> None:
    for engine in list(ENGINES):
        for lease in engine.live_leases():
            lease._abandon()
    for reference in list(LIVE.values()):
        lifetime = reference()
        if lifetime is not None:
            lifetime._abandon()


def chain_context(error: BaseException, body: BaseException | None) -> None:
    """Gives `error` the implicit `__context__` Python would have set had it been
    raised by Python code while `body` propagated: errors raised from the core (through
    C) carry no implicit context."""
    if body is not None and error is not body and error.__context__ is None:
        error.__context__ = body


class Lifetime:
    """Finalization shared by leases, holds and reservations: an object collected or
    alive at exit while still active is released safely, with a ResourceWarning."""

    __slots__ = ("__weakref__", "_active", "_entered", "_generation")

    _active: bool
    _entered: bool
    _generation: int

    def _track(self) -> None:
        self._active = True
        self._generation = _Fork.generation
        LIVE[id(self)] = weakref.ref(self)

    def _inherited(self) -> bool:
        """Whether this lifetime was made before a fork, in the parent process."""
        return getattr(self, "_generation", _Fork.generation) != _Fork.generation

    def _untrack(self) -> None:
        self._active = False
        LIVE.pop(id(self), None)

    def _finalize(self) -> None:
        raise NotImplementedError

    @property
    def active(self) -> bool:
        """Whether the lifetime still protects (or reserves) anything.

        ``True`` from creation (for a scope, from a successful entry) until it is released,
        closed or finalized.
        """
        return self._active

    def release(self) -> None:
        """Release the lifetime; leases, holds and reservations each implement it.

        A `ResidencyScope` does not: it ends with `ResidencyScope.close` (or by leaving its
        ``with`` block), and calling ``release`` on it raises.

        Raises:
            NotImplementedError: Called on a lifetime kind without a release of its own (a
                scope).
        """
        raise NotImplementedError

    def _closed_message(self) -> str:
        raise NotImplementedError

    def _enter_once(self, noun: str) -> None:
        require_active(self)
        # Unset until the first entry on a lease the manager built.
        if getattr(self, "_entered", False):
            raise RuntimeError(f"a {noun} can be entered only once")
        self._entered = True

    def __exit__(self, exc_type: object, exc: BaseException | None, traceback: object) -> None:
        try:
            self.release()
        except BaseException as error:
            chain_context(error, exc)
            raise

    def _abandon(self) -> None:
        if self._active and not self._inherited():
            self._untrack()
            self._finalize()


def require_active(lifetime: Lifetime) -> None:
    """ResidencyLifetimeClosedError, saying what was released, once ``lifetime`` is."""
    if not lifetime._active:
        raise ResidencyLifetimeClosedError(lifetime._closed_message())


class FinalizedLifetime(Lifetime):
    """A lifetime whose own finalizer releases it when it is collected still active.

    Leases are not: the manager's core keeps a weak reference to each unreleased
    lease, whose callback finalizes it, so a lease released in time costs no
    finalizer call when it is freed."""

    __slots__ = ()

    def __del__(self) -> None:
        # Interpreter teardown may have cleared module globals; nothing is left to do.
        if getattr(self, "_active", False) and not self._inherited():
            self._untrack()
            self._finalize()
