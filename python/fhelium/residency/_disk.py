"""The files of one owner (a manager) in a disk directory: written atomically with a
checksum per storage, read back into memory the reader owns and checked on the way,
removed on request, at close and at interpreter exit.

Layout: ``<root>/fhelium-residency-<owner id>/`` (mode ``0700``) holds ``owner.json``
(who owns the directory: process id, host, owner id, process start time) and one
``<name>.safetensors`` file (mode ``0600``) per stored value; both modes are set
explicitly, whatever the umask. Each file is a standard safetensors file, so other
tools can read it:

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
their place (the same width), and rewritten in place once the data is written, before
the file is synced and renamed.

The header is padded with spaces (as the format allows) so that the data starts at a
multiple of 4096 bytes: the data can then be read and written with direct I/O.

Writes go to ``<name>.safetensors.tmp`` (created exclusively; only a file this write
created is ever removed on failure), are synced, then renamed over the final name, and
the directory is synced: a crash leaves at most a ``.tmp`` file, never a final file the
store would trust. Reads check the file's size against what was written, so a file
truncated or replaced behind the store's back is refused, and (unless the store was
opened with ``verify=False``) each storage's checksum against the one recorded at
write, before the bytes are returned: a damaged file raises `ResidencyIntegrityError`.
Every read lands in new memory the reader owns (pageable ``torch.empty`` storage,
pinned memory, or device memory), never a map of the file: a file truncated or
rewritten afterwards cannot change the value or kill the process, and deleting the
file frees its blocks at once. File names carry the writing process's id and a random
token, so processes sharing a directory (a forked child) never collide.

Bytes that come from or go to a CUDA device, and every byte of a store opened with
``direct=True``, pass through a `Staging` ring: two chunks of `CHUNK` bytes, pinned
where the runtime can pin, each guarded by the event of the last copy that used it.
Reading the next chunk from the file (on the ring's I/O thread) overlaps hashing and
copying out the one before, and writing a chunk to the file overlaps hashing and the
device copy of the next. While a pipeline stages a step (`DiskTier.defer`), a
read to a device, or a reconstruction by a source that ``loads_alone``, runs whole on
the I/O thread, after the ones before it, and its event is a `StagedEvent`
(docs/concepts/locations-and-budgets.md#staging-and-direct-io); whatever else uses the
ring first waits for them. With ``direct=True`` the file is opened with ``O_DIRECT``
(bypassing the page cache) when the file system allows it, and with buffered I/O
otherwise.

A directory is created under a temporary name (``<final name>.creating-<token>``),
given its ``owner.json``, and renamed into place, so a final directory always names its
owner. Opening a store in a root sweeps it for stale directories: a
``fhelium-residency-*`` directory (never a symlink, only one this user owns, looked at
with ``lstat``) whose ``owner.json`` names a process of this host that no longer runs,
or that has no readable owner record and has not changed for `STALE_AGE` seconds (a
process killed while creating it). With ``stale="clean"`` its files are removed (a
``RuntimeWarning`` says so; nothing is followed through a symlink: a planted link is
removed, never its target); a directory with an owner that also holds anything the
store did not write is refused instead, and one with no owner record and such files
is left alone. With ``stale="refuse"`` opening fails with ``ResidencyInUseError``. A
directory is never reused: every owner gets its own.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import secrets
import socket
import stat
import struct
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
import torch

from fhelium._core import Checksum
from fhelium.errors import (
    ResidencyIntegrityError,
    ResidencyInUseError,
    ResidencyMaterializationError,
)
from fhelium.residency._runtime.base import StagedEvent
from fhelium.values.tensor_resident import TensorResident

__all__ = ["DiskFile", "DiskStore", "DiskTier"]

# Direct I/O needs file offsets, lengths and buffer addresses aligned to the device's
# logical block size; 4096 covers every common one.
ALIGN: Final = 4096
# One staging chunk (a multiple of ALIGN), and how many the ring holds.
CHUNK: Final = 16 << 20
SLOTS: Final = 2
# With direct I/O, memory on a page moves straight between the file and itself in
# pieces this large (a multiple of ALIGN): each is hashed on the caller's thread while
# the ring's I/O thread writes it, or while it reads the next; large pieces keep the
# device's queue deep.
STRAIGHT: Final = 64 << 20
# Buffered writes, and buffered reads of small storages, move this many bytes per
# system call, and each piece is hashed right after it is read (or just before it is
# written): small enough that the hash reads what the copy just left in the CPU's cache.
PIECE: Final = 256 << 10
# A verified buffered read of a storage of at least two of these reads it a piece this
# large at a time and hashes each piece on a hashing thread while the next is read: with
# a core to spare the checksum then costs almost nothing (docs/project.md).
OVERLAPPED: Final = 4 << 20
_O_DIRECT: Final = getattr(os, "O_DIRECT", 0)

PREFIX: Final = "fhelium-residency-"
OWNER: Final = "owner.json"
SUFFIX: Final = ".safetensors"
TEMPORARY: Final = ".tmp"
CREATING: Final = ".creating-"
FORMAT: Final = "1"
CHECKSUM: Final = "xxh3-64"
# A store directory with no readable owner record is stale once it has not changed
# (its mtime) for this many seconds: its creator was killed before writing one.
STALE_AGE: Final = 600.0
DIRECTORY_MODE: Final = 0o700
FILE_MODE: Final = 0o600
# What a checksum looks like in the header while the data is still being written.
_UNKNOWN: Final = "0" * 16

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
    # Per storage: its XXH3-64 checksum as written, 16 hexadecimal digits.
    checksums: tuple[str, ...]


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` as the kernel counts it, where /proc has it
    (it tells a live process from a later one that reused its id)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat_line.rsplit(")", 1)[-1].split()[19]


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return started is None or _process_start(pid) in (None, started)


def _ours(name: str) -> bool:
    """Whether a directory entry has a name the store writes."""
    return name == OWNER or name.endswith((SUFFIX, SUFFIX + TEMPORARY))


def _open_directory(directory: Path) -> int:
    """A descriptor for ``directory`` itself, never for what a symlink there names."""
    return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def _remove_quietly(directory: Path) -> None:
    """Removes the store's own files and then the directory, ignoring what is gone.
    Nothing is followed: a symlink is removed as a link, and the directory is opened
    with ``O_NOFOLLOW``. ``owner.json`` goes last, so a directory left half-removed
    still names its owner."""
    try:
        descriptor = _open_directory(directory)
    except OSError:
        return
    try:
        names = os.listdir(descriptor)
        for name in sorted(names, key=lambda entry: entry == OWNER):
            if _ours(name):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=descriptor)
    except OSError:
        pass  # unreadable: the rmdir below fails and leaves it
    finally:
        os.close(descriptor)
    with contextlib.suppress(OSError):
        directory.rmdir()


def _remove_owned(directory: Path, owner_pid: int) -> None:
    # A forked child inherits the finalizer, not the directory: it touches nothing.
    if os.getpid() == owner_pid:
        _remove_quietly(directory)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_owner(directory: Path, record: dict[str, Any]) -> None:
    descriptor = os.open(
        directory / OWNER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE
    )
    try:
        os.fchmod(descriptor, FILE_MODE)
        _write_all(descriptor, memoryview(json.dumps(record).encode()))
    finally:
        os.close(descriptor)


def _read_owner(directory: int) -> dict[str, Any] | None:
    """The owner record in the directory open as ``directory``, or None where there
    is no readable one (missing, a symlink, not a regular file, not the record)."""
    try:
        descriptor = os.open(OWNER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=directory)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return None
        owner = json.loads(os.read(descriptor, 1 << 16))
        return {
            "pid": int(owner["pid"]),
            "host": str(owner["host"]),
            "owner": str(owner["owner"]),
            "started": owner.get("started"),
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    finally:
        os.close(descriptor)


def _pageable(nbytes: int) -> torch.Tensor:
    """New pageable memory owned by the process (never a map of a file)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def _pageable_on_a_page(nbytes: int) -> torch.Tensor:
    """New pageable memory owned by the process that starts on a page, as direct I/O
    reads straight into (torch's allocator aligns to 64 bytes only, which sends every
    byte through the staging ring and a second copy): an anonymous private map, kept
    alive by the tensor, freed with it."""
    if nbytes < CHUNK:
        return _pageable(nbytes)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def _prefix(header: dict[str, Any], checksums: list[str]) -> bytes:
    """The file's first bytes: the header's length, then the header, with
    ``checksums`` recorded and padded so that the data starts on a page."""
    header["__metadata__"]["fhelium.checksums"] = json.dumps(checksums, separators=(",", ":"))
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % ALIGN)
    return struct.pack("<Q", len(encoded)) + encoded


def _verify(file: DiskFile, hashers: list[Checksum] | None) -> None:
    """Raises `ResidencyIntegrityError` unless every storage's bytes, as hashed while
    they were read, have the checksum recorded at write."""
    if hashers is None:
        return
    for hasher, expected in zip(hashers, file.checksums, strict=True):
        actual = hasher.hexdigest()
        if actual != expected:
            raise ResidencyIntegrityError(path=str(file.path), expected=expected, actual=actual)


class DiskStore:
    """The files of owner ``owner_id`` under ``root`` (see the module docstring)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        owner_id: str,
        *,
        stale: Literal["clean", "refuse"] = "clean",
        direct: bool = False,
        verify: bool = True,
    ) -> None:
        if stale not in ("clean", "refuse"):
            raise ValueError(f"stale must be 'clean' or 'refuse', got {stale!r}")
        self.root = Path(root)
        # Direct I/O (O_DIRECT) for staged reads and every write; it turns off for good
        # when the file system refuses it.
        self.direct = direct
        # Check every read against the checksums recorded at write.
        self.verify = verify
        self._pid = os.getpid()
        self._handle_stale(stale)
        self.directory = self.root / f"{PREFIX}{owner_id}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._create(owner_id)
        except FileExistsError as error:
            raise ResidencyInUseError(
                f"{self.directory} already exists: a directory is never shared or reused"
            ) from error
        except OSError as error:
            raise ResidencyMaterializationError(
                f"cannot create the disk directory {self.directory}: {error}"
            ) from error
        # Files left at interpreter exit are removed then, by this process only (a
        # forked child inherits the finalizer, not the directory).
        self._finalizer = weakref.finalize(self, _remove_owned, self.directory, self._pid)

    def _create(self, owner_id: str) -> None:
        """Makes the directory atomically: under a temporary name, with its owner
        record, then renamed into place (a killed process leaves at most a temporary
        directory, which a later sweep removes by age)."""
        if os.path.lexists(self.directory):
            raise FileExistsError(errno.EEXIST, "exists", str(self.directory))
        creating = self.root / f"{PREFIX}{owner_id}{CREATING}{secrets.token_hex(6)}"
        os.mkdir(creating, DIRECTORY_MODE)
        try:
            os.chmod(creating, DIRECTORY_MODE, follow_symlinks=False)
            _write_owner(
                creating,
                {
                    "pid": self._pid,
                    "host": socket.gethostname(),
                    "owner": owner_id,
                    "started": _process_start(self._pid),
                },
            )
            try:
                os.rename(creating, self.directory)
            except OSError as error:
                if error.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    raise FileExistsError(
                        error.errno, error.strerror, str(self.directory)
                    ) from error
                raise
        except BaseException:
            _remove_quietly(creating)
            raise

    # ------------------------------------------------------------------ owners

    def _handle_stale(self, stale: str) -> None:
        if not self.root.is_dir():
            return
        host, uid, now = socket.gethostname(), os.getuid(), time.time()
        try:
            names_in_root = sorted(os.listdir(self.root))
        except OSError:
            return  # unreadable: creating the directory below says why
        for name in names_in_root:
            if not name.startswith(PREFIX):
                continue
            directory = self.root / name
            try:
                info = os.lstat(directory)
            except OSError:
                continue
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
                continue  # a symlink or a file, or another user's: never touched
            try:
                descriptor = _open_directory(directory)
            except OSError:
                continue
            try:
                opened = os.fstat(descriptor)
                if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
                    continue  # replaced since the lstat
                owner = _read_owner(descriptor)
                names = os.listdir(descriptor)
            except OSError:
                continue
            finally:
                os.close(descriptor)
            if owner is not None:
                pid = owner["pid"]
                if owner["host"] != host or _alive(pid, owner["started"]):
                    continue  # another host's, or a live owner's: not ours to judge
                how = (
                    f"left by residency manager {owner['owner']!r} of process {pid}, which "
                    "exited without closing it"
                )
            else:
                age = now - info.st_mtime
                if age < STALE_AGE:
                    continue  # perhaps being created right now
                how = (
                    f"which has no owner record and has not changed for {age:.0f} s (more "
                    f"than {STALE_AGE:.0f}): left by a process killed while creating it"
                )
            foreign = [entry for entry in names if not _ours(entry)]
            if foreign and owner is None:
                continue  # not recognisably a store's directory: left alone
            if stale == "refuse":
                raise ResidencyInUseError(
                    f"{directory} holds the files of a residency manager, {how}; remove "
                    "it, or open with stale='clean' to have it removed"
                )
            if foreign:
                raise ResidencyInUseError(
                    f"{directory} was {how}, but also holds files the manager did not write "
                    f"({sorted(foreign)[:3]}); it is left alone: remove it by hand"
                )
            _remove_quietly(directory)
            warnings.warn(f"removed {directory}, {how}", RuntimeWarning, stacklevel=4)

    # ------------------------------------------------------------------ files

    def path_of(self, name: str) -> Path:
        return self.directory / f"{name}{SUFFIX}"

    def write(
        self,
        name: str,
        value: TensorResident,
        *,
        staging: Staging | None = None,
        device: torch.device | None = None,
    ) -> DiskFile:
        """Stores ``value``'s tensors as ``<name>.safetensors``, atomically, with a
        checksum per storage computed as the bytes stream to the file. A host value's
        bytes are written from its own memory; a value on CUDA ``device`` (and, with
        direct I/O, every value) passes through ``staging``."""
        tensors = value._resident_tensors
        header, storages, fields, blobs = _layout(tensors)
        placeholder = _prefix(header, [_UNKNOWN] * len(blobs))
        data_start = len(placeholder)
        hashers = [Checksum() for _ in blobs]
        final = self.path_of(name)
        temporary = final.with_name(final.name + TEMPORARY)
        staged = self.direct or device is not None
        if staged and staging is None:
            raise ValueError("writing CUDA bytes or with direct I/O needs a staging ring")
        created = False  # only a file this call created is ever removed
        try:
            descriptor, direct = self._open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            created = True
            try:
                os.fchmod(descriptor, FILE_MODE)
                if staged:
                    assert staging is not None
                    size = self._write_staged(
                        descriptor, direct, placeholder, blobs, hashers, staging, device
                    )
                else:
                    size = _write_buffered(descriptor, placeholder, blobs, hashers)
                checksums = tuple(hasher.hexdigest() for hasher in hashers)
                prefix = _prefix(header, list(checksums))
                assert len(prefix) == data_start  # fixed-width checksums
                _write_at(descriptor, prefix, 0, direct)
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
            os.replace(temporary, final)
            _fsync_directory(self.directory)
        except OSError as error:
            if created:
                with contextlib.suppress(OSError):
                    temporary.unlink()
            raise ResidencyMaterializationError(
                f"writing {final.name} to {self.directory} failed: {error}"
            ) from error
        except BaseException:
            if created:
                with contextlib.suppress(OSError):
                    temporary.unlink()
            raise
        skeleton = value._with_resident_tensors(
            tuple(
                torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
                for t in tensors
            )
        )
        return DiskFile(final, size, skeleton, storages, fields, data_start, checksums)

    def _open(self, path: Path, flags: int) -> tuple[int, bool]:
        """A descriptor for ``path`` and whether it does direct I/O: ``O_DIRECT`` when
        the store asks for it and the file system allows it (a refusal turns the store
        to buffered I/O for good)."""
        if self.direct and _O_DIRECT:
            try:
                return os.open(path, flags | _O_DIRECT, FILE_MODE), True
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                self.direct = False
        return os.open(path, flags, FILE_MODE), False

    def _write_staged(
        self,
        descriptor: int,
        direct: bool,
        prefix: bytes,
        blobs: list[torch.Tensor],
        hashers: list[Checksum],
        staging: Staging,
        device: torch.device | None,
    ) -> int:
        """Writes ``prefix`` and ``blobs`` (on CUDA ``device``, or on the host for None)
        to the new file open as ``descriptor`` through ``staging``, a chunk at a time:
        while the ring's I/O thread hashes one slot's bytes (into ``hashers``, one per
        blob) and writes them to the file, the next is filled (from the device, or by a
        host copy)."""
        stream = None if device is None else staging.runtime.current_stream(device)
        try:
            total = len(prefix) + sum(int(blob.numel()) for blob in blobs)
            inline = total <= CHUNK  # one chunk: nothing to overlap
            slot, fill = staging.take(), 0
            # (checksum, begin, length) of each blob's bytes in the slot being filled.
            pieces: list[tuple[Checksum, int, int]] = []

            def flush() -> None:
                """Hashes the slot's ``fill`` bytes, hands them to the I/O thread (which
                writes them while the next slot fills) and takes the next slot."""
                nonlocal slot, fill, pieces
                staging.land(slot)
                view = staging.view(slot, fill)
                for hasher, begin, length in pieces:
                    hasher.update(view[begin : begin + length])
                staging.submit(slot, inline, _write_all, descriptor, view)
                slot, fill, pieces = staging.take(), 0, []

            header = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
            segments: list[tuple[torch.Tensor, Any, Checksum | None]] = [
                (header, None, None),
                *((blob, stream, hasher) for blob, hasher in zip(blobs, hashers, strict=True)),
            ]
            for segment, copy_stream, hasher in segments:
                position, length = 0, int(segment.numel())
                if (
                    direct
                    and copy_stream is None
                    and fill % ALIGN == 0
                    and length >= ALIGN
                    and segment.data_ptr() % ALIGN == 0
                ):
                    # Host memory on a page (pinned memory is), at a page of the file:
                    # its whole pages are written straight from it, in order on the
                    # I/O thread, after what the slot holds; only its tail is staged.
                    if fill:
                        flush()
                    position = length - length % ALIGN
                    straight = memoryview(segment.numpy())[:position]  # type: ignore[arg-type]
                    for at in range(0, position, STRAIGHT):
                        piece = straight[at : at + STRAIGHT]
                        staging.submit(None, inline, _write_all, descriptor, piece)
                        if hasher is not None:  # while the I/O thread writes it
                            hasher.update(piece)
                while position < length:
                    step = min(CHUNK - fill, length - position)
                    staging.fill(slot, fill, segment[position : position + step], copy_stream)
                    if hasher is not None:
                        pieces.append((hasher, fill, step))
                    fill += step
                    position += step
                    if fill == CHUNK:
                        flush()
            staging.land(slot)
            if fill:
                padded = fill + (-fill % ALIGN) if direct else fill
                staging.zero(slot, fill, padded)
                view = staging.view(slot, padded)
                for hasher, begin, length in pieces:
                    hasher.update(view[begin : begin + length])
                staging.submit(slot, inline, _write_all, descriptor, view)
            staging.finish_io()
            if direct:
                os.ftruncate(descriptor, total)
            return total
        except BaseException as error:
            staging.settle_after(error)
            raise

    def _check_size(self, file: DiskFile) -> None:
        size = file.path.stat().st_size
        if size != file.nbytes:
            raise ResidencyMaterializationError(
                f"{file.path} is {size} bytes, not the {file.nbytes} written: it was "
                "truncated or replaced behind the manager's back"
            )

    def read(
        self,
        file: DiskFile,
        allocate: Callable[[int], torch.Tensor] | None = None,
        *,
        staging: Staging | None = None,
    ) -> TensorResident:
        """The stored value, each storage read into new memory: ``allocate(nbytes)`` (a
        flat ``uint8`` CPU tensor, for instance pinned), or pageable memory the process
        owns for None (never a map of the file). Straight from the file with buffered
        I/O, a piece at a time, or through ``staging`` with direct I/O; each storage's
        checksum is computed as its bytes arrive and checked before the value is
        returned (unless the store does not verify)."""
        path = file.path
        hashers = [Checksum() for _ in file.storages] if self.verify else None
        try:
            self._check_size(file)
            pageable = _pageable_on_a_page if self.direct else _pageable
            buffers = [(allocate or pageable)(length) for _, length in file.storages]
            if self.direct and staging is not None:
                self._read_staged(file, buffers, staging, hashers=hashers)
            else:
                _read_buffered(file, buffers, hashers)
                _verify(file, hashers)
        except OSError as error:
            raise ResidencyMaterializationError(f"reading {path} failed: {error}") from error
        return _rebuild(file, buffers)

    def read_to_cuda(
        self,
        file: DiskFile,
        device: torch.device,
        stream: Any,
        staging: Staging,
    ) -> tuple[TensorResident, Any]:
        """The stored value on CUDA ``device``, read through ``staging`` and copied on
        ``stream``, and the event that completes when every copy has: the copies are
        enqueued, not waited for. The checksums are checked before it returns; on a
        mismatch the copies are waited for and nothing is returned."""
        runtime = staging.runtime
        hashers = [Checksum() for _ in file.storages] if self.verify else None
        try:
            self._check_size(file)
            buffers = [runtime.empty_cuda(length, device, stream) for _, length in file.storages]
            event = self._read_staged(file, buffers, staging, stream, hashers=hashers)
        except OSError as error:
            raise ResidencyMaterializationError(f"reading {file.path} failed: {error}") from error
        if event is None:  # nothing to copy: an event that orders after nothing
            event = runtime.record_event(stream)
        return _rebuild(file, buffers), event

    def read_to_cuda_deferred(
        self,
        file: DiskFile,
        device: torch.device,
        stream: Any,
        staging: Staging,
    ) -> tuple[TensorResident, StagedEvent]:
        """`read_to_cuda` without blocking the caller on the file: the size is checked
        and the device memory allocated here, then the ring's I/O thread reads the
        chunks, checks the checksums and enqueues the copies on ``stream``, after the
        reads queued before it (docs/concepts/locations-and-budgets.md#staging-and-direct-io).
        The `StagedEvent` returned covers the last copy once that thread has enqueued
        it; on a failure it carries the error, after the copies made were waited for."""
        runtime = staging.runtime
        try:
            self._check_size(file)
        except OSError as error:
            raise ResidencyMaterializationError(f"reading {file.path} failed: {error}") from error
        buffers = [runtime.empty_cuda(length, device, stream) for _, length in file.storages]
        value = _rebuild(file, buffers)
        staged = StagedEvent()
        staged.value = value
        verify = self.verify

        def read() -> None:
            hashers = [Checksum() for _ in file.storages] if verify else None
            try:
                try:
                    event = self._read_staged(
                        file, buffers, staging, stream, hashers=hashers, inline=True
                    )
                except OSError as failure:
                    raise ResidencyMaterializationError(
                        f"reading {file.path} failed: {failure}"
                    ) from failure
                if event is None:
                    event = runtime.record_event(stream)
            except BaseException as error:  # carried by the event to whoever waits
                # `_read_staged` waited for the copies it made before raising.
                staged.finish(None, error)
                return
            staged.finish(event, None)

        staging.defer(read)
        return value, staged

    def _read_staged(
        self,
        file: DiskFile,
        buffers: list[torch.Tensor],
        staging: Staging,
        stream: Any = None,
        *,
        hashers: list[Checksum] | None = None,
        inline: bool = False,
    ) -> Any:
        """Reads the file's data into ``buffers`` (one per storage, host or CUDA),
        hashing each storage's bytes into ``hashers`` as they arrive and checking them
        at the end (None: no check).

        With direct I/O, a host buffer that starts on a page, for a storage that starts
        on a page of the file (the first storage always does), is read into straight
        from the file for all its whole pages. Everything else goes through
        ``staging``, a chunk at a time: while one slot's bytes are copied out (CUDA
        copies enqueued on ``stream``), the ring's I/O thread reads the next chunk into
        the other and hashes it. With ``inline`` (on the I/O thread itself) every read
        runs on the calling thread, while the device copies of the chunk before run.
        Returns the event of the last device copy (None when none was made)."""
        descriptor, direct = self._open(file.path, os.O_RDONLY)
        path = file.path
        last = None

        def ended_early() -> ResidencyMaterializationError:
            return ResidencyMaterializationError(
                f"{path} ended early: it was truncated behind the manager's back"
            )

        try:
            # (offset in the data, length, flat target, storage index) of each byte
            # range to stage.
            spans: list[tuple[int, int, torch.Tensor, int]] = []
            for index, ((start, size), buffer) in enumerate(
                zip(file.storages, buffers, strict=True)
            ):
                whole = size - size % ALIGN if direct and stream is None else 0
                if (
                    whole
                    and (file.data_start + start) % ALIGN == 0
                    and buffer.data_ptr() % ALIGN == 0
                ):
                    view = memoryview(buffer.numpy())[:whole]  # type: ignore[arg-type]
                    at = file.data_start + start
                    if hashers is None:  # nothing to overlap: one read
                        _read_exactly(descriptor, view, at, path)
                    else:
                        # A piece at a time on the I/O thread, each hashed here while
                        # the next is read.
                        pieces = [view[i : i + STRAIGHT] for i in range(0, whole, STRAIGHT)]
                        alone = len(pieces) == 1
                        staging.submit(None, alone, _read_exactly, descriptor, pieces[0], at, path)
                        for number, piece in enumerate(pieces):
                            staging.finish_io()
                            if number + 1 < len(pieces):
                                after = pieces[number + 1]
                                where = at + (number + 1) * STRAIGHT
                                staging.submit(
                                    None, alone, _read_exactly, descriptor, after, where, path
                                )
                            hashers[index].update(piece)
                    spans.append((start + whole, size - whole, buffer[whole:], index))
                else:
                    spans.append((start, size, buffer, index))
            # The chunks that cover the spans, each starting on a page and at most CHUNK
            # long; a span starting within a chunk's reach extends that chunk.
            chunks: list[tuple[int, int]] = []
            for offset, length, _, _ in spans:
                end = offset + length
                if not length:
                    continue
                begin = offset - offset % ALIGN
                if chunks and begin < chunks[-1][0] + CHUNK:
                    previous, reach = chunks[-1]
                    chunks[-1] = (previous, max(reach, min(CHUNK, end - previous)))
                    begin = previous + CHUNK
                while begin < end:
                    chunks.append((begin, min(CHUNK, end - begin)))
                    begin += CHUNK

            def read(slot: int, begin: int, step: int) -> None:
                want = step + (-step % ALIGN) if direct else step
                got = os.preadv(descriptor, [staging.view(slot, want)], file.data_start + begin)
                if got < step:
                    raise ended_early()

            inline = inline or len(chunks) <= 1
            slot = staging.take()
            if chunks:
                staging.submit(slot, inline, read, slot, *chunks[0])
            for position, (begin, step) in enumerate(chunks):
                staging.finish_io(slot)
                following = -1
                if position + 1 < len(chunks):
                    following = staging.take()
                    staging.submit(following, inline, read, following, *chunks[position + 1])
                # The chunk is here: each storage's part of it is hashed (chunks come in
                # order, so each checksum gets its bytes in order) while the I/O
                # thread reads the next, then copied out.
                chunk = staging.view(slot, step)
                for offset, length, target, index in spans:
                    low, high = max(offset, begin), min(offset + length, begin + step)
                    if low < high:
                        if hashers is not None:
                            hashers[index].update(chunk[low - begin : high - begin])
                        staging.drain(
                            slot, low - begin, target[low - offset : high - offset], stream
                        )
                event = staging.seal(slot)
                last = event if event is not None else last
                slot = following
            _verify(file, hashers)
            return last
        except BaseException as error:
            staging.settle_after(error)
            raise
        finally:
            os.close(descriptor)

    def remove(self, file: DiskFile) -> None:
        """Deletes the file; one already gone is no error. Only the process that made
        the store deletes its files (a forked child leaves its parent's alone)."""
        if os.getpid() != self._pid:
            return
        with contextlib.suppress(FileNotFoundError):
            file.path.unlink()

    def close(self) -> None:
        """Removes every file of the store and its directory (in the process that made
        it; elsewhere it does nothing)."""
        self._finalizer()


def _write_all(descriptor: int, view: memoryview) -> None:
    while view:
        written = os.write(descriptor, view)
        view = view[written:]


def _write_at(descriptor: int, data: bytes, offset: int, direct: bool) -> None:
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


def _write_buffered(
    descriptor: int, prefix: bytes, blobs: list[torch.Tensor], hashers: list[Checksum]
) -> int:
    """Writes ``prefix`` then each host blob a `PIECE` at a time, each piece hashed
    into its blob's checksum just before it is written. Returns the bytes written."""
    _write_all(descriptor, memoryview(prefix))
    total = len(prefix)
    for blob, hasher in zip(blobs, hashers, strict=True):
        view = memoryview(blob.numpy())  # type: ignore[arg-type]
        for begin in range(0, len(view), PIECE):
            piece = view[begin : begin + PIECE]
            hasher.update(piece)
            _write_all(descriptor, piece)
        total += len(view)
    return total


def _read_buffered(
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
                _read_exactly(descriptor, piece, at + done, file.path)
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
            _read_exactly(descriptor, piece, at + done, path)
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


def _read_exactly(descriptor: int, view: memoryview, offset: int, path: Path) -> None:
    filled = 0
    while filled < len(view):
        got = os.preadv(descriptor, [view[filled:]], offset + filled)
        if got <= 0:
            raise ResidencyMaterializationError(
                f"{path} ended early: it was truncated behind the manager's back"
            )
        filled += got


def _rebuild(file: DiskFile, buffers: list[torch.Tensor]) -> TensorResident:
    """The stored value's tensors as views of ``buffers`` (one per storage)."""
    tensors = []
    for storage, dtype, offset, shape, stride in file.fields:
        tensor = torch.empty(0, dtype=dtype, device=buffers[storage].device)
        tensor.set_(buffers[storage].untyped_storage(), offset, shape, stride)
        tensors.append(tensor)
    return file.skeleton._with_resident_tensors(tuple(tensors))


class Staging:
    """The disk tier's staging ring: `SLOTS` chunks of `CHUNK` bytes, pinned where the
    runtime can pin (page-aligned pageable memory otherwise), each guarded by the event
    of the last device copy that used it. Made on first use, kept until `close`."""

    __slots__ = (
        "_events",
        "_holders",
        "_io",
        "_jobs",
        "_loose",
        "_pool",
        "_pool_pid",
        "_streams",
        "buffers",
        "next",
        "runtime",
    )

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.buffers: list[torch.Tensor] = []
        self._holders: list[object] = []  # what keeps pageable chunks alive
        self._events: list[Any] = [None] * SLOTS
        # Per slot: the stream of device copies enqueued since it was last sealed.
        self._streams: list[Any] = [None] * SLOTS
        # Per slot: the file read or write the I/O thread runs on it.
        self._io: list[Future[None] | None] = [None] * SLOTS
        self._loose: list[Future[None]] = []
        # Deferred reads the I/O thread runs whole, slots included; they never raise.
        self._jobs: list[Future[None]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self.next = 0

    def _allocate(self) -> None:
        # Pinned memory is page-aligned (the allocators map whole pages), so a slot is
        # exactly CHUNK: asking for CHUNK + ALIGN would make torch's power-of-two pinned
        # allocator hand out twice CHUNK. Only a runtime that returns an unaligned buffer
        # gets one ALIGN bigger, which direct I/O then uses from its first aligned byte.
        try:
            raw = [self.runtime.empty_pinned(CHUNK) for _ in range(SLOTS)]
            raw = [
                r if r.data_ptr() % ALIGN == 0 else self.runtime.empty_pinned(CHUNK + ALIGN)
                for r in raw
            ]
        except RuntimeError:  # no pinning here (a CPU-only build): page-aligned memory
            self._holders = [mmap.mmap(-1, CHUNK) for _ in range(SLOTS)]
            self.buffers = [torch.frombuffer(m, dtype=torch.uint8) for m in self._holders]
            return
        self.buffers = [r[(-r.data_ptr()) % ALIGN :][:CHUNK] for r in raw]

    def take(self) -> int:
        """The next slot, once the device copies that last used it have completed."""
        if not self.buffers:
            self._allocate()
        slot = self.next
        self.next = (slot + 1) % SLOTS
        self.finish_io(slot)
        self.wait(slot)
        return slot

    def submit(self, slot: int | None, inline: bool, work: Callable[..., None], *args: Any) -> None:
        """Runs file I/O ``work(*args)`` on ``slot`` (None: on memory outside the ring)
        on the ring's one I/O thread, in submission order, so the caller can go on
        with the other slot; or at once with ``inline``. The file calls release the
        interpreter, and so do the host copies beside them."""
        if inline:
            work(*args)
            return
        try:
            future = self._executor().submit(work, *args)
        except RuntimeError:  # the interpreter is shutting down: no new threads
            work(*args)
            return
        if slot is None:
            self._loose.append(future)
        else:
            self._io[slot] = future

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_pid != os.getpid():
            # A forked child inherits the pool but not its thread: it makes its own.
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fhelium-disk-io")
            self._pool_pid = os.getpid()
            self._jobs = []
        return self._pool

    def defer(self, job: Callable[[], None]) -> None:
        """Runs ``job`` (a whole deferred read, which uses the slots itself and never
        raises) on the I/O thread after the reads deferred before it; at once where no
        thread can start."""
        self._jobs = [future for future in self._jobs if not future.done()]
        if not self.buffers:
            self._allocate()  # here, not on the I/O thread: pinning may sync
        try:
            self._jobs.append(self._executor().submit(job))
        except RuntimeError:  # the interpreter is shutting down: no new threads
            job()

    def quiesce(self) -> None:
        """Waits for the deferred reads: the caller then has the slots to itself."""
        jobs, self._jobs = self._jobs, []
        # A forked child inherits the parent's jobs, not the thread that runs them.
        if jobs and self._pool_pid == os.getpid():
            wait_futures(jobs)

    def finish_io(self, slot: int | None = None) -> None:
        """Waits for the I/O on ``slot`` (all I/O for None), raising its error."""
        for index in range(SLOTS) if slot is None else (slot,):
            future = self._io[index]
            if future is not None:
                self._io[index] = None
                future.result()
        if slot is None:
            loose, self._loose = self._loose, []
            for future in loose:
                future.result()

    def wait(self, slot: int) -> None:
        """Waits for the device copies recorded on the slot."""
        event = self._events[slot]
        if event is not None:
            self._events[slot] = None
            self.runtime.synchronize_event(event)

    def view(self, slot: int, length: int) -> memoryview:
        return memoryview(self.buffers[slot].numpy())[:length]  # type: ignore[arg-type]

    def fill(self, slot: int, at: int, source: torch.Tensor, stream: Any) -> None:
        """Copies flat bytes ``source`` into the slot at ``at``: on the host for a
        ``stream`` of None, else from the device on ``stream``."""
        self._copy(slot, self.buffers[slot][at : at + int(source.numel())], source, stream)

    def drain(self, slot: int, at: int, target: torch.Tensor, stream: Any) -> None:
        """Copies the slot's bytes from ``at`` into flat ``target``: on the host for a
        ``stream`` of None, else to the device on ``stream``."""
        self._copy(slot, target, self.buffers[slot][at : at + int(target.numel())], stream)

    def _copy(
        self, slot: int, destination: torch.Tensor, source: torch.Tensor, stream: Any
    ) -> None:
        if stream is None:
            destination.copy_(source)
            return
        self.runtime.copy_bytes(destination, source, stream)
        self._streams[slot] = stream

    def land(self, slot: int) -> None:
        """`seal` then `wait`: the slot's device copies are done, the host may read it."""
        self.seal(slot)
        self.wait(slot)

    def zero(self, slot: int, begin: int, end: int) -> None:
        self.buffers[slot][begin:end].zero_()

    def seal(self, slot: int) -> Any:
        """Ends a round of device copies with the slot: records the event that guards
        it (returned; None when it had none). `take` and `wait` wait for it."""
        copied_on = self._streams[slot]
        if copied_on is None:
            return None
        self._streams[slot] = None
        event = self._events[slot] = self.runtime.record_event(copied_on)
        return event

    def settle(self) -> None:
        """Waits for every copy and file operation still using a slot (after a
        failure, and at close)."""
        futures = [future for future in self._io if future is not None] + self._loose
        self._io = [None] * SLOTS
        self._loose = []
        if futures:
            wait_futures(futures)  # their errors were, or will be, raised by their owner
        for slot in range(SLOTS):
            stream = self._streams[slot]
            self._streams[slot] = None
            if stream is not None:
                self.runtime.synchronize_stream(stream)
            self.wait(slot)

    def close(self) -> None:
        """`settle`, then ends the I/O thread."""
        try:
            self.quiesce()
            self.settle()
        finally:
            pool, self._pool = self._pool, None
            if pool is not None and self._pool_pid == os.getpid():
                pool.shutdown(wait=True)

    def settle_after(self, error: BaseException) -> None:
        """`settle` on a failure path: a failure to wait becomes a note on ``error``."""
        try:
            self.settle()
        except Exception as cleanup:
            error.add_note(
                f"waiting for the disk tier's staging copies after the failure also failed: "
                f"{cleanup!r}"
            )


def _copy_through(
    staging: Staging, tensors: tuple[torch.Tensor, ...], buffers: list[torch.Tensor], stream: Any
) -> Any:
    """Copies host ``tensors`` into device ``buffers`` (flat bytes, one each) through
    the ring, a chunk at a time on ``stream``, on the thread that calls it; the event
    of the last copy (None when none was made). On a failure the copies made are
    waited for before it raises."""
    last = None
    try:
        for tensor, buffer in zip(tensors, buffers, strict=True):
            flat = tensor.contiguous().reshape(-1).view(torch.uint8)
            for begin in range(0, int(flat.numel()), CHUNK):
                piece = flat[begin : begin + CHUNK]
                slot = staging.take()
                staging.fill(slot, 0, piece, None)
                staging.drain(slot, 0, buffer[begin : begin + int(piece.numel())], stream)
                event = staging.seal(slot)
                last = event if event is not None else last
    except BaseException as error:
        staging.settle_after(error)
        raise
    return last


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
            blob = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
                storage, 0, (storage.nbytes(),), (1,)
            )
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
        "fhelium.checksum": CHECKSUM,
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
    write, all removed at close, and one `Staging` ring for the transfers that need it.
    The binding calls it to write, read and remove the materialisations at disk
    locations (docs/concepts/locations-and-budgets.md#disk)."""

    __slots__ = ("_deferring", "owner_id", "staging", "stores", "written")

    def __init__(self) -> None:
        # Per thread: the list the reads to a device it defers are added to, while a
        # pipeline stages ahead (`defer`); None otherwise.
        self._deferring = threading.local()
        self.owner_id = ""
        self.stores: dict[str, DiskStore] = {}
        self.staging: Staging | None = None
        self.written = 0  # names every file uniquely

    def _store(self, location: Any) -> DiskStore:
        store = self.stores.get(location.path)
        if store is None:
            store = DiskStore(
                location.path,
                self.owner_id,
                direct=location.direct_io,
                verify=location.verify,
            )
            self.stores[location.path] = store
        return store

    def _store_of(self, file: DiskFile) -> DiskStore:
        for store in self.stores.values():
            if store.directory == file.path.parent:
                return store
        raise ResidencyMaterializationError(f"{file.path} belongs to no open disk store")

    def _staging(self, runtime: Any, *, deferred: bool = False) -> Staging:
        """The ring, for ``runtime``; unless for a ``deferred`` read, once the reads
        deferred before are done (the caller then uses the slots itself)."""
        staging = self.staging
        if staging is None or staging.runtime is not runtime:
            if staging is not None:
                staging.close()
            staging = self.staging = Staging(runtime)
        elif not deferred:
            staging.quiesce()
        return staging

    def defer(self, runtime: Any) -> tuple[list[StagedEvent], list[StagedEvent] | None]:
        """From now on, this thread's reads from disk to a device (and reconstructions by
        sources that ``loads_alone``) are deferred to the ring's I/O thread, where
        ``runtime`` accepts a `StagedEvent`: the list their events are added to, in
        order, and what to give `undefer` (a pipeline's staging; no context manager,
        which would cost a step more)."""
        local = self._deferring
        previous: list[StagedEvent] | None = getattr(local, "issued", None)
        issued: list[StagedEvent] = []
        if getattr(runtime, "staged_events", False):
            local.issued = issued
        return issued, previous

    def undefer(self, previous: list[StagedEvent] | None) -> None:
        """Ends `defer`: this thread's reads block again (or go to ``previous``)."""
        self._deferring.issued = previous

    def write(self, location: Any, value: TensorResident, runtime: Any) -> DiskFile:
        """Writes a host or CUDA value to a new file (a CUDA one through the staging
        ring, one chunk at a time)."""
        device = runtime.value_device(value)
        store = self._store(location)
        cuda = device if device.type == "cuda" else None
        staging = self._staging(runtime) if cuda is not None or store.direct else None
        self.written += 1
        # Unique across processes too: a forked child inherits the counter.
        name = f"value-{os.getpid()}-{self.written}-{secrets.token_hex(4)}"
        return store.write(name, value, staging=staging, device=cuda)

    def read(self, file: DiskFile, pinned: bool, runtime: Any) -> TensorResident:
        """The stored value read into new pageable memory of the process's own, or
        into new pinned memory, its checksums checked."""
        store = self._store_of(file)
        staging = self._staging(runtime) if store.direct else None
        allocate = runtime.empty_pinned if pinned else _pageable
        return store.read(file, allocate, staging=staging)

    def read_to_cuda(
        self, file: DiskFile, device: torch.device, stream: Any, runtime: Any
    ) -> tuple[TensorResident, Any]:
        """The stored value on ``device``, copied through the staging ring on
        ``stream``, and the event of its last copy (enqueued, not waited for). While
        this thread defers (`defer`), the reads and copies are left to the ring's I/O
        thread and the event is a `StagedEvent`."""
        store = self._store_of(file)
        issued = getattr(self._deferring, "issued", None)
        if issued is None:
            return store.read_to_cuda(file, device, stream, self._staging(runtime))
        staging = self._staging(runtime, deferred=True)
        value, event = store.read_to_cuda_deferred(file, device, stream, staging)
        issued.append(event)
        return value, event

    def load_to_cuda(
        self, source: Any, device: torch.device, stream: Any, runtime: Any
    ) -> tuple[TensorResident, StagedEvent] | None:
        """While this thread defers (`defer`), a reconstruction from a source that
        `loads_alone` (it never calls a manager) into pageable memory, left to the
        ring's I/O thread: the destination is allocated here from the source's
        ``layout()``, and that thread runs ``load()``, checks that the loaded value has
        that layout and copies it through the ring, a chunk at a time, on ``stream``.
        None where the reconstruction is not deferred (it then runs as usual)
        (docs/concepts/values.md#reconstructions-a-pipeline-defers)."""
        issued = getattr(self._deferring, "issued", None)
        if issued is None or not getattr(source, "loads_alone", False):
            return None
        layout = source.layout()
        if not isinstance(layout, TensorResident):
            raise TypeError(
                f"{type(source).__name__}.layout() must return a TensorResident, "
                f"got {type(layout).__name__}"
            )
        shapes = [(tensor.shape, tensor.dtype) for tensor in layout._resident_tensors]
        buffers = [
            runtime.empty_cuda(shape.numel() * dtype.itemsize, device, stream)
            for shape, dtype in shapes
        ]
        value = layout._with_resident_tensors(
            tuple(
                buffer[: shape.numel() * dtype.itemsize].view(dtype).view(shape)
                for buffer, (shape, dtype) in zip(buffers, shapes, strict=True)
            )
        )
        staging = self._staging(runtime, deferred=True)
        staged = StagedEvent()
        staged.value = value

        def load() -> None:
            try:
                loaded = source.load()
                tensors = loaded._resident_tensors if isinstance(loaded, TensorResident) else None
                if (
                    type(loaded) is not type(layout)
                    or tensors is None
                    or [(t.shape, t.dtype, t.device.type) for t in tensors]
                    != [(shape, dtype, "cpu") for shape, dtype in shapes]
                ):
                    raise ResidencyMaterializationError(
                        f"{type(source).__name__}.load() returned a value other than its "
                        "layout() described"
                    )
                event = _copy_through(staging, tensors, buffers, stream)
                if event is None:
                    event = runtime.record_event(stream)
            except BaseException as error:  # carried by the event to whoever waits
                staged.finish(None, error)
                return
            staged.finish(event, None)

        staging.defer(load)
        issued.append(staged)
        return value, staged

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
        staging, self.staging = self.staging, None
        stores, self.stores = self.stores, {}
        try:
            if staging is not None:
                staging.close()
        finally:
            for store in stores.values():
                store.close()
