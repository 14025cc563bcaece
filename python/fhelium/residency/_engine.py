"""The manager engine: one per `ResidencyManager`, handed to everything that works
on its state (lifetimes, plans, scopes, the controller).

The Rust core owns every record: handles, specs, materialisations, charges, tokens,
versions, and the objects the core cannot hold (values, sources, reservation labels),
kept beside its records and indexed by its handle ids. The engine adds what needs
Python: measuring values, moving them through the device runtime, CUDA events, the
trace, and building the records users read. The rules it follows are written in
docs/concepts/.
"""

from __future__ import annotations

import gc
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any, Final, NoReturn, TypeVar, cast

import torch

from fhelium import _core
from fhelium._core import ActionKind, EnsureOutcome, LeaseState, LifetimeKind, MoveOutcome
from fhelium.errors import (
    ResidencyHandleError,
    ResidencyMaterializationError,
    ResidencyReentrancyError,
    ResidencyUnavailableError,
)
from fhelium.residency import _lowering
from fhelium.residency._locations import (
    CUDA_BASE,
    HOST_CODES,
    PAGEABLE,
    PINNED,
    PLACEMENT,
    location_code_of,
    location_of,
)
from fhelium.residency._records import bulk_builder, trusted_builder
from fhelium.residency._runtime import (
    DeviceRuntime,
    TorchCudaRuntime,
    ValueFacts,
    current_runtime,
)
from fhelium.residency._runtime.torch_runtime import pinning_possible
from fhelium.residency._validation import byte_count, index_int
from fhelium.residency.lease import (
    ResidencyHold,
    ResidencyLease,
    ResidencyReservation,
    new_lease,
)
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, ResidencyLocation
from fhelium.residency.model import (
    Recoverability,
    ReplicaMode,
    ResidencyHandle,
    ResidencySource,
    ResidencyValueSpec,
)
from fhelium.residency.plan import (
    DiscardValue,
    DropResident,
    EnsureResident,
    MemoryReservation,
    MoveResident,
    ResidencyAction,
)
from fhelium.residency.snapshot import (
    MaterializationSnapshot,
    ResidencyLocationSnapshot,
    ResidencyReservationSnapshot,
    ResidencySnapshot,
    ResidencyTransitionReport,
    ResidencyValueSnapshot,
)
from fhelium.values.tensor_resident import TensorResident

__all__ = ["Engine", "normalize_handles"]

ValueT = TypeVar("ValueT", bound=TensorResident)

_REASON_ENSURE_NOOP: Final = "destination already resident"
_REASON_MOVE_NOOP: Final = "destination already owns the selected replica"
_REASON_DROP_NOOP: Final = "materialization already absent"

_new_ensure = trusted_builder(EnsureResident)
_MUST_PRESERVE: Final = Recoverability.MUST_PRESERVE
# Spec records of adopted values by shape; bounded by the program's value shapes.
_ADOPTED_SPECS: dict[tuple[type, int, int, ReplicaMode], ResidencyValueSpec[Any]] = {}
_new_spec = trusted_builder(ResidencyValueSpec)
_new_report = trusted_builder(ResidencyTransitionReport)
_REPORT_RECORDS = bulk_builder(ResidencyTransitionReport)
_HANDLE_RECORDS = bulk_builder(ResidencyHandle)
_VALUE_SNAPSHOTS = bulk_builder(ResidencyValueSnapshot)
_MATERIALIZATION_SNAPSHOTS = bulk_builder(MaterializationSnapshot)
_new_location_snapshot = trusted_builder(ResidencyLocationSnapshot)
_new_reservation_snapshot = trusted_builder(ResidencyReservationSnapshot)

_NO_SAMPLE: Final[tuple[None, None]] = (None, None)
_time_ns = time.time_ns


def _no_owner() -> None:
    return None


def normalize_handles(handles: object) -> tuple[ResidencyHandle[Any], ...]:
    """A non-empty tuple of distinct handles, first occurrences kept (see
    docs/concepts/lifetimes.md)."""
    if type(handles) is tuple and len(handles) == 1 and type(handles[0]) is ResidencyHandle:
        return handles  # the common single-handle call, already normal
    try:
        items = tuple(cast(Iterable[object], handles))
    except TypeError:
        raise TypeError(
            f"handles must be an iterable of ResidencyHandle, got {type(handles).__name__}"
        ) from None
    for item in items:
        if not isinstance(item, ResidencyHandle):
            raise TypeError(f"handles must be ResidencyHandle objects, got {type(item).__name__}")
    normalized = cast(tuple[ResidencyHandle[Any], ...], tuple(dict.fromkeys(items)))
    if not normalized:
        raise ValueError("at least one handle is required")
    return normalized


class Engine:
    """Everything one manager does, behind the public `ResidencyManager` facade.

    Methods without a leading underscore are what lifetimes, plans, scopes and the
    controller call; each either takes the gate itself or says that its caller holds it.
    """

    __slots__ = (
        "__weakref__",
        "core",
        "cuda_count",
        "manager_id",
        "owner",
        "pending_events",
        "runtime",
    )

    def __init__(
        self, budgets: Mapping[ResidencyLocation, int] | None, trace_capacity: int
    ) -> None:
        if budgets is not None and not isinstance(budgets, Mapping):
            raise TypeError(f"budgets must be a Mapping or None, got {type(budgets).__name__}")
        capacity = index_int(trace_capacity, "trace_capacity")
        self.runtime: DeviceRuntime = current_runtime()
        runtime = self.runtime
        self.cuda_count: int = runtime.device_count() if runtime.cuda_available() else 0
        entries: list[tuple[int, int]] = []
        for location, budget in (budgets or {}).items():
            code = self.location_code(location)
            name = f"budget for {location}"
            entries.append((code, byte_count(index_int(budget, name), name)))
        context = (
            EnsureResident,
            MoveResident,
            DropResident,
            DiscardValue,
            _REPORT_RECORDS,
            runtime,
            type(runtime) is TorchCudaRuntime,
            pinning_possible(),
            PAGEABLE_HOST,
            PINNED_HOST,
            location_of,
            (_REASON_ENSURE_NOOP, _REASON_MOVE_NOOP, _REASON_DROP_NOOP),
            _lowering.type_key,
            _new_spec,
            _MUST_PRESERVE,
            new_lease,
            ReplicaMode.EXCLUSIVE,
        )
        # The trace keeps the newest `capacity` reports; 0 disables it.
        self.core = _core.CoreManager(entries, _HANDLE_RECORDS, context, min(capacity, sys.maxsize))
        self.manager_id: str = self.core.manager_id
        # The public manager this engine serves, set by it; weak, so the engine never
        # keeps its owner alive.
        self.owner: Callable[[], object | None] = _no_owner
        # Pending CUDA lease token -> the events recorded at its release.
        self.pending_events: dict[int, list[Any]] = {}

    # ------------------------------------------------------------------ identity

    @property
    def deferred(self) -> bool:
        """Whether releases queued during a source callback still wait to be applied."""
        return self.core.deferred_pending()

    @property
    def state_version(self) -> int:
        """The monotonic state version. Reading it reaps completed CUDA leases."""
        core = self.core
        core.enter(True, True)
        try:
            self.reap()
            return core.version
        finally:
            core.exit()

    @property
    def locations(self) -> tuple[ResidencyLocation, ...]:
        """Registered locations: budgeted ones first, then in first-use order."""
        core = self.core
        core.enter(False, False)
        try:
            return tuple(location_of(code) for code in core.locations())
        finally:
            core.exit()

    # ------------------------------------------------------------------ validation

    def location_code(self, location: object) -> int:
        """TypeError for a non-location, ValueError for an unusable CUDA device (see
        docs/concepts/locations-and-budgets.md)."""
        if not isinstance(location, ResidencyLocation):
            raise TypeError(f"expected a ResidencyLocation, got {type(location).__name__}")
        kind = location.kind
        if kind == "pageable-host":
            return PAGEABLE
        if kind == "pinned-host":
            return PINNED
        index: int = location.device.index
        if self.cuda_count == 0:
            raise ValueError(f"{location} is not usable: CUDA is not available")
        if index >= self.cuda_count:
            raise ValueError(
                f"{location} is not usable: only {self.cuda_count} CUDA device(s) present"
            )
        return CUDA_BASE + index

    def check_stream(self, stream: object, location: ResidencyLocation) -> None:
        runtime = self.runtime
        if not runtime.is_stream(stream):
            raise TypeError(f"stream must be a CUDA stream, got {type(stream).__name__}")
        if location.kind != "cuda":
            raise ValueError(f"a stream was given for host location {location}")
        if runtime.stream_device(stream) != location.device:
            raise ValueError(
                f"stream is on {runtime.stream_device(stream)}, but the location is {location}"
            )

    def resolve(self, handle: ResidencyHandle[Any]) -> int:
        """The index of a live handle of this manager, else the precise handle error."""
        index = self.core.resolve(handle)
        if index is not None:
            return index
        return self.handle_error(handle)

    def handle_error(self, handle: ResidencyHandle[Any]) -> NoReturn:
        if handle.manager_id != self.manager_id:
            raise ResidencyHandleError(
                f"handle {handle.handle_id!r} belongs to manager {handle.manager_id!r}, "
                f"not {self.manager_id!r}"
            )
        if self.core.is_discarded(handle):
            raise ResidencyHandleError(f"Value {handle.handle_id!r} is discarded")
        raise ResidencyHandleError(
            f"unknown handle {handle.handle_id!r} (value type {handle.value_type.__name__}) "
            f"for manager {self.manager_id!r}"
        )

    def _check_placement(
        self, facts: ValueFacts, location: ResidencyLocation, value: TensorResident
    ) -> None:
        """The value's device and pinning must match the location."""
        name = type(value).__name__
        if facts.device != location.device:
            raise ResidencyMaterializationError(
                f"{name} is on {facts.device}, but the location is {location}"
            )
        if facts.device.type != "cpu":
            return
        if facts.pinned is None:
            raise ResidencyMaterializationError(f"{name} mixes pinned and pageable host tensors")
        if location.kind == "pinned-host" and not facts.pinned:
            raise ResidencyMaterializationError(
                f"{name} is not in pinned memory, but the location is {location}"
            )
        if location.kind == "pageable-host" and facts.pinned:
            raise ResidencyMaterializationError(
                f"{name} is in pinned memory, but the location is {location}"
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

        The general path: the facade first offers host values to the core's one-call
        `adopt_host`, which declines whatever needs this path."""
        if not isinstance(value, TensorResident):
            raise TypeError(f"value must be a TensorResident, got {type(value).__name__}")
        core = self.core
        core.enter_transition()
        try:
            if self.pending_events or self.deferred:
                self.reap()
            if at is None:
                facts = self.runtime.measure(value)
                device = facts.device
                if device.type == "cuda":
                    at = location_of(CUDA_BASE + (device.index or 0))
                elif facts.pinned is None:
                    raise ResidencyMaterializationError(
                        f"{type(value).__name__} mixes pinned and pageable host tensors"
                    )
                else:
                    at = PINNED_HOST if facts.pinned else PAGEABLE_HOST
                code = self.location_code(at)
            else:
                code = self.location_code(at)
                facts = self.runtime.measure(value)
            if (facts.device_code, facts.pinned) != PLACEMENT[code]:
                self._check_placement(facts, at, value)
            if not isinstance(replica_mode, ReplicaMode):
                raise TypeError(
                    f"replica_mode must be a ReplicaMode, got {type(replica_mode).__name__}"
                )
            value_type = type(value)
            logical = facts.logical_nbytes
            storage = facts.storage_nbytes
            charge = max(logical, storage)
            shape = (value_type, logical, charge, replica_mode)
            spec = _ADOPTED_SPECS.get(shape)
            if spec is None:
                # Specs are immutable, and values of one shape share one spec record.
                spec = _new_spec(value_type, logical, charge, replica_mode, _MUST_PRESERVE)
                _ADOPTED_SPECS[shape] = spec
            handle: ResidencyHandle[ValueT] = core.adopt(
                _lowering.type_key(value_type),
                logical,
                charge,
                replica_mode is ReplicaMode.EXCLUSIVE,
                code,
                storage,
                facts.storage_keys,
                value_type,
                spec,
                value,
            )
            return handle
        finally:
            core.exit_transition()

    def register_source(
        self,
        spec: ResidencyValueSpec[ValueT],
        source: ResidencySource[ValueT],
        *,
        source_location: ResidencyLocation = PAGEABLE_HOST,
    ) -> ResidencyHandle[ValueT]:
        """Register a reconstructible value; `source.load()` runs only when needed.

        The general path, behind the facade's one-call `register_host`."""
        if not isinstance(spec, ResidencyValueSpec):
            raise TypeError(f"spec must be a ResidencyValueSpec, got {type(spec).__name__}")
        core = self.core
        if not callable(getattr(source, "load", None)):
            raise TypeError("source must have a callable load() method")
        core.enter_transition()
        try:
            if self.pending_events or self.deferred:
                self.reap()
            code = self.location_code(source_location)
            if spec.recoverability is not Recoverability.RECONSTRUCTIBLE:
                raise ValueError(
                    "register_source requires Recoverability.RECONSTRUCTIBLE; "
                    "use adopt() for values that must be preserved"
                )
            value_type = spec.value_type
            handle: ResidencyHandle[ValueT] = core.register_source(
                _lowering.type_key(value_type),
                byte_count(spec.logical_nbytes, "spec.logical_nbytes"),
                byte_count(spec.storage_nbytes, "spec.storage_nbytes"),
                spec.replica_mode is ReplicaMode.EXCLUSIVE,
                code,
                value_type,
                spec,
                source,
            )
            return handle
        finally:
            core.exit_transition()

    # ------------------------------------------------------------------ transitions

    def transition(self, action: ResidencyAction, stream: Any) -> ResidencyTransitionReport:
        """One primitive: takes the gate and runs the action (see execute)."""
        core = self.core
        if stream is None and not self.pending_events:
            report: ResidencyTransitionReport | None = core.run_host(action)
            if report is not None:
                return report
        core.enter_transition()
        try:
            # execute reaps first thing, which covers the operation's own reap.
            return self.execute(action, stream)
        finally:
            core.exit_transition()

    def execute(self, action: ResidencyAction, stream: Any) -> ResidencyTransitionReport:
        """Runs one action inside a transition; the caller holds the gate (see
        docs/concepts/transitions.md).

        This is the hot path of every primitive and plan step, so host-only actions
        skip the allocator sampling calls entirely.
        """
        if self.pending_events:
            self.reap()
        started = _time_ns()
        core = self.core
        index = core.resolve(action.handle)
        if index is None:
            index = self.resolve(action.handle)
        spec = core.spec(index)
        kind = _lowering.ACTION_KINDS.get(type(action))
        if kind is None:
            kind = _lowering.action_kind(action)
        device: torch.device | None = None
        before: tuple[int | None, int | None] = _NO_SAMPLE
        if kind == ActionKind.ENSURE:
            location: ResidencyLocation = action.location  # type: ignore[union-attr]
            code = HOST_CODES.get(location.kind)
            if code is None:
                code = self.location_code(location)
            if stream is not None:
                self.check_stream(stream, location)
            if code >= CUDA_BASE:
                device = location.device
                before = self._sample(device)
            no_op, source, reason = self._ensure(index, code, stream)
            destination: ResidencyLocation | None = location
        elif kind == ActionKind.MOVE:
            move: MoveResident[Any] = action  # type: ignore[assignment]
            code = self.location_code(move.to)
            from_code = (
                None if move.from_location is None else self.location_code(move.from_location)
            )
            if stream is not None:
                self.check_stream(stream, move.to)
            device = self._sample_device(
                (code, from_code)
                if from_code is not None
                else (code, *core.materialization_locations(index))
            )
            if device is not None:
                before = self._sample(device)
            no_op, source, reason = self._move(index, code, from_code, stream)
            destination = move.to
        elif kind == ActionKind.DROP:
            location = action.location  # type: ignore[union-attr]
            code = HOST_CODES.get(location.kind)
            if code is None:
                code = self.location_code(location)
            if stream is not None:
                raise ValueError("DropResident does not take a transfer stream")
            if code >= CUDA_BASE:
                device = location.device
                before = self._sample(device)
            no_op = not core.drop_materialization(index, code)
            source, destination = location, None
            reason = _REASON_DROP_NOOP if no_op else None
        else:
            if stream is not None:
                raise ValueError("DiscardValue does not take a transfer stream")
            device = self._sample_device(core.materialization_locations(index))
            if device is not None:
                before = self._sample(device)
            core.discard(index)
            no_op, source, reason, destination = False, None, None, None
        after = _NO_SAMPLE if device is None else self._sample(device)
        report: ResidencyTransitionReport = _new_report(
            action,
            no_op,
            source,
            destination,
            spec.logical_nbytes,
            spec.storage_nbytes,
            started,
            _time_ns(),
            device,
            before[0],
            before[1],
            after[0],
            after[1],
            reason,
        )
        self.core.record(report)
        return report

    def _ensure(
        self, index: int, code: int, stream: Any
    ) -> tuple[bool, ResidencyLocation | None, str | None]:
        core = self.core
        kind, source, loaded = core.plan_ensure(index, code)
        if self.deferred:
            # Releases that arrived while load() ran apply as soon as it returned.
            self._drain_deferred()
        if kind == EnsureOutcome.NO_OP:
            return True, None, _REASON_ENSURE_NOOP
        if kind == EnsureOutcome.COPY:
            value = core.value(index, source)
            self._install(index, code, self._copy(value, source, code, stream), False)
        else:
            self._reconstruct_into(index, source, code, loaded, stream, exclusive_transition=False)
        return False, location_of(source), None

    def _move(
        self, index: int, code: int, from_code: int | None, stream: Any
    ) -> tuple[bool, ResidencyLocation | None, str | None]:
        core = self.core
        kind, source, loaded = core.plan_move(index, code, from_code)
        if self.deferred:
            self._drain_deferred()
        if kind == MoveOutcome.NO_OP:
            return True, (None if source < 0 else location_of(source)), _REASON_MOVE_NOOP
        if kind == MoveOutcome.COPY:
            copied = self._copy(core.value(index, source), source, code, stream)
            self._install(index, code, copied, True)
            core.remove(index, source)
        elif kind == MoveOutcome.RECONSTRUCT:
            self._reconstruct_into(index, source, code, loaded, stream, exclusive_transition=True)
        return False, location_of(source), None

    def _reconstruct_into(
        self,
        index: int,
        source_code: int,
        code: int,
        loaded: object,
        stream: Any,
        *,
        exclusive_transition: bool,
    ) -> None:
        """After the core took the temporary charge at `source_code` and ran `load()`:
        validate the loaded value there, then install it there or copy it to `code`.
        The charge is returned on every path (see docs/concepts/values.md)."""
        core = self.core
        charged = True
        try:
            # Installing where it was loaded, the core's install checks the bytes itself.
            value, facts = self._validate(
                index, source_code, loaded, check_bytes=source_code != code
            )
            if source_code == code:
                charged = False  # install_loaded returns it just before installing
                core.install_loaded(
                    index,
                    code,
                    facts.logical_nbytes,
                    facts.storage_nbytes,
                    facts.storage_keys,
                    exclusive_transition,
                    value,
                )
            else:
                core.admit(index, code)
                copied = self._copy(value, source_code, code, stream)
                self._install(index, code, copied, exclusive_transition)
        finally:
            if charged:
                core.release_temporary(index, source_code)

    def _validate(
        self, index: int, code: int, value: object, *, check_bytes: bool = True
    ) -> tuple[TensorResident, ValueFacts]:
        """Type, placement, logical bytes and storage ceiling of a candidate value.

        `check_bytes=False` leaves the byte checks to the core's install, which makes
        them in the same order right after."""
        core = self.core
        value_type = core.spec(index).value_type
        if not isinstance(value, value_type):
            raise ResidencyMaterializationError(
                f"expected a {value_type.__name__} for value "
                f"{core.handle(index).handle_id!r}, got {type(value).__name__}"
            )
        resident: TensorResident = value  # narrowed by the isinstance check above
        facts = self.runtime.measure(resident)
        if (facts[1], facts[2]) != PLACEMENT[code]:  # (device_code, pinned)
            self._check_placement(facts, location_of(code), resident)
        if check_bytes:
            core.check_materialization(index, facts.logical_nbytes, facts.storage_nbytes)
        return resident, facts

    def _install(
        self,
        index: int,
        code: int,
        value: TensorResident,
        exclusive_transition: bool,
        facts: ValueFacts | None = None,
    ) -> None:
        """Validates (unless `facts` are already validated for `code`) and installs."""
        if facts is None:
            value, facts = self._validate(index, code, value, check_bytes=False)
        self.core.install(
            index,
            code,
            facts.logical_nbytes,
            facts.storage_nbytes,
            facts.storage_keys,
            exclusive_transition,
            value,
        )

    def _copy(
        self, value: TensorResident, source_code: int, code: int, stream: Any
    ) -> TensorResident:
        """Host copies are synchronous; CUDA copies are enqueued on the transfer stream
        and synchronised through an event (see docs/concepts/transitions.md)."""
        runtime = self.runtime
        if code == PAGEABLE:
            return runtime.copy_to_pageable(value)
        if code == PINNED:
            return runtime.copy_to_pinned(value)
        device = location_of(code).device
        copy_stream = stream if stream is not None else runtime.current_stream(device)
        try:
            copied = runtime.copy_to_cuda(
                value, device, copy_stream, non_blocking=source_code != PAGEABLE
            )
            runtime.synchronize_event(runtime.record_event(copy_stream))
        except BaseException as error:
            # Interrupts too: the copy may still be reading the source on the stream.
            try:
                runtime.synchronize_stream(copy_stream)
            except Exception as cleanup:
                error.add_note(
                    f"cleanup after the failed transfer to {device} also failed: "
                    f"copy stream synchronize raised {cleanup!r}"
                )
            raise
        return copied

    # ------------------------------------------------------------------ telemetry

    def _sample_device(self, codes: Any) -> torch.device | None:
        for code in codes:
            if code >= CUDA_BASE:
                return location_of(code).device
        return None

    def _sample(self, device: torch.device | None) -> tuple[int | None, int | None]:
        if device is None:
            return None, None
        runtime = self.runtime
        try:
            return runtime.memory_allocated(device), runtime.memory_reserved(device)
        except Exception:
            return None, None

    # ------------------------------------------------------------------ lifetimes

    def reserve_locked(self, reservation: MemoryReservation) -> int:
        """Admits a plan reservation exactly like `reserve`; the caller holds the gate."""
        code = self.location_code(reservation.location)
        label = reservation.label
        return self.core.reserve(
            code,
            byte_count(reservation.nbytes, "nbytes"),
            _lowering.diagnostic_text(label),
            label,
        )

    def completed_pending_leases(self) -> list[int]:
        """Pending leases whose events all report complete (explain's protection
        rule); a query that raises keeps its lease protecting."""
        query = self.runtime.event_query
        completed = []
        for token, events in self.pending_events.items():
            try:
                if all(query(event) for event in events):
                    completed.append(token)
            except Exception:
                continue
        return completed

    def acquire(
        self,
        handles: Iterable[ResidencyHandle[Any]],
        *,
        at: ResidencyLocation,
        consumer_stream: Any = None,
    ) -> ResidencyLease:
        """Borrow already-ready materialisations at `at` atomically; never materialises.

        CUDA locations need the `consumer_stream` that will read the values.
        """
        normalized = normalize_handles(handles)
        core = self.core
        if consumer_stream is None and not self.pending_events:
            lease: ResidencyLease | None = core.acquire_host(self, normalized, at)
            if lease is not None:
                return lease
        core.enter(True, True)
        try:
            code = self.location_code(at)
            if code >= CUDA_BASE and consumer_stream is None:
                raise ValueError(
                    f"acquiring at {at} needs the consumer_stream that will read the values"
                )
            if self.deferred or self.pending_events:
                self.reap()
            if consumer_stream is not None:
                self.check_stream(consumer_stream, at)
            index = core.resolve(normalized[0]) if len(normalized) == 1 else None
            token = core.acquire(
                [index] if index is not None else self._resolve_in_order(normalized, code), code
            )
            return new_lease(
                self, token, normalized, at, [] if consumer_stream is None else [consumer_stream]
            )
        finally:
            core.exit()

    def hold(
        self, handles: Iterable[ResidencyHandle[Any]], *, at: ResidencyLocation
    ) -> ResidencyHold:
        """Protect already-ready materialisations at `at` from removal until released."""
        normalized = normalize_handles(handles)
        core = self.core
        core.enter(True, True)
        try:
            code = self.location_code(at)
            if self.deferred or self.pending_events:
                self.reap()
            token = core.hold(self._resolve_in_order(normalized, code), code)
            return ResidencyHold(manager=self, token=token, handles=normalized, location=at)
        finally:
            core.exit()

    def reserve(
        self, location: ResidencyLocation, nbytes: int, *, label: str
    ) -> ResidencyReservation:
        """Charge `nbytes` of accounting headroom at `location` until released."""
        nbytes = index_int(nbytes, "nbytes")
        if not isinstance(label, str):
            raise TypeError(f"label must be a str, got {type(label).__name__}")
        if not label or label.isspace():
            raise ValueError(f"label must be a non-empty string, got {label!r}")
        core = self.core
        core.enter(True, True)
        try:
            code = self.location_code(location)
            token = core.reserve(
                code, byte_count(nbytes, "nbytes"), _lowering.diagnostic_text(label), label
            )
            return ResidencyReservation(
                manager=self, token=token, location=location, nbytes=nbytes, label=label
            )
        finally:
            core.exit()

    def _resolve_in_order(self, handles: tuple[ResidencyHandle[Any], ...], code: int) -> list[int]:
        """Per handle in order, the lookup and then residency, so a non-resident handle
        before an unknown one reports unavailability (see docs/concepts/lifetimes.md)."""
        indices: list[int] = []
        resolve = self.core.resolve
        for handle in handles:
            index = resolve(handle)
            if index is None:
                if indices:
                    self.core.check_resident(indices, code)
                index = self.resolve(handle)
            indices.append(index)
        return indices

    def borrowed(
        self, token: int, handle: ResidencyHandle[Any], location: ResidencyLocation
    ) -> TensorResident:
        """A borrowed lookup: the managed object itself, while the lease still holds."""
        core = self.core
        core.enter(False, True)
        try:
            index = core.resolve(handle)
            if index is None or not core.lease_covers(token, index):
                raise ResidencyUnavailableError(
                    f"value {handle.handle_id!r} is no longer borrowed at {location} "
                    "(its lease ended with a forced close or the value was discarded)"
                )
            value: TensorResident = core.value(index, location_code_of(location))
            return value
        finally:
            core.exit()

    def _enter_for_release(self, apply: Callable[[], object], finalizing: bool) -> bool:
        """Enters the gate for a release. If a source callback runs on another thread
        (or a finalizer fires inside one), queues `apply` instead and returns False.

        The callback rule forbids observing half-built state, not cleaning up: a
        deferred release is applied as soon as the callback ends.
        """
        core = self.core
        while True:
            try:
                core.enter(False, True)
                return True
            except ResidencyReentrancyError:
                if core.callback_running_elsewhere() or (finalizing and core.callback_active):
                    break
                if core.callback_active:
                    raise  # the callback is this thread's own: ResidencyReentrancyError
                # Either this thread is mid-transition (check_reentrant raises the
                # re-entrancy error) or the callback ended since our attempt: retry.
                core.check_reentrant()
        self.core.defer(apply)
        if not core.callback_active:
            # The callback ended while we queued: apply it now ourselves.
            self._apply_deferred_soon()
        return False

    def _release_token(self, apply: Callable[[], object], finalizing: bool) -> None:
        if self._enter_for_release(apply, finalizing):
            try:
                if self.deferred:
                    self._drain_deferred()
                apply()
            finally:
                self.core.exit()

    def _apply_deferred_soon(self) -> None:
        core = self.core
        try:
            core.enter(False, False)
        except ResidencyReentrancyError:
            return  # another callback started; its transition drains the queue
        try:
            self._drain_deferred()
        finally:
            core.exit()

    def _drain_deferred(self) -> None:
        """Applies releases queued while a callback ran; the caller holds the gate."""
        self.core.drain_deferred()

    def release_host_lease(self, token: int, finalizing: bool = False) -> None:
        """A host lease: remove the use tokens, one version step (see
        docs/concepts/lifetimes.md#lease-release)."""
        core = self.core
        if self._release_now(LifetimeKind.LEASE, token) is not None:
            return
        try:
            core.enter(False, True)
        except ResidencyReentrancyError:
            self._release_token(partial(core.release_lease, token), finalizing)
            return
        try:
            if self.deferred:
                self._drain_deferred()
            core.release_lease(token)
        finally:
            core.exit()

    def release_lease(
        self,
        token: int,
        location: ResidencyLocation,
        streams: list[Any],
        *,
        wait: bool,
        finalizing: bool = False,
    ) -> None:
        """The manager side of `ResidencyLease.release` (see
        docs/concepts/lifetimes.md#lease-release)."""
        core = self.core
        if location.kind != "cuda":
            self.release_host_lease(token, finalizing)
            return
        if core.lease_state(token) != LeaseState.ACTIVE:
            return  # unknown (a forced close) or already released
        runtime = self.runtime
        if not streams:
            runtime.synchronize_device(location.device)
            self._release_token(partial(core.release_lease, token), finalizing)
            warnings.warn(
                f"a CUDA lease at {location} had no consumer streams; a full-device "
                "synchronisation was used to release it",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        # Every stream was validated against this location when it joined the lease
        # (acquire or add_consumer_stream), and a stream never changes device, so the
        # streams were validated when they joined the lease, without asking the runtime again.
        try:
            events = [runtime.record_event(stream) for stream in streams]
        except Exception:
            # Without events, the streams are waited for instead (lifetimes.md#lease-release).
            for stream in streams:
                runtime.synchronize_stream(stream)
            self._release_token(partial(core.release_lease, token), finalizing)
            warnings.warn(
                f"recording release events at {location} failed; the consumer streams were "
                "synchronised instead",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        if wait:
            for event in events:
                runtime.synchronize_event(event)
        try:
            core.enter(False, True)
        except ResidencyReentrancyError:
            self._release_token(partial(self._apply_pending, token, events, wait), finalizing)
            return
        try:
            if self.deferred:
                self._drain_deferred()
            self._apply_pending(token, events, wait)
        finally:
            core.exit()

    def _apply_pending(self, token: int, events: list[Any], completed: bool) -> None:
        """Moves a CUDA lease's use tokens to pending-event tokens, and releases them at
        once when its events are already known complete (`wait=True`)."""
        core = self.core
        if core.lease_to_pending(token):
            if completed:
                core.release_pending(token)
            else:
                self.pending_events[token] = events

    def _release_now(self, kind: LifetimeKind, token: int) -> bool | None:
        """One-call release when nothing is deferred and the gate is free; `None`
        sends the caller down the waiting path, which defers or raises as needed."""
        try:
            return self.core.release_now(kind, token)
        except ResidencyReentrancyError:
            return None

    def release_hold(self, token: int, *, finalizing: bool = False) -> None:
        released = self._release_now(LifetimeKind.HOLD, token)
        if released is None:
            self._release_token(partial(self._apply_hold_release, token, finalizing), finalizing)
        elif not released and not (finalizing or self.core.closed):
            raise RuntimeError(f"internal error: unknown hold token {token}")

    def _apply_hold_release(self, token: int, missing_ok: bool) -> None:
        if not self.core.release_hold(token) and not (missing_ok or self.core.closed):
            raise RuntimeError(f"internal error: unknown hold token {token}")

    def release_reservation(self, token: int, *, finalizing: bool = False) -> None:
        released = self._release_now(LifetimeKind.RESERVATION, token)
        if released is None:
            self._release_token(
                partial(self._apply_reservation_release, token, finalizing), finalizing
            )
            return
        if not released and not (finalizing or self.core.closed):
            raise RuntimeError(f"internal error: unknown reservation token {token}")

    def _apply_reservation_release(self, token: int, missing_ok: bool) -> None:
        if not self.core.release_reservation(token) and not (missing_ok or self.core.closed):
            raise RuntimeError(f"internal error: unknown reservation token {token}")

    def reap(self) -> None:
        """Releases pending CUDA leases whose events all completed (see
        docs/concepts/lifetimes.md)."""
        if self.deferred:
            self._drain_deferred()
        if not self.pending_events:
            return
        query = self.runtime.event_query
        for token, events in list(self.pending_events.items()):
            if query(events[0]) if len(events) == 1 else all(map(query, events)):
                self.core.release_pending(token)
                del self.pending_events[token]

    # ------------------------------------------------------------------ observations

    def snapshot(self) -> ResidencySnapshot[Any]:
        """One atomic, tensor-free observation. O(1) to capture; entries build lazily."""
        core = self.core
        view = None if self.deferred else core.try_published()
        if view is None:
            core.enter(True, True)
            try:
                self.reap()
                view = core.current()
                captured = time.time_ns()
            finally:
                core.exit()
        else:
            captured = time.time_ns()
        return _ManagerSnapshot._capture(self, view, captured)

    def trace(self) -> tuple[ResidencyTransitionReport, ...]:
        """The retained transition reports, oldest first."""
        core = self.core
        core.enter(False, False)
        try:
            return tuple(core.trace_reports())
        finally:
            core.exit()

    def clear_trace(self) -> None:
        """Empty the trace; residency state and the version are unchanged."""
        core = self.core
        core.enter(False, False)
        try:
            core.clear_trace()
        finally:
            core.exit()

    # ------------------------------------------------------------------ close

    def close(self, *, wait: bool = True, force: bool = False) -> None:
        """Close the manager; a closed manager returns silently (see
        docs/concepts/lifetimes.md)."""
        core = self.core
        core.enter(False, False)
        try:
            if core.closed:
                return
            core.check_reentrant()
            if self.deferred:
                self._drain_deferred()
            if wait:
                self._synchronize_pending()
            else:
                self.reap()
            if force:
                runtime = self.runtime
                for code in core.locations():
                    if code >= CUDA_BASE and self.cuda_count:
                        runtime.synchronize_device(location_of(code).device)
            core.close(force)
            self.pending_events.clear()
            core.clear_deferred()
        finally:
            core.exit()

    def _synchronize_pending(self) -> None:
        synchronize = self.runtime.synchronize_event
        for token, events in list(self.pending_events.items()):
            for event in events:
                synchronize(event)
            self.core.release_pending(token)
            del self.pending_events[token]


class _ManagerSnapshot(ResidencySnapshot[Any]):
    """A `ResidencySnapshot` over a published core state whose entries are built on
    first access, once. It compares, hashes and pickles like the plain record."""

    __slots__ = ("_built", "_records", "_view")
    __qualname__ = "ResidencySnapshot"

    _built: dict[str, tuple[Any, ...]]
    _records: _core.CoreManager | None
    _view: _core.StateView | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Called as the record's own constructor (`type(snapshot)(...)`,
        # `dataclasses.replace`): validate like ResidencySnapshot and keep the fields.
        plain = ResidencySnapshot(*args, **kwargs)
        self._set_scalars(plain.manager_id, plain.state_version, plain.captured_at_ns)
        init = object.__setattr__
        init(self, "_view", None)
        init(self, "_records", None)
        init(
            self,
            "_built",
            {
                "values": plain.values,
                "locations": plain.locations,
                "reservations": plain.reservations,
            },
        )

    @classmethod
    def _capture(
        cls, engine: Engine, view: _core.StateView, captured_at_ns: int
    ) -> _ManagerSnapshot:
        snapshot = object.__new__(cls)
        core = engine.core
        snapshot._set_scalars(engine.manager_id, view.version, captured_at_ns)
        # The frozen record's __setattr__ refuses every assignment, ours included.
        init = object.__setattr__
        init(snapshot, "_view", view)
        # Handle and spec objects are only ever appended, so the view's prefix of them
        # stays valid for as long as the snapshot lives.
        init(snapshot, "_records", core)
        # Locations are few and carry allocator readings that belong to capture time;
        # reservations are few and their labels are released with them.
        label_of = core.label
        init(
            snapshot,
            "_built",
            {
                "locations": _location_entries(view, engine.runtime),
                "reservations": tuple(
                    _new_reservation_snapshot(
                        location_of(code), nbytes, _label(label_of(token), label)
                    )
                    for token, code, nbytes, label in view.reservation_rows()
                ),
            },
        )
        return snapshot

    def _set_scalars(self, manager_id: str, state_version: int, captured_at_ns: int) -> None:
        slots = ResidencySnapshot.__dict__
        slots["manager_id"].__set__(self, manager_id)
        slots["state_version"].__set__(self, state_version)
        slots["captured_at_ns"].__set__(self, captured_at_ns)

    def _field(self, name: str) -> tuple[Any, ...]:
        built = self._built.get(name)
        if built is None:
            # Building allocates many small records; a collection pass in the middle
            # would scan the whole heap for nothing, so collect after instead.
            collecting = gc.isenabled()
            gc.disable()
            try:
                built = cast(tuple[Any, ...], getattr(self, f"_build_{name}")())
            finally:
                if collecting:
                    gc.enable()
            self._built[name] = built
        return built

    @property
    def values(self) -> tuple[ResidencyValueSnapshot[Any], ...]:
        return self._field("values")

    @property
    def locations(self) -> tuple[ResidencyLocationSnapshot, ...]:
        return self._field("locations")

    @property
    def reservations(self) -> tuple[ResidencyReservationSnapshot, ...]:
        return self._field("reservations")

    def _build_values(self) -> tuple[ResidencyValueSnapshot[Any], ...]:
        # Fields given at construction are never rebuilt.
        assert self._view is not None
        assert self._records is not None
        return self._view.value_entries(
            self._records, _VALUE_SNAPSHOTS, _MATERIALIZATION_SNAPSHOTS, location_of
        )

    def _plain(self) -> ResidencySnapshot[Any]:
        return ResidencySnapshot(
            self.manager_id,
            self.state_version,
            self.values,
            self.locations,
            self.reservations,
            self.captured_at_ns,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ResidencySnapshot):
            return NotImplemented
        return _fields(self) == _fields(other)

    def __hash__(self) -> int:
        return hash(_fields(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (ResidencySnapshot, _fields(self))


def _label(kept: object, text: str) -> str:
    """The label exactly as given, or the core's UTF-8 copy if it is gone."""
    return kept if isinstance(kept, str) else text


def _fields(snapshot: ResidencySnapshot[Any]) -> tuple[Any, ...]:
    return (
        snapshot.manager_id,
        snapshot.state_version,
        snapshot.values,
        snapshot.locations,
        snapshot.reservations,
        snapshot.captured_at_ns,
    )


def _location_entries(
    view: _core.StateView, runtime: DeviceRuntime
) -> tuple[ResidencyLocationSnapshot, ...]:
    entries = []
    for row in view.location_rows():
        code, budget, used, reserved = row[0], row[1], row[2], row[3]
        location = location_of(code)
        allocated = allocator_reserved = None
        if code >= CUDA_BASE:
            try:
                allocated = runtime.memory_allocated(location.device)
                allocator_reserved = runtime.memory_reserved(location.device)
            except Exception:
                allocated = allocator_reserved = None
        entries.append(
            _new_location_snapshot(
                location,
                budget,
                used,
                reserved,
                None if budget is None else budget - used - reserved,
                *row[4:],
                allocated,
                allocator_reserved,
            )
        )
    return tuple(entries)
