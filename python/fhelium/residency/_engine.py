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
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any, Final, NoReturn, TypeVar, cast

from fhelium import _core
from fhelium._core import LifetimeKind, PolicyKeys
from fhelium.residency import _lowering
from fhelium.residency._disk.tier import DiskTier
from fhelium.residency._lifetime import ENGINES
from fhelium.residency._locations import (
    CUDA_BASE,
    disk_code,
    location_of,
)
from fhelium.residency._records import bulk_builder, trusted_builder
from fhelium.residency._runtime import (
    DeviceRuntime,
    TorchCudaRuntime,
    current_runtime,
)
from fhelium.residency._runtime.torch_runtime import pinning_possible
from fhelium.residency._validation import byte_size, index_int, require_non_empty_str
from fhelium.residency.lease import (
    ResidencyHold,
    ResidencyLease,
    ResidencyReservation,
    new_hold,
    new_lease,
    new_reservation,
)
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, ResidencyLocation
from fhelium.residency.model import (
    Recoverability,
    ReplicaMode,
    ResidencyHandle,
    ResidencyValueSpec,
)
from fhelium.residency.plan import (
    DiscardValue,
    DropResident,
    EnsureResident,
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


_MUST_PRESERVE: Final = Recoverability.MUST_PRESERVE
_new_spec = trusted_builder(ResidencyValueSpec)
_REPORT_RECORDS = bulk_builder(ResidencyTransitionReport)
_HANDLE_RECORDS = bulk_builder(ResidencyHandle)
_NEW_ENSURE = bulk_builder(EnsureResident)
_NEW_MOVE = bulk_builder(MoveResident)
_NEW_DROP = bulk_builder(DropResident)
_VALUE_SNAPSHOTS = bulk_builder(ResidencyValueSnapshot)
_MATERIALIZATION_SNAPSHOTS = bulk_builder(MaterializationSnapshot)
_new_location_snapshot = trusted_builder(ResidencyLocationSnapshot)
_new_reservation_snapshot = trusted_builder(ResidencyReservationSnapshot)

_NO_SAMPLE: Final[tuple[None, None]] = (None, None)
_time_ns = time.time_ns


def _no_owner() -> None:
    return None


def _budget_bytes(budget: object, location: ResidencyLocation) -> int:
    return byte_size(budget, f"budget for {location}")


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
        "acquire_lease",
        "adopt",
        "blocked_here",
        "blocks_host",
        "borrowed",
        "check_process",
        "core",
        "cuda_count",
        "decide_request",
        "discard_count",
        "disk",
        "drop",
        "ensure",
        "enter_scope",
        "enter_step",
        "execute_plan",
        "exit_scope",
        "handle_at",
        "manager_id",
        "move_to",
        "owner",
        "pending_among",
        "plan_run",
        "register_source",
        "release_host_lease_now",
        "release_lease",
        "resolve",
        "runtime",
        "snapshot_state",
        "stage_request",
        "track_lease",
        "transfers_into",
        "untrack_lease",
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
        # The manager's files at disk locations; named after the manager once it has an id.
        disk = self.disk = DiskTier()
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
            _lowering.type_key,
            _new_spec,
            _MUST_PRESERVE,
            new_lease,
            ReplicaMode.EXCLUSIVE,
            self.cuda_count,
            new_hold,
            new_reservation,
            normalize_handles,
            ResidencyHandle,
            (_NEW_ENSURE, _NEW_MOVE, _NEW_DROP),
            disk,
            disk_code,
        )
        # The trace keeps the newest `capacity` reports; 0 disables it.
        # Each budget's location is checked by the core, then its byte count here.
        self.core = _core.CoreManager(
            list((budgets or {}).items()),
            _budget_bytes,
            _HANDLE_RECORDS,
            context,
            min(capacity, sys.maxsize),
        )
        core = self.core
        self.manager_id: str = core.manager_id
        disk.owner_id = self.manager_id
        # The calls on the per-step hot path, bound once: the manager facade and the
        # controller call them at the cost of the core's own method.
        # `adopt(value, at, replica_mode)`: a new handle for a value the manager adopts.
        self.adopt: Callable[..., Any] = core.adopt
        # `register_source(spec, source, location)`: a new handle for a sourced value.
        self.register_source: Callable[..., Any] = core.register_source
        # `ensure(handle, at, stream)`, `move_to(handle, to, from, stream)`,
        # `drop(handle, at)`: one primitive each, run end to end by the core.
        self.ensure: Callable[..., ResidencyTransitionReport] = core.ensure
        self.move_to: Callable[..., ResidencyTransitionReport] = core.move_to
        self.drop: Callable[..., ResidencyTransitionReport] = core.drop
        # `check_process()`: refuses a forked child (docs/concepts/lifetimes.md#fork).
        self.check_process: Callable[[], None] = core.check_process
        # `resolve(handle)`: the handle's index in the core, or None when it is not live.
        self.resolve: Callable[[object], int | None] = core.resolve
        # `handle_at(index)`: the handle at a core index.
        self.handle_at: Callable[[int], ResidencyHandle[Any]] = core.handle
        # `discard_count()`: how many values were discarded (indices change only then).
        self.discard_count: Callable[[], int] = core.discard_count
        # `decide_request(lowered request, limit, cuda, native=, schedule= | python=)`:
        # the controller's decision in one call under one hold of the gate (reap, state
        # read, search, plan IR, explanation); None when a value was discarded since
        # the request was lowered (docs/concepts/controller.md#decide).
        self.decide_request: Callable[..., Any] = core.decide_request
        # `stage_request(lowered request, limit, cuda, previous, run, ir, handles,
        # actions, transfer streams, (groups, held), native, schedule, then, reclaim,
        # blocking)`: a pipeline staging's decide and, when it decides what `previous`
        # decided, that plan run again at once with its holds
        # (docs/concepts/controller.md#staging): (decision or None, whether the plan
        # ran), or None where, with `blocking`, its copies would block the host.
        self.stage_request: Callable[..., tuple[Any, bool] | None] = core.stage_request
        # `enter_step(engine, groups, consumers, holds, keys)`: a staged step's entry
        # under one hold of the gate, after reaping: (state view, a lease per (location,
        # handles) group, what its CUDA leases leave protected), the staging's hold
        # tokens released whatever happens, and the access epochs recorded in `keys`.
        self.enter_step: Callable[..., tuple[_core.StateView, _core.StepEntry, list[int]]] = (
            core.enter_step
        )
        # `plan_run()`: a new record of one plan run (phase, position, tokens, reports).
        self.plan_run: Callable[[], _core.PlanRun] = partial(_core.PlanRun, _REPORT_RECORDS)
        # `execute_plan(run, ir, handles, actions, streams, version, asynchronous=,
        # then=)`: a lowered action list as one plan; `enter_scope(run, ir, handles,
        # plan, streams, version, then=)`: scope entry (version check, streams,
        # preflight, reclaim, reserve, enter); `exit_scope(run, actions)`: scope exit.
        self.execute_plan: Callable[..., None] = core.execute_plan
        self.enter_scope: Callable[..., None] = core.enter_scope
        self.exit_scope: Callable[..., None] = core.exit_scope
        # `transfers_into(handles, location)`: the tokens of the copies still in flight
        # into them; `blocks_host(handles, location, disk_deferred=)`: whether making
        # them resident there would block the host; `pending_among(tokens)`: those
        # that still protect something (empty when none); `blocked_here()`: whether
        # this thread cannot enter the manager now (its own callback or transition runs).
        self.transfers_into: Callable[..., list[int]] = core.transfers_into
        self.blocks_host: Callable[..., bool] = core.blocks_host
        self.pending_among: Callable[[list[int]], list[int]] = core.pending_among
        self.blocked_here: Callable[[], bool] = core.blocked_here
        # Leases: `release_lease(token, location, streams, wait=, finalizing=)`, the
        # manager side of `ResidencyLease.release` (docs/concepts/lifetimes.md#lease-release),
        # whose warnings name the caller of the Python function calling it;
        # `release_host_lease_now(token)`: a host lease's release when the gate is free
        # and nothing is queued, else False (then `release_host_lease`);
        # `track_lease(token, lease, engine, location, streams)` / `untrack_lease(token)`:
        # the weak reference that finalizes an unreleased lease collected (with what its
        # finalizer needs, so the binding reads no private attribute of the lease).
        self.release_lease: Callable[..., None] = core.release_lease
        self.release_host_lease_now: Callable[[int], bool] = core.release_host_lease_now
        self.track_lease: Callable[..., None] = core.track_lease
        # `borrowed(token, handle, location)`: a borrowed lookup, the managed object
        # itself, while the lease still holds.
        self.borrowed: Callable[..., TensorResident] = core.borrowed
        # `acquire` and `snapshot_state` as the core takes them, without a frame of this
        # engine's: on every pipeline step's path. `acquire_lease(engine, handles, at,
        # consumer_stream)`, `snapshot_state()` -> (state view, captured ns).
        self.acquire_lease: Callable[..., ResidencyLease] = core.acquire
        self.snapshot_state: Callable[[], tuple[_core.StateView, int]] = core.snapshot_state
        self.untrack_lease: Callable[[int], None] = core.untrack_lease
        # The public manager this engine serves, set by it; weak, so the engine never
        # keeps its owner alive.
        self.owner: Callable[[], object | None] = _no_owner
        ENGINES.add(self)

    # ------------------------------------------------------------------ identity

    @property
    def state_version(self) -> int:
        """The monotonic state version. Reading it reaps completed CUDA leases."""
        return self.core.checked_version()

    @property
    def locations(self) -> tuple[ResidencyLocation, ...]:
        """Registered locations: budgeted ones first, then in first-use order."""
        return tuple(self.core.location_records())

    # ------------------------------------------------------------------ validation

    def location_code(self, location: object) -> int:
        """TypeError for a non-location, ValueError for an unusable CUDA device (see
        docs/concepts/locations-and-budgets.md)."""
        return self.core.location_code(location)

    def check_stream(self, stream: object, location: ResidencyLocation) -> object:
        """Checks `stream` for `location`; returns the stream to keep for it there."""
        return self.core.check_stream(stream, location)

    def handle_error(self, handle: ResidencyHandle[Any]) -> NoReturn:
        raise self.core.handle_error(handle)

    # ------------------------------------------------------------------ transitions

    def transition(self, action: ResidencyAction, stream: Any) -> ResidencyTransitionReport:
        """One primitive as one transition; the core takes the gate (see
        docs/concepts/transitions.md)."""
        report: ResidencyTransitionReport = self.core.run(action, stream)
        return report

    def check_open(self) -> None:
        """ResidencyClosedError once the manager is closed."""
        self.core.check_open()

    @property
    def closed(self) -> bool:
        """Whether the manager is closed."""
        return bool(self.core.closed)

    # ------------------------------------------------------------------ the controller

    def spec_at(self, index: int) -> ResidencyValueSpec[Any]:
        """The spec of the value at a core index."""
        spec: ResidencyValueSpec[Any] = self.core.spec(index)
        return spec

    def schedule_index(self, steps: list[list[ResidencyHandle[Any]]], *, cyclic: bool) -> Any:
        """A schedule's steps as handle indices, for the native schedule-aware order."""
        return self.core.schedule_index(steps, cyclic=cyclic)

    @staticmethod
    def policy_keys() -> PolicyKeys:
        """An empty table of native policy keys (epochs and metadata by handle index)."""
        return PolicyKeys()

    # ------------------------------------------------------------------ plans

    def explain_plan(self, *args: Any) -> _core.SimulationView:
        """Simulates a lowered plan at the current state; changes nothing."""
        return self.core.explain_plan(*args)

    # ------------------------------------------------------------------ transfers

    def wait_transfers(
        self, handles: tuple[ResidencyHandle[Any], ...], location: ResidencyLocation, stream: object
    ) -> None:
        """Orders ``stream`` after the copies still in flight into ``handles``."""
        self.core.wait_transfers(handles, location, stream)

    def settle(self, tokens: list[int], *, transfers: bool = False) -> None:
        """Waits on the host for ``tokens`` (and, with ``transfers``, every copy in
        flight) and releases what they protect."""
        self.core.settle(tokens, transfers=transfers)

    def settle_on_device(self, tokens: list[int]) -> list[int]:
        """Releases ``tokens`` behind device waits; returns those that need a host wait."""
        left: list[int] = self.core.settle_on_device(tokens, host=False)
        return left

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
        lease: ResidencyLease = self.core.acquire(self, handles, at, consumer_stream)
        return lease

    def hold(
        self, handles: Iterable[ResidencyHandle[Any]], *, at: ResidencyLocation
    ) -> ResidencyHold:
        """Protect already-ready materialisations at `at` from removal until released."""
        hold: ResidencyHold = self.core.hold(self, handles, at)
        return hold

    def reserve(
        self, location: ResidencyLocation, nbytes: int, *, label: str
    ) -> ResidencyReservation:
        """Charge `nbytes` of accounting headroom at `location` until released."""
        nbytes = byte_size(nbytes, "nbytes")
        require_non_empty_str(label, "label")
        reservation: ResidencyReservation = self.core.reserve(self, location, nbytes, label)
        return reservation

    def live_leases(self) -> list[ResidencyLease]:
        """The leases not yet released."""
        leases: list[ResidencyLease] = self.core.live_leases()
        return leases

    def release_host_lease(self, token: int, finalizing: bool = False) -> None:
        """A host lease's release, waiting for the gate or queueing as needed."""
        self.core.release(LifetimeKind.LEASE, token, finalizing)

    def release_hold(self, token: int, *, finalizing: bool = False) -> None:
        self.core.release(LifetimeKind.HOLD, token, finalizing)

    def release_reservation(self, token: int, *, finalizing: bool = False) -> None:
        self.core.release(LifetimeKind.RESERVATION, token, finalizing)

    # ------------------------------------------------------------------ observations

    def state_view(self) -> _core.StateView:
        """The current published state, as `snapshot` captures it (reaping first where
        something waits to be reaped), without building its records."""
        return self.core.snapshot_state()[0]

    def snapshot(self) -> ResidencySnapshot[Any]:
        """One atomic, tensor-free observation. O(1) to capture; entries build lazily."""
        view, captured = self.core.snapshot_state()
        return _ManagerSnapshot._capture(self, view, captured)

    def trace(self) -> tuple[ResidencyTransitionReport, ...]:
        """The retained transition reports, oldest first."""
        return tuple(self.core.trace_reports())

    def clear_trace(self) -> None:
        """Empty the trace; residency state and the version are unchanged."""
        self.core.clear_trace()

    # ------------------------------------------------------------------ close

    def close(self, *, wait: bool = True, force: bool = False) -> None:
        """Close the manager; a closed manager returns silently (see
        docs/concepts/lifetimes.md)."""
        self.core.close(wait=wait, force=force)


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
                sample = runtime.memory_sample(location.device)
            except Exception:
                sample = None
            if sample is not None:
                allocated, allocator_reserved = sample
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
