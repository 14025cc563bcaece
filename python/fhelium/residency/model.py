"""The managed-value model: handles, value specifications and reconstruction sources.

Everything here is tensor-free, so handles and specs stay valid dict keys and can be
compared, hashed and pickled whatever happens to the values they describe.
"""

from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, Protocol, TypeVar

from fhelium.residency._validation import require_count, require_non_empty_str, seal
from fhelium.values.tensor_resident import TensorResident

__all__ = [
    "ReplicaMode",
    "Recoverability",
    "ResidencyHandle",
    "ResidencyValueSpec",
    "ResidencySource",
]

# Covariant: the records are frozen, so a handle of a subclass is a handle of its base.
ValueT_co = TypeVar("ValueT_co", bound=TensorResident, covariant=True)


class ReplicaMode(StrEnum):
    """Whether a value may be materialised at several locations at once.

    A spec field; see docs/concepts/values.md#replica-modes.

    Attributes:
        REPLICABLE: The value may be materialised at several locations at the same time.
        EXCLUSIVE: At most one steady materialisation: `ensure` or `copy` of a value that
            already exists elsewhere raises `ResidencyOwnershipError`; use `move`.
    """

    REPLICABLE = "replicable"
    EXCLUSIVE = "exclusive"


class Recoverability(StrEnum):
    """Whether the last copy of a value may be dropped.

    A spec field; see docs/concepts/values.md#recoverability. The rule the manager
    applies is that the last materialisation of a value with no registered source cannot
    be dropped.

    Attributes:
        RECONSTRUCTIBLE: A registered source can rebuild the value, so its last copy may
            be dropped. `ResidencyManager.register_source` requires it.
        MUST_PRESERVE: The last copy may not be dropped. Adopted values are always
            MUST_PRESERVE.
    """

    RECONSTRUCTIBLE = "reconstructible"
    MUST_PRESERVE = "must-preserve"


def _require_resident_type(value_type: object) -> None:
    if not (isinstance(value_type, type) and issubclass(value_type, TensorResident)):
        raise TypeError(f"value_type must be a TensorResident subclass, got {value_type!r}")


class _HashSlot:
    """A non-field slot for a record's cached hash."""

    __slots__ = ("_hash",)

    _hash: int


@dataclass(frozen=True, slots=True)
class ResidencyHandle(_HashSlot, Generic[ValueT_co]):
    """An opaque, tensor-free name for one value managed by one manager: a frozen record.

    Managers issue handles from `ResidencyManager.adopt` and
    `ResidencyManager.register_source`, with ``handle_id`` a version 4 UUID. A handle
    built by hand is only accepted by the manager that issued an equal one (same three
    fields); any other raises `ResidencyHandleError` there. Equality and hashing cover
    all three fields, and a handle stays a valid dict key through every transition. A
    discarded value keeps its handle, but every later use of it raises
    `ResidencyHandleError`. See docs/concepts/values.md#handles.

    Args:
        manager_id: The issuing manager's id (`ResidencyManager.manager_id`).
        handle_id: The value's id within that manager.
        value_type: The `TensorResident` subclass of the value.

    Attributes:
        manager_id: The issuing manager's id.
        handle_id: The value's id, unique in the process for issued handles.
        value_type: The value's class.

    Raises:
        TypeError: ``manager_id`` or ``handle_id`` is not a string, or ``value_type`` is
            not a `TensorResident` subclass.
        ValueError: ``manager_id`` or ``handle_id`` is blank.
    """

    manager_id: str
    handle_id: str
    value_type: type[ValueT_co]

    def __post_init__(self) -> None:
        require_non_empty_str(self.manager_id, "manager_id")
        require_non_empty_str(self.handle_id, "handle_id")
        _require_resident_type(self.value_type)

    def __hash__(self) -> int:
        # Handles key every manager lookup; the field hash is computed once. A copy
        # or an unpickled handle has no cached value yet and computes it again.
        try:
            return self._hash
        except AttributeError:
            value = hash((self.manager_id, self.handle_id, self.value_type))
            object.__setattr__(self, "_hash", value)
            return value


@dataclass(frozen=True, slots=True)
class ResidencyValueSpec(Generic[ValueT_co]):
    """What a value is and what each of its materialisations is charged: a frozen record.

    ``storage_nbytes`` is the fixed charge for every materialisation and the ceiling on its
    actual backing storage (see docs/concepts/locations-and-budgets.md#charges). The
    checks run in field order (see docs/concepts/values.md#value-specs).

    Args:
        value_type: The `TensorResident` subclass of the value.
        logical_nbytes: The logical payload, ``value.nbytes`` (a strict int >= 0).
        storage_nbytes: The charge of each materialisation and the ceiling on its actual
            storage (a strict int >= ``logical_nbytes``).
        replica_mode: Whether the value may live at several locations at once.
        recoverability: Whether its last copy may be dropped.

    Attributes:
        value_type: The value's class.
        logical_nbytes: The logical payload in bytes.
        storage_nbytes: The charge of each materialisation, in bytes.
        replica_mode: A `ReplicaMode`.
        recoverability: A `Recoverability`.

    Raises:
        TypeError: ``value_type`` is not a `TensorResident` subclass; a byte count that is
            not a strict int; ``replica_mode`` or ``recoverability`` of the wrong enum
            (plain strings are refused).
        ValueError: A negative byte count, or ``storage_nbytes < logical_nbytes``. (A
            count above ``2**64 - 1`` is refused by the manager that is given the spec.)

    Example:
        ```python
        from fhelium.residency import Recoverability, ReplicaMode, ResidencyValueSpec
        from fhelium.values import ResidentTensor

        spec = ResidencyValueSpec(
            ResidentTensor, 4096, 4096, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
        )
        ```
    """

    value_type: type[ValueT_co]
    logical_nbytes: int
    storage_nbytes: int
    replica_mode: ReplicaMode
    recoverability: Recoverability

    def __post_init__(self) -> None:
        _require_resident_type(self.value_type)
        require_count(self.logical_nbytes, "logical_nbytes")
        require_count(self.storage_nbytes, "storage_nbytes")
        if self.storage_nbytes < self.logical_nbytes:
            raise ValueError(
                f"storage_nbytes ({self.storage_nbytes}) must be >= logical_nbytes "
                f"({self.logical_nbytes})"
            )
        # Plain strings are rejected on purpose: a typo must not become a valid mode.
        if not isinstance(self.replica_mode, ReplicaMode):
            raise TypeError(f"replica_mode must be a ReplicaMode, got {self.replica_mode!r}")
        if not isinstance(self.recoverability, Recoverability):
            raise TypeError(f"recoverability must be a Recoverability, got {self.recoverability!r}")


class ResidencySource(Protocol[ValueT_co]):
    """Rebuilds a value on demand: the recipe behind `ResidencyManager.register_source`.

    The manager only requires ``getattr(source, "load", None)`` to be callable; the
    protocol is not runtime-checkable. While ``load`` runs, every other public operation
    on that manager raises `ResidencyReentrancyError`. `fhelium.residency.sources`
    ships `SafetensorsSource`. See docs/concepts/values.md#sources and
    docs/concepts/values.md#reconstruction.

    A source whose ``load`` never calls a manager may say so with a true
    ``loads_alone`` attribute and a ``layout()`` method (the value ``load`` returns,
    every tensor on the meta device): a pipeline may then run ``load`` on the disk
    tier's I/O thread, outside the gate
    (docs/concepts/values.md#reconstructions-a-pipeline-defers).
    """

    def load(self) -> ValueT_co:
        """Return a ready, independent value; ownership of its storage passes to the manager.

        The result is validated against the spec at the source location (type, device,
        pinning, logical bytes, storage ceiling). A CUDA value must be complete on its
        device's current stream (see docs/concepts/values.md#cuda-values).

        Returns:
            A new value matching the registered spec.

        Raises:
            Exception: Whatever the source raises propagates unchanged from a direct
                primitive and is wrapped in `ResidencyPlanExecutionError` by a plan.
        """
        ...


seal(ResidencyHandle, ResidencyValueSpec)
