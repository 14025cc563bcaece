"""The ordered plan IR: the four transition actions, reservations and plans.

A plan is manager-bound command IR, checked for shape only; it is lowered into the Rust
core once, at construction, and the manager decides at execution time what is feasible.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

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
    """Plan action: make the value resident at ``location``, keeping any other replicas.

    The action form of `ResidencyManager.ensure`; a frozen record checked for shape only (the
    manager checks the handle and location when it runs the action). See
    docs/concepts/transitions.md#actions.

    Attributes:
        handle: The value.
        location: Where it must be resident.

    Raises:
        TypeError: A field of the wrong class (checked in field order).
    """

    handle: ResidencyHandle[ValueT_co]
    location: ResidencyLocation

    def __post_init__(self) -> None:
        require_instance(self.handle, ResidencyHandle, "handle")
        require_instance(self.location, ResidencyLocation, "location")


@dataclass(frozen=True, slots=True)
class MoveResident(Generic[ValueT_co]):
    """Plan action: install the value at ``to``, then remove the source it was copied from.

    The action form of `ResidencyManager.move`. The source is ``from_location`` when given,
    otherwise chosen in the canonical source order. See docs/concepts/transitions.md#move.

    Attributes:
        handle: The value.
        to: The destination.
        from_location: The materialisation to move from, or ``None`` to select one.

    Raises:
        TypeError: A field of the wrong class (checked in field order).
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
    """Plan action: remove the materialisation at ``location``, keeping the managed value.

    The action form of `ResidencyManager.drop`. See docs/concepts/transitions.md#drop.

    Attributes:
        handle: The value.
        location: The materialisation to remove.

    Raises:
        TypeError: A field of the wrong class (checked in field order).
    """

    handle: ResidencyHandle[ValueT_co]
    location: ResidencyLocation

    def __post_init__(self) -> None:
        require_instance(self.handle, ResidencyHandle, "handle")
        require_instance(self.location, ResidencyLocation, "location")


@dataclass(frozen=True, slots=True)
class DiscardValue(Generic[ValueT_co]):
    """Plan action: end the managed value, removing every materialisation and its source.

    The action form of `ResidencyManager.discard`. See docs/concepts/transitions.md#discard.

    Attributes:
        handle: The value.

    Raises:
        TypeError: A field of the wrong class (checked in field order).
    """

    handle: ResidencyHandle[ValueT_co]

    def __post_init__(self) -> None:
        require_instance(self.handle, ResidencyHandle, "handle")


# Typing only: subscripted generics make this a typing.Union that isinstance rejects.
# Runtime checks use ACTION_TYPES.
ResidencyAction: TypeAlias = (
    EnsureResident[Any] | MoveResident[Any] | DropResident[Any] | DiscardValue[Any]
)
"""Any of the four plan actions: `EnsureResident`, `MoveResident`, `DropResident`, `DiscardValue`.

A typing alias only: runtime checks use the tuple of the four classes (subclasses count).
See docs/concepts/transitions.md#actions.
"""
ACTION_TYPES = (EnsureResident, MoveResident, DropResident, DiscardValue)


def _require_actions(actions: tuple[object, ...], name: str) -> None:
    for index, action in enumerate(actions):
        if not isinstance(action, ACTION_TYPES):
            raise TypeError(
                f"{name}[{index}] must be EnsureResident, MoveResident, DropResident or "
                f"DiscardValue, got {type(action).__name__}"
            )


@dataclass(frozen=True, slots=True)
class MemoryReservation:
    """Accounting headroom of ``nbytes`` at ``location`` held by a plan; it allocates nothing.

    A frozen record. A scope admits its plan's reservations after the reclaim actions and
    releases them on exit; the controller holds a request's for the use. See
    docs/concepts/plans.md#plan-records.

    Attributes:
        location: Where the bytes are reserved.
        nbytes: How many bytes (a strict int >= 0; for a size such as ``"64MiB"``, pass
            ``sizes.parse_size("64MiB")``, docs/concepts/locations-and-budgets.md#byte-counts).
        label: A non-empty name, shown in snapshots and budget errors.

    Raises:
        TypeError: ``location`` is not a `ResidencyLocation`, ``nbytes`` not a strict int,
            or ``label`` not a string.
        ValueError: A negative ``nbytes`` or a blank ``label``.
    """

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
    """An ordered plan: ``reclaim``, then ``reservations`` and ``enter``, and on exit ``exit``.

    A manager-bound command list, checked for shape only and lowered into the core once, at
    construction; the manager decides at run time what is feasible (`ResidencyManager.explain`
    is the dry run, `ResidencyManager.scope` runs it). The field order is ``name, enter,
    exit, reservations, reclaim``, even though reclaim runs first. Any iterables are accepted
    and stored as tuples; nothing is checked across fields. See docs/concepts/plans.md.

    Args:
        name: A non-empty name for reports and errors.
        enter: Actions run on scope entry, after the reservations are admitted.
        exit: Actions run on scope exit, without a new preflight.
        reservations: Headroom held for the scope's body.
        reclaim: Actions run first on entry, to free capacity before the reservations.

    Attributes:
        name: The plan's name.
        enter: The enter actions.
        exit: The exit actions.
        reservations: The reservations.
        reclaim: The reclaim actions.

    Raises:
        TypeError: ``name`` is not a string, a sequence argument is not iterable, or an
            element is not an action (reclaim, enter, exit) or a `MemoryReservation`.
        ValueError: A blank ``name``.

    Example:
        ```python
        import torch
        from fhelium.residency import (
            PAGEABLE_HOST, DropResident, EnsureResident, MemoryReservation, ResidencyManager,
            ResidencyPlan,
        )
        from fhelium.values import ResidentTensor

        with ResidencyManager({PAGEABLE_HOST: 1 << 20}) as manager:
            handle = manager.adopt(ResidentTensor(torch.ones(256)))
            plan = ResidencyPlan(
                "stage",
                enter=[EnsureResident(handle, PAGEABLE_HOST)],
                reservations=[MemoryReservation(PAGEABLE_HOST, 1 << 16, "workspace")],
            )
            assert manager.explain(plan).feasible
            with manager.scope(plan) as scope:
                pass
            assert scope.report.transitions[0].no_op
        ```
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
        return lowered_plan(self)


def lowered_plan(plan: ResidencyPlan) -> _lowering.LoweredPlan:
    """The core IR of ``plan``, lowered again if unpickling dropped it."""
    try:
        return plan._ir
    except AttributeError:
        lowered = _lowering.lower_plan(plan)
        object.__setattr__(plan, "_ir", lowered)
        return lowered


def set_lowered(plan: ResidencyPlan, lowered: _lowering.LoweredPlan) -> None:
    """Gives a plan built from a decision the IR it was decided as: never lowered again."""
    object.__setattr__(plan, "_ir", lowered)


seal(EnsureResident, MoveResident, DropResident, DiscardValue, MemoryReservation, ResidencyPlan)

_lowering.ACTION_CLASSES.extend(ACTION_TYPES)
