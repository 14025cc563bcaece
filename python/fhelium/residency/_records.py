"""Trusted construction of frozen records for values the manager already validated.

The public constructors validate every field, which is right for callers and wasteful
for the manager's hot paths (reports, handles, snapshot entries), whose fields come
from the core's invariants. These builders fill the slots directly, in the extension:
one record per call (`trusted_builder`), or many per call for the records users read
in bulk (`bulk_builder`'s builder handed to the extension's bulk calls).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar, cast

from fhelium import _core

__all__ = ["bulk_builder", "trusted_builder"]

R = TypeVar("R")


def trusted_builder(cls: type[R]) -> Callable[..., R]:
    """A positional constructor for frozen slots dataclass ``cls`` that skips checks:
    the extension's builder (`bulk_builder`) called with one record's fields in
    declaration order. No record code and no Python frame run per record."""
    return cast(Callable[..., R], bulk_builder(cls))


def bulk_builder(cls: type[Any], names: list[str] | None = None) -> _core.RecordBuilder:
    """The extension's builder for frozen slots dataclass ``cls``: its fields in
    declaration order, or the slots ``names`` (a lazy record subclass's, whose fields
    are partly properties over private slots).

    It fills an instance of a subclass that adds no slots and assigns attributes
    plainly (``cls`` itself refuses every assignment), then gives the instance the
    class ``cls``: the result is the record `trusted_builder` would build, made
    without calling any Python code per record. The subclass never escapes.
    """
    if names is None:
        names = [field.name for field in dataclasses.fields(cls)]
    fill = type(
        f"_{cls.__name__}Fill",
        (cls,),
        {
            "__slots__": (),
            "__module__": __name__,
            "__init__": object.__init__,
            # Both, or the type keeps a Python-level attribute hook for either.
            "__setattr__": object.__setattr__,
            "__delattr__": object.__delattr__,
        },
    )
    return _core.RecordBuilder(cls, fill, names)
