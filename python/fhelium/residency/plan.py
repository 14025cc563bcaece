"""The ordered plan IR: the four transition actions, reservations and plans.

A plan is manager-bound command IR, checked for shape only; it is lowered into the Rust
core once, at construction, and the manager decides at execution time what is feasible.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

from fhelium._core import ActionKind
from fhelium.residency import _lowering
from fhelium.residency._validation import (
    require_count,
    require_instance,
    require_non_empty_str,
    require_optional_instance,
    seal,
)
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.model import ResidencyHandle
from fhelium.values.tensor_resident import TensorResident

__all__ = [
    "EnsureResident",
    "MoveResident",
    "DropResident",
    "DiscardValue",
    "ResidencyAction",
    "MemoryReservation",
    "ResidencyPlan",
]

# Covariant because the records are frozen (see fhelium.residency.model).
ValueT_co = TypeVar("ValueT_co", bound=TensorResident, covariant=True)


@dataclass(frozen=True, slots=True)
class EnsureResident(Generic[ValueT_co]):
    """Make the value resident at ``location``, keeping any other replicas."""

    handle: ResidencyHandle[ValueT_co]
    location: ResidencyLocation

    def __post_init__(self) -> None:
        require_instance(self.handle, ResidencyHandle, "handle")
        require_instance(self.location, ResidencyLocation, "location")


@dataclass(frozen=True, slots=True)
class MoveResident(Generic[ValueT_co]):
    """Install the value at ``to``, then remove the source it was copied from.

    The source is ``from_location`` when given, otherwise chosen deterministically.
    """

    handle: ResidencyHandle[ValueT_co]
    to: ResidencyLocation
    from_location: ResidencyLocation | None = None

    def __post_init__(self) -> None:
        require_instance(self.handle, ResidencyHandle, "handle")
        require_instance(self.to, ResidencyLocation, "to")
        require_optional_instance(self.from_location, ResidencyLocation, "from_location")


@dataclass(frozen=True, slots=True)
class DropResident(Generic[ValueT_co]):
    """Remove the materialisation at ``location``, keeping the managed value."""

    handle: ResidencyHandle[ValueT_co]
    location: ResidencyLocation

    def __post_init__(self) -> None:
        require_instance(self.handle, ResidencyHandle, "handle")
        require_instance(self.location, ResidencyLocation, "location")


@dataclass(frozen=True, slots=True)
class DiscardValue(Generic[ValueT_co]):
    """End the managed value: remove every materialisation and its source."""

    handle: ResidencyHandle[ValueT_co]

    def __post_init__(self) -> None:
        require_instance(self.handle, ResidencyHandle, "handle")


# Typing only: subscripted generics make this a typing.Union that isinstance rejects.
# Runtime checks use _ACTION_TYPES.
ResidencyAction: TypeAlias = (
    EnsureResident[Any] | MoveResident[Any] | DropResident[Any] | DiscardValue[Any]
)
_ACTION_TYPES = (EnsureResident, MoveResident, DropResident, DiscardValue)


def _require_actions(actions: tuple[object, ...], name: str) -> None:
    for index, action in enumerate(actions):
        if not isinstance(action, _ACTION_TYPES):
            raise TypeError(
                f"{name}[{index}] must be EnsureResident, MoveResident, DropResident or "
                f"DiscardValue, got {type(action).__name__}"
            )


@dataclass(frozen=True, slots=True)
class MemoryReservation:
    """Accounting headroom of ``nbytes`` at ``location``; it allocates nothing."""

    location: ResidencyLocation
    nbytes: int
    label: str

    def __post_init__(self) -> None:
        require_instance(self.location, ResidencyLocation, "location")
        require_count(self.nbytes, "nbytes")
        require_non_empty_str(self.label, "label")


class _LoweredPlanSlot:
    # Holds the core's lowered IR outside the dataclass fields, so it takes no part in
    # equality, hashing, repr or pickling.
    __slots__ = ("_ir",)

    _ir: _lowering.LoweredPlan


@dataclass(frozen=True, slots=True, init=False)
class ResidencyPlan(_LoweredPlanSlot):
    """An ordered plan: ``reclaim``, then ``reservations``, ``enter`` and, on exit, ``exit``.

    The field order is ``name, enter, exit, reservations, reclaim``, even though reclaim
    runs first. Any iterables are accepted and stored as tuples.
    """

    name: str
    enter: tuple[ResidencyAction, ...]
    exit: tuple[ResidencyAction, ...]
    reservations: tuple[MemoryReservation, ...]
    reclaim: tuple[ResidencyAction, ...]

    # A hand-written __init__ (init=False) so type checkers accept any iterable, which is
    # what construction normalises.
    def __init__(
        self,
        name: str,
        enter: Iterable[ResidencyAction] = (),
        exit: Iterable[ResidencyAction] = (),
        reservations: Iterable[MemoryReservation] = (),
        reclaim: Iterable[ResidencyAction] = (),
    ) -> None:
        require_non_empty_str(name, "name")
        reclaim_actions = tuple(reclaim)
        enter_actions = tuple(enter)
        exit_actions = tuple(exit)
        plan_reservations = tuple(reservations)
        _require_actions(reclaim_actions, "reclaim")
        _require_actions(enter_actions, "enter")
        _require_actions(exit_actions, "exit")
        for index, reservation in enumerate(plan_reservations):
            require_instance(reservation, MemoryReservation, f"reservations[{index}]")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "enter", enter_actions)
        object.__setattr__(self, "exit", exit_actions)
        object.__setattr__(self, "reservations", plan_reservations)
        object.__setattr__(self, "reclaim", reclaim_actions)
        object.__setattr__(self, "_ir", _lowering.lower_plan(self))

    def _lowered(self) -> _lowering.LoweredPlan:
        """The core IR of this plan, lowered again if unpickling dropped it."""
        try:
            return self._ir
        except AttributeError:
            lowered = _lowering.lower_plan(self)
            object.__setattr__(self, "_ir", lowered)
            return lowered


seal(EnsureResident, MoveResident, DropResident, DiscardValue, MemoryReservation, ResidencyPlan)

_lowering.ACTION_KINDS.update(
    {
        EnsureResident: ActionKind.ENSURE,
        MoveResident: ActionKind.MOVE,
        DropResident: ActionKind.DROP,
        DiscardValue: ActionKind.DISCARD,
    }
)
