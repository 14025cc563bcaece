"""The files of one owner (a manager) in a disk directory: written atomically, read back
without an extra copy, removed on request, at close and at interpreter exit.

Layout: ``<root>/fhelium-residency-<owner id>/`` holds ``owner.json`` (who owns the
directory: process id, host, owner id, process start time) and one ``<name>.safetensors``
file per stored value. Each file is a standard safetensors file, so other tools can
read it:

- a tensor field that is exactly its whole contiguous storage is stored as itself,
  under the name ``field.<i>`` (its dtype and shape as safetensors records them);
- any other storage (a view's larger backing, or one shared by several fields) is
  stored once as raw bytes (``U8``) under ``storage.<k>``, and the
  ``__metadata__`` entry ``fhelium.fields`` (JSON) says, per field, which storage it
  views with which dtype, element offset, shape and stride.

``__metadata__`` also records ``fhelium.format`` (``"1"``) and ``fhelium.fields``
always, so a reader can rebuild the value's exact tensors, views and sharing.

Writes go to ``<name>.safetensors.tmp``, are flushed and synced, then renamed over the
final name, and the directory is synced: a crash leaves at most a ``.tmp`` file, never
a final file the store would trust. Reads check the file's size against what was
written, so a file truncated or replaced behind the store's back is refused.

A directory whose ``owner.json`` names a process of this host that no longer runs was
left by a killed process. Opening a store in the same root recognises it: with
``stale="clean"`` its files are removed (a ``RuntimeWarning`` says so; a directory
holding anything the store did not write is refused instead), with ``stale="refuse"``
opening fails with ``ResidencyInUseError``. A directory is never reused: every owner
gets its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
import torch

from fhelium.errors import ResidencyInUseError, ResidencyMaterializationError
from fhelium.values.tensor_resident import TensorResident

__all__ = ["DiskFile", "DiskStore", "DiskTier"]

PREFIX: Final = "fhelium-residency-"
OWNER: Final = "owner.json"
SUFFIX: Final = ".safetensors"
TEMPORARY: Final = ".tmp"
FORMAT: Final = "1"

_DTYPES: Final[dict[torch.dtype, str]] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
_NAMES: Final = {name: dtype for dtype, name in _DTYPES.items()}


@dataclass(frozen=True, slots=True)
class DiskFile:
    """One stored value: its file, the file's size when written, and how to rebuild it."""

    path: Path
    nbytes: int
    # The value with every tensor on the meta device: its type and structure, no memory.
    skeleton: TensorResident
    # (entry offset from the data start, entry length) per storage, in storage order.
    storages: tuple[tuple[int, int], ...]
    # Per field: (storage index, dtype, element offset, shape, stride).
    fields: tuple[tuple[int, torch.dtype, int, tuple[int, ...], tuple[int, ...]], ...]
    data_start: int


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` as the kernel counts it, where /proc has it
    (it tells a live process from a later one that reused its id)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return started is None or _process_start(pid) in (None, started)


def _remove_quietly(directory: Path) -> None:
    """Removes the store's own files and then the directory, ignoring what is gone."""
    for path in directory.glob(f"*{SUFFIX}*"):
        with contextlib.suppress(OSError):
            path.unlink()
    with contextlib.suppress(OSError):
        (directory / OWNER).unlink()
    with contextlib.suppress(OSError):
        directory.rmdir()


def _remove_owned(directory: Path, owner_pid: int) -> None:
    if os.getpid() == owner_pid:
        _remove_quietly(directory)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class DiskStore:
    """The files of owner ``owner_id`` under ``root`` (see the module docstring)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        owner_id: str,
        *,
        stale: Literal["clean", "refuse"] = "clean",
    ) -> None:
        if stale not in ("clean", "refuse"):
            raise ValueError(f"stale must be 'clean' or 'refuse', got {stale!r}")
        self.root = Path(root)
        self._handle_stale(stale)
        self.directory = self.root / f"{PREFIX}{owner_id}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.directory.mkdir()
            owner = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "owner": owner_id,
                "started": _process_start(os.getpid()),
            }
            with open(self.directory / OWNER, "x", encoding="utf-8") as file:
                json.dump(owner, file)
        except FileExistsError as error:
            raise ResidencyInUseError(
                f"{self.directory} already exists: a directory is never shared or reused"
            ) from error
        except OSError as error:
            _remove_quietly(self.directory)
            raise ResidencyMaterializationError(
                f"cannot create the disk directory {self.directory}: {error}"
            ) from error
        # Files left at interpreter exit are removed then, by this process only (a
        # forked child inherits the finalizer, not the directory).
        self._finalizer = weakref.finalize(self, _remove_owned, self.directory, os.getpid())

    # ------------------------------------------------------------------ owners

    def _handle_stale(self, stale: str) -> None:
        if not self.root.is_dir():
            return
        host = socket.gethostname()
        for directory in sorted(self.root.glob(f"{PREFIX}*")):
            try:
                owner = json.loads((directory / OWNER).read_text(encoding="utf-8"))
                pid, started = int(owner["pid"]), owner.get("started")
                if owner["host"] != host or _alive(pid, started):
                    continue  # another host's, or a live owner's: not ours to judge
            except (OSError, ValueError, KeyError, TypeError):
                continue  # no readable owner record: not a directory this store made
            if stale == "refuse":
                raise ResidencyInUseError(
                    f"{directory} holds the files of residency manager {owner['owner']!r} "
                    f"from process {pid}, which exited without closing it; remove it, or "
                    "open with stale='clean' to have it removed"
                )
            foreign = [
                path.name
                for path in directory.iterdir()
                if path.name != OWNER and not path.name.endswith((SUFFIX, SUFFIX + TEMPORARY))
            ]
            if foreign:
                raise ResidencyInUseError(
                    f"{directory} was left by process {pid}, which exited without closing "
                    f"it, but also holds files the manager did not write ({foreign[:3]}); "
                    "it is left alone: remove it by hand"
                )
            _remove_quietly(directory)
            warnings.warn(
                f"removed {directory}, left by residency manager {owner['owner']!r} of "
                f"process {pid}, which exited without closing it",
                RuntimeWarning,
                stacklevel=4,
            )

    # ------------------------------------------------------------------ files

    def path_of(self, name: str) -> Path:
        return self.directory / f"{name}{SUFFIX}"

    def write(self, name: str, value: TensorResident) -> DiskFile:
        """Stores ``value``'s tensors as ``<name>.safetensors``, atomically."""
        tensors = value._resident_tensors
        header, storages, fields, blobs = _layout(tensors)
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        data_start = 8 + len(encoded)
        final = self.path_of(name)
        temporary = final.with_name(final.name + TEMPORARY)
        try:
            with open(temporary, "wb") as file:
                file.write(struct.pack("<Q", len(encoded)))
                file.write(encoded)
                for blob in blobs:
                    file.write(blob.numpy().data)
                file.flush()
                os.fsync(file.fileno())
                size = file.tell()
            os.replace(temporary, final)
            _fsync_directory(self.directory)
        except OSError as error:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise ResidencyMaterializationError(
                f"writing {final.name} to {self.directory} failed: {error}"
            ) from error
        skeleton = value._with_resident_tensors(
            tuple(
                torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
                for t in tensors
            )
        )
        return DiskFile(final, size, skeleton, storages, fields, data_start)

    def read(
        self,
        file: DiskFile,
        allocate: Callable[[int], torch.Tensor] | None = None,
    ) -> TensorResident:
        """The stored value. Without ``allocate`` its storages are private copy-on-write
        maps of the file (pageable memory, filled from the page cache as touched); with
        it, each storage is read straight into ``allocate(nbytes)`` (a flat ``uint8``
        CPU tensor, for instance pinned)."""
        path = file.path
        try:
            size = path.stat().st_size
            if size != file.nbytes:
                raise ResidencyMaterializationError(
                    f"{path} is {size} bytes, not the {file.nbytes} written: it was truncated "
                    "or replaced behind the manager's back"
                )
            buffers: list[torch.Tensor] = []
            if allocate is None:
                for offset, length in file.storages:
                    mapped = (
                        np.memmap(
                            path,
                            dtype=np.uint8,
                            mode="c",
                            offset=file.data_start + offset,
                            shape=(length,),
                        )
                        if length
                        else np.empty(0, dtype=np.uint8)
                    )
                    buffers.append(torch.from_numpy(mapped))
            else:
                with open(path, "rb") as handle:
                    for offset, length in file.storages:
                        buffer = allocate(length)
                        handle.seek(file.data_start + offset)
                        view = buffer.numpy().data
                        if handle.readinto(view) != length:
                            raise ResidencyMaterializationError(
                                f"{path} ended early: it was truncated behind the manager's back"
                            )
                        buffers.append(buffer)
        except OSError as error:
            raise ResidencyMaterializationError(f"reading {path} failed: {error}") from error
        tensors = []
        for storage, dtype, offset, shape, stride in file.fields:
            tensor = torch.empty(0, dtype=dtype)
            tensor.set_(buffers[storage].untyped_storage(), offset, shape, stride)
            tensors.append(tensor)
        return file.skeleton._with_resident_tensors(tuple(tensors))

    def remove(self, file: DiskFile) -> None:
        """Deletes the file; one already gone is no error."""
        with contextlib.suppress(FileNotFoundError):
            file.path.unlink()

    def close(self) -> None:
        """Removes every file of the store and its directory."""
        self._finalizer()


def _layout(
    tensors: tuple[torch.Tensor, ...],
) -> tuple[dict[str, Any], tuple[tuple[int, int], ...], tuple[Any, ...], list[torch.Tensor]]:
    """The safetensors header, each storage's (offset, length), each field's view, and
    the byte blobs to write in order."""
    storage_index: dict[int, int] = {}
    blobs: list[torch.Tensor] = []
    storages: list[tuple[int, int]] = []
    fields: list[tuple[int, torch.dtype, int, tuple[int, ...], tuple[int, ...]]] = []
    header: dict[str, Any] = {}
    offset = 0
    whole: dict[int, int] = {}
    for position, tensor in enumerate(tensors):
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"cannot store a {tensor.dtype} tensor on disk")
        storage = tensor.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else -1 - position
        if key not in storage_index:
            storage_index[key] = len(blobs)
            if tensor.device.type != "cpu":
                raise ValueError(f"the disk store writes host values, got one on {tensor.device}")
            blob = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
            blobs.append(blob)
            storages.append((offset, storage.nbytes()))
            offset += storage.nbytes()
            whole[storage_index[key]] = (
                position
                if (
                    tensor.is_contiguous()
                    and tensor.storage_offset() == 0
                    and tensor.nbytes == storage.nbytes()
                )
                else -1
            )
        else:
            whole[storage_index[key]] = -1  # shared: raw bytes
        index = storage_index[key]
        fields.append(
            (
                index,
                tensor.dtype,
                int(tensor.storage_offset()),
                tuple(tensor.shape),
                tuple(tensor.stride()),
            )
        )
    for index, (begin, length) in enumerate(storages):
        field = whole[index]
        if field >= 0:
            tensor = tensors[field]
            header[f"field.{field}"] = {
                "dtype": _DTYPES[tensor.dtype],
                "shape": list(tensor.shape),
                "data_offsets": [begin, begin + length],
            }
        else:
            header[f"storage.{index}"] = {
                "dtype": "U8",
                "shape": [length],
                "data_offsets": [begin, begin + length],
            }
    header["__metadata__"] = {
        "fhelium.format": FORMAT,
        "fhelium.fields": json.dumps(
            [
                [index, _DTYPES[dtype], element, list(shape), list(stride)]
                for index, dtype, element, shape, stride in fields
            ]
        ),
    }
    return header, tuple(storages), tuple(fields), blobs


class DiskTier:
    """A manager's disk locations: one `DiskStore` per directory, opened on first
    write, all removed at close. The binding calls it to write, read and remove the
    materialisations at disk locations (docs/concepts/locations-and-budgets.md#disk)."""

    __slots__ = ("owner_id", "stores", "written")

    def __init__(self) -> None:
        self.owner_id = ""
        self.stores: dict[str, DiskStore] = {}
        self.written = 0  # names every file uniquely

    def _store(self, path: str) -> DiskStore:
        store = self.stores.get(path)
        if store is None:
            store = self.stores[path] = DiskStore(path, self.owner_id)
        return store

    def write(self, location: Any, value: TensorResident, runtime: Any) -> DiskFile:
        """Writes a host value (a CUDA one is first copied to pageable memory) to a
        new file."""
        if runtime.value_device(value).type != "cpu":
            value = runtime.copy_to_pageable(value)
        self.written += 1
        return self._store(location.path).write(f"value-{self.written}", value)

    def read(self, file: DiskFile, pinned: bool, runtime: Any) -> TensorResident:
        """The stored value in pageable memory (mapped), or in pinned memory."""
        store = next(
            (store for store in self.stores.values() if store.directory == file.path.parent),
            None,
        )
        if store is None:
            raise ResidencyMaterializationError(f"{file.path} belongs to no open disk store")
        value = store.read(file)
        return runtime.copy_to_pinned(value) if pinned else value

    def remove(self, file: object) -> None:
        if isinstance(file, DiskFile):
            for store in self.stores.values():
                if file.path.parent == store.directory:
                    store.remove(file)
                    return

    def facts(self, file: DiskFile) -> tuple[int, int]:
        """(logical bytes, storage bytes) of a stored value."""
        logical = sum(
            int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
            for _, dtype, _, shape, _ in file.fields
        )
        return logical, sum(length for _, length in file.storages)

    def close(self) -> None:
        stores, self.stores = self.stores, {}
        for store in stores.values():
            store.close()
