"""Checkpoints on disk, read lazily a unit at a time.

`Checkpoint.open` takes a safetensors file, or a directory holding ``model.safetensors``
or the sharded layout that ``save_pretrained(max_shard_size=...)`` writes (an index,
``model.safetensors.index.json``, whose ``weight_map`` names each tensor's shard). Each
shard's header is parsed (`fhelium.residency.nn._shards`; no tensor data is touched) the
first time one of its tensors is needed. `Checkpoint.check` validates a module's
expectations against the headers before anything runs; `Checkpoint.source` returns a
`CheckpointSource` (`fhelium.residency.nn._checkpoint_source`), the recipe of one
managed value, which reads only its own tensors' byte ranges.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import torch

from fhelium.errors import ResidencyCheckpointError
from fhelium.residency.nn._checkpoint_source import CheckpointSource
from fhelium.residency.nn._shards import CheckpointEntry, Shard, read_header, read_index

__all__ = ["INDEX", "SINGLE", "Checkpoint", "CheckpointSource"]

SINGLE: Final = "model.safetensors"
INDEX: Final = "model.safetensors.index.json"

# safetensors data are little-endian; a module attribute so a test can play a big-endian
# host.
_BYTEORDER: str = sys.byteorder


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
        self._shards: dict[Path, Shard] = {}
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
        weight_map, metadata = read_index(index)
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

    def _shard(self, path: Path) -> Shard:
        with self._lock:
            shard = self._shards.get(path)
            if shard is None:
                shard = read_header(path)
                self._shards[path] = shard
            return shard

    def __repr__(self) -> str:
        kind = "index" if self._weight_map is not None else "file"
        return f"Checkpoint({str(self._path)!r}, {kind}, files={len(self.files)})"


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
