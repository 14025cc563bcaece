"""Trusted construction of frozen records for values the manager already validated.

The public constructors validate every field, which is right for callers and wasteful
for the manager's hot paths (reports, handles, snapshot entries), whose fields come
from the core's invariants. These builders fill the slots directly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["trusted_builder"]

R = TypeVar("R")


def trusted_builder(cls: type[R]) -> Callable[..., R]:
    """A positional constructor for frozen slots dataclass ``cls`` that skips checks."""
    setters: list[Callable[[Any, Any], None]] = [
        cls.__dict__[field.name].__set__
        for field in dataclasses.fields(cls)  # type: ignore[arg-type]
    ]
    new = object.__new__

    def build(*values: object) -> R:
        record = new(cls)
        for setter, value in zip(setters, values, strict=True):
            setter(record, value)
        return record

    build.__name__ = f"trusted_{cls.__name__}"
    return build
