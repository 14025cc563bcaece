"""The headers of a safetensors checkpoint: each file's tensors and metadata, parsed
without reading tensor data, and a sharded checkpoint's index.

A header is read once, by `read_header`, with the file's identity (device, inode, size,
mtime) at that moment: a later read that finds another identity refuses the file
(docs/concepts/offload.md#checkpoints). `read_index` reads the ``weight_map`` that
``save_pretrained(max_shard_size=...)`` writes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch

from fhelium.errors import ResidencyCheckpointError
from fhelium.residency._safetensors import DTYPES, MAX_HEADER

__all__ = ["CheckpointEntry", "Identity", "Shard", "file_identity", "read_header", "read_index"]


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
Identity = tuple[int, int, int, int]


class Shard:
    """One safetensors file: its header's tensors and metadata, and its identity."""

    __slots__ = ("entries", "identity", "metadata", "path")

    def __init__(
        self,
        path: Path,
        entries: dict[str, CheckpointEntry],
        metadata: dict[str, str],
        identity: Identity,
    ) -> None:
        self.path = path
        self.entries = entries
        self.metadata = metadata
        self.identity = identity


def file_identity(status: os.stat_result) -> Identity:
    """The identity of the file ``status`` describes."""
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


def read_header(path: Path) -> Shard:
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
    return Shard(path, entries, metadata, file_identity(status))


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


def read_index(index: Path) -> tuple[dict[str, Path], dict[str, Any]]:
    """A sharded checkpoint's index: each tensor's shard file, and the ``metadata``."""

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
