"""Argument checks shared by the residency records.

Each helper raises ``TypeError`` for the wrong kind of value and ``ValueError`` for a wrong
value and names the argument, so a record's ``__post_init__`` reads as its check order.
"""

import operator
from dataclasses import FrozenInstanceError
from typing import TypeVar

import torch

T = TypeVar("T")


def wrong_type(name: str, expected: str, value: object) -> TypeError:
    """The TypeError for an argument ``name`` that is not ``expected`` ("a str")."""
    return TypeError(f"{name} must be {expected}, got {type(value).__name__}")


def negative(name: str, value: int) -> ValueError:
    """The ValueError for an argument ``name`` below zero."""
    return ValueError(f"{name} must be >= 0, got {value}")


def require_instance(value: object, cls: type[T], name: str) -> T:
    if not isinstance(value, cls):
        raise wrong_type(name, f"a {cls.__name__}", value)
    return value


def require_optional_instance(value: object, cls: type[T], name: str) -> T | None:
    if value is None:
        return None
    return require_instance(value, cls, name)


def require_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise wrong_type(name, "a bool", value)
    return value


def require_strict_int(value: object, name: str) -> int:
    # bool is an int subclass but never a meaningful count, priority or version.
    if not isinstance(value, int) or isinstance(value, bool):
        raise wrong_type(name, "an int", value)
    return value


def require_count(value: object, name: str) -> int:
    """A strict int that is at least 0."""
    count = require_strict_int(value, name)
    if count < 0:
        raise negative(name, count)
    return count


def require_optional_count(value: object, name: str) -> int | None:
    if value is None:
        return None
    return require_count(value, name)


def require_non_empty_str(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise wrong_type(name, "a str", value)
    # Same verdict as `not value.strip()`, without building the stripped copy.
    if not value or value.isspace():
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


def require_optional_non_empty_str(value: object, name: str) -> str | None:
    if value is None:
        return None
    return require_non_empty_str(value, name)


def to_torch_device(value: object, name: str) -> torch.device:
    """``torch.device(value)``, reporting an unparsable spelling as ``ValueError``."""
    if isinstance(value, torch.device):
        return value
    try:
        # Unsupported input types raise torch's own TypeError, which is the right kind.
        device: torch.device = torch.device(value)  # type: ignore[call-overload]
    except RuntimeError as exc:
        # torch reports unknown device strings as RuntimeError; here it is a bad value.
        raise ValueError(f"{name} is not a valid torch.device: {value!r}") from exc
    return device


def _refuse_setattr(self: object, name: str, value: object) -> None:
    raise FrozenInstanceError(f"cannot assign to field {name!r} of {type(self).__name__}")


def _refuse_delattr(self: object, name: str) -> None:
    raise FrozenInstanceError(f"cannot delete field {name!r} of {type(self).__name__}")


def seal(*classes: type) -> None:
    """Make every attribute assignment on these frozen slots records raise
    ``FrozenInstanceError``.

    On Python 3.11, ``dataclass(frozen=True, slots=True)`` only refuses declared field
    names; any other name reaches a ``super()`` call bound to the pre-slots class and
    fails with an unrelated ``TypeError``.
    """
    for cls in classes:
        cls.__setattr__ = _refuse_setattr  # type: ignore[assignment]
        cls.__delattr__ = _refuse_delattr  # type: ignore[assignment]


# The core accounts bytes as u64: larger counts are refused, never saturated.
_U64_MAX = (1 << 64) - 1


def byte_count(value: int, name: str) -> int:
    """Byte counts the core can account exactly: at most 2**64 - 1 (16 EiB)."""
    if value > _U64_MAX:
        raise ValueError(f"{name} of {value} bytes exceeds the supported maximum of 2**64 - 1")
    return value


def byte_size(value: object, name: str) -> int:
    """A byte count taken as an index int (`index_int`), at most 2**64 - 1; a string such
    as ``"8GiB"`` is a `TypeError` that says how to write it
    (docs/concepts/locations-and-budgets.md#byte-counts)."""
    if isinstance(value, str):
        raise TypeError(
            f"{name} must be an int, got str {value!r}: for a size such as '8GiB', pass "
            f"fhelium.residency.sizes.parse_size({value!r})"
        )
    return byte_count(index_int(value, name), name)


def index_int(value: object, name: str) -> int:
    """A lenient non-negative int: bool is a TypeError, `__index__` is accepted."""
    if isinstance(value, bool):
        raise wrong_type(name, "an int", value)
    try:
        result = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise wrong_type(name, "an int", value) from None
    if result < 0:
        raise negative(name, result)
    return result
