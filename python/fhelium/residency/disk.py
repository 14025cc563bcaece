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


def disk_location(path: str | os.PathLike[str], *, direct_io: bool = False) -> DiskLocation:
    """The location of directory ``path`` on local storage (absolute and normalised,
    so equal directories give equal locations). The directory need not exist yet; a
    manager creates it, and a directory of its own inside it, when it first writes.

    With ``direct_io=True`` every write, and every read into pinned memory or to a
    device, bypasses the page cache (``O_DIRECT``, through the staging ring), where
    the file system allows it; reads into pageable memory stay memory maps. A process
    names a directory one way: naming it again with the other ``direct_io`` raises
    ``ValueError`` where the location is used. See
    docs/concepts/locations-and-budgets.md#disk."""
    return DiskLocation(path, direct_io)
