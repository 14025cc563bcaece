"""How `offload` cuts a module into units and values, and the placeholders that stand in
for a unit's tensors outside its forward (docs/concepts/offload.md#units).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from fhelium.errors import ResidencyUnavailableError

__all__ = ["UnitRule", "Slot", "TensorGroup", "UnitPlan", "plan_units", "Placeholder"]

# What `units=` accepts: None (the default rule), a module class, a tuple of classes, or a
# predicate over (qualified name, module).
UnitRule = (
    type[nn.Module]
    | tuple[type[nn.Module], ...]
    | Callable[[nn.Module], bool]
    | Callable[[str, nn.Module], bool]
    | None
)


@dataclass(eq=False)
class Slot:
    """One place a tensor sits: ``module._parameters[name]`` or ``module._buffers[name]``."""

    module: nn.Module
    name: str
    is_parameter: bool
    qualified: str  # the state_dict key of this place

    def install(self, tensor: torch.Tensor) -> None:
        if self.is_parameter:
            self.module._parameters[self.name] = tensor  # type: ignore[assignment]
        else:
            self.module._buffers[self.name] = tensor


@dataclass(eq=False)
class TensorGroup:
    """The tensors one managed value holds, each with every slot it sits in. A unit's own
    tensors are one group; a tensor shared by several units is a group of its own."""

    names: list[str] = field(default_factory=list)  # one key per tensor (its first slot's)
    tensors: list[torch.Tensor] = field(default_factory=list)
    slots: list[list[Slot]] = field(default_factory=list)
    persistent: list[bool] = field(default_factory=list)
    requires_grad: list[bool] = field(default_factory=list)  # parameters' own flags
    units: list[int] = field(default_factory=list)  # the units that require the value


@dataclass(eq=False)
class UnitPlan:
    """A unit: the module whose forward is one step, and the groups it requires."""

    name: str
    module: nn.Module
    groups: list[int] = field(default_factory=list)


def _matcher(rule: UnitRule) -> Callable[[str, nn.Module], bool] | None:
    if rule is None:
        return None
    if isinstance(rule, type):
        if not issubclass(rule, nn.Module):
            raise TypeError(f"units must be a module class, got {rule.__name__}")
        cls = rule
        return lambda _name, module: isinstance(module, cls)
    if isinstance(rule, tuple):
        if not rule or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in rule):
            raise TypeError("units must be a non-empty tuple of nn.Module classes")
        classes = rule
        return lambda _name, module: isinstance(module, classes)
    if callable(rule):
        predicate: Callable[..., object] = rule
        takes_name = _positional_count(rule) >= 2

        def matches(name: str, module: nn.Module) -> bool:
            answer = predicate(name, module) if takes_name else predicate(module)
            if not isinstance(answer, bool):
                raise TypeError(f"the units predicate must return a bool, got {answer!r}")
            return answer

        return matches
    raise TypeError(
        "units must be None, an nn.Module class, a tuple of classes, or a callable "
        f"(module) -> bool or (name, module) -> bool, got {type(rule).__name__}"
    )


def _positional_count(function: Callable[..., object]) -> int:
    """How many positional arguments ``function`` takes (2 for ``*args``); a predicate of
    one is called with the module, of two with its qualified name and the module."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return 2
    count = 0
    for parameter in parameters:
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            return 2
        if parameter.kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            count += 1
    return count


def _owns(module: nn.Module) -> bool:
    return any(t is not None for t in module._parameters.values()) or any(
        t is not None for t in module._buffers.values()
    )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def plan_units(root: nn.Module, rule: UnitRule) -> tuple[list[UnitPlan], list[TensorGroup]]:
    """Cut ``root`` into units and tensor groups (docs/concepts/offload.md#units).

    A matching module (or, by default, a module that directly owns parameters or buffers)
    is a unit with every tensor in its subtree, outermost first: a unit never contains
    another, except a leftover owner that contains matched units. A tensor placed in
    several units (tied weights) becomes a group of its own, required by each of them.
    """
    match = _matcher(rule)
    units: list[UnitPlan] = []
    # Per unit, its tensors by identity, each with its slots, in discovery order.
    owned: list[dict[int, tuple[torch.Tensor, list[Slot], bool]]] = []
    seen_modules: set[int] = set()

    def collect(
        module: nn.Module, prefix: str, unit: int, stop: Callable[[str, nn.Module], bool] | None
    ) -> None:
        """Adds ``module``'s own tensors to ``unit`` and descends, not into ``stop``."""
        tensors = owned[unit]
        persistent_skip = module._non_persistent_buffers_set
        for name, parameter in module._parameters.items():
            if parameter is not None:
                entry = tensors.setdefault(id(parameter), (parameter, [], True))
                entry[1].append(Slot(module, name, True, _join(prefix, name)))
        for name, buffer in module._buffers.items():
            if buffer is not None:
                persistent = name not in persistent_skip
                entry = tensors.setdefault(id(buffer), (buffer, [], persistent))
                entry[1].append(Slot(module, name, False, _join(prefix, name)))
        for child_name, child in module._modules.items():
            if child is None:
                continue
            child_prefix = _join(prefix, child_name)
            if stop is not None and stop(child_prefix, child):
                visit(child, child_prefix)
            else:
                collect(child, child_prefix, unit, stop)

    def new_unit(module: nn.Module, prefix: str) -> int:
        units.append(UnitPlan(prefix or "<root>", module))
        owned.append({})
        return len(units) - 1

    def visit(module: nn.Module, prefix: str) -> None:
        if id(module) in seen_modules:
            return  # a module reused in several places is one unit, hooked once
        seen_modules.add(id(module))
        if match is not None and match(prefix, module):
            collect(module, prefix, new_unit(module, prefix), None)
            return
        if _owns(module):
            # A leftover owner: its subtree, except the matched units inside it, which
            # are entered (nested) during its forward.
            collect(module, prefix, new_unit(module, prefix), match)
            return
        for child_name, child in module._modules.items():
            if child is not None:
                visit(child, _join(prefix, child_name))

    visit(root, "")
    # Tensors in several units become groups of their own.
    where: dict[int, list[int]] = {}
    for index, tensors in enumerate(owned):
        for key in tensors:
            where.setdefault(key, []).append(index)
    groups: list[TensorGroup] = []
    shared: dict[int, int] = {}
    own_group: list[int | None] = [None] * len(units)
    for index, tensors in enumerate(owned):
        for key, (tensor, slots, persistent) in tensors.items():
            holders = where[key]
            if len(holders) > 1:
                group_index = shared.get(key)
                if group_index is None:
                    group_index = shared[key] = len(groups)
                    groups.append(TensorGroup(units=list(holders)))
                    for holder in holders:
                        units[holder].groups.append(group_index)
                    group = groups[group_index]
                    group.names.append(slots[0].qualified)
                    group.tensors.append(tensor)
                    group.slots.append([])
                    group.persistent.append(persistent)
                    group.requires_grad.append(tensor.requires_grad)
                groups[group_index].slots[0].extend(slots)
                continue
            group_index = own_group[index]
            if group_index is None:
                group_index = own_group[index] = len(groups)
                groups.append(TensorGroup(units=[index]))
                units[index].groups.insert(0, group_index)
            group = groups[group_index]
            group.names.append(slots[0].qualified)
            group.tensors.append(tensor)
            group.slots.append(list(slots))
            group.persistent.append(persistent)
            group.requires_grad.append(tensor.requires_grad)
    return units, groups


def _placeholder_error(func: Any, args: Any, kwargs: Any) -> ResidencyUnavailableError:
    names = []
    stack: list[Any] = [args, kwargs or {}]
    while stack:
        item = stack.pop()
        if isinstance(item, Placeholder):
            names.append(item.qualified)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    what = ", ".join(sorted(set(names))) or "an offloaded tensor"
    return ResidencyUnavailableError(
        f"{what} is offloaded: its bytes are only in place during its unit's forward. "
        "Call the module (the offload loads it), or read it inside "
        "`with off.materialize(submodule):` (docs/concepts/offload.md#placeholders)"
        f" [operation: {getattr(func, '__name__', func)}]"
    )


class Placeholder(torch.Tensor):
    """What sits in a unit's parameter and buffer slots outside its forward: the right
    shape, dtype and device, no bytes; every operation on it raises
    `ResidencyUnavailableError` naming the tensor. A parameter's placeholder passes
    ``isinstance(p, nn.Parameter)``."""

    qualified: str
    _is_param: bool
    _SAFE: ClassVar[frozenset[str]] = frozenset()

    @staticmethod
    def __new__(
        cls, like: torch.Tensor, qualified: str, device: torch.device, *, parameter: bool
    ) -> Placeholder:
        made = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=like.dtype, device=device, requires_grad=False
        )
        made.qualified = qualified
        if parameter:
            made._is_param = True
        return made

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # everything is set in __new__

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise _placeholder_error(func, args, kwargs)

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        kind = "Parameter" if getattr(self, "_is_param", False) else "buffer"
        return f"<offloaded {kind} {self.qualified}: shape={tuple(self.shape)}, dtype={self.dtype}>"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _placeholder_error("pickle", (self,), None)


def placeholders(group: TensorGroup, device: torch.device) -> Iterator[Placeholder]:
    """One placeholder per tensor of ``group``."""
    for name, tensor, slots in zip(group.names, group.tensors, group.slots, strict=True):
        yield Placeholder(tensor, name, device, parameter=slots[0].is_parameter)
