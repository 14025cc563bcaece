"""Residency locations: pageable host, pinned host, one indexed CUDA device, or a
directory on local storage.

Locations are plain normalised records; whether a CUDA device exists is the manager's
question, not the record's.
"""

import os
import re
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch

from fhelium.residency._validation import require_bool, seal, to_torch_device

__all__ = [
    "ResidencyLocationKind",
    "ResidencyLocation",
    "PAGEABLE_HOST",
    "PINNED_HOST",
    "cuda_location",
]

# The documented kinds; a `DiskLocation` (fhelium.residency.disk) is kind "disk".
ResidencyLocationKind: TypeAlias = Literal["pageable-host", "pinned-host", "cuda"]
"""The kinds of `ResidencyLocation`: ``"pageable-host"``, ``"pinned-host"`` or ``"cuda"``.

A `DiskLocation` (see `fhelium.residency.disk.disk_location`) has kind ``"disk"``. See
docs/concepts/locations-and-budgets.md#location-kinds.
"""

_CUDA_MAX_INDEX = 127
# Canonical spellings only: no bare "cuda", no leading zeros, no whitespace.
_CUDA_DEVICE_STRING = re.compile(r"cuda:(0|[1-9][0-9]*)")
_CPU = torch.device("cpu")
# A tuple, not a set: membership by equality works for unhashable `kind` inputs too.
_HOST_KINDS: tuple[ResidencyLocationKind, ...] = ("pageable-host", "pinned-host")
# torch.device is immutable, so the normalised devices can be built once and shared.
_CUDA_DEVICES = tuple(torch.device("cuda", index) for index in range(_CUDA_MAX_INDEX + 1))


def _validate_cuda_device(device: object) -> torch.device:
    """Normalise ``device`` to an indexed CUDA ``torch.device`` with index 0..127.

    Raises ``ValueError`` for anything else, including an unindexed ``"cuda"``, which is
    never resolved against the current device.
    """
    if isinstance(device, str):
        match = _CUDA_DEVICE_STRING.fullmatch(device)
        if match is None:
            raise ValueError(f"CUDA device must be spelled 'cuda:N', got {device!r}")
        index = int(match.group(1))
        if index > _CUDA_MAX_INDEX:
            raise ValueError(f"CUDA device index must be <= {_CUDA_MAX_INDEX}, got {index}")
        return _CUDA_DEVICES[index]
    normalized = to_torch_device(device, "CUDA device")
    if normalized.type != "cuda" or normalized.index is None:
        raise ValueError(f"expected an indexed CUDA device, got {normalized}")
    if not 0 <= normalized.index <= _CUDA_MAX_INDEX:
        raise ValueError(
            f"CUDA device index must be in 0..{_CUDA_MAX_INDEX}, got {normalized.index}"
        )
    return _CUDA_DEVICES[normalized.index]


@dataclass(frozen=True, slots=True)
class ResidencyLocation:
    """Where one materialisation of a value lives: a frozen record.

    Host kinds always carry the unindexed ``torch.device("cpu")``; the CUDA kind carries
    an indexed CUDA device (``cuda:0`` to ``cuda:127``). Equality and hashing use
    ``(kind, device)``, so equal locations compare and hash equal whatever spelling
    created them, and ``str(location)`` is its `name`. Construction never asks whether
    CUDA is present: a manager validates a location when it is used (see
    docs/concepts/locations-and-budgets.md#location-validation). Prefer the constants
    `PAGEABLE_HOST` and `PINNED_HOST` and the builders `cuda_location` and
    `fhelium.residency.disk.disk_location`. The rules are in
    docs/concepts/locations-and-budgets.md#construction-rules.

    Args:
        kind: ``"pageable-host"``, ``"pinned-host"`` or ``"cuda"``.
        device: For a host kind, anything ``torch.device(...)`` turns into a ``cpu``
            device (stored as the unindexed ``cpu``); for ``"cuda"``, a ``"cuda:N"``
            string or an indexed CUDA ``torch.device``.

    Attributes:
        kind: The location kind (see `ResidencyLocationKind`), or ``"disk"`` for a
            `DiskLocation`.
        device: The normalised device: ``cpu`` for host and disk kinds, ``cuda:N`` for
            CUDA.

    Raises:
        ValueError: An unknown kind; a host kind whose device is not ``cpu``; a CUDA
            device that is not spelled ``"cuda:N"`` (bare ``"cuda"``, leading zeros,
            spaces), not indexed, or past index 127; kind ``"disk"`` outside
            `DiskLocation`.
        TypeError: A device that ``torch.device`` cannot convert.

    Example:
        ```python
        import torch
        from fhelium.residency import PINNED_HOST, ResidencyLocation, cuda_location

        assert ResidencyLocation("pinned-host", "cpu") == PINNED_HOST
        assert ResidencyLocation("cuda", torch.device("cuda", 1)) == cuda_location("cuda:1")
        assert str(cuda_location("cuda:1")) == "cuda:1"
        ```
    """

    kind: ResidencyLocationKind
    device: torch.device

    def __post_init__(self) -> None:
        kind: object = self.kind
        if kind == "disk":
            if not isinstance(self, DiskLocation):
                raise ValueError("a disk location is made by disk_location(path)")
            object.__setattr__(self, "kind", "disk")
            object.__setattr__(self, "device", _CPU)
        elif kind == "cuda":
            object.__setattr__(self, "kind", "cuda")
            object.__setattr__(self, "device", _validate_cuda_device(self.device))
        elif kind in _HOST_KINDS:
            if to_torch_device(self.device, "host device").type != "cpu":
                raise ValueError(f"{kind} location needs a cpu device, got {self.device!r}")
            # A canonical str (not an equal subclass or lookalike) keeps hashing uniform.
            canonical = "pageable-host" if kind == "pageable-host" else "pinned-host"
            object.__setattr__(self, "kind", canonical)
            object.__setattr__(self, "device", _CPU)
        else:
            raise ValueError(
                "unsupported kind: expected 'pageable-host', 'pinned-host', 'cuda' or 'disk', "
                f"got {kind!r}"
            )

    @property
    def name(self) -> str:
        """The location's name: ``"pageable-host"``, ``"pinned-host"``, ``"cuda:N"`` or
        ``"disk:<path>"``.

        Snapshots, traces, budget errors and the controller's texts name locations by it.
        """
        if self.kind == "cuda":
            return f"cuda:{self.device.index}"
        if isinstance(self, DiskLocation):
            return f"disk:{self.path}"
        return self.kind

    def __str__(self) -> str:
        return self.name


PAGEABLE_HOST = ResidencyLocation("pageable-host", _CPU)
"""Ordinary (pageable) host memory: kind ``"pageable-host"``, device ``cpu``."""

PINNED_HOST = ResidencyLocation("pinned-host", _CPU)
"""Page-locked host memory: kind ``"pinned-host"``, device ``cpu``.

CUDA copies read it without a staging copy. Its budget counts charges, not the rounded
page-locked blocks of PyTorch's allocator (see
docs/concepts/locations-and-budgets.md#pinned-host).
"""


def cuda_location(device: torch.device | str) -> ResidencyLocation:
    """Return the location of one CUDA device.

    Only the spelling is checked: whether the device exists is checked by a manager when
    the location is used (see docs/concepts/locations-and-budgets.md#location-validation),
    so CUDA locations can be built on a machine without CUDA.

    Args:
        device: ``"cuda:N"`` (canonical spelling: no bare ``"cuda"``, no leading zeros,
            no whitespace) or an indexed CUDA ``torch.device``, with ``N`` at most 127.

    Returns:
        The `ResidencyLocation` of kind ``"cuda"`` for that index.

    Raises:
        ValueError: Any other spelling, an unindexed or non-CUDA device, or an index
            past 127.
        TypeError: A device that ``torch.device`` cannot convert.

    Example:
        ```python
        import torch
        from fhelium.residency import cuda_location

        assert cuda_location("cuda:0") == cuda_location(torch.device("cuda", 0))
        assert cuda_location("cuda:0").name == "cuda:0"
        ```
    """
    return ResidencyLocation("cuda", _validate_cuda_device(device))


@dataclass(frozen=True, slots=True, init=False)
class DiskLocation(ResidencyLocation):
    """A directory on local storage used as a location: kind ``"disk"``, device ``cpu``.

    Made by `fhelium.residency.disk.disk_location`, which also checks that the process
    names the directory one way only. Equal directories give equal locations; the
    directory need not exist yet. A value on disk is one safetensors file in a directory
    of the manager's own inside ``path`` (see
    docs/concepts/locations-and-budgets.md#disk).

    Args:
        path: The directory; stored absolute and normalised.
        direct_io: Read and write the files with ``O_DIRECT``, bypassing the page cache
            (see docs/concepts/locations-and-budgets.md#staging-and-direct-io).
        verify: Check every read against the checksums recorded at write (see
            docs/concepts/locations-and-budgets.md#integrity).

    Attributes:
        path: The directory's absolute, normalised path.
        direct_io: Whether the files are read and written with direct I/O.
        verify: Whether reads are checked against the files' checksums.
        kind: Always ``"disk"``.
        device: Always ``cpu``.

    Raises:
        TypeError: ``path`` is not a string or path-like, or ``direct_io`` or ``verify``
            is not a ``bool``.
        ValueError: An empty path or one containing a NUL character.
    """

    path: str
    direct_io: bool
    verify: bool

    def __init__(
        self, path: str | os.PathLike[str], direct_io: bool = False, verify: bool = True
    ) -> None:
        require_bool(direct_io, "direct_io")
        require_bool(verify, "verify")
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"a disk location needs a directory path, got {type(path).__name__}")
        text = os.fspath(path)
        if not isinstance(text, str) or not text or "\0" in text:
            raise ValueError(f"a disk location needs a non-empty directory path, got {text!r}")
        object.__setattr__(self, "path", os.path.normpath(os.path.abspath(text)))
        object.__setattr__(self, "direct_io", direct_io)
        object.__setattr__(self, "verify", verify)
        object.__setattr__(self, "kind", "disk")
        object.__setattr__(self, "device", _CPU)

    def __reduce__(self) -> tuple[object, ...]:
        return (DiskLocation, (self.path, self.direct_io, self.verify))


seal(ResidencyLocation, DiskLocation)
