"""`CheckpointSource`: the recipe of one managed value, read from a checkpoint's files.

Each load reads only its own tensors' byte ranges, into memory the process owns
(``torch.empty`` buffers filled with ``os.preadv``), never into a map of the file: a
checkpoint truncated or rewritten while it is in use cannot kill the process with
``SIGBUS`` (see docs/concepts/locations-and-budgets.md#disk, which follows the same
rule), and a file that changed since its header was read, or that ends early, raises
`ResidencyMaterializationError` instead of returning other bytes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import torch

from fhelium.errors import ResidencyMaterializationError
from fhelium.residency.model import Recoverability, ReplicaMode, ResidencyValueSpec
from fhelium.residency.nn._shards import CheckpointEntry, Identity, file_identity
from fhelium.values.tensor_resident import TensorBundle

__all__ = ["CheckpointSource"]

# At most this many buffers in one `os.preadv` (IOV_MAX is 1024 on Linux).
_IOV_MAX: Final = 512


class CheckpointSource:
    """A `ResidencySource` reading some tensors of a checkpoint into a `TensorBundle`.

    Made by `Checkpoint.source`. Each `load` reads exactly its tensors' byte ranges (runs
    of adjacent tensors in one ``os.preadv`` each) into new pageable memory the process
    owns, casts floating tensors when a dtype was given, and returns them named and
    ordered as asked. A file that changed since its header was read (its size, mtime or
    inode), that ends early, or that cannot be read raises
    `ResidencyMaterializationError` naming it; no bytes of another layout are returned.
    """

    __slots__ = ("_cast", "_entries", "_identities")

    def __init__(
        self,
        entries: tuple[tuple[str, CheckpointEntry], ...],
        identities: Mapping[Path, Identity],
        cast: torch.dtype | None,
    ) -> None:
        self._entries = entries
        self._identities = dict(identities)
        self._cast = cast

    @property
    def names(self) -> tuple[str, ...]:
        """The value's tensor names, in order."""
        return tuple(name for name, _ in self._entries)

    @property
    def entries(self) -> tuple[CheckpointEntry, ...]:
        """Where each tensor lies, in the order of `names`."""
        return tuple(found for _, found in self._entries)

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype floating tensors are cast to, or ``None``."""
        return self._cast

    @property
    def read_nbytes(self) -> int:
        """The bytes one `load` reads from the files."""
        return sum(found.nbytes for _, found in self._entries)

    @property
    def nbytes(self) -> int:
        """The loaded value's bytes (after any cast)."""
        return sum(
            found.shape.numel() * self._loaded_dtype(found.dtype).itemsize
            for _, found in self._entries
        )

    def _loaded_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self._cast is not None and dtype.is_floating_point:
            return self._cast
        return dtype

    def spec(
        self, *, replica_mode: ReplicaMode = ReplicaMode.EXCLUSIVE
    ) -> ResidencyValueSpec[TensorBundle]:
        """The value's spec: a RECONSTRUCTIBLE `TensorBundle` of `nbytes` logical and
        storage bytes; nothing is read.

        Raises:
            TypeError: ``replica_mode`` is not a ReplicaMode.
        """
        size = self.nbytes
        return ResidencyValueSpec(
            TensorBundle, size, size, replica_mode, Recoverability.RECONSTRUCTIBLE
        )

    def layout(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Each loaded tensor's shape and dtype (after any cast), by name; nothing is
        read."""
        return {
            name: (found.shape, self._loaded_dtype(found.dtype)) for name, found in self._entries
        }

    def load(self) -> TensorBundle:
        """Read the tensors into new pageable host memory.

        Raises:
            ResidencyMaterializationError: A file changed since its header was read, ended
                early, or could not be read.
        """
        buffers: dict[int, torch.Tensor] = {}
        by_file: dict[Path, list[int]] = {}
        for position, (_, found) in enumerate(self._entries):
            buffers[position] = torch.empty(found.nbytes, dtype=torch.uint8)
            by_file.setdefault(found.path, []).append(position)
        for path, positions in by_file.items():
            self._read_file(path, positions, buffers)
        tensors: dict[str, torch.Tensor] = {}
        for position, (name, found) in enumerate(self._entries):
            raw = buffers.pop(position)
            tensor = raw.view(found.dtype).reshape(found.shape)
            loaded = self._loaded_dtype(found.dtype)
            tensors[name] = tensor if loaded == found.dtype else tensor.to(loaded)
        return TensorBundle(tensors)

    def _read_file(
        self, path: Path, positions: list[int], buffers: dict[int, torch.Tensor]
    ) -> None:
        try:
            descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as error:
            raise ResidencyMaterializationError(f"{path} cannot be read: {error}") from error
        try:
            if file_identity(os.fstat(descriptor)) != self._identities[path]:
                raise ResidencyMaterializationError(
                    f"{path} changed since its header was read (its size, mtime or inode "
                    "differs): open the checkpoint again"
                )
            # Runs of tensors that lie end to end, each read with one call.
            ordered = sorted(positions, key=lambda position: self._entries[position][1].start)
            run: list[int] = []
            for position in ordered:
                found = self._entries[position][1]
                if found.nbytes == 0:
                    continue
                if run and (self._entries[run[-1]][1].stop != found.start or len(run) == _IOV_MAX):
                    self._read_run(descriptor, path, run, buffers)
                    run = []
                run.append(position)
            if run:
                self._read_run(descriptor, path, run, buffers)
        except OSError as error:
            raise ResidencyMaterializationError(f"{path} cannot be read: {error}") from error
        finally:
            os.close(descriptor)

    def _read_run(
        self, descriptor: int, path: Path, run: list[int], buffers: dict[int, torch.Tensor]
    ) -> None:
        offset = self._entries[run[0]][1].start
        views = [memoryview(buffers[position].numpy()) for position in run]  # type: ignore[arg-type]
        _read_exactly(descriptor, views, offset, path)


def _read_exactly(descriptor: int, views: list[memoryview], offset: int, path: Path) -> None:
    """Fill ``views``, in order, with the file's bytes from ``offset`` on."""
    pending = [view for view in views if len(view)]
    while pending:
        got = os.preadv(descriptor, pending, offset)
        if got <= 0:
            raise ResidencyMaterializationError(
                f"{path} ended early, at byte {offset}: it was truncated after its header was read"
            )
        offset += got
        while pending and got >= len(pending[0]):
            got -= len(pending[0])
            pending.pop(0)
        if got:
            pending[0] = pending[0][got:]
