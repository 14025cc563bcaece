"""Lowering of plan records into the Rust core's plan IR, once per plan.

Handles are interned into a per-plan table and value types get process-wide integer
keys, so the core can tell apart handles that differ only in their value type. The
core reads the records in one call (`_core.lower_records`); nothing here loops over
actions.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from fhelium import _core
from fhelium._core import LoweredRequest, TierTable
from fhelium.residency._locations import disk_code
from fhelium.residency.location import DiskLocation

if TYPE_CHECKING:
    from fhelium.residency.location import ResidencyLocation
    from fhelium.residency.model import ResidencyHandle

__all__ = [
    "ACTION_CLASSES",
    "U64_MAX",
    "LoweredPlan",
    # The core's forms of a controller's request and of a policy's tiers, which the
    # decider lowers once and keeps.
    "LoweredRequest",
    "TierTable",
    "diagnostic_text",
    "location_code",
    "lower_actions",
    "lower_plan",
    "saturate",
    "type_key",
]

_type_keys: dict[type, int] = {}
# In a one-slot list (no `global`) so a forked child can start with a free one.
_type_keys_lock = [threading.Lock()]


def _unlock_in_child() -> None:
    # A lock another thread held at a fork stays held in the child, which has no such
    # thread: the child starts with a free one (docs/concepts/lifetimes.md#fork).
    _type_keys_lock[0] = threading.Lock()


os.register_at_fork(after_in_child=_unlock_in_child)


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
        with _type_keys_lock[0]:
            key = _type_keys.setdefault(value_type, len(_type_keys) + 1)
    return key


def location_code(location: ResidencyLocation) -> int:
    """The core's location code: 0 pageable host, 1 pinned host, 2 + CUDA index, and
    130 + index for a disk directory (see `_locations`)."""
    kind = location.kind
    if kind == "pageable-host":
        return 0
    if kind == "pinned-host":
        return 1
    if isinstance(location, DiskLocation):
        return disk_code(location)
    index = location.device.index
    assert index is not None  # ResidencyLocation guarantees an indexed CUDA device.
    return 2 + index


class _Reservation(Protocol):
    @property
    def location(self) -> ResidencyLocation: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def label(self) -> str: ...


class _Plan(Protocol):
    """The fields of a `ResidencyPlan` that lowering reads (the plan module imports
    this one, so it is named by shape here)."""

    @property
    def name(self) -> str: ...
    @property
    def reclaim(self) -> tuple[Any, ...]: ...
    @property
    def enter(self) -> tuple[Any, ...]: ...
    @property
    def exit(self) -> tuple[Any, ...]: ...
    @property
    def reservations(self) -> tuple[_Reservation, ...]: ...


# The action record classes, in the core's kind order (ensure, move, drop, discard),
# registered by `plan` when it defines them: the plan module imports this one, never
# the other way round.
ACTION_CLASSES: list[type] = []


class LoweredPlan(NamedTuple):
    """A plan's core IR and its handle table (slot order: first appearance)."""

    ir: _core.PlanIR
    handles: tuple[ResidencyHandle[Any], ...]


def lower_actions(name: str, actions: Iterable[Any]) -> LoweredPlan:
    """Lowers `execute_actions`' single phase (kept in the IR's enter phase)."""
    return _lower(name, (), actions, (), ())


def lower_plan(plan: _Plan) -> LoweredPlan:
    """Lowers a validated plan in one call into the core."""
    return _lower(plan.name, plan.reclaim, plan.enter, plan.exit, plan.reservations)


def _lower(
    name: str,
    reclaim_actions: Iterable[Any],
    enter_actions: Iterable[Any],
    exit_actions: Iterable[Any],
    plan_reservations: Iterable[_Reservation],
) -> LoweredPlan:
    """One call into the core, which reads the records themselves: action kinds by
    `ACTION_CLASSES` (subclasses included), location records as codes, handles interned
    in first-appearance order by their own hash and equality, and every text as
    `diagnostic_text` gives it."""
    ir, handles = _core.lower_records(
        name,
        reclaim_actions,
        enter_actions,
        exit_actions,
        plan_reservations,
        ACTION_CLASSES,
        type_key,
    )
    return LoweredPlan(ir, handles)
