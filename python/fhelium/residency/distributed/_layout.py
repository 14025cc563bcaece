"""The storage layout of a value in transit: what a receiving rank needs to rebuild a
value from its storages' bytes (`Layout`), how a sender describes a value and finds the
bytes to send (`describe`), and how a receiver rebuilds the value on the buffers those
bytes arrived in (`rebuild`). The disk tier's file format describes a stored value the
same way; this module holds all of the distributed side of it, so that writing the
description once for both is a change here.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fhelium.residency.model import ReplicaMode
from fhelium.values.tensor_resident import TensorResident


@dataclass(frozen=True)
class Layout:
    """What a receiver needs to rebuild one value: a tensor-free skeleton of it, the
    byte size of each unique storage, and where each tensor sits in them."""

    skeleton: bytes
    storages: tuple[int, ...]
    # (storage position or -1 for a tensor without storage bytes, storage offset in
    # elements, size, stride, dtype) per tensor field, in order.
    tensors: tuple[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], ...]
    replica_mode: ReplicaMode

    @property
    def nbytes(self) -> int:
        return sum(self.storages)


def describe(value: TensorResident, replica_mode: ReplicaMode) -> tuple[Layout, list[torch.Tensor]]:
    """The value's layout and one flat ``uint8`` view per unique storage."""
    positions: dict[int, int] = {}
    flats: list[torch.Tensor] = []
    storages: list[int] = []
    tensors = []
    for tensor in value._resident_tensors:
        storage = tensor.untyped_storage()
        size = storage.nbytes()
        if size == 0:
            position = -1
        else:
            key = storage.data_ptr()
            position = positions.get(key, -1)
            if position < 0:
                position = len(flats)
                positions[key] = position
                flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
                flat.set_(storage)
                flats.append(flat)
                storages.append(size)
        tensors.append(
            (
                position,
                int(tensor.storage_offset()),
                tuple(int(n) for n in tensor.size()),
                tuple(tensor.stride()),
                tensor.dtype,
            )
        )
    skeleton = value._with_resident_tensors(
        tuple(torch.empty(0, dtype=tensor.dtype) for tensor in value._resident_tensors)
    )
    layout = Layout(pickle.dumps(skeleton), tuple(storages), tuple(tensors), replica_mode)
    return layout, flats


def rebuild(
    layout: Layout, buffers: list[torch.Tensor], empty: Callable[[int], torch.Tensor]
) -> TensorResident:
    """The value ``layout`` describes, its tensors views of ``buffers`` (one per storage);
    ``empty`` makes the empty buffer a tensor without storage bytes sits on."""
    skeleton = pickle.loads(layout.skeleton)
    if not isinstance(skeleton, TensorResident):
        raise TypeError(f"the layout describes a {type(skeleton).__name__}, not a TensorResident")
    tensors = []
    for position, offset, size, stride, dtype in layout.tensors:
        backing = buffers[position] if position >= 0 else empty(0)
        tensor = torch.empty(0, dtype=dtype, device=backing.device)
        tensor.set_(backing.untyped_storage(), offset, size, stride)
        tensors.append(tensor)
    return skeleton._with_resident_tensors(tuple(tensors))
