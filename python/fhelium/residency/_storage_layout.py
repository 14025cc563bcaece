"""A value's storage layout, written once for the disk tier and the distributed transfers.

A `TensorResident` value's tensors may view parts of storages, and share them. Its
layout is what it takes to make the same tensors again from the storages' bytes alone:

- its unique storages, deduplicated by storage and numbered in the order their first
  tensors come, each with its size in bytes;
- per tensor field, in order, a `Field`: the storage's number, the storage offset in
  elements, the size, the stride and the dtype.

`describe` gives a value's layout and one flat ``uint8`` view per storage (the bytes to
write or send, in storage order); `rebuild` makes the value's tensors again as views of
one buffer per storage. The disk tier records the layout in its file format
(`fhelium.residency._disk.format`); a transfer sends it to the receiving ranks
(`fhelium.residency.distributed._layout`).

A storage of no bytes has no address to deduplicate it by, so `ZeroBytes` says what a
tensor on one gets: a zero-length storage of its own (``"own"``: the disk's choice,
every field of a file names a storage), or none at all (``"none"``: a transfer's, with
no bytes to send; its field's storage is -1 and `rebuild` sits it on an empty buffer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeVar

import torch

from fhelium.values.tensor_resident import TensorResident

__all__ = ["Field", "StorageLayout", "ZeroBytes", "describe", "rebuild"]

_Value = TypeVar("_Value", bound=TensorResident)

ZeroBytes = Literal["own", "none"]


class Field(NamedTuple):
    """Where one tensor field sits in its value's storages."""

    # The storage's number, or -1 for a tensor on no storage bytes (`ZeroBytes` "none").
    storage: int
    # The storage offset, in elements.
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class StorageLayout:
    """A value's unique storages and where each of its tensor fields sits in them."""

    # The size in bytes of each unique storage, in storage order.
    storages: tuple[int, ...]
    fields: tuple[Field, ...]
    # Per storage: the field that is all of it, alone (contiguous from offset 0 over
    # every byte, the storage's only field), or -1.
    whole: tuple[int, ...]


def describe(
    tensors: Sequence[torch.Tensor], zero_bytes: ZeroBytes
) -> tuple[StorageLayout, list[torch.Tensor]]:
    """The layout of a value with these tensor fields, and one flat ``uint8`` view per
    unique storage, in storage order."""
    numbers: dict[int, int] = {}
    flats: list[torch.Tensor] = []
    storages: list[int] = []
    whole: list[int] = []
    fields: list[Field] = []
    for position, tensor in enumerate(tensors):
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0 and zero_bytes == "none":
            number = -1
        else:
            key = storage.data_ptr() if nbytes else -1 - position
            number = numbers.get(key, -1)
            if number < 0:
                number = len(flats)
                numbers[key] = number
                flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
                flat.set_(storage, 0, (nbytes,), (1,))
                flats.append(flat)
                storages.append(nbytes)
                alone = (
                    tensor.is_contiguous()
                    and tensor.storage_offset() == 0
                    and tensor.nbytes == nbytes
                )
                whole.append(position if alone else -1)
            else:
                whole[number] = -1  # shared
        fields.append(
            Field(
                number,
                int(tensor.storage_offset()),
                tuple(tensor.shape),
                tuple(tensor.stride()),
                tensor.dtype,
            )
        )
    return StorageLayout(tuple(storages), tuple(fields), tuple(whole)), flats


def rebuild(
    skeleton: _Value,
    fields: Sequence[Field],
    buffers: Sequence[torch.Tensor],
    empty: Callable[[int], torch.Tensor] | None,
) -> _Value:
    """``skeleton`` with its tensors made again from ``fields``, as views of ``buffers``
    (one per storage, in storage order); ``empty`` makes the empty buffer a field
    without storage bytes sits on (None where there is none: `ZeroBytes` "own").

    Raises:
        ValueError: A field without storage bytes and no ``empty``.
    """
    tensors = []
    for storage, offset, size, stride, dtype in fields:
        if storage >= 0:
            backing = buffers[storage]
        elif empty is not None:
            backing = empty(0)
        else:
            raise ValueError("a field without storage bytes needs `empty` to rebuild it")
        tensor = torch.empty(0, dtype=dtype, device=backing.device)
        tensor.set_(backing.untyped_storage(), offset, size, stride)
        tensors.append(tensor)
    return skeleton._with_resident_tensors(tuple(tensors))
