"""Checkpoints on disk, read lazily a unit at a time, and modules built without weights.

`Checkpoint.open` takes a safetensors file, or a directory holding ``model.safetensors``
or the sharded layout that ``save_pretrained(max_shard_size=...)`` writes (an index,
``model.safetensors.index.json``, whose ``weight_map`` names each tensor's shard). Each
shard's header is parsed by this module (no tensor data is touched) the first time one
of its tensors is needed. `Checkpoint.check` validates a module's expectations against
the headers before anything runs; `Checkpoint.source` returns a `CheckpointSource`, the
recipe of one managed value, which reads only its own tensors' byte ranges.

Reads land in memory the process owns (``torch.empty`` buffers filled with
``os.preadv``), never in a map of the file: a checkpoint truncated or rewritten while
it is in use cannot kill the process with ``SIGBUS`` (see
docs/concepts/locations-and-budgets.md#disk, which follows the same rule), and a file
that changed since its header was read, or that ends early, raises
`ResidencyMaterializationError` instead of returning other bytes.

`init_empty_weights` builds a module with its parameters on the meta device, so a large
model costs no memory until its units are loaded from a checkpoint.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final, NamedTuple

import torch
from torch import nn

from fhelium.errors import ResidencyCheckpointError, ResidencyMaterializationError
from fhelium.residency._safetensors import DTYPES, MAX_HEADER
from fhelium.residency.model import Recoverability, ReplicaMode, ResidencyValueSpec
from fhelium.values.tensor_resident import TensorBundle

__all__ = ["init_empty_weights"]

SINGLE: Final = "model.safetensors"
INDEX: Final = "model.safetensors.index.json"

# safetensors data are little-endian; a module attribute so a test can play a big-endian
# host.
_BYTEORDER: str = sys.byteorder
# At most this many buffers in one `os.preadv` (IOV_MAX is 1024 on Linux).
_IOV_MAX: Final = 512
_META: Final = torch.device("meta")


class CheckpointEntry(NamedTuple):
    """Where one tensor lies: its file, dtype, shape and byte range ``[start, stop)``.

    ``start`` and ``stop`` are offsets in the file (the header included), so they can be
    handed to ``os.pread`` as they are.
    """

    path: Path
    dtype: torch.dtype
    shape: torch.Size
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        """The tensor's bytes in the file."""
        return self.stop - self.start


# What a file looked like when its header was read: device, inode, size, mtime. A read
# that finds anything else refuses the file rather than trust offsets that may be stale.
_Identity = tuple[int, int, int, int]


class _Shard:
    """One safetensors file: its header's tensors and metadata, and its identity."""

    __slots__ = ("entries", "identity", "metadata", "path")

    def __init__(
        self,
        path: Path,
        entries: dict[str, CheckpointEntry],
        metadata: dict[str, str],
        identity: _Identity,
    ) -> None:
        self.path = path
        self.entries = entries
        self.metadata = metadata
        self.identity = identity


def _identity(status: os.stat_result) -> _Identity:
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


def _read_header(path: Path) -> _Shard:
    """Parse the header of the safetensors file ``path``; no tensor data is read."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ResidencyCheckpointError("the file does not exist", path=str(path)) from None
    except OSError as error:
        raise ResidencyCheckpointError(f"cannot be opened: {error}", path=str(path)) from error
    try:
        status = os.fstat(descriptor)
        prefix = _pread_all(descriptor, 8, 0, path)
        if len(prefix) < 8:
            raise ResidencyCheckpointError(
                f"is {status.st_size} bytes long, shorter than a safetensors header",
                path=str(path),
            )
        length = int.from_bytes(prefix, "little")
        if length > MAX_HEADER or 8 + length > status.st_size:
            raise ResidencyCheckpointError(
                f"declares a header of {length} bytes, which a file of {status.st_size} "
                "bytes cannot hold: it is not a safetensors file, or it is truncated",
                path=str(path),
            )
        raw = _pread_all(descriptor, length, 8, path)
        if len(raw) < length:
            raise ResidencyCheckpointError(
                "ended while its header was read: it is being truncated", path=str(path)
            )
    finally:
        os.close(descriptor)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ResidencyCheckpointError(
            f"has a header that is not JSON: {error}", path=str(path)
        ) from None
    if not isinstance(header, dict):
        raise ResidencyCheckpointError("has a header that is not a JSON object", path=str(path))
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(
        isinstance(value, str) for value in metadata.values()
    ):
        raise ResidencyCheckpointError(
            "has a __metadata__ entry that is not an object of strings", path=str(path)
        )
    data_start = 8 + length
    data_bytes = status.st_size - data_start
    entries: dict[str, CheckpointEntry] = {}
    for key, info in header.items():
        entries[key] = _parse_entry(path, key, info, data_start, data_bytes)
    return _Shard(path, entries, metadata, _identity(status))


def _parse_entry(
    path: Path, key: str, info: object, data_start: int, data_bytes: int
) -> CheckpointEntry:
    def bad(detail: str) -> ResidencyCheckpointError:
        return ResidencyCheckpointError(detail, key=key, path=str(path))

    if not isinstance(info, dict):
        raise bad("its header entry is not a JSON object")
    name = info.get("dtype")
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    if not isinstance(name, str):
        raise bad(f"its header entry has no dtype name (dtype={name!r})")
    dtype = DTYPES.get(name)
    if dtype is None:
        known = ", ".join(DTYPES)
        raise bad(f"has dtype {name!r}, which safetensors does not define ({known})")
    if not isinstance(shape, list) or not all(_is_count(extent) for extent in shape):
        raise bad(f"has shape {shape!r}, not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(offset) for offset in offsets)
        or offsets[0] > offsets[1]
    ):
        raise bad(f"has data_offsets {offsets!r}, not [begin, end] with begin <= end")
    begin, end = offsets
    count = 1
    for extent in shape:
        count *= extent
    need = count * dtype.itemsize
    if end - begin != need:
        raise bad(
            f"has data_offsets [{begin}, {end}] ({end - begin} bytes), but a {name} tensor "
            f"of shape {shape} takes {need} bytes"
        )
    if end > data_bytes:
        raise bad(
            f"lies at data bytes [{begin}, {end}), past the file's {data_bytes} bytes of "
            "data: the file is truncated"
        )
    return CheckpointEntry(path, dtype, torch.Size(shape), data_start + begin, data_start + end)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _pread_all(descriptor: int, length: int, offset: int, path: Path) -> bytes:
    """Up to ``length`` bytes from ``offset``: fewer only where the file ends."""
    pieces: list[bytes] = []
    done = 0
    while done < length:
        try:
            piece = os.pread(descriptor, length - done, offset + done)
        except OSError as error:
            raise ResidencyCheckpointError(f"cannot be read: {error}", path=str(path)) from error
        if not piece:
            break
        pieces.append(piece)
        done += len(piece)
    return b"".join(pieces)


class Checkpoint:
    """A safetensors checkpoint: one file, or the shards named by an index.

    Made by `Checkpoint.open`. Shard headers are parsed lazily, once each, the first time
    one of their tensors is looked up; the object is safe to share between threads.
    """

    __slots__ = ("_index", "_lock", "_metadata", "_path", "_shards", "_single", "_weight_map")

    def __init__(
        self,
        path: Path,
        *,
        single: Path | None = None,
        index: Path | None = None,
        weight_map: dict[str, Path] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self._path = path
        self._single = single
        self._index = index
        self._weight_map = weight_map
        self._metadata = metadata
        self._shards: dict[Path, _Shard] = {}
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """Open a checkpoint: a safetensors file, or a directory holding ``model.safetensors``
        or ``model.safetensors.index.json`` (the file wins when both are there, as in
        transformers).

        Only the index is read here; shard headers are read when first needed.

        Raises:
            TypeError: ``path`` is not a path.
            FileNotFoundError: ``path`` does not exist.
            ResidencyCheckpointError: A directory with neither file, an index that is not
                the ``save_pretrained`` layout, or a big-endian host.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(f"no checkpoint at {root}")
        if _BYTEORDER != "little":
            raise ResidencyCheckpointError(
                "safetensors data are little-endian and this host is big-endian, which this "
                "reader does not support",
                path=str(root),
            )
        if not root.is_dir():
            return cls(root, single=root)
        if (root / SINGLE).is_file():
            return cls(root, single=root / SINGLE)
        index = root / INDEX
        if not index.is_file():
            raise ResidencyCheckpointError(
                f"the directory holds neither {SINGLE} nor {INDEX}", path=str(root)
            )
        weight_map, metadata = _read_index(index)
        return cls(root, index=index, weight_map=weight_map, metadata=metadata)

    @property
    def path(self) -> Path:
        """The path given to `open` (a file or a directory)."""
        return self._path

    @property
    def files(self) -> tuple[Path, ...]:
        """The safetensors files of the checkpoint, each once, in first-use order of keys."""
        if self._weight_map is None:
            assert self._single is not None
            return (self._single,)
        return tuple(dict.fromkeys(self._weight_map.values()))

    @property
    def metadata(self) -> dict[str, Any]:
        """The index's ``metadata`` object, or a single file's ``__metadata__``.

        Raises:
            ResidencyCheckpointError: The single file's header cannot be parsed.
        """
        if self._metadata is not None:
            return dict(self._metadata)
        assert self._single is not None
        return dict(self._shard(self._single).metadata)

    def keys(self) -> tuple[str, ...]:
        """The names of the checkpoint's tensors, in the index's (or the header's) order.

        Raises:
            ResidencyCheckpointError: The single file's header cannot be parsed.
        """
        if self._weight_map is not None:
            return tuple(self._weight_map)
        assert self._single is not None
        return tuple(self._shard(self._single).entries)

    def __contains__(self, key: object) -> bool:
        if self._weight_map is not None:
            return key in self._weight_map
        assert self._single is not None
        return key in self._shard(self._single).entries

    def entry(self, key: str) -> CheckpointEntry:
        """Where tensor ``key`` lies: its file, dtype, shape and byte range.

        Raises:
            TypeError: ``key`` is not a str.
            ResidencyCheckpointError: No such tensor, or its shard's header is damaged or
                disagrees with the index.
        """
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        if self._weight_map is not None:
            assert self._index is not None
            file = self._weight_map.get(key)
            if file is None:
                raise ResidencyCheckpointError(
                    "no tensor of that name in the index", key=key, path=str(self._index)
                )
            try:
                shard = self._shard(file)
            except ResidencyCheckpointError as error:
                if error.key is not None:
                    raise
                # A shard that is missing or damaged: say which tensor needed it.
                raise ResidencyCheckpointError(error.detail, key=key, path=error.path) from error
            found = shard.entries.get(key)
            if found is None:
                raise ResidencyCheckpointError(
                    f"the index {self._index.name} maps it to this shard, which has no such tensor",
                    key=key,
                    path=str(file),
                )
            return found
        assert self._single is not None
        found = self._shard(self._single).entries.get(key)
        if found is None:
            raise ResidencyCheckpointError(
                "no tensor of that name in the file", key=key, path=str(self._single)
            )
        return found

    def check(
        self,
        expected: Mapping[str, tuple[torch.Size, torch.dtype]],
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Check that every expected tensor is there, with its shape and a loadable dtype.

        Keys are checked in ``expected``'s order and the first failure is raised. A dtype
        loads when it is the expected one, or, with ``dtype`` given, when both are
        floating point (the tensor is cast to ``dtype``). Integer, bool and complex
        tensors are never cast. Reads the headers of the shards concerned only.

        Args:
            expected: Checkpoint key -> (shape, dtype) the module needs.
            dtype: The floating dtype that floating tensors will be cast to, or ``None``.

        Raises:
            TypeError: ``expected`` is not a mapping of str to (shape, dtype), or ``dtype``
                is not a torch.dtype.
            ValueError: ``dtype`` is not a floating point dtype.
            ResidencyCheckpointError: A missing key, another shape, a dtype that does not
                load, or a damaged header; it names the key and the file.
        """
        cast = _check_cast(dtype)
        if not isinstance(expected, Mapping):
            raise TypeError(f"expected must be a Mapping, got {type(expected).__name__}")
        wanted: list[tuple[str, torch.Size, torch.dtype]] = []
        for key, spec in expected.items():
            if not isinstance(key, str):
                raise TypeError(f"expected keys must be str, got {type(key).__name__}")
            if (
                not isinstance(spec, tuple)
                or len(spec) != 2
                or not isinstance(spec[1], torch.dtype)
            ):
                raise TypeError(f"expected[{key!r}] must be a (shape, dtype) pair, got {spec!r}")
            wanted.append((key, torch.Size(spec[0]), spec[1]))
        for key, shape, want in wanted:
            found = self.entry(key)
            if found.shape != shape:
                raise ResidencyCheckpointError(
                    f"has shape {list(found.shape)}, but the module expects {list(shape)}",
                    key=key,
                    path=str(found.path),
                )
            problem = _dtype_problem(found.dtype, want, cast)
            if problem is not None:
                raise ResidencyCheckpointError(problem, key=key, path=str(found.path))

    def source(
        self, names: Mapping[str, str], *, dtype: torch.dtype | None = None
    ) -> CheckpointSource:
        """The recipe of one value: the tensors ``names`` maps to, read from this checkpoint.

        Args:
            names: Value name -> checkpoint key, in the order the value's `TensorBundle`
                will have them.
            dtype: Cast floating tensors to this dtype on load (integer and bool tensors
                keep theirs), or ``None`` to keep the file's.

        Returns:
            A `CheckpointSource`, ready for ``manager.register_source(source.spec(),
            source)``.

        Raises:
            TypeError: ``names`` is not a mapping of str to str, or ``dtype`` is not a
                torch.dtype.
            ValueError: ``names`` is empty or has an empty name, or ``dtype`` is not
                floating point.
            ResidencyCheckpointError: A key that is not in the checkpoint, or a damaged
                header.
        """
        cast = _check_cast(dtype)
        if not isinstance(names, Mapping):
            raise TypeError(f"names must be a Mapping, got {type(names).__name__}")
        if not names:
            raise ValueError("a checkpoint source needs at least one tensor")
        entries: list[tuple[str, CheckpointEntry]] = []
        for name, key in names.items():
            if not isinstance(name, str) or not isinstance(key, str):
                raise TypeError(f"names must map str to str, got {name!r}: {key!r}")
            if not name or name.isspace():
                raise ValueError(f"value names must be non-empty, got {name!r}")
            entries.append((name, self.entry(key)))
        identities = {found.path: self._shard(found.path).identity for _, found in entries}
        return CheckpointSource(tuple(entries), identities, cast)

    def _shard(self, path: Path) -> _Shard:
        with self._lock:
            shard = self._shards.get(path)
            if shard is None:
                shard = _read_header(path)
                self._shards[path] = shard
            return shard

    def __repr__(self) -> str:
        kind = "index" if self._weight_map is not None else "file"
        return f"Checkpoint({str(self._path)!r}, {kind}, files={len(self.files)})"


def _read_index(index: Path) -> tuple[dict[str, Path], dict[str, Any]]:
    def bad(detail: str, key: str | None = None) -> ResidencyCheckpointError:
        return ResidencyCheckpointError(detail, key=key, path=str(index))

    try:
        document = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise bad(f"is not JSON: {error}") from None
    except OSError as error:
        raise bad(f"cannot be read: {error}") from error
    if not isinstance(document, dict) or not isinstance(document.get("weight_map"), dict):
        raise bad('is not a safetensors index: it has no "weight_map" object')
    metadata = document.get("metadata", {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise bad('has a "metadata" entry that is not an object')
    weight_map: dict[str, Path] = {}
    for key, file in document["weight_map"].items():
        if not isinstance(file, str) or file in {"", ".", ".."} or Path(file).name != file:
            raise bad(f"maps the tensor to {file!r}, not a file name in its directory", key)
        weight_map[key] = index.parent / file
    return weight_map, metadata


def _check_cast(dtype: object) -> torch.dtype | None:
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {type(dtype).__name__}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point dtype, got {dtype}")
    return dtype


def _dtype_problem(found: torch.dtype, want: torch.dtype, cast: torch.dtype | None) -> str | None:
    """Why a ``found`` tensor cannot be loaded where ``want`` is expected, or None."""
    if found == want:
        return None
    if found.is_floating_point and want.is_floating_point:
        if cast is not None:
            return None
        return (
            f"holds {found}, but the module's tensor is {want}: pass dtype= to cast floating "
            f"tensors, or build the module in {found}"
        )
    if cast is not None and found.is_floating_point:
        return (
            f"holds {found}, which is not cast to the module's {want} tensor (only floating "
            "tensors are cast, to floating dtypes)"
        )
    return f"holds {found}, which cannot be loaded into the module's {want} tensor"


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
        identities: Mapping[Path, _Identity],
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
            if _identity(os.fstat(descriptor)) != self._identities[path]:
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


# --- init_empty_weights ---------------------------------------------------------------


# The innermost active `init_empty_weights` of this thread (or task): None outside, else
# whether buffers go on meta too.
_EMPTY: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "fhelium_init_empty_weights", default=None
)


class _Patch:
    """``nn.Module.register_parameter`` and ``register_buffer`` replaced while any thread
    is inside `init_empty_weights`; the originals are put back when the last one leaves."""

    lock = threading.Lock()
    active = 0
    register_parameter: Callable[..., None] | None = None
    register_buffer: Callable[..., None] | None = None


def _register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    original = _Patch.register_parameter
    assert original is not None
    original(module, name, param)
    if param is None or _EMPTY.get() is None:
        return
    current = module._parameters[name]
    if current is None or current.device == _META:
        return
    module._parameters[name] = _on_meta(current)


def _on_meta(param: nn.Parameter) -> nn.Parameter:
    cls = type(param)
    data = param.detach().to(_META)
    if cls is nn.Parameter:
        moved = nn.Parameter(data, requires_grad=param.requires_grad)
        moved.__dict__.update(param.__dict__)
        return moved
    # A Parameter subclass (a quantised weight, say) takes its attributes as keywords, as
    # Accelerate passes them.
    return cls(data, **{**param.__dict__, "requires_grad": param.requires_grad})


def _register_buffer(
    module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True
) -> None:
    original = _Patch.register_buffer
    assert original is not None
    original(module, name, tensor, persistent=persistent)
    if tensor is None or not _EMPTY.get():
        return
    current = module._buffers[name]
    if current is not None and current.device != _META:
        module._buffers[name] = current.to(_META)


def _install() -> None:
    with _Patch.lock:
        if _Patch.active == 0:
            # Our wrapper may still be there, put back over a foreign patch we left; it
            # keeps delegating to what we saved then.
            if nn.Module.register_parameter is not _register_parameter:
                _Patch.register_parameter = nn.Module.register_parameter
            if nn.Module.register_buffer is not _register_buffer:
                _Patch.register_buffer = nn.Module.register_buffer
            nn.Module.register_parameter = _register_parameter  # type: ignore[method-assign,assignment]
            nn.Module.register_buffer = _register_buffer  # type: ignore[method-assign,assignment]
        _Patch.active += 1


def _uninstall() -> None:
    with _Patch.lock:
        _Patch.active -= 1
        if _Patch.active:
            return
        # Put back what was there, unless someone patched over us meanwhile (their own
        # restore will put our wrapper back, which then only delegates).
        if nn.Module.register_parameter is _register_parameter:
            nn.Module.register_parameter = _Patch.register_parameter  # type: ignore[method-assign,assignment]
        if nn.Module.register_buffer is _register_buffer:
            nn.Module.register_buffer = _Patch.register_buffer  # type: ignore[method-assign,assignment]


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Build modules with their parameters on the meta device: no memory, no init cost.

    While the block runs on this thread, every parameter a module registers is replaced
    by one of the same class, shape, dtype and ``requires_grad`` on ``meta`` (as
    Accelerate's ``init_empty_weights`` does). Buffers stay real by default, so buffers
    a checkpoint does not hold (a rotary ``inv_freq``) keep the value the module
    computed; ``include_buffers=True`` puts registered buffers on meta too. Tensors are
    made where the module's code makes them and moved to meta as they are registered.
    Other threads are not affected; blocks nest (the innermost decides);
    ``torch.nn.Module`` is restored exactly when the last block leaves, on an exception
    too.

    Args:
        include_buffers: Put buffers on meta too.

    Yields:
        None.

    Raises:
        TypeError: ``include_buffers`` is not a bool.

    Example:
        ```python
        import torch
        from torch import nn
        from fhelium.residency.nn import init_empty_weights

        with init_empty_weights():
            model = nn.Sequential(nn.Linear(4096, 4096), nn.BatchNorm1d(4096))
        assert model[0].weight.device == torch.device("meta")
        assert model[1].running_mean.device == torch.device("cpu")
        ```
    """
    if not isinstance(include_buffers, bool):
        raise TypeError(f"include_buffers must be a bool, got {type(include_buffers).__name__}")
    with contextlib.ExitStack() as stack:
        _install()
        stack.callback(_uninstall)
        token = _EMPTY.set(include_buffers)
        stack.callback(_EMPTY.reset, token)
        yield
