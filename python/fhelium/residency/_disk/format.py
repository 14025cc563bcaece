"""The disk tier's file format: one standard safetensors file per stored value, with a
checksum per storage, and the file I/O that reads and writes it.

Each file is a standard safetensors file, so other tools can read it:

- a tensor field that is exactly its whole contiguous storage is stored as itself,
  under the name ``field.<i>`` (its dtype and shape as safetensors records them);
- any other storage (a view's larger backing, or one shared by several fields) is
  stored once as raw bytes (``U8``) under ``storage.<k>``, and the
  ``__metadata__`` entry ``fhelium.fields`` (JSON) says, per field, which storage it
  views with which dtype, element offset, shape and stride.

``__metadata__`` also records ``fhelium.format`` (``"1"``), ``fhelium.checksum``
(``"xxh3-64"``) and ``fhelium.checksums``: a JSON list with one checksum per storage,
in storage order, each 16 lowercase hexadecimal digits (XXH3-64, seed 0, of the
storage's bytes). The checksums are computed by the Rust core (`fhelium._core.Checksum`,
the interpreter released) while the bytes stream to the file, a piece or a staging
chunk at a time, never in a second pass: the header is written first with zeros in
their place (the same width, `UNKNOWN`), and rewritten in place once the data is
written, before the file is synced and renamed.

The header is padded with spaces (as the format allows) so that the data starts at a
multiple of 4096 bytes: the data can then be read and written with direct I/O.

A value's storage layout (which storage each tensor views, and how) is the one the
distributed transfers use too, written once in `fhelium.residency._storage_layout`:
`layout` records it in the header, `DiskFile` keeps it, `rebuild` makes the tensors
again from the storages' bytes. A tensor on a zero-byte storage gets a zero-length
storage of its own, so every field names one.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from fhelium._core import Checksum
from fhelium.errors import ResidencyIntegrityError, ResidencyMaterializationError
from fhelium.residency._safetensors import DTYPES
from fhelium.residency._storage_layout import Field, describe
from fhelium.residency._storage_layout import rebuild as rebuild_views
from fhelium.values.tensor_resident import TensorResident

__all__ = [
    "ALIGN",
    "CHECKSUM",
    "FORMAT",
    "OVERLAPPED",
    "PIECE",
    "UNKNOWN",
    "DiskFile",
    "ended_early",
    "layout",
    "prefix",
    "read_buffered",
    "read_exactly",
    "rebuild",
    "verify",
    "write_all",
    "write_at",
    "write_buffered",
]

# Direct I/O needs file offsets, lengths and buffer addresses aligned to the device's
# logical block size; 4096 covers every common one.
ALIGN: Final = 4096
# Buffered writes, and buffered reads of small storages, move this many bytes per
# system call, and each piece is hashed right after it is read (or just before it is
# written): small enough that the hash reads what the copy just left in the CPU's cache.
PIECE: Final = 256 << 10
# A verified buffered read of a storage of at least two of these reads it a piece this
# large at a time and hashes each piece on a hashing thread while the next is read: with
# a core to spare the checksum then costs almost nothing (docs/project.md).
OVERLAPPED: Final = 4 << 20

FORMAT: Final = "1"
CHECKSUM: Final = "xxh3-64"
# What a checksum looks like in the header while the data is still being written.
UNKNOWN: Final = "0" * 16

# The dtypes a file stores, by their safetensors names (the one table of those names is
# `fhelium.residency._safetensors.DTYPES`): format "1" stores these and no others.
_STORED: Final = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "C64")
_NAMES: Final[dict[torch.dtype, str]] = {DTYPES[name]: name for name in _STORED}


@dataclass(frozen=True, slots=True)
class DiskFile:
    """One stored value: its file, the file's size when written, and how to rebuild it."""

    path: Path
    nbytes: int
    # The value with every tensor on the meta device: its type and structure, no memory.
    skeleton: TensorResident
    # (entry offset from the data start, entry length) per storage, in storage order.
    storages: tuple[tuple[int, int], ...]
    # Per field: its storage, element offset, shape, stride and dtype.
    fields: tuple[Field, ...]
    data_start: int
    # Per storage: its XXH3-64 checksum as written, 16 hexadecimal digits.
    checksums: tuple[str, ...]


def layout(
    tensors: tuple[torch.Tensor, ...],
) -> tuple[dict[str, Any], tuple[tuple[int, int], ...], tuple[Field, ...], list[torch.Tensor]]:
    """The safetensors header, each storage's (offset, length), each field's view, and
    the byte blobs to write in order.

    Raises:
        TypeError: A tensor of a dtype the format does not store.
    """
    for tensor in tensors:
        if tensor.dtype not in _NAMES:
            raise TypeError(f"cannot store a {tensor.dtype} tensor on disk")
    described, blobs = describe(tensors, "own")
    storages: list[tuple[int, int]] = []
    header: dict[str, Any] = {}
    offset = 0
    for index, (length, field) in enumerate(zip(described.storages, described.whole, strict=True)):
        storages.append((offset, length))
        if field >= 0:
            header[f"field.{field}"] = {
                "dtype": _NAMES[tensors[field].dtype],
                "shape": list(tensors[field].shape),
                "data_offsets": [offset, offset + length],
            }
        else:
            header[f"storage.{index}"] = {
                "dtype": "U8",
                "shape": [length],
                "data_offsets": [offset, offset + length],
            }
        offset += length
    header["__metadata__"] = {
        "fhelium.format": FORMAT,
        "fhelium.checksum": CHECKSUM,
        "fhelium.fields": json.dumps(
            [
                [
                    field.storage,
                    _NAMES[field.dtype],
                    field.offset,
                    list(field.size),
                    list(field.stride),
                ]
                for field in described.fields
            ]
        ),
    }
    return header, tuple(storages), described.fields, blobs


def rebuild(file: DiskFile, buffers: list[torch.Tensor]) -> TensorResident:
    """The stored value's tensors as views of ``buffers`` (one per storage)."""
    return rebuild_views(file.skeleton, file.fields, buffers, None)


def prefix(header: dict[str, Any], checksums: list[str]) -> bytes:
    """The file's first bytes: the header's length, then the header, with
    ``checksums`` recorded and padded so that the data starts on a page."""
    header["__metadata__"]["fhelium.checksums"] = json.dumps(checksums, separators=(",", ":"))
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % ALIGN)
    return struct.pack("<Q", len(encoded)) + encoded


def verify(file: DiskFile, hashers: list[Checksum] | None) -> None:
    """Raises `ResidencyIntegrityError` unless every storage's bytes, as hashed while
    they were read, have the checksum recorded at write."""
    if hashers is None:
        return
    for hasher, expected in zip(hashers, file.checksums, strict=True):
        actual = hasher.hexdigest()
        if actual != expected:
            raise ResidencyIntegrityError(path=str(file.path), expected=expected, actual=actual)


def write_all(descriptor: int, view: memoryview) -> None:
    while view:
        written = os.write(descriptor, view)
        view = view[written:]


def write_at(descriptor: int, data: bytes, offset: int, direct: bool) -> None:
    """Writes ``data`` at ``offset``; with direct I/O from a page-aligned copy (an
    anonymous map), as ``O_DIRECT`` needs (``data`` is whole pages then)."""
    if not direct:
        view = memoryview(data)
        while view:
            view = view[os.pwrite(descriptor, view, offset + len(data) - len(view)) :]
        return
    block = mmap.mmap(-1, len(data))
    try:
        block.write(data)
        aligned = memoryview(block)
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(descriptor, aligned[done:], offset + done)
        finally:
            aligned.release()
    finally:
        block.close()


def write_buffered(
    descriptor: int, prefix: bytes, blobs: list[torch.Tensor], hashers: list[Checksum]
) -> int:
    """Writes ``prefix`` then each host blob a `PIECE` at a time, each piece hashed
    into its blob's checksum just before it is written. Returns the bytes written."""
    write_all(descriptor, memoryview(prefix))
    total = len(prefix)
    for blob, hasher in zip(blobs, hashers, strict=True):
        view = memoryview(blob.numpy())  # type: ignore[arg-type]
        for begin in range(0, len(view), PIECE):
            piece = view[begin : begin + PIECE]
            hasher.update(piece)
            write_all(descriptor, piece)
        total += len(view)
    return total


def read_buffered(
    file: DiskFile, buffers: list[torch.Tensor], hashers: list[Checksum] | None
) -> None:
    """Reads each storage of ``file`` into its buffer. Unverified, or for a storage
    under two `OVERLAPPED` pieces, a `PIECE` at a time, each piece hashed right after it
    is read; larger verified storages an `OVERLAPPED` piece at a time, each hashed on
    the hashing thread while the next is read."""
    descriptor = os.open(file.path, os.O_RDONLY)
    try:
        for index, ((offset, length), buffer) in enumerate(
            zip(file.storages, buffers, strict=True)
        ):
            view = memoryview(buffer.numpy())  # type: ignore[arg-type]
            at = file.data_start + offset
            hasher = None if hashers is None else hashers[index]
            pool = _hashing_pool() if hasher is not None and length >= 2 * OVERLAPPED else None
            if hasher is not None and pool is not None:
                _read_overlapped(descriptor, view, at, file.path, hasher, pool)
                continue
            for done in range(0, length, PIECE):
                piece = view[done : done + PIECE]
                read_exactly(descriptor, piece, at + done, file.path)
                if hasher is not None:
                    hasher.update(piece)
    finally:
        os.close(descriptor)


def _read_overlapped(
    descriptor: int,
    view: memoryview,
    at: int,
    path: Path,
    hasher: Checksum,
    pool: ThreadPoolExecutor,
) -> None:
    """Reads ``view`` from ``at`` an `OVERLAPPED` piece at a time, hashing each piece on
    ``pool``'s thread (in order: one piece at a time) while this thread reads the next."""
    hashing: Future[None] | None = None
    try:
        for done in range(0, len(view), OVERLAPPED):
            piece = view[done : done + OVERLAPPED]
            read_exactly(descriptor, piece, at + done, path)
            if hashing is not None:
                hashing.result()
                hashing = None
            try:
                hashing = pool.submit(hasher.update, piece)
            except RuntimeError:  # the interpreter is shutting down: no new threads
                hasher.update(piece)
        if hashing is not None:
            hashing.result()
            hashing = None
    finally:
        if hashing is not None:  # a read failed: the hash still reads the buffer
            wait_futures([hashing])


class _Hashing:
    """The one thread that hashes buffered reads beside the reader, made on first use
    in each process (a forked child inherits the executor but not its thread)."""

    pool: ThreadPoolExecutor | None = None
    pid = 0


def _hashing_pool() -> ThreadPoolExecutor | None:
    """The hashing thread's executor, or None once the interpreter is shutting down (no
    new threads: the caller hashes on its own thread then)."""
    if _Hashing.pool is None or _Hashing.pid != os.getpid():
        try:
            _Hashing.pool = ThreadPoolExecutor(1, thread_name_prefix="fhelium-disk-hash")
        except RuntimeError:
            return None
        _Hashing.pid = os.getpid()
    return _Hashing.pool


def read_exactly(descriptor: int, view: memoryview, offset: int, path: Path) -> None:
    filled = 0
    while filled < len(view):
        got = os.preadv(descriptor, [view[filled:]], offset + filled)
        if got <= 0:
            raise ended_early(path)
        filled += got


def ended_early(path: Path) -> ResidencyMaterializationError:
    """The error of a read that found the file at ``path`` shorter than written."""
    return ResidencyMaterializationError(
        f"{path} ended early: it was truncated behind the manager's back"
    )
