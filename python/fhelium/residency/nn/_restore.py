"""Closing an offload: each value's tensors put back in the module's slots, as they were
before it was offloaded (docs/concepts/offload.md#closing)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fhelium.residency.location import PAGEABLE_HOST, ResidencyLocation
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.model import ResidencyHandle
from fhelium.residency.nn._stats import manager_closed
from fhelium.residency.nn._values import OffloadValue
from fhelium.values import TensorBundle

__all__ = ["restore_values"]


def restore_values(
    manager: ResidencyManager,
    values: list[OffloadValue],
    *,
    from_checkpoint: bool,
    owns_manager: bool,
) -> BaseException | None:
    """Puts every value's tensors back in its slots, each one tried whatever the others
    did; returns the first failure, or None."""
    error: BaseException | None = None
    held: dict[ResidencyHandle[Any], set[ResidencyLocation]] = {}
    if values and not manager_closed(manager):
        for entry in manager.snapshot().values:
            held[entry.handle] = {m.location for m in entry.materializations}
    # Those with a pageable copy first: each discard frees room for the next copy.
    values.sort(key=lambda value: PAGEABLE_HOST not in held.get(value.handle, ()))
    for value in values:
        try:
            _restore(
                manager,
                value,
                held.get(value.handle, set()),
                from_checkpoint=from_checkpoint,
                owns_manager=owns_manager,
            )
        except BaseException as failure:
            error = error or failure
    return error


def _restore(
    manager: ResidencyManager,
    value: OffloadValue,
    held: set[ResidencyLocation],
    *,
    from_checkpoint: bool,
    owns_manager: bool,
) -> None:
    """Puts ``value``'s tensors back in its slots (``held``: where it lives), and
    discards it from a caller's manager."""
    group = value.group
    if from_checkpoint:
        for name, placeholder, slots, grad in zip(
            group.names, value.placeholders, group.slots, group.requires_grad, strict=True
        ):
            empty = value.kept.get(name)
            if empty is None:
                empty = torch.empty(placeholder.shape, dtype=placeholder.dtype, device="meta")
            tensor: torch.Tensor = (
                nn.Parameter(empty, requires_grad=grad) if slots[0].is_parameter else empty
            )
            for slot in slots:
                slot.install(tensor)
        if not owns_manager:
            manager.discard(value.handle)
        return
    # Back in pageable memory, as the module's tensors were: copied out of whatever
    # the value lives in (one value's bytes extra at a time).
    handle = value.handle
    if PAGEABLE_HOST not in held:
        manager.ensure(handle, PAGEABLE_HOST)
    with manager.acquire([handle], at=PAGEABLE_HOST) as borrowed:
        bundle = borrowed[handle]
    assert isinstance(bundle, TensorBundle)  # every offload value is one
    # Forgotten at once: its charges are free for the next value's copy.
    manager.discard(handle)
    for tensor, slots, grad in zip(
        bundle.tensors.values(), group.slots, group.requires_grad, strict=True
    ):
        plain = tensor
        if tensor.is_inference():
            # Copied under `torch.inference_mode()`: the module's tensors were
            # ordinary ones, usable with autograd; so are these.
            with torch.inference_mode(False):
                plain = tensor.clone()
        restored: torch.Tensor = (
            nn.Parameter(plain, requires_grad=grad) if slots[0].is_parameter else plain
        )
        for slot in slots:
            slot.install(restored)
