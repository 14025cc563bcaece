"""Residency locations: pageable host, pinned host, or one indexed CUDA device.

Locations are plain normalised records; whether a CUDA device exists is the manager's
question, not the record's.
"""

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
        if kind == "cuda":
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
                f"unsupported kind: expected 'pageable-host', 'pinned-host' or 'cuda', got {kind!r}"
            )

    @property
    def name(self) -> str:
        """``"pageable-host"``, ``"pinned-host"`` or ``"cuda:N"``."""
        if self.kind == "cuda":
            return f"cuda:{self.device.index}"
        return self.kind

    def __str__(self) -> str:
        return self.name


PAGEABLE_HOST = ResidencyLocation("pageable-host", _CPU)
PINNED_HOST = ResidencyLocation("pinned-host", _CPU)


def cuda_location(device: torch.device | str) -> ResidencyLocation:
    """The location of CUDA device ``device`` (``"cuda:N"`` or an indexed device)."""
    return ResidencyLocation("cuda", _validate_cuda_device(device))


seal(ResidencyLocation)
