"""Lowering of plan records into the Rust core's plan IR, once per plan.

Handles are interned into a per-plan table and value types get process-wide integer
keys, so the core can tell apart handles that differ only in their value type.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from fhelium import _core
from fhelium._core import ActionKind

if TYPE_CHECKING:
    from fhelium.residency.location import ResidencyLocation
    from fhelium.residency.model import ResidencyHandle
    from fhelium.residency.plan import MemoryReservation, ResidencyAction, ResidencyPlan

__all__ = [
    "U64_MAX",
    "LoweredPlan",
    "diagnostic_text",
    "location_code",
    "lower_actions",
    "lower_plan",
    "saturate",
    "type_key",
]

_NO_LOCATION = -1

_type_keys: dict[type, int] = {}
_type_keys_lock = threading.Lock()


# The core keeps byte counts as u64; larger Python ints saturate (no machine has 16 EiB).
U64_MAX = (1 << 64) - 1


def saturate(nbytes: int) -> int:
    return nbytes if nbytes <= U64_MAX else U64_MAX


def diagnostic_text(text: str) -> str:
    """`text` as the core's UTF-8 diagnostics; lone surrogates become U+FFFD.

    The core identifies handles by their slot in the plan, never by these strings.
    """
    if text.isascii():
        return text
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def type_key(value_type: type) -> int:
    """A stable process-wide integer for `value_type` (the class object stays alive)."""
    key = _type_keys.get(value_type)
    if key is None:
        with _type_keys_lock:
            key = _type_keys.setdefault(value_type, len(_type_keys) + 1)
    return key


def location_code(location: ResidencyLocation) -> int:
    """The core's location code: 0 pageable host, 1 pinned host, 2 + CUDA index."""
    kind = location.kind
    if kind == "pageable-host":
        return 0
    if kind == "pinned-host":
        return 1
    index = location.device.index
    assert index is not None  # ResidencyLocation guarantees an indexed CUDA device.
    return 2 + index


def _encode_actions(
    actions: Iterable[ResidencyAction],
    slots: dict[ResidencyHandle[Any], int],
) -> list[tuple[ActionKind, int, int, int]]:
    from fhelium.residency.plan import DiscardValue, DropResident, EnsureResident, MoveResident

    encoded: list[tuple[ActionKind, int, int, int]] = []
    for action in actions:
        slot = slots.setdefault(action.handle, len(slots))
        if isinstance(action, EnsureResident):
            encoded.append((ActionKind.ENSURE, slot, location_code(action.location), _NO_LOCATION))
        elif isinstance(action, MoveResident):
            source = action.from_location
            encoded.append(
                (
                    ActionKind.MOVE,
                    slot,
                    location_code(action.to),
                    _NO_LOCATION if source is None else location_code(source),
                )
            )
        elif isinstance(action, DropResident):
            encoded.append((ActionKind.DROP, slot, location_code(action.location), _NO_LOCATION))
        elif isinstance(action, DiscardValue):
            encoded.append((ActionKind.DISCARD, slot, _NO_LOCATION, _NO_LOCATION))
        else:  # pragma: no cover - ResidencyPlan validates element types first.
            raise TypeError(f"not a residency action: {action!r}")
    return encoded


class LoweredPlan(NamedTuple):
    """A plan's core IR and its handle table (slot order: first appearance)."""

    ir: _core.PlanIR
    handles: tuple[ResidencyHandle[Any], ...]


def lower_actions(name: str, actions: Iterable[ResidencyAction]) -> LoweredPlan:
    """Lowers `execute_actions`' single phase (kept in the IR's enter phase)."""
    return _lower(name, (), actions, (), ())


def lower_plan(plan: ResidencyPlan) -> LoweredPlan:
    """Lowers a validated plan in one call into the core."""
    return _lower(plan.name, plan.reclaim, plan.enter, plan.exit, plan.reservations)


def _lower(
    name: str,
    reclaim_actions: Iterable[ResidencyAction],
    enter_actions: Iterable[ResidencyAction],
    exit_actions: Iterable[ResidencyAction],
    plan_reservations: Iterable[MemoryReservation],
) -> LoweredPlan:
    slots: dict[ResidencyHandle[Any], int] = {}
    reclaim = _encode_actions(reclaim_actions, slots)
    enter = _encode_actions(enter_actions, slots)
    exit_ = _encode_actions(exit_actions, slots)
    handles = [
        (
            diagnostic_text(handle.manager_id),
            diagnostic_text(handle.handle_id),
            type_key(handle.value_type),
        )
        for handle in slots
    ]
    reservations = [
        (
            location_code(reservation.location),
            saturate(reservation.nbytes),
            diagnostic_text(reservation.label),
        )
        for reservation in plan_reservations
    ]
    ir = _core.lower_plan(diagnostic_text(name), handles, reclaim, enter, exit_, reservations)
    return LoweredPlan(ir, tuple(slots))
