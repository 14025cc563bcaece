"""The documented public surface, walked the same way by the docstring and introspection tests.

Public names are the `__all__` of `fhelium`, `fhelium.errors`, `fhelium.values`,
`fhelium.residency` and of each public `fhelium.residency` submodule (see
docs/concepts/conventions.md#public-names). The members of a public class are the
non-underscore names defined by the class or by a base class that fhelium defines, so what
comes from object, Enum, tuple, Protocol or the dataclass machinery is left out.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

PUBLIC_MODULES = (
    "fhelium",
    "fhelium.errors",
    "fhelium.values",
    "fhelium.values.tensor_resident",
    "fhelium.residency",
    "fhelium.residency.location",
    "fhelium.residency.model",
    "fhelium.residency.plan",
    "fhelium.residency.request",
    "fhelium.residency.policy",
    "fhelium.residency.lease",
    "fhelium.residency.manager",
    "fhelium.residency.controller",
    "fhelium.residency.snapshot",
    "fhelium.residency.schedule",
    "fhelium.residency.disk",
    "fhelium.residency.pipeline",
    "fhelium.residency.distributed",
    "fhelium.residency.simulation",
    "fhelium.residency.sources",
    "fhelium.residency.export",
    "fhelium.residency.nn",
)


@dataclass(frozen=True)
class PublicName:
    """One public object, under the first module (in `PUBLIC_MODULES` order) exporting it."""

    qualname: str  # "module.Name"
    module: ModuleType
    name: str
    obj: Any


@dataclass(frozen=True)
class PublicMember:
    """A method, property or field of a public class, as found in the defining class."""

    qualname: str  # "module.Class.member"
    owner: type
    name: str
    raw: Any  # the object in the defining class's __dict__ (property, function, ...)


def public_modules() -> list[ModuleType]:
    return [importlib.import_module(name) for name in PUBLIC_MODULES]


def public_names() -> list[PublicName]:
    seen: set[int] = set()
    found: list[PublicName] = []
    for module in public_modules():
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or id(obj) in seen:
                continue
            seen.add(id(obj))
            found.append(PublicName(f"{module.__name__}.{name}", module, name, obj))
    return found


def public_classes() -> list[PublicName]:
    return [entry for entry in public_names() if inspect.isclass(entry.obj)]


def public_functions() -> list[PublicName]:
    return [entry for entry in public_names() if inspect.isfunction(entry.obj)]


def public_members(cls: type) -> Iterator[PublicMember]:
    """Yield each public member once, from the most derived fhelium class defining it."""
    names: set[str] = set()
    for base in cls.__mro__:
        if not base.__module__.startswith("fhelium"):
            continue
        for name, raw in vars(base).items():
            if name.startswith("_") or name in names:
                continue
            names.add(name)
            yield PublicMember(f"{cls.__module__}.{cls.__qualname__}.{name}", cls, name, raw)


def member_callable(member: PublicMember) -> Any:
    """The function whose docstring and signature document the member, or None for a field."""
    raw = member.raw
    if isinstance(raw, property):
        return raw.fget
    if isinstance(raw, (staticmethod, classmethod)):
        return raw.__func__
    if inspect.isfunction(raw):
        return raw
    return None


def is_field(member: PublicMember) -> bool:
    """A record slot, a named-tuple field or an enum member: documented under `Attributes:`."""
    return member_callable(member) is None
