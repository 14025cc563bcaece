"""Immutable observations: snapshots, transition and plan reports, plan explanations.

The records check their own internal consistency so that a snapshot that constructs is
one that could describe a real manager state.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from fhelium.residency._validation import (
    require_bool,
    require_count,
    require_instance,
    require_non_empty_str,
    require_optional_count,
    require_optional_instance,
    require_optional_non_empty_str,
    seal,
    to_torch_device,
)
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.model import ResidencyHandle, ResidencyValueSpec
from fhelium.residency.plan import ACTION_TYPES, MemoryReservation, ResidencyAction
from fhelium.values.tensor_resident import TensorResident

__all__ = [
    "MaterializationSnapshot",
    "ResidencyValueSnapshot",
    "ResidencyLocationSnapshot",
    "ResidencyReservationSnapshot",
    "ResidencySnapshot",
    "ResidencyTransitionReport",
    "ResidencyActionExplanation",
    "ResidencyPlanExplanation",
    "ResidencyPlanReport",
]

# Covariant because the records are frozen (see fhelium.residency.model).
ValueT_co = TypeVar("ValueT_co", bound=TensorResident, covariant=True)


def _require_action(action: object) -> None:
    if not isinstance(action, ACTION_TYPES):
        raise TypeError(
            "action must be EnsureResident, MoveResident, DropResident or DiscardValue, "
            f"got {type(action).__name__}"
        )


def _require_elements(items: tuple[object, ...], cls: type[object], name: str) -> None:
    for index, item in enumerate(items):
        require_instance(item, cls, f"{name}[{index}]")


def _require_at_least(larger: int, smaller: int, what: str) -> None:
    if larger < smaller:
        raise ValueError(f"{what} ({larger} < {smaller})")


@dataclass(frozen=True, slots=True)
class MaterializationSnapshot:
    """One materialisation of a value in a snapshot: its bytes, charge and protection counts.

    A frozen record (see docs/concepts/snapshots.md#materialisation-snapshots).

    Attributes:
        location: Where this materialisation lives.
        logical_nbytes: The spec's logical bytes.
        storage_nbytes: The actual unique storage measured at install (can be below the
            charge when a source loaded a value below its spec's ceiling).
        charged_nbytes: The spec's ``storage_nbytes``: the fixed charge.
        use_count: Active leases covering it.
        hold_count: Active holds covering it.
        pending_event_count: Released CUDA leases whose events are not reaped yet; they
            protect it even when ``use_count`` is 0.

    Raises:
        TypeError: A field of the wrong kind (a non-location, a non-int count, ...).
        ValueError: A negative count or inconsistent fields (see
            docs/concepts/snapshots.md#record-checks).
    """

    location: ResidencyLocation
    logical_nbytes: int
    storage_nbytes: int
    charged_nbytes: int
    use_count: int
    hold_count: int
    pending_event_count: int

    def __post_init__(self) -> None:
        require_instance(self.location, ResidencyLocation, "location")
        require_count(self.logical_nbytes, "logical_nbytes")
        require_count(self.storage_nbytes, "storage_nbytes")
        require_count(self.charged_nbytes, "charged_nbytes")
        require_count(self.use_count, "use_count")
        require_count(self.hold_count, "hold_count")
        require_count(self.pending_event_count, "pending_event_count")
        _require_at_least(
            self.charged_nbytes,
            max(self.logical_nbytes, self.storage_nbytes),
            "charged_nbytes must cover logical_nbytes and storage_nbytes",
        )


@dataclass(frozen=True, slots=True)
class ResidencyValueSnapshot(Generic[ValueT_co]):
    """One managed value in a snapshot: its spec, materialisations and reconstruction source.

    A frozen record (see docs/concepts/snapshots.md#value-snapshots).

    Attributes:
        handle: The value's handle.
        spec: Its spec; adopted values carry MUST_PRESERVE.
        materializations: One `MaterializationSnapshot` per current location, in install
            order.
        has_source: Whether a reconstruction source is registered (false after discard).
        source_location: Where the source rebuilds the value, or ``None``.
        discarded: Whether the value was discarded (it then has no materialisation and no
            source).

    Raises:
        TypeError: A field of the wrong kind (a non-location, a non-int count, ...).
        ValueError: A negative count or inconsistent fields (see
            docs/concepts/snapshots.md#record-checks).
    """

    handle: ResidencyHandle[ValueT_co]
    spec: ResidencyValueSpec[ValueT_co]
    materializations: tuple[MaterializationSnapshot, ...]
    has_source: bool
    source_location: ResidencyLocation | None
    discarded: bool

    def __post_init__(self) -> None:
        require_instance(self.handle, ResidencyHandle, "handle")
        require_instance(self.spec, ResidencyValueSpec, "spec")
        materializations = tuple(self.materializations)
        object.__setattr__(self, "materializations", materializations)
        _require_elements(materializations, MaterializationSnapshot, "materializations")
        locations = {m.location for m in materializations}
        if len(locations) != len(materializations):
            raise ValueError("materializations must be at distinct locations")
        require_bool(self.has_source, "has_source")
        require_optional_instance(self.source_location, ResidencyLocation, "source_location")
        if self.has_source != (self.source_location is not None):
            raise ValueError("has_source must be true exactly when source_location is set")
        require_bool(self.discarded, "discarded")
        if self.discarded and (self.has_source or materializations):
            raise ValueError("a discarded value has no source and no materializations")


@dataclass(frozen=True, slots=True)
class ResidencyReservationSnapshot:
    """One active reservation in a snapshot, from `ResidencyManager.reserve` or a scope.

    A frozen record (see docs/concepts/snapshots.md#reservation-snapshots).

    Attributes:
        location: Where the bytes are reserved.
        nbytes: How many bytes.
        label: The reservation's label.

    Raises:
        TypeError: A field of the wrong kind (a non-location, a non-int count, ...).
        ValueError: A negative count or inconsistent fields (see
            docs/concepts/snapshots.md#record-checks).
    """

    location: ResidencyLocation
    nbytes: int
    label: str

    def __post_init__(self) -> None:
        require_instance(self.location, ResidencyLocation, "location")
        require_count(self.nbytes, "nbytes")
        require_non_empty_str(self.label, "label")


@dataclass(frozen=True, slots=True)
class ResidencyLocationSnapshot:
    """The books of one registered location in a snapshot: budget, charges, peaks and counts.

    A frozen record (see docs/concepts/snapshots.md#location-snapshots and
    docs/concepts/locations-and-budgets.md#peaks).

    Attributes:
        location: The location.
        budget_bytes: The strict budget, or ``None``.
        used_bytes: The charges of the current materialisations here.
        reserved_bytes: The active reservations (plus a temporary reconstruction charge
            during a transition).
        remaining_budget_bytes: ``budget - used - reserved``, or ``None`` when unbudgeted.
        peak_used_bytes: The historical maximum of ``used_bytes``.
        peak_charged_bytes: The historical maximum of ``used + reserved``.
        value_count: Materialisations here, across all values.
        reservation_count: Active reservation records here.
        use_count: Use tokens summed over the materialisations here.
        hold_count: Hold tokens summed over the materialisations here.
        pending_event_count: Pending lease tokens summed over the materialisations here.
        allocator_allocated_bytes: For a CUDA location with CUDA available, the device's
            ``torch.cuda.memory_allocated`` (process-wide); otherwise ``None``.
        allocator_reserved_bytes: Likewise ``torch.cuda.memory_reserved``, or ``None``.

    Raises:
        TypeError: A field of the wrong kind (a non-location, a non-int count, ...).
        ValueError: A negative count or inconsistent fields (see
            docs/concepts/snapshots.md#record-checks).
    """

    location: ResidencyLocation
    budget_bytes: int | None
    used_bytes: int
    reserved_bytes: int
    remaining_budget_bytes: int | None
    peak_used_bytes: int
    peak_charged_bytes: int
    value_count: int
    reservation_count: int
    use_count: int
    hold_count: int
    pending_event_count: int
    allocator_allocated_bytes: int | None
    allocator_reserved_bytes: int | None

    def __post_init__(self) -> None:
        require_instance(self.location, ResidencyLocation, "location")
        used = require_count(self.used_bytes, "used_bytes")
        reserved = require_count(self.reserved_bytes, "reserved_bytes")
        peak_used = require_count(self.peak_used_bytes, "peak_used_bytes")
        peak_charged = require_count(self.peak_charged_bytes, "peak_charged_bytes")
        require_count(self.value_count, "value_count")
        require_count(self.reservation_count, "reservation_count")
        require_count(self.use_count, "use_count")
        require_count(self.hold_count, "hold_count")
        require_count(self.pending_event_count, "pending_event_count")
        budget = require_optional_count(self.budget_bytes, "budget_bytes")
        remaining = require_optional_count(self.remaining_budget_bytes, "remaining_budget_bytes")
        _require_at_least(peak_used, used, "peak_used_bytes must be >= used_bytes")
        _require_at_least(
            peak_charged,
            max(peak_used, used + reserved),
            "peak_charged_bytes must cover peak_used_bytes and used_bytes + reserved_bytes",
        )
        if budget is None:
            if remaining is not None:
                raise ValueError("remaining_budget_bytes must be None without a budget")
        else:
            _require_at_least(budget, used + reserved, "used + reserved bytes exceed the budget")
            if remaining != budget - used - reserved:
                raise ValueError(
                    f"remaining_budget_bytes must be budget - used - reserved "
                    f"({budget - used - reserved}), got {remaining}"
                )
            _require_at_least(budget, peak_charged, "peak_charged_bytes exceeds the budget")
        require_optional_count(self.allocator_allocated_bytes, "allocator_allocated_bytes")
        require_optional_count(self.allocator_reserved_bytes, "allocator_reserved_bytes")


@dataclass(frozen=True, slots=True)
class ResidencySnapshot(Generic[ValueT_co]):
    """One atomic, tensor-free observation of a manager, from `ResidencyManager.snapshot`.

    ``values`` are in issue order (discarded handles included), ``locations`` in registration
    order and ``reservations`` in creation order. Entries are built on first access. See
    docs/concepts/snapshots.md#snapshot.

    Attributes:
        manager_id: The observed manager's id.
        state_version: The version at capture, after the snapshot's own reap.
        values: One `ResidencyValueSnapshot` per issued handle.
        locations: One `ResidencyLocationSnapshot` per registered location.
        reservations: One `ResidencyReservationSnapshot` per active reservation.
        captured_at_ns: ``time.time_ns()`` taken during capture.

    Raises:
        TypeError: A field of the wrong kind (a non-location, a non-int count, ...).
        ValueError: A negative count or inconsistent fields (see
            docs/concepts/snapshots.md#record-checks).
    """

    manager_id: str
    state_version: int
    values: tuple[ResidencyValueSnapshot[ValueT_co], ...]
    locations: tuple[ResidencyLocationSnapshot, ...]
    reservations: tuple[ResidencyReservationSnapshot, ...]
    captured_at_ns: int

    def __post_init__(self) -> None:
        require_non_empty_str(self.manager_id, "manager_id")
        require_count(self.state_version, "state_version")
        values = tuple(self.values)
        locations = tuple(self.locations)
        reservations = tuple(self.reservations)
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "locations", locations)
        object.__setattr__(self, "reservations", reservations)
        _require_elements(values, ResidencyValueSnapshot, "values")
        _require_elements(locations, ResidencyLocationSnapshot, "locations")
        _require_elements(reservations, ResidencyReservationSnapshot, "reservations")
        if len({value.handle for value in values}) != len(values):
            raise ValueError("values must have distinct handles")
        if len({entry.location for entry in locations}) != len(locations):
            raise ValueError("locations must be distinct")
        require_count(self.captured_at_ns, "captured_at_ns")


@dataclass(frozen=True, slots=True)
class ResidencyTransitionReport:
    """What one executed action did (no-ops included), with optional allocator readings.

    Returned by the primitives, collected in plan reports and the trace. Allocator readings
    are best-effort observations of the first CUDA location involved and never feed
    admission (see docs/concepts/transitions.md#reports and
    docs/concepts/transitions.md#telemetry).

    Attributes:
        action: The action: the one passed to a plan, or the one a primitive built.
        no_op: True for the three no-op cases.
        source: The location copied from (or rebuilt at), the dropped location, or ``None``.
        destination: The ensure location or move target; ``None`` for drop and discard.
        logical_nbytes: The spec's logical bytes.
        storage_nbytes: The spec's charge (not the measured storage).
        started_at_ns: Wall-clock nanoseconds before the action.
        completed_at_ns: Wall-clock nanoseconds after it.
        allocator_device: The sampled CUDA device, or ``None``.
        allocator_allocated_bytes_before: ``memory_allocated`` before, or ``None``.
        allocator_reserved_bytes_before: ``memory_reserved`` before, or ``None``.
        allocator_allocated_bytes_after: ``memory_allocated`` after, or ``None``.
        allocator_reserved_bytes_after: ``memory_reserved`` after, or ``None``.
        reason: The no-op reason, otherwise ``None``.

    Raises:
        TypeError: A field of the wrong kind (a non-location, a non-int count, ...).
        ValueError: A negative count or inconsistent fields (see
            docs/concepts/snapshots.md#record-checks).
    """

    action: ResidencyAction
    no_op: bool
    source: ResidencyLocation | None
    destination: ResidencyLocation | None
    logical_nbytes: int
    storage_nbytes: int
    started_at_ns: int
    completed_at_ns: int
    allocator_device: torch.device | None = None
    allocator_allocated_bytes_before: int | None = None
    allocator_reserved_bytes_before: int | None = None
    allocator_allocated_bytes_after: int | None = None
    allocator_reserved_bytes_after: int | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        _require_action(self.action)
        require_bool(self.no_op, "no_op")
        logical = require_count(self.logical_nbytes, "logical_nbytes")
        storage = require_count(self.storage_nbytes, "storage_nbytes")
        started = require_count(self.started_at_ns, "started_at_ns")
        completed = require_count(self.completed_at_ns, "completed_at_ns")
        if self.allocator_device is not None:
            device = to_torch_device(self.allocator_device, "allocator_device")
            if device.type != "cuda" or device.index is None:
                raise ValueError(f"allocator_device must be an indexed CUDA device, got {device}")
            object.__setattr__(self, "allocator_device", device)
        _require_at_least(storage, logical, "storage_nbytes must be >= logical_nbytes")
        _require_at_least(completed, started, "completed_at_ns must be >= started_at_ns")
        require_optional_count(
            self.allocator_allocated_bytes_before, "allocator_allocated_bytes_before"
        )
        require_optional_count(
            self.allocator_reserved_bytes_before, "allocator_reserved_bytes_before"
        )
        require_optional_count(
            self.allocator_allocated_bytes_after, "allocator_allocated_bytes_after"
        )
        require_optional_count(
            self.allocator_reserved_bytes_after, "allocator_reserved_bytes_after"
        )
        require_optional_non_empty_str(self.reason, "reason")


@dataclass(frozen=True, slots=True)
class ResidencyActionExplanation:
    """One simulated action of an explanation or preflight.

    A frozen record (see docs/concepts/snapshots.md#action-explanations and
    docs/concepts/plans.md#simulation-results).

    Attributes:
        action: The action.
        executable: Whether the simulation could apply it (a no-op included).
        no_op: Whether it would change nothing.
        source: The simulated source, or ``None``.
        destination: The simulated destination, or ``None``.
        logical_nbytes: From the spec; 0 for a handle-lookup failure.
        storage_nbytes: From the spec; 0 for a handle-lookup failure.
        reason: The no-op reason, the failure reason, or ``None``.

    Raises:
        TypeError: A field of the wrong kind (a non-location, a non-int count, ...).
        ValueError: A negative count or inconsistent fields (see
            docs/concepts/snapshots.md#record-checks).
    """

    action: ResidencyAction
    executable: bool
    no_op: bool
    source: ResidencyLocation | None
    destination: ResidencyLocation | None
    logical_nbytes: int
    storage_nbytes: int
    reason: str | None = None

    def __post_init__(self) -> None:
        _require_action(self.action)
        require_bool(self.executable, "executable")
        require_bool(self.no_op, "no_op")
        logical = require_count(self.logical_nbytes, "logical_nbytes")
        storage = require_count(self.storage_nbytes, "storage_nbytes")
        _require_at_least(storage, logical, "storage_nbytes must be >= logical_nbytes")
        require_optional_non_empty_str(self.reason, "reason")


def _peak_pairs(
    predicted: Mapping[ResidencyLocation, int] | Iterable[tuple[ResidencyLocation, int]],
) -> tuple[tuple[ResidencyLocation, int], ...]:
    items: Iterable[Any] = predicted.items() if isinstance(predicted, Mapping) else predicted
    pairs: list[tuple[ResidencyLocation, int]] = []
    seen: set[ResidencyLocation] = set()
    for index, item in enumerate(items):
        pair = tuple(item)
        if len(pair) != 2:
            raise TypeError(
                f"predicted_peak_bytes[{index}] must be a (location, nbytes) pair, got {item!r}"
            )
        location, nbytes = pair
        require_instance(location, ResidencyLocation, f"predicted_peak_bytes[{index}] location")
        require_count(nbytes, f"predicted_peak_bytes[{index}] nbytes")
        if location in seen:
            raise ValueError(f"predicted_peak_bytes lists {location} more than once")
        seen.add(location)
        pairs.append((location, nbytes))
    return tuple(pairs)


@dataclass(frozen=True, slots=True)
class ResidencyPlanExplanation:
    """The result of `ResidencyManager.explain` or the controller's decision: a plan's dry run.

    A frozen record (see docs/concepts/snapshots.md#plan-explanations).
    ``predicted_peak_bytes`` accepts a mapping or ``(location, bytes)`` pairs and is stored
    as a tuple of pairs.

    Attributes:
        plan_name: The plan's name.
        actions: The action explanations, up to and including the first failure.
        reservations: The plan's reservations as given.
        predicted_peak_bytes: ``(location, bytes)`` pairs: the predicted maximum of
            ``used + reserved`` over the plan, from the current charge.
        feasible: False when any reservation or action failed.
        reason: The first failure, or ``None``.

    Raises:
        TypeError: A field of the wrong kind (a non-location, a non-int count, ...).
        ValueError: A negative count or inconsistent fields (see
            docs/concepts/snapshots.md#record-checks).
    """

    plan_name: str
    actions: tuple[ResidencyActionExplanation, ...]
    reservations: tuple[MemoryReservation, ...]
    predicted_peak_bytes: tuple[tuple[ResidencyLocation, int], ...]
    feasible: bool
    reason: str | None = None

    def __post_init__(self) -> None:
        require_non_empty_str(self.plan_name, "plan_name")
        actions = tuple(self.actions)
        reservations = tuple(self.reservations)
        object.__setattr__(self, "actions", actions)
        object.__setattr__(self, "reservations", reservations)
        _require_elements(actions, ResidencyActionExplanation, "actions")
        _require_elements(reservations, MemoryReservation, "reservations")
        object.__setattr__(self, "predicted_peak_bytes", _peak_pairs(self.predicted_peak_bytes))
        require_bool(self.feasible, "feasible")
        require_optional_non_empty_str(self.reason, "reason")


@dataclass(frozen=True, slots=True)
class ResidencyPlanReport:
    """The committed transitions of a plan run, in execution order, and its timing.

    Returned by `ResidencyManager.execute_actions`, held by `ResidencyScope.report`, and a
    failed plan's ``partial_report`` (see docs/concepts/snapshots.md#plan-reports).

    Attributes:
        plan_name: The plan's name.
        transitions: The committed transition reports, in execution order.
        started_at_ns: The start of `execute_actions` or of scope entry.
        completed_at_ns: Completion, or the failure time for a partial report.

    Raises:
        TypeError: A field of the wrong kind (a non-location, a non-int count, ...).
        ValueError: A negative count or inconsistent fields (see
            docs/concepts/snapshots.md#record-checks).
    """

    plan_name: str
    transitions: tuple[ResidencyTransitionReport, ...]
    started_at_ns: int
    completed_at_ns: int

    def __post_init__(self) -> None:
        require_non_empty_str(self.plan_name, "plan_name")
        transitions = tuple(self.transitions)
        object.__setattr__(self, "transitions", transitions)
        _require_elements(transitions, ResidencyTransitionReport, "transitions")
        started = require_count(self.started_at_ns, "started_at_ns")
        completed = require_count(self.completed_at_ns, "completed_at_ns")
        _require_at_least(completed, started, "completed_at_ns must be >= started_at_ns")


seal(
    MaterializationSnapshot,
    ResidencyValueSnapshot,
    ResidencyReservationSnapshot,
    ResidencyLocationSnapshot,
    ResidencySnapshot,
    ResidencyTransitionReport,
    ResidencyActionExplanation,
    ResidencyPlanExplanation,
    ResidencyPlanReport,
)
