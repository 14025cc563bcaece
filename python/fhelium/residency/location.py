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

from fhelium.residency._validation import seal, to_torch_device

__all__ = [
    "ResidencyLocationKind",
    "ResidencyLocation",
    "PAGEABLE_HOST",
    "PINNED_HOST",
    "cuda_location",
]

# The documented kinds; a `DiskLocation` (fhelium.residency.disk) is kind "disk".
ResidencyLocationKind: TypeAlias = Literal["pageable-host", "pinned-host", "cuda"]

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
    """Where one materialisation of a value lives.

    Host kinds always carry the unindexed ``torch.device("cpu")``; the CUDA kind carries
    an indexed CUDA device. Equal locations compare and hash equal whatever spelling
    created them.
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
        """``"pageable-host"``, ``"pinned-host"``, ``"cuda:N"`` or ``"disk:<path>"``."""
        if self.kind == "cuda":
            return f"cuda:{self.device.index}"
        if isinstance(self, DiskLocation):
            return f"disk:{self.path}"
        return self.kind

    def __str__(self) -> str:
        return self.name


PAGEABLE_HOST = ResidencyLocation("pageable-host", _CPU)
PINNED_HOST = ResidencyLocation("pinned-host", _CPU)


def cuda_location(device: torch.device | str) -> ResidencyLocation:
    """The location of CUDA device ``device`` (``"cuda:N"`` or an indexed device)."""
    return ResidencyLocation("cuda", _validate_cuda_device(device))


@dataclass(frozen=True, slots=True, init=False)
class DiskLocation(ResidencyLocation):
    """A directory on local storage (``fhelium.residency.disk.disk_location``): kind
    ``"disk"``, device ``cpu``, the directory's absolute, normalised ``path``, and
    whether its files are read and written with direct I/O (``direct_io``)."""

    path: str
    direct_io: bool

    def __init__(self, path: str | os.PathLike[str], direct_io: bool = False) -> None:
        if not isinstance(direct_io, bool):
            raise TypeError(f"direct_io must be a bool, got {type(direct_io).__name__}")
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"a disk location needs a directory path, got {type(path).__name__}")
        text = os.fspath(path)
        if not isinstance(text, str) or not text or "\0" in text:
            raise ValueError(f"a disk location needs a non-empty directory path, got {text!r}")
        object.__setattr__(self, "path", os.path.normpath(os.path.abspath(text)))
        object.__setattr__(self, "direct_io", direct_io)
        object.__setattr__(self, "kind", "disk")
        object.__setattr__(self, "device", _CPU)

    def __reduce__(self) -> tuple[object, ...]:
        return (DiskLocation, (self.path, self.direct_io))


seal(ResidencyLocation, DiskLocation)
