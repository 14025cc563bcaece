"""The values of an offload whose module is built on meta: one reconstructible value per
tensor group, read from a safetensors checkpoint (docs/concepts/offload.md#checkpoints).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fhelium.errors import ResidencyCheckpointError
from fhelium.residency.model import Recoverability, ReplicaMode, ResidencyValueSpec
from fhelium.residency.nn._checkpoint import Checkpoint
from fhelium.residency.nn._checkpoint_source import CheckpointSource
from fhelium.residency.nn._units import TensorGroup
from fhelium.values import TensorBundle

__all__ = ["GroupSource", "group_sources"]


class GroupSource:
    """A tensor group's source: its tensors read from the checkpoint, and the buffers the
    checkpoint does not hold (non-persistent ones, such as rotary ``inv_freq``) copied
    from the module as it was built."""

    __slots__ = ("_names", "_read", "kept", "read_nbytes", "reads")

    # Its `load` reads files and never calls a manager, and `layout` says what it
    # returns: a pipeline may run it on the disk tier's I/O thread
    # (docs/concepts/values.md#reconstructions-a-pipeline-defers).
    loads_alone = True

    def __init__(
        self, names: list[str], read: CheckpointSource | None, kept: dict[str, torch.Tensor]
    ) -> None:
        self._names = names
        self._read = read
        self.kept = kept  # the buffers the checkpoint lacks, as the module built them
        self.read_nbytes = 0 if read is None else read.read_nbytes
        self.reads = 0  # loads so far (the offload's stats count the bytes)

    @property
    def nbytes(self) -> int:
        kept = sum(t.numel() * t.element_size() for t in self.kept.values())
        return kept + (0 if self._read is None else self._read.nbytes)

    def spec(self) -> ResidencyValueSpec[TensorBundle]:
        size = self.nbytes
        return ResidencyValueSpec(
            TensorBundle, size, size, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
        )

    def layout(self) -> TensorBundle:
        """What `load` returns, every tensor on the meta device: nothing is read."""
        read = {} if self._read is None else self._read.layout()
        tensors = {}
        for name in self._names:
            shape, dtype = (
                read[name]
                if name in read
                else (
                    self.kept[name].shape,
                    self.kept[name].dtype,
                )
            )
            tensors[name] = torch.empty(shape, dtype=dtype, device="meta")
        return TensorBundle(tensors)

    def load(self) -> TensorBundle:
        read = {} if self._read is None else self._read.load().tensors
        self.reads += 1
        kept = self.kept
        return TensorBundle(
            {name: read[name] if name in read else kept[name].clone() for name in self._names}
        )


def group_sources(
    checkpoint: str | os.PathLike[str], groups: list[TensorGroup], dtype: torch.dtype | None
) -> list[GroupSource]:
    """One source per group; every key is checked (shape, dtype) before any is read.

    Raises:
        ResidencyCheckpointError: A parameter or a persistent buffer on meta that the
            checkpoint lacks, another shape, or a dtype that does not load.
    """
    found = Checkpoint.open(Path(checkpoint))
    expected: dict[str, tuple[torch.Size, torch.dtype]] = {}
    plans: list[tuple[list[str], dict[str, str], dict[str, torch.Tensor]]] = []
    for group in groups:
        keys: dict[str, str] = {}
        kept: dict[str, torch.Tensor] = {}
        for name, tensor, slots in zip(group.names, group.tensors, group.slots, strict=True):
            # A tied tensor is saved under one of its names (transformers drops the
            # others): any of them will do.
            key = next((slot.qualified for slot in slots if slot.qualified in found), None)
            if key is not None:
                keys[name] = key
                expected[key] = (tensor.shape, tensor.dtype)
            elif not slots[0].is_parameter and not tensor.is_meta:
                kept[name] = tensor.detach()
            else:
                what = "parameter" if slots[0].is_parameter else "buffer (on meta)"
                raise ResidencyCheckpointError(
                    f"the module's {what} is not in the checkpoint"
                    + (
                        ""
                        if slots[0].is_parameter
                        else ": build the module with init_empty_weights(), which keeps "
                        "buffers real"
                    ),
                    key=name,
                    path=str(found.path),
                )
        plans.append((list(group.names), keys, kept))
    found.check(expected, dtype=dtype)
    sources = []
    for names, keys, kept in plans:
        read = found.source(keys, dtype=dtype) if keys else None
        sources.append(GroupSource(names, read, kept))
    return sources
