"""Location records and the core's location codes, in both directions.

The core names a location by a small integer: 0 pageable host, 1 pinned host and
2 + index for a CUDA device. Records for the codes are shared, so the hot paths map
a code back to its record without building one.
"""

from __future__ import annotations

from typing import Final

import torch

from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, ResidencyLocation

__all__ = [
    "CUDA_BASE",
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

_LOCATIONS: dict[int, ResidencyLocation] = {PAGEABLE: PAGEABLE_HOST, PINNED: PINNED_HOST}
# Host kinds need no availability check, so hot paths map them without a call.
HOST_CODES: Final[dict[str, int]] = {"pageable-host": PAGEABLE, "pinned-host": PINNED}
# The (device code, pinning) a correctly placed value measures at each location code.
PLACEMENT: Final[dict[int, tuple[int, bool]]] = {
    PAGEABLE: (-1, False),
    PINNED: (-1, True),
    **{CUDA_BASE + index: (index, False) for index in range(128)},
}


def location_of(code: int) -> ResidencyLocation:
    """The shared location record for a core location code."""
    location = _LOCATIONS.get(code)
    if location is None:
        location = ResidencyLocation("cuda", torch.device("cuda", code - CUDA_BASE))
        _LOCATIONS[code] = location
    return location


def location_code_of(location: ResidencyLocation) -> int:
    """The core code of a location already validated by the manager."""
    code = HOST_CODES.get(location.kind)
    return CUDA_BASE + (location.device.index or 0) if code is None else code
