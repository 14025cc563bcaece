"""The files of one owner (a manager) in a disk directory: written atomically in the
disk format (`fhelium.residency._disk.format`), read back into memory the reader owns
and checked on the way, removed on request, at close and at interpreter exit.

Layout: ``<root>/fhelium-residency-<owner id>/`` (mode ``0700``) holds ``owner.json``
(who owns the directory: process id, host, owner id, process start time) and one
``<name>.safetensors`` file (mode ``0600``) per stored value; both modes are set
explicitly, whatever the umask.

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
``direct=True``, pass through the staging ring (`fhelium.residency._disk.staging`).
With ``direct=True`` the file is opened with ``O_DIRECT`` (bypassing the page cache)
when the file system allows it, and with buffered I/O otherwise.

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
import os
import secrets
import socket
import stat
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, Literal

import torch

from fhelium._core import Checksum
from fhelium.errors import (
    ResidencyInUseError,
    ResidencyMaterializationError,
)
from fhelium.residency._disk.format import (
    UNKNOWN,
    DiskFile,
    layout,
    prefix,
    read_buffered,
    rebuild,
    verify,
    write_all,
    write_at,
    write_buffered,
)
from fhelium.residency._disk.staging import (
    Staging,
    pageable,
    pageable_on_a_page,
    read_through,
    write_through,
)
from fhelium.residency._runtime.base import StagedEvent
from fhelium.values.tensor_resident import TensorResident

__all__ = [
    "CREATING",
    "DIRECTORY_MODE",
    "FILE_MODE",
    "OWNER",
    "PREFIX",
    "STALE_AGE",
    "SUFFIX",
    "TEMPORARY",
    "DiskStore",
]

_O_DIRECT: Final = getattr(os, "O_DIRECT", 0)

PREFIX: Final = "fhelium-residency-"
OWNER: Final = "owner.json"
SUFFIX: Final = ".safetensors"
TEMPORARY: Final = ".tmp"
CREATING: Final = ".creating-"
# A store directory with no readable owner record is stale once it has not changed
# (its mtime) for this many seconds: its creator was killed before writing one.
STALE_AGE: Final = 600.0
DIRECTORY_MODE: Final = 0o700
FILE_MODE: Final = 0o600


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
        write_all(descriptor, memoryview(json.dumps(record).encode()))
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
        header, storages, fields, blobs = layout(tensors)
        placeholder = prefix(header, [UNKNOWN] * len(blobs))
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
                    size = write_through(
                        staging, descriptor, direct, placeholder, blobs, hashers, device
                    )
                else:
                    size = write_buffered(descriptor, placeholder, blobs, hashers)
                checksums = tuple(hasher.hexdigest() for hasher in hashers)
                recorded = prefix(header, list(checksums))
                assert len(recorded) == data_start  # fixed-width checksums
                write_at(descriptor, recorded, 0, direct)
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
            fresh = pageable_on_a_page if self.direct else pageable
            buffers = [(allocate or fresh)(length) for _, length in file.storages]
            if self.direct and staging is not None:
                self._read_staged(file, buffers, staging, hashers=hashers)
            else:
                read_buffered(file, buffers, hashers)
                verify(file, hashers)
        except OSError as error:
            raise ResidencyMaterializationError(f"reading {path} failed: {error}") from error
        return rebuild(file, buffers)

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
        return rebuild(file, buffers), event

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
        value = rebuild(file, buffers)
        staged = StagedEvent()
        staged.value = value
        verifying = self.verify

        def read() -> None:
            hashers = [Checksum() for _ in file.storages] if verifying else None
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
        """Reads the file's data into ``buffers`` through ``staging`` (`read_through`),
        the file opened with direct I/O where the store does it; the event of the last
        device copy (None when none was made)."""
        descriptor, direct = self._open(file.path, os.O_RDONLY)
        try:
            return read_through(
                staging,
                descriptor,
                direct,
                file,
                buffers,
                stream,
                hashers=hashers,
                inline=inline,
            )
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
