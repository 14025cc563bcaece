"""The disk tier: a directory on local storage as a residency location.

`disk_location(path)` names a directory. A manager with a budget there can `ensure`,
`move`, `drop` and `discard` values to and from it like any other location, the
controller can spill there through fallback tiers, and every file is the manager's
own (see docs/concepts/locations-and-budgets.md#disk).
"""

from __future__ import annotations

import os

from fhelium.residency.location import DiskLocation

__all__ = ["DiskLocation", "disk_location"]


def disk_location(path: str | os.PathLike[str]) -> DiskLocation:
    """The location of directory ``path`` on local storage (absolute and normalised,
    so equal directories give equal locations). The directory need not exist yet; a
    manager creates it, and a directory of its own inside it, when it first writes."""
    return DiskLocation(path)
