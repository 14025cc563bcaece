"""Location records and the core's location codes, in both directions.

The core names a location by a small integer: 0 pageable host, 1 pinned host,
2 + index for a CUDA device, and 130 + index for a disk directory, where the index is
the order in which this process first named the directory (at most 128 of them).
Records for the codes are shared, so the hot paths map a code back to its record
without building one.
"""

from __future__ import annotations

from typing import Final

import torch

from fhelium.residency.location import (
    PAGEABLE_HOST,
    PINNED_HOST,
    DiskLocation,
    ResidencyLocation,
)

__all__ = [
    "CUDA_BASE",
    "DISK_BASE",
    "HOST_CODES",
    "PAGEABLE",
    "PINNED",
    "PLACEMENT",
    "location_code_of",
    "location_of",
]

PAGEABLE: Final = 0
PINNED: Final = 1
CUDA_BASE: Final = 2
DISK_BASE: Final = 130
_DISK_LIMIT: Final = 128

_LOCATIONS: dict[int, ResidencyLocation] = {PAGEABLE: PAGEABLE_HOST, PINNED: PINNED_HOST}
# Host kinds need no availability check, so hot paths map them without a call.
HOST_CODES: Final[dict[str, int]] = {"pageable-host": PAGEABLE, "pinned-host": PINNED}
# The (device code, pinning) a correctly placed value measures at each location code.
PLACEMENT: Final[dict[int, tuple[int, bool]]] = {
    PAGEABLE: (-1, False),
    PINNED: (-1, True),
    **{CUDA_BASE + index: (index, False) for index in range(128)},
}


# Disk directories by path, in the order this process first named them.
_DISK_CODES: dict[str, int] = {}


def location_of(code: int) -> ResidencyLocation:
    """The shared location record for a core location code."""
    location = _LOCATIONS.get(code)
    if location is None:
        location = ResidencyLocation("cuda", torch.device("cuda", code - CUDA_BASE))
        _LOCATIONS[code] = location
    return location


def disk_code(location: ResidencyLocation) -> int:
    """The code of a disk location, given on first use (``ValueError`` past 128
    directories in one process)."""
    assert isinstance(location, DiskLocation)
    path = location.path
    code = _DISK_CODES.get(path)
    if code is not None:
        known = _LOCATIONS[code]
        assert isinstance(known, DiskLocation)
        if known != location:
            raise ValueError(
                f"{location} is named with direct_io={location.direct_io}, "
                f"verify={location.verify}, but this process already names that directory "
                f"with direct_io={known.direct_io}, verify={known.verify}: a "
                "directory is one location, read and written one way"
            )
    else:
        if len(_DISK_CODES) >= _DISK_LIMIT:
            raise ValueError(
                f"{location} is not usable: a process can name at most {_DISK_LIMIT} disk "
                "directories"
            )
        code = _DISK_CODES.setdefault(path, DISK_BASE + len(_DISK_CODES))
        _LOCATIONS.setdefault(code, location)
    return code


def location_code_of(location: ResidencyLocation) -> int:
    """The core code of a location already validated by the manager."""
    code = HOST_CODES.get(location.kind)
    if code is not None:
        return code
    if isinstance(location, DiskLocation):
        return disk_code(location)
    return CUDA_BASE + (location.device.index or 0)
