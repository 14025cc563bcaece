"""Ready-made reconstruction sources: values that can always be rebuilt from disk.

`SafetensorsSource` loads named tensors from a safetensors file into a new value each
time the manager asks, so a value backed by it can lose its last in-memory copy.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from fhelium.residency._safetensors import dtype_size as _dtype_size
from fhelium.residency.model import Recoverability, ReplicaMode, ResidencyValueSpec
from fhelium.values.tensor_resident import ResidentTensor, TensorBundle, TensorResident

__all__ = ["SafetensorsSource"]

ValueT = TypeVar("ValueT", bound=TensorResident)


class SafetensorsSource(Generic[ValueT]):
    """A `ResidencySource` loading ``keys`` from a safetensors file into pageable host memory.

    One key gives a `ResidentTensor`; several give a `TensorBundle` named by key. `spec`
    measures the file's header, so registering costs no tensor load. The file is opened only
    by `spec` and `load`. See docs/concepts/values.md#sources.

    Args:
        path: The safetensors file.
        keys: One tensor name, or a sequence of them.

    Raises:
        ValueError: No keys.
        TypeError: A key that is not a non-empty string.

    Example:
        ```python
        import torch
        from safetensors.torch import save_file
        from fhelium.residency import PAGEABLE_HOST, ResidencyManager
        from fhelium.residency.sources import SafetensorsSource

        save_file({"w": torch.ones(4, 4), "b": torch.zeros(4)}, "layer.safetensors")
        source = SafetensorsSource("layer.safetensors", ["w", "b"])
        with ResidencyManager() as manager:
            handle = manager.register_source(source.spec(), source)
            manager.ensure(handle, PAGEABLE_HOST)  # reads the file now
        ```
    """

    __slots__ = ("_keys", "_path")

    def __init__(self, path: str | os.PathLike[str], keys: str | Sequence[str]) -> None:
        self._path = Path(path)
        names = (keys,) if isinstance(keys, str) else tuple(keys)
        if not names:
            raise ValueError("SafetensorsSource needs at least one tensor key")
        for name in names:
            if not isinstance(name, str) or not name:
                raise TypeError(f"tensor keys must be non-empty str, got {name!r}")
        self._keys = names

    @property
    def path(self) -> Path:
        """The safetensors file, as a ``Path``."""
        return self._path

    @property
    def keys(self) -> tuple[str, ...]:
        """The tensor names loaded, in order."""
        return self._keys

    def _read(self) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        with safe_open(str(self._path), framework="pt", device="cpu") as handle:
            return {name: handle.get_tensor(name) for name in self._keys}

    def load(self) -> ValueT:
        """Read the tensors from the file into pageable host memory.

        Returns:
            A `ResidentTensor` for one key, otherwise a `TensorBundle` named by key.

        Raises:
            OSError: The file cannot be opened or read.
            Exception: Whatever ``safetensors`` raises for a corrupt file or a missing key.
        """
        tensors = self._read()
        if len(self._keys) == 1:
            return ResidentTensor(tensors[self._keys[0]])  # type: ignore[return-value]
        return TensorBundle(tensors)  # type: ignore[return-value]

    def spec(
        self, *, replica_mode: ReplicaMode = ReplicaMode.EXCLUSIVE
    ) -> ResidencyValueSpec[ValueT]:
        """Return the value's spec, measured from the file's header; no tensor data is read.

        Logical and storage bytes are both the sum of the tensors' sizes; the spec is
        RECONSTRUCTIBLE.

        Args:
            replica_mode: The spec's replica mode.

        Returns:
            A `ResidencyValueSpec` for `ResidentTensor` (one key) or `TensorBundle`.

        Raises:
            OSError: The file cannot be opened or read.
            ValueError: A tensor of a dtype the source cannot size.
            Exception: Whatever ``safetensors`` raises for a corrupt file or a missing key.
        """
        from safetensors import safe_open

        logical = 0
        with safe_open(str(self._path), framework="pt", device="cpu") as handle:
            for name in self._keys:
                sliced = handle.get_slice(name)
                count = 1
                for extent in sliced.get_shape():
                    count *= extent
                logical += count * _dtype_size(sliced.get_dtype())
        value_type: type[Any] = ResidentTensor if len(self._keys) == 1 else TensorBundle
        return ResidencyValueSpec(
            value_type, logical, logical, replica_mode, Recoverability.RECONSTRUCTIBLE
        )

    def __repr__(self) -> str:
        return f"SafetensorsSource({str(self._path)!r}, {list(self._keys)!r})"
