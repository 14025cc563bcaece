"""`ResidencyManager` and `ResidencyScope`: the public face of one manager.

Both are thin: they check argument shapes, build the action records, and hand the
work to the manager's engine, which owns everything else. The behaviour they promise
is written in the concept guides (docs/concepts/index.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from fhelium.residency._engine import Engine
from fhelium.residency._lifetime import chain_context
from fhelium.residency._scope import ManagerPlans, ResidencyScope
from fhelium.residency._scope import engine_of as engine_of  # noqa: PLC0414 (re-exported)
from fhelium.residency.lease import ResidencyHold, ResidencyLease, ResidencyReservation
from fhelium.residency.location import PAGEABLE_HOST, ResidencyLocation
from fhelium.residency.model import (
    ReplicaMode,
    ResidencyHandle,
    ResidencySource,
    ResidencyValueSpec,
)
from fhelium.residency.plan import DiscardValue
from fhelium.residency.snapshot import ResidencySnapshot, ResidencyTransitionReport
from fhelium.values.tensor_resident import TensorResident

__all__ = ["ResidencyManager", "ResidencyScope"]

ValueT = TypeVar("ValueT", bound=TensorResident)


class ResidencyManager(ManagerPlans):
    """Owns where managed values live, under strict per-location byte budgets.

    Every value gets an opaque `ResidencyHandle`. The four primitives (`ensure`/`copy`,
    `move`, `drop`, `discard`) change where its materialisations live, with exact accounting
    at every location and optional strict budgets: admitting ``incoming`` bytes at a budgeted
    location requires ``used + reserved + incoming <= budget`` (see
    docs/concepts/locations-and-budgets.md#budget-admission). Plans (`execute_actions`,
    `scope`) run ordered action lists after a preflight; leases, holds and reservations
    protect or reserve memory (see docs/concepts/lifetimes.md). The manager captures the
    installed device runtime when it is built (see docs/concepts/simulation.md#installing-it)
    and is safe to use from several threads. As a context manager it returns itself and calls
    `close` on exit.

    Args:
        budgets: Strict byte budgets by location, registered in mapping order. Every other
            location is unbudgeted (never refused, accounted the same way). Each budget is an
            index int (see docs/concepts/conventions.md#integer-arguments); a size such as
            ``"8GiB"`` is written ``sizes.parse_size("8GiB")``
            (docs/concepts/locations-and-budgets.md#byte-counts).
        trace_capacity: How many transition reports `trace` keeps (oldest dropped first);
            0 disables the trace. An index int.

    Raises:
        TypeError: ``budgets`` is not a mapping or ``None``; a key is not a
            `ResidencyLocation`; a budget or ``trace_capacity`` is a ``bool`` or not an
            integer.
        ValueError: A negative budget or ``trace_capacity``, a budget above ``2**64 - 1``, or
            a CUDA location without CUDA or past the device count.

    Example:
        ```python
        import torch
        from fhelium.residency import PAGEABLE_HOST, ResidencyManager
        from fhelium.values import ResidentTensor

        with ResidencyManager({PAGEABLE_HOST: 1 << 20}) as manager:
            handle = manager.adopt(ResidentTensor(torch.zeros(1024)))
            location = manager.snapshot().locations[0]
            assert (location.used_bytes, location.remaining_budget_bytes) == (4096, 1044480)
        ```
    """

    __slots__ = ("__weakref__", "_engine")

    def __init__(
        self,
        budgets: Mapping[ResidencyLocation, int] | None = None,
        *,
        trace_capacity: int = 4096,
    ) -> None:
        self._engine = Engine(budgets, trace_capacity)
        self._engine.owner = weakref.ref(self)

    # ------------------------------------------------------------------ identity

    @property
    def manager_id(self) -> str:
        """The process-unique id carried by every handle this manager issues.

        Needs no state: it works at any time, also after `close` and during a source callback.
        """
        return self._engine.manager_id

    @property
    def state_version(self) -> int:
        """The monotonic state version: a plain int starting at 0.

        It advances with every change of residency state (see
        docs/concepts/transitions.md#state-version). Reading it reaps completed CUDA leases, so
        reading it can advance it. Pass an observed version as ``expected_state_version`` to make
        `explain`, `execute_actions` or `scope` refuse a changed state.

        Raises:
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of this manager is running.
        """
        return self._engine.state_version

    @property
    def locations(self) -> tuple[ResidencyLocation, ...]:
        """The registered locations: budgeted ones first, then in first-use order.

        A location is registered lazily on its first successful install, source registration or
        reservation (see docs/concepts/locations-and-budgets.md#location-registration). Keeps
        working after `close`.
        """
        return self._engine.locations

    def __repr__(self) -> str:
        engine = self._engine
        return (
            f"ResidencyManager(manager_id={engine.manager_id!r}, runtime={engine.runtime.name!r})"
        )

    # ------------------------------------------------------------------ registration

    def adopt(
        self,
        value: ValueT,
        *,
        at: ResidencyLocation | None = None,
        replica_mode: ReplicaMode = ReplicaMode.EXCLUSIVE,
    ) -> ResidencyHandle[ValueT]:
        """Take ownership of an existing value as a MUST_PRESERVE managed value.

        The location is ``at``, or inferred: a CUDA value's own device, a uniformly pinned host
        value `PINNED_HOST`, anything else `PAGEABLE_HOST`. The value must fit the location and
        its budget; the spec is built from the value (``logical = value.nbytes``, ``storage =
        max(value.nbytes, value.storage_nbytes)``). The value must not be used through other
        references afterwards in ways that change its storage. A CUDA value must be complete on
        its device's current stream. Adopt produces no transition report. See
        docs/concepts/values.md#adopt.

        Args:
            value: The `TensorResident` to manage; the manager keeps this very object.
            at: Where the value lives, or ``None`` to infer it. A disk location is refused.
            replica_mode: Whether the value may later be replicated.

        Returns:
            The new handle, typed by the value's class.

        Raises:
            TypeError: ``value`` is not a `TensorResident` (checked first, also on a closed
                manager); ``at`` is not a location; ``replica_mode`` is not a `ReplicaMode`.
            ValueError: ``at`` is a CUDA location without CUDA or past the device count.
            RuntimeError: ``value.device`` fails for a value with no tensors or tensors on
                several devices (propagated unchanged).
            ResidencyMaterializationError: The value does not fit ``at`` (device, pinning, a
                host value mixing pinned and pageable tensors, a disk location).
            ResidencyBudgetError: The value's storage does not fit the budget at the location.
            ResidencyOwnershipError: The value's storage is already managed (adopting the same
                object twice).
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of this manager is running, or this
                thread is inside a transition.

        Example:
            ```python
            import torch
            from fhelium.residency import PINNED_HOST, ReplicaMode, ResidencyManager
            from fhelium.residency.simulation import SimulatedRuntime, use_runtime
            from fhelium.values import TensorBundle

            runtime = SimulatedRuntime(device_count=1)
            with use_runtime(runtime), ResidencyManager() as manager:
                pinned = runtime.pin(TensorBundle(w=torch.randn(8, 8), b=torch.zeros(8)))
                handle = manager.adopt(pinned, replica_mode=ReplicaMode.REPLICABLE)
                (entry,) = manager.snapshot().values
                assert entry.materializations[0].location == PINNED_HOST
            ```
        """
        handle: ResidencyHandle[ValueT] = self._engine.adopt(value, at, replica_mode)
        return handle

    def register_source(
        self,
        spec: ResidencyValueSpec[ValueT],
        source: ResidencySource[ValueT],
        *,
        source_location: ResidencyLocation = PAGEABLE_HOST,
    ) -> ResidencyHandle[ValueT]:
        """Register a reconstructible value; ``source.load()`` runs only when it is needed.

        Registration never calls ``load`` and never checks a budget: the value has no
        materialisation until an action needs one, and then it is rebuilt at
        ``source_location`` under a temporary charge (see docs/concepts/values.md#reconstruction).
        Either replica mode is allowed. See docs/concepts/values.md#register-a-source.

        Args:
            spec: What the value is and what each materialisation is charged; must be
                `Recoverability.RECONSTRUCTIBLE`.
            source: Any object with a callable ``load()`` returning a value matching ``spec``
                at ``source_location`` (see `ResidencySource`).
            source_location: Where ``load()`` puts the value: a host or CUDA location, never a
                disk location.

        Returns:
            The new handle, typed by ``spec.value_type``.

        Raises:
            TypeError: ``spec`` is not a `ResidencyValueSpec`, ``source`` has no callable
                ``load`` (both checked before any state access), or ``source_location`` is not
                a location.
            ValueError: The spec is not RECONSTRUCTIBLE; ``source_location`` is a disk location,
                or a CUDA location without CUDA or past the device count.
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of this manager is running, or this
                thread is inside a transition.

        Example:
            ```python
            import torch
            from fhelium.residency import (
                PAGEABLE_HOST, Recoverability, ReplicaMode, ResidencyManager, ResidencyValueSpec,
            )
            from fhelium.values import ResidentTensor

            class Zeros:
                def load(self) -> ResidentTensor:
                    return ResidentTensor(torch.zeros(256))

            spec = ResidencyValueSpec(
                ResidentTensor, 1024, 1024, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
            )
            with ResidencyManager() as manager:
                handle = manager.register_source(spec, Zeros())
                report = manager.ensure(handle, PAGEABLE_HOST)  # load() runs here
                assert report.source == PAGEABLE_HOST
            ```
        """
        handle: ResidencyHandle[ValueT] = self._engine.register_source(
            spec, source, source_location
        )
        return handle

    # ------------------------------------------------------------------ primitives

    def ensure(
        self, handle: ResidencyHandle[Any], at: ResidencyLocation, *, stream: Any = None
    ) -> ResidencyTransitionReport:
        """Install the value at ``at``, keeping existing replicas; a no-op if it is already there.

        A resident value is a no-op report (reason ``"destination already resident"``). Otherwise
        the source is the first existing materialisation in the canonical source order, or the
        registered source rebuilds it (see docs/concepts/values.md#reconstruction); the budget at
        ``at`` is checked before anything is copied. A copy to CUDA runs on ``stream`` (or the
        device's current stream) and is waited for on the host before the call returns. See
        docs/concepts/transitions.md#ensure-and-copy.

        Args:
            handle: The value, issued by this manager.
            at: Where it must be resident.
            stream: A CUDA stream on ``at``'s device for the copy; ``None`` for the device's
                current stream. Only valid for a CUDA ``at``.

        Returns:
            The transition report (``no_op=True`` when nothing had to happen); also appended to
            the trace.

        Raises:
            TypeError: ``handle`` is not a handle or ``at`` not a location (from the action
                constructor, also on a closed manager); ``stream`` is not a CUDA stream.
            ValueError: ``at`` is a CUDA location without CUDA or past the device count;
                ``stream`` given for a host location or on another device.
            ResidencyOwnershipError: An EXCLUSIVE value materialised elsewhere (use `move`), or
                the copy's storage aliases managed storage.
            ResidencyUnavailableError: No materialisation to copy from and no source.
            ResidencyBudgetError: The charge does not fit the budget at ``at`` (or the temporary
                reconstruction charge at the source location).
            ResidencyMaterializationError: A loaded value does not match the spec.
            ResidencyHandleError: A foreign, unknown or discarded handle.
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of this manager is running, or this
                thread is inside a transition.
            Exception: Whatever the source's ``load()`` or a copy raises, unchanged (for example
                `RuntimeError` when pinned memory is unavailable).

        Example:
            ```python
            import torch
            from fhelium.residency import PINNED_HOST, ReplicaMode, ResidencyManager, cuda_location
            from fhelium.residency.simulation import SimulatedRuntime, use_runtime
            from fhelium.values import ResidentTensor

            runtime = SimulatedRuntime(device_count=1)
            cuda0 = cuda_location("cuda:0")
            with use_runtime(runtime), ResidencyManager({cuda0: 1 << 20}) as manager:
                handle = manager.adopt(
                    ResidentTensor(torch.ones(1024)), replica_mode=ReplicaMode.REPLICABLE
                )
                report = manager.ensure(handle, cuda0)
                assert report.destination == cuda0 and not report.no_op
                assert manager.ensure(handle, cuda0).no_op  # already resident
                manager.ensure(handle, PINNED_HOST)          # a third replica
            ```
        """
        # One call: the core builds the action record (checking argument classes).
        return self._engine.ensure(handle, at, stream)

    def copy(
        self, handle: ResidencyHandle[Any], to: ResidencyLocation, *, stream: Any = None
    ) -> ResidencyTransitionReport:
        """Exactly `ensure` under another parameter name: add a materialisation at ``to``.

        The report's action is an `EnsureResident`. See
        docs/concepts/transitions.md#ensure-and-copy.

        Args:
            handle: The value, issued by this manager.
            to: Where it must be resident.
            stream: A CUDA stream on ``to``'s device for the copy; ``None`` for the device's
                current stream.

        Returns:
            The transition report, as for `ensure`.

        Raises:
            TypeError: ``handle`` is not a handle, ``to`` not a location, ``stream`` not a CUDA
                stream.
            ValueError: An unusable CUDA location, or a stream for a host location or another
                device.
            ResidencyOwnershipError: An EXCLUSIVE value materialised elsewhere, or aliased storage.
            ResidencyUnavailableError: No materialisation to copy from and no source.
            ResidencyBudgetError: The charge does not fit the budget at ``to``.
            ResidencyMaterializationError: A loaded value does not match the spec.
            ResidencyHandleError: A foreign, unknown or discarded handle.
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of this manager is running, or this
                thread is inside a transition.

        Example:
            ```python
            import torch
            from fhelium.residency import PINNED_HOST, ReplicaMode, ResidencyManager
            from fhelium.residency.simulation import SimulatedRuntime, use_runtime
            from fhelium.values import ResidentTensor

            with use_runtime(SimulatedRuntime(device_count=0)), ResidencyManager() as manager:
                value = ResidentTensor(torch.ones(4))
                handle = manager.adopt(value, replica_mode=ReplicaMode.REPLICABLE)
                assert type(manager.copy(handle, PINNED_HOST).action).__name__ == "EnsureResident"
            ```
        """
        return self.ensure(handle, to, stream=stream)

    def move(
        self,
        handle: ResidencyHandle[Any],
        to: ResidencyLocation,
        *,
        from_location: ResidencyLocation | None = None,
        stream: Any = None,
    ) -> ResidencyTransitionReport:
        """Install the value at ``to``, then remove the source materialisation it came from.

        The source is ``from_location`` when given, otherwise the first materialisation other
        than ``to`` in the canonical source order. It must be removable before anything is
        copied. A value with no materialisation is rebuilt from its source and nothing is
        removed. When ``to`` already holds it and the source is none or ``to``, the move is a
        no-op (reason ``"destination already owns the selected replica"``). The only way to
        change where an EXCLUSIVE value lives. See docs/concepts/transitions.md#move.

        Args:
            handle: The value, issued by this manager.
            to: The destination.
            from_location: The materialisation to move from; ``None`` to select one. May equal
                ``to`` (a no-op).
            stream: A CUDA stream on ``to``'s device for the copy; ``None`` for the device's
                current stream.

        Returns:
            The transition report, with the selected ``source``.

        Raises:
            TypeError: ``handle`` is not a handle, ``to`` or ``from_location`` not a location,
                ``stream`` not a CUDA stream.
            ValueError: An unusable CUDA location, or a stream for a host location or another
                device.
            ResidencyUnavailableError: ``from_location`` holds nothing, or there is no
                materialisation and no source.
            ResidencyInUseError: The source is protected by a lease, hold or pending event.
            ResidencyBudgetError: The charge does not fit the budget at ``to``.
            ResidencyOwnershipError: The copy's storage aliases managed storage.
            ResidencyMaterializationError: A loaded value does not match the spec.
            ResidencyHandleError: A foreign, unknown or discarded handle.
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of this manager is running, or this
                thread is inside a transition.

        Example:
            ```python
            import torch
            from fhelium.residency import PAGEABLE_HOST, ResidencyManager, cuda_location
            from fhelium.residency.simulation import SimulatedRuntime, use_runtime
            from fhelium.values import ResidentTensor

            cuda0 = cuda_location("cuda:0")
            with use_runtime(SimulatedRuntime(device_count=1)), ResidencyManager() as manager:
                handle = manager.adopt(ResidentTensor(torch.ones(16)))  # EXCLUSIVE by default
                report = manager.move(handle, cuda0)
                assert (report.source, report.destination) == (PAGEABLE_HOST, cuda0)
            ```
        """
        return self._engine.move_to(handle, to, from_location, stream)

    def drop(
        self, handle: ResidencyHandle[Any], at: ResidencyLocation
    ) -> ResidencyTransitionReport:
        """Remove one unprotected materialisation, keeping the managed value.

        Nothing at ``at`` is a no-op (reason ``"materialization already absent"``). Protection is
        checked before the last-copy rule: the only materialisation of a value with no registered
        source cannot be dropped, while a reconstructible value may lose its last copy. See
        docs/concepts/transitions.md#drop.

        Args:
            handle: The value, issued by this manager.
            at: The materialisation to remove.

        Returns:
            The transition report; its ``source`` is ``at``, also for a no-op.

        Raises:
            TypeError: ``handle`` is not a handle or ``at`` not a location.
            ValueError: ``at`` is a CUDA location without CUDA or past the device count.
            ResidencyInUseError: The materialisation is protected by a lease, hold or pending
                event.
            ResidencyOwnershipError: It is the last copy of a value with no source.
            ResidencyHandleError: A foreign, unknown or discarded handle.
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of this manager is running, or this
                thread is inside a transition.

        Example:
            ```python
            import torch
            from fhelium.residency import PAGEABLE_HOST, PINNED_HOST, ReplicaMode, ResidencyManager
            from fhelium.residency.simulation import SimulatedRuntime, use_runtime
            from fhelium.values import ResidentTensor

            with use_runtime(SimulatedRuntime(device_count=0)), ResidencyManager() as manager:
                value = ResidentTensor(torch.ones(4))
                handle = manager.adopt(value, replica_mode=ReplicaMode.REPLICABLE)
                manager.ensure(handle, PINNED_HOST)
                manager.drop(handle, PAGEABLE_HOST)          # the pinned replica remains
                assert manager.drop(handle, PAGEABLE_HOST).no_op
            ```
        """
        return self._engine.drop(handle, at)

    def discard(self, handle: ResidencyHandle[Any]) -> ResidencyTransitionReport:
        """End the managed value: remove every materialisation and forget its source.

        Every materialisation must be removable, or nothing changes. The discarded value stays
        visible in snapshots; every later use of the handle, a second `discard` included, raises
        `ResidencyHandleError`. See docs/concepts/transitions.md#discard.

        Args:
            handle: The value, issued by this manager.

        Returns:
            The transition report (``source`` and ``destination`` are ``None``).

        Raises:
            TypeError: ``handle`` is not a handle.
            ResidencyInUseError: A materialisation is protected by a lease, hold or pending event.
            ResidencyHandleError: A foreign, unknown or discarded handle.
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of this manager is running, or this
                thread is inside a transition.

        Example:
            ```python
            import torch
            from fhelium.residency import ResidencyManager
            from fhelium.values import ResidentTensor

            with ResidencyManager() as manager:
                handle = manager.adopt(ResidentTensor(torch.ones(4)))
                manager.discard(handle)
                (entry,) = manager.snapshot().values
                assert entry.handle == handle and entry.discarded
            ```
        """
        return self._engine.transition(DiscardValue(handle), None)

    # ------------------------------------------------------------------ lifetimes

    def acquire(
        self,
        handles: Iterable[ResidencyHandle[Any]],
        *,
        at: ResidencyLocation,
        consumer_stream: Any = None,
    ) -> ResidencyLease:
        """Borrow values already materialised at ``at``, atomically; never materialises anything.

        Only when every handle is resident at ``at`` is a `ResidencyLease` recorded: each
        materialisation gets a use token (it cannot be removed) and the version advances once.
        A CUDA lease needs the ``consumer_stream`` that will read the values; releasing it
        records an event there, and the memory stays protected until that event completes. A
        disk location cannot be borrowed. See docs/concepts/lifetimes.md#leases.

        Args:
            handles: The values; duplicates collapse, keeping the first occurrence.
            at: Where they are materialised.
            consumer_stream: For a CUDA ``at``, the stream that will read the values (required);
                must be ``None`` for a host ``at``.

        Returns:
            The active lease; ``with lease as values:`` gives the `BorrowedValues`.

        Raises:
            TypeError: ``handles`` is not iterable or holds a non-handle; ``at`` is not a
                location; ``consumer_stream`` is not a CUDA stream.
            ValueError: No handles; a CUDA ``at`` without ``consumer_stream``, a host ``at``
                with one, or one on another device; an unusable CUDA location; a disk location.
            ResidencyHandleError: A foreign, unknown or discarded handle.
            ResidencyUnavailableError: A value is not materialised at ``at``.
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of this manager is running, or this
                thread is inside a transition.

        Example:
            ```python
            import torch
            from fhelium.residency import PAGEABLE_HOST, ResidencyManager
            from fhelium.values import ResidentTensor

            with ResidencyManager() as manager:
                handle = manager.adopt(ResidentTensor(torch.ones(4)))
                with manager.acquire([handle], at=PAGEABLE_HOST) as values:
                    assert float(values[handle].tensor.sum()) == 4.0
            ```
        """
        engine = self._engine
        # `Engine.acquire`, without its frame: acquiring is on every step's path.
        lease: ResidencyLease = engine.acquire_lease(engine, handles, at, consumer_stream)
        return lease

    def hold(
        self, handles: Iterable[ResidencyHandle[Any]], *, at: ResidencyLocation
    ) -> ResidencyHold:
        """Protect values already materialised at ``at`` from removal until the hold is released.

        Like `acquire` without streams or values: each materialisation gets a hold token and the
        version advances once. See docs/concepts/lifetimes.md#holds.

        Args:
            handles: The values; duplicates collapse, keeping the first occurrence.
            at: Where they are materialised.

        Returns:
            The active hold.

        Raises:
            TypeError: ``handles`` is not iterable or holds a non-handle; ``at`` is not a
                location.
            ValueError: No handles, or an unusable CUDA location.
            ResidencyHandleError: A foreign, unknown or discarded handle.
            ResidencyUnavailableError: A value is not materialised at ``at``.
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of this manager is running, or this
                thread is inside a transition.

        Example:
            ```python
            import torch
            from fhelium.errors import ResidencyInUseError
            from fhelium.residency import PAGEABLE_HOST, Recoverability, ResidencyManager
            from fhelium.values import ResidentTensor

            with ResidencyManager() as manager:
                handle = manager.adopt(ResidentTensor(torch.ones(4)))
                with manager.hold([handle], at=PAGEABLE_HOST):
                    try:
                        manager.discard(handle)
                    except ResidencyInUseError:
                        pass  # protected while held
                manager.discard(handle)
            ```
        """
        return self._engine.hold(handles, at=at)

    def reserve(
        self, location: ResidencyLocation, nbytes: int, *, label: str
    ) -> ResidencyReservation:
        """Charge ``nbytes`` of accounting headroom at ``location`` until released.

        A reservation allocates nothing: the work that uses the headroom owns its memory. It is
        budget-checked like an install and counted in ``reserved_bytes``; zero bytes are valid.
        Reservations are not reaped or traced. See docs/concepts/lifetimes.md#reservations.

        Args:
            location: Where to reserve.
            nbytes: How many bytes; an index int (``sizes.parse_size("64MiB")`` for a size, see
                docs/concepts/locations-and-budgets.md#byte-counts).
            label: A non-empty name, shown in snapshots.

        Returns:
            The active reservation.

        Raises:
            TypeError: ``nbytes`` is a ``bool`` or not an integer (a string, such as ``"64MiB"``,
                included: the message says to pass ``sizes.parse_size``); ``label`` is not a
                string; ``location`` is not a location.
            ValueError: A negative ``nbytes`` or one above ``2**64 - 1``; a blank ``label``; an
                unusable CUDA location.
            ResidencyBudgetError: The bytes do not fit the budget at ``location``.
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of this manager is running, or this
                thread is inside a transition.

        Example:
            ```python
            from fhelium.residency import PAGEABLE_HOST, ResidencyManager

            with ResidencyManager({PAGEABLE_HOST: 1 << 20}) as manager:
                with manager.reserve(PAGEABLE_HOST, 1 << 19, label="workspace"):
                    assert manager.snapshot().locations[0].reserved_bytes == 1 << 19
            ```
        """
        return self._engine.reserve(location, nbytes, label=label)

    # ------------------------------------------------------------------ observations

    def snapshot(self) -> ResidencySnapshot[Any]:
        """Take one atomic, tensor-free observation of the manager.

        O(1) to capture; its entries are built when first read. Reaps completed CUDA leases first.
        See docs/concepts/snapshots.md.

        Returns:
            The snapshot: every value (discarded ones included), every registered location and
            every reservation, at one state version.

        Raises:
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of this manager is running, or this
                thread is inside a transition.

        Example:
            ```python
            import torch
            from fhelium.residency import PAGEABLE_HOST, ResidencyManager
            from fhelium.values import ResidentTensor

            with ResidencyManager() as manager:
                handle = manager.adopt(ResidentTensor(torch.ones(4)))
                snapshot = manager.snapshot()
                (entry,) = snapshot.values
                assert entry.handle == handle and entry.spec.storage_nbytes == 16
                assert snapshot.locations[0].location == PAGEABLE_HOST
                assert snapshot.locations[0].used_bytes == 16
            ```
        """
        return self._engine.snapshot()

    def trace(self) -> tuple[ResidencyTransitionReport, ...]:
        """Return the retained transition reports, oldest first.

        The trace is a bounded FIFO of the last ``trace_capacity`` reports of primitives,
        `execute_actions` and scope actions; adopt, registration, lifetimes and close are not
        traced. Works after `close`. See docs/concepts/transitions.md#trace.

        Returns:
            The reports, oldest first.

        Raises:
            ResidencyReentrancyError: A source callback of this manager is running.

        Example:
            ```python
            import torch
            from fhelium.residency import PINNED_HOST, ReplicaMode, ResidencyManager
            from fhelium.residency.simulation import SimulatedRuntime, use_runtime
            from fhelium.values import ResidentTensor

            with use_runtime(SimulatedRuntime(device_count=0)), ResidencyManager() as manager:
                value = ResidentTensor(torch.ones(4))
                handle = manager.adopt(value, replica_mode=ReplicaMode.REPLICABLE)
                manager.ensure(handle, PINNED_HOST)
                (report,) = manager.trace()
                manager.clear_trace()
                assert manager.trace() == ()
            ```
        """
        return self._engine.trace()

    def clear_trace(self) -> None:
        """Empty the trace; residency state and the state version are unchanged.

        Works after `close`.

        Raises:
            ResidencyReentrancyError: A source callback of this manager is running.
        """
        self._engine.clear_trace()

    # ------------------------------------------------------------------ close

    def close(self, *, wait: bool = True, force: bool = False) -> None:
        """Close the manager: release everything and refuse every later gated operation.

        An already closed manager returns silently. With ``wait=True`` pending CUDA leases are
        synchronised first; with ``wait=False`` completed ones are only reaped. If any lease,
        hold or reservation remains and ``force`` is false, the manager stays open. A forced close
        synchronises every registered CUDA device and drops every protection: outstanding
        lifetimes become inert. Closing deletes the manager's disk files. After close only
        `locations`, `trace`, `clear_trace` and `manager_id` keep working. See
        docs/concepts/lifetimes.md#close.

        Args:
            wait: Synchronise pending CUDA lease events instead of only reaping completed ones.
            force: Close even with lifetimes outstanding; the caller guarantees no borrowed
                object is still in use.

        Raises:
            ResidencyInUseError: Leases, holds or reservations remain and ``force`` is false; the
                message lists ``active_leases=``, ``pending_leases=``, ``holds=`` and
                ``reservations=``.
            ResidencyReentrancyError: A source callback of this manager is running, or this
                thread is inside a transition.
        """
        self._engine.close(wait=wait, force=force)

    def __enter__(self) -> ResidencyManager:
        self._engine.check_open()
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, traceback: object) -> None:
        try:
            self._engine.close()
        except BaseException as error:
            # Errors raised from the core carry no implicit context; chain the body's.
            chain_context(error, exc)
            raise
