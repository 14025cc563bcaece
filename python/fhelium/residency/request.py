"""Declarative residency requests: which values must be resident where, plus headroom.

A request states the goal; the controller decides the concrete plan that reaches it.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fhelium.residency._validation import require_instance, require_non_empty_str, seal
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.model import ResidencyHandle
from fhelium.residency.plan import MemoryReservation

__all__ = ["ResidencyRequirement", "ResidencyRequest"]


@dataclass(frozen=True, slots=True)
class ResidencyRequirement:
    """The value behind ``handle`` must be resident at ``location``: one line of a request.

    A frozen record (see docs/concepts/controller.md).

    Attributes:
        handle: The value.
        location: Where it must be resident.

    Raises:
        TypeError: ``handle`` is not a handle or ``location`` not a location.
    """

    handle: ResidencyHandle[Any]
    location: ResidencyLocation

    def __post_init__(self) -> None:
        require_instance(self.handle, ResidencyHandle, "handle")
        require_instance(self.location, ResidencyLocation, "location")


@dataclass(frozen=True, slots=True, init=False)
class ResidencyRequest:
    """A named set of requirements and the reservations to hold while they are in use.

    What a step needs, for `ResidencyController.decide`, `use` and `run`: the controller
    decides the plan that reaches it. The same handle may be required at several locations;
    whether its replica mode allows that is the controller's check. Sequence arguments are
    stored as tuples. See docs/concepts/controller.md.

    Args:
        name: A non-empty name for decisions, reports and errors.
        requirements: At least one `ResidencyRequirement`, none repeated.
        reservations: Headroom held for the use, as `MemoryReservation` records.

    Attributes:
        name: The request's name.
        requirements: The requirements, in order.
        reservations: The reservations, in order.

    Raises:
        TypeError: ``name`` is not a string, or an element is not a `ResidencyRequirement`
            or `MemoryReservation`.
        ValueError: A blank ``name``, no requirements, or a repeated requirement.
    """

    name: str
    requirements: tuple[ResidencyRequirement, ...]
    reservations: tuple[MemoryReservation, ...]

    # A hand-written __init__ (init=False) so type checkers accept any iterable, which is
    # what construction normalises.
    def __init__(
        self,
        name: str,
        requirements: Iterable[ResidencyRequirement],
        reservations: Iterable[MemoryReservation] = (),
    ) -> None:
        require_non_empty_str(name, "name")
        required = tuple(requirements)
        reserved = tuple(reservations)
        if not required:
            raise ValueError(f"request {name!r} needs at least one requirement")
        for index, requirement in enumerate(required):
            require_instance(requirement, ResidencyRequirement, f"requirements[{index}]")
        seen: set[ResidencyRequirement] = set()
        for requirement in required:
            if requirement in seen:
                raise ValueError(
                    f"request {name!r} repeats the requirement of handle "
                    f"{requirement.handle.handle_id!r} at {requirement.location}"
                )
            seen.add(requirement)
        for index, reservation in enumerate(reserved):
            require_instance(reservation, MemoryReservation, f"reservations[{index}]")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "requirements", required)
        object.__setattr__(self, "reservations", reserved)


seal(ResidencyRequirement, ResidencyRequest)
