"""The storage layout of a value in transit: what a receiving rank needs to rebuild a
value from its storages' bytes (`Layout`), how a sender describes a value and finds the
bytes to send (`describe`), and how a receiver rebuilds the value on the buffers those
bytes arrived in (`rebuild`). The layout itself is the one the disk tier records,
written once in `fhelium.residency._storage_layout`; a tensor on a zero-byte storage
has no storage here (nothing to send), and the receiver sits it on an empty buffer.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fhelium.residency._storage_layout import Field
from fhelium.residency._storage_layout import describe as describe_storages
from fhelium.residency._storage_layout import rebuild as rebuild_views
from fhelium.residency.model import ReplicaMode
from fhelium.values.tensor_resident import TensorResident


@dataclass(frozen=True)
class Layout:
    """What a receiver needs to rebuild one value: a tensor-free skeleton of it, the
    byte size of each unique storage, and where each tensor sits in them."""

    skeleton: bytes
    storages: tuple[int, ...]
    # Per tensor field, in order: its storage (-1 for a tensor without storage bytes),
    # storage offset in elements, size, stride and dtype.
    fields: tuple[Field, ...]
    replica_mode: ReplicaMode

    @property
    def nbytes(self) -> int:
        return sum(self.storages)


def describe(value: TensorResident, replica_mode: ReplicaMode) -> tuple[Layout, list[torch.Tensor]]:
    """The value's layout and one flat ``uint8`` view per unique storage."""
    tensors = value._resident_tensors
    described, flats = describe_storages(tensors, "none")
    skeleton = value._with_resident_tensors(
        tuple(torch.empty(0, dtype=tensor.dtype) for tensor in tensors)
    )
    layout = Layout(pickle.dumps(skeleton), described.storages, described.fields, replica_mode)
    return layout, flats


def rebuild(
    layout: Layout, buffers: list[torch.Tensor], empty: Callable[[int], torch.Tensor]
) -> TensorResident:
    """The value ``layout`` describes, its tensors views of ``buffers`` (one per storage);
    ``empty`` makes the empty buffer a tensor without storage bytes sits on."""
    skeleton = pickle.loads(layout.skeleton)
    if not isinstance(skeleton, TensorResident):
        raise TypeError(f"the layout describes a {type(skeleton).__name__}, not a TensorResident")
    return rebuild_views(skeleton, layout.fields, buffers, empty)
