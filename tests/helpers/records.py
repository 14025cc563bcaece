"""Sample values and checkers shared by the record tests; the fixtures are in conftest.py.

The suite is written from the documented behaviour (docs/concepts/), not from the
implementation, so the helpers here encode its generic rules once
(docs/concepts/conventions.md): what a "frozen record" is, what a
strict int / non-empty str rejects, and a tiny concrete `TensorResident`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from fhelium.residency.model import ResidencyHandle
from fhelium.values import TensorResident

# --------------------------------------------------------------------------------------------
# Concrete TensorResident values used by the tests.
# --------------------------------------------------------------------------------------------


class Pair(TensorResident):
    """Two tensor fields plus one piece of non-tensor metadata (`tag`)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, tag: str = "pair") -> None:
        self.a = a
        self.b = b
        self.tag = tag

    @property
    def _resident_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.a, self.b)

    def _with_resident_tensors(self, tensors: tuple[torch.Tensor, ...]) -> Pair:
        a, b = tensors
        return Pair(a, b, tag=self.tag)


class Single(TensorResident):
    """One tensor field; a second value type distinct from `Pair`."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    @property
    def _resident_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.t,)

    def _with_resident_tensors(self, tensors: tuple[torch.Tensor, ...]) -> Single:
        (t,) = tensors
        return Single(t)


class Empty(TensorResident):
    """A value with no tensor fields at all."""

    @property
    def _resident_tensors(self) -> tuple[torch.Tensor, ...]:
        return ()

    def _with_resident_tensors(self, tensors: tuple[torch.Tensor, ...]) -> Empty:
        assert tensors == ()
        return Empty()


# --------------------------------------------------------------------------------------------
# Inputs the generic rules reject (docs/concepts/conventions.md#integer-arguments).
# --------------------------------------------------------------------------------------------

# strict int: bool, numpy integers, floats and anything else non-int raise TypeError.
NOT_STRICT_INT: list[Any] = [True, False, np.int64(3), np.int32(0), 3.0, "3", None]
NOT_STRICT_INT_IDS = ["True", "False", "np.int64", "np.int32", "float", "str", "None"]
# Same, for fields where None is a valid value.
NOT_STRICT_INT_NONE_OK: list[Any] = [True, False, np.int64(3), 3.0, "3"]
NOT_STRICT_INT_NONE_OK_IDS = ["True", "False", "np.int64", "float", "str"]

# non-empty str: non-str raises TypeError, blank raises ValueError.
NOT_STR: list[Any] = [None, 5, b"name", ["name"]]
NOT_STR_IDS = ["None", "int", "bytes", "list"]
BLANK_STR: list[str] = ["", " ", "\t\n "]
BLANK_STR_IDS = ["empty", "space", "whitespace"]

# Real bools only.
NOT_BOOL: list[Any] = [0, 1, None, "true", np.True_]
NOT_BOOL_IDS = ["0", "1", "None", "str", "np.bool_"]


# --------------------------------------------------------------------------------------------
# Generic checker for the "frozen record" convention (docs/concepts/conventions.md#frozen-records).
# --------------------------------------------------------------------------------------------


def check_frozen_record(obj: Any, fields: Sequence[str]) -> None:
    """Assert every property of a frozen record (docs/concepts/conventions.md#frozen-records)
    with `fields` in order."""
    cls = type(obj)
    values = [getattr(obj, name) for name in fields]

    # __slots__ and no instance __dict__.
    assert hasattr(cls, "__slots__"), f"{cls.__name__} has no __slots__"
    assert not hasattr(obj, "__dict__"), f"{cls.__name__} instances have a __dict__"

    # Assignment raises FrozenInstanceError (an AttributeError), for fields and new names.
    for name, value in zip(fields, values, strict=True):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, value)
        assert getattr(obj, name) is value
    # A new attribute can never be added. (CPython 3.11's frozen+slots dataclass raises TypeError
    # from its generated __setattr__ for undeclared names; only field assignment is pinned.)
    with pytest.raises((AttributeError, TypeError)):
        obj.not_a_declared_field = 1  # type: ignore[attr-defined]
    assert not hasattr(obj, "not_a_declared_field")
    assert issubclass(dataclasses.FrozenInstanceError, AttributeError)

    # Dataclass-like repr in the documented field order.
    expected_repr = (
        f"{cls.__name__}(" + ", ".join(f"{n}={v!r}" for n, v in zip(fields, values, strict=True))
    ) + ")"
    assert repr(obj) == expected_repr

    # Positional and keyword construction agree with the listed field order.
    positional = cls(*values)
    keyword = cls(**dict(zip(fields, values, strict=True)))
    for clone in (positional, keyword):
        assert clone == obj
        assert obj == clone
        assert (clone != obj) is False
        assert hash(clone) == hash(obj)
        assert clone is not obj

    # Equality is false against any other class, including a tuple of the same fields.
    assert obj != tuple(values)
    assert (obj == tuple(values)) is False
    assert (obj == object()) is False
    assert obj != None  # noqa: E711
    # Hashable and usable as a dict / set key.
    assert {obj: 1}[positional] == 1
    assert len({obj, positional, keyword}) == 1


# --------------------------------------------------------------------------------------------
# Common record fixtures.
# --------------------------------------------------------------------------------------------


def make_handle(
    manager_id: str = "manager-1", handle_id: str = "handle-1", value_type: type = Pair
) -> ResidencyHandle[Any]:
    return ResidencyHandle(manager_id, handle_id, value_type)


class Boom(Exception):
    """Raised by exploding iterables to observe when an input is consumed."""


def exploding(*items: Any) -> Any:
    """A generator that yields `items` and then raises `Boom`."""
    yield from items
    raise Boom("consumed")
