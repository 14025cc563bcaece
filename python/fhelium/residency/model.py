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
    """Whether a value may be materialised at several locations at once."""

    REPLICABLE = "replicable"
    EXCLUSIVE = "exclusive"


class Recoverability(StrEnum):
    """Whether the last copy of a value may be dropped."""

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
    """An opaque, tensor-free name for one value managed by one manager.

    Managers issue handles; a handle built by hand is only accepted by the manager that
    issued an equal one.
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
    """What a value is and what each of its materialisations is charged.

    ``storage_nbytes`` is the fixed charge for every materialisation and the ceiling on its
    actual backing storage.
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
    """Rebuilds a value on demand.

    ``load`` synchronously returns a ready, independent value; ownership of its storage
    passes to the manager. The manager only requires ``load`` to be callable.
    """

    def load(self) -> ValueT_co: ...


seal(ResidencyHandle, ResidencyValueSpec)
