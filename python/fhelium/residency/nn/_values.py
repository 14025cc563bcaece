"""An offload's units and values: one managed value per tensor group, with its slots'
placeholders and the device tensors last put in them; made by adopting the module's
tensors (moved to the host tier, or past its budget to disk) or by registering a
checkpoint's sources (docs/concepts/offload.md#units, #placeholders, #checkpoints).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fhelium.errors import ResidencyBudgetError
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, ResidencyLocation
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.model import ReplicaMode, ResidencyHandle
from fhelium.residency.nn._loading import GroupSource
from fhelium.residency.nn._units import Placeholder, TensorGroup, placeholders
from fhelium.values import TensorBundle

__all__ = ["OffloadUnit", "OffloadValue", "adopt_groups", "host_location"]

_make_subclass = torch.Tensor._make_subclass


@dataclass(frozen=True)
class OffloadUnit:
    """One unit of an offload: a module whose forward is one step.

    Attributes:
        name: The module's qualified name (``"<root>"`` for the root).
        module: The module.
        handles: The values its forward requires: its own tensors first (when it has
            any), then each tied tensor it shares with other units.
        nbytes: The bytes those values are charged on the device.
    """

    name: str
    module: nn.Module
    handles: tuple[ResidencyHandle[TensorBundle], ...]
    nbytes: int


class OffloadValue:
    """A managed value of the offload: its handle, slots and placeholders, and the
    device tensors last installed (reused while the same materialisation is resident)."""

    __slots__ = (
        "bundle",
        "group",
        "handle",
        "index",
        "installed",
        "kept",
        "nbytes",
        "placeholders",
        "reconstructible",
        "tensors",
    )

    def __init__(
        self, index: int, group: TensorGroup, handle: ResidencyHandle[TensorBundle], nbytes: int
    ) -> None:
        self.index = index
        self.group = group
        self.handle = handle
        self.nbytes = nbytes  # what it is charged on the device
        self.placeholders: list[Placeholder] = []
        self.installed = 0  # how many active units use it
        # Read from a checkpoint: each step also keeps a host copy (a cache of the
        # file), docs/concepts/offload.md#checkpoints.
        self.reconstructible = False
        # Its buffers a checkpoint does not hold, as the module built them: `close`
        # puts them back (docs/concepts/offload.md#checkpoints).
        self.kept: dict[str, torch.Tensor] = {}
        self.bundle: TensorBundle | None = None
        self.tensors: list[torch.Tensor] = []

    def install(self, bundle: Any) -> None:
        """Puts ``bundle``'s tensors in the slots (the same tensors as last time when it
        is the same bundle)."""
        if bundle is not self.bundle:
            tensors: list[torch.Tensor] = []
            for tensor, slots in zip(bundle._resident_tensors, self.group.slots, strict=True):
                if not slots[0].is_parameter:
                    tensors.append(tensor)
                elif type(tensor) is torch.Tensor:
                    # What `nn.Parameter(tensor, requires_grad=False)` does for a plain
                    # tensor, without its frame.
                    tensors.append(_make_subclass(nn.Parameter, tensor, False))
                else:
                    tensors.append(nn.Parameter(tensor, requires_grad=False))
            self.bundle, self.tensors = bundle, tensors
        for tensor, slots in zip(self.tensors, self.group.slots, strict=True):
            for slot in slots:
                slot.install(tensor)

    def uninstall(self) -> None:
        """Puts the placeholders back in the slots."""
        for placeholder, slots in zip(self.placeholders, self.group.slots, strict=True):
            for slot in slots:
                slot.install(placeholder)

    def install_placeholders(self, device: torch.device) -> None:
        """Makes the placeholders (for compute on ``device``) and puts them in the slots;
        the group forgets the module's original tensors (their memory is freed once the
        manager moved them)."""
        group = self.group
        self.placeholders = list(placeholders(group, device))
        group.tensors = list(self.placeholders)
        self.uninstall()


def adopt_groups(
    values: list[OffloadValue],
    manager: ResidencyManager,
    groups: list[TensorGroup],
    sources: list[GroupSource] | None,
    *,
    dtype: torch.dtype | None,
    runtime: Any,
    host: ResidencyLocation,
    host_budget: int | None,
    disk: ResidencyLocation | None,
    device: torch.device,
) -> None:
    """Registers every group as a value: read from ``sources``, or adopted from the
    module and moved to the host tier (or, past the host budget, to disk). Each value is
    appended to ``values`` as soon as its placeholders are in place (after a failure,
    those are the ones to put back); ``values`` ends in group order."""
    if sources is not None:
        for index, (group, source) in enumerate(zip(groups, sources, strict=True)):
            handle = manager.register_source(source.spec(), source)
            value = OffloadValue(index, group, handle, source.nbytes)
            value.reconstructible = True
            value.kept = source.kept
            value.install_placeholders(device)
            values.append(value)
        return
    # Where each group goes: the host tier while its budget lasts, then disk. The
    # groups bound for disk are adopted (and moved) first, so a budgeted pageable
    # host never holds them.
    room = _remaining(manager, host)
    sizes = [_storage_nbytes(group.tensors, dtype) for group in groups]
    if room is not None and disk is not None and host == PAGEABLE_HOST:
        # A read from disk lands in pageable memory first: room for the largest.
        room = max(0, room - max(sizes))
    targets: list[ResidencyLocation] = []
    for nbytes in sizes:
        target = host
        if room is not None and nbytes > room:
            if disk is None:
                # Refused as the manager would refuse it; nothing was adopted.
                budget_bytes = host_budget or 0
                raise ResidencyBudgetError(
                    location=host.name,
                    budget_bytes=budget_bytes,
                    used_bytes=budget_bytes - room,
                    reserved_bytes=0,
                    requested_bytes=nbytes,
                )
            target = disk
        elif room is not None:
            room -= nbytes
        targets.append(target)
    order = sorted(range(len(groups)), key=lambda index: targets[index] == host)
    for index in order:
        group, target = groups[index], targets[index]
        bundle = TensorBundle(
            {
                name: (
                    tensor.detach().to(dtype)
                    if dtype is not None and tensor.is_floating_point()
                    else tensor.detach()
                )
                for name, tensor in zip(group.names, group.tensors, strict=True)
            }
        )
        # Where adopt puts it (docs/concepts/values.md#adopt).
        adopted = PINNED_HOST if runtime.value_is_pinned(bundle) else PAGEABLE_HOST
        handle = manager.adopt(bundle, at=adopted, replica_mode=ReplicaMode.REPLICABLE)
        value = OffloadValue(index, group, handle, bundle.storage_nbytes)
        del bundle
        value.install_placeholders(device)
        values.append(value)
        if target != adopted:
            manager.move(handle, target)
    values.sort(key=lambda value: value.index)


def _remaining(manager: ResidencyManager, location: ResidencyLocation) -> int | None:
    for record in manager.snapshot().locations:
        if record.location == location:
            return record.remaining_budget_bytes
    return None


def _storage_nbytes(tensors: list[torch.Tensor], dtype: torch.dtype | None) -> int:
    """The bytes a bundle of ``tensors`` (cast to ``dtype``) is charged: each storage
    once, a cast tensor its own size."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if dtype is not None and tensor.is_floating_point():
            total += tensor.numel() * dtype.itemsize
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen or storage.nbytes() == 0:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def host_location(runtime: Any, host: str) -> ResidencyLocation:
    """The host tier: pinned where the runtime has pinned memory, else pageable (with
    one warning, attributed to the caller of `offload`)."""
    if host == "pageable":
        return PAGEABLE_HOST
    try:
        runtime.empty_pinned(1)
    except RuntimeError:
        warnings.warn(
            "pinned host memory is not available here; the offload keeps weights in "
            "pageable host memory (copies to the device are slower)",
            UserWarning,
            stacklevel=4,
        )
        return PAGEABLE_HOST
    return PINNED_HOST
