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
    """Return the location of directory ``path`` on local storage.

    The path is made absolute and normalised, so equal directories give equal locations. The
    directory need not exist yet; a manager creates it, and a directory of its own inside it,
    when it first writes. With ``direct_io=True`` every write, and every read into pinned
    memory or to a device, bypasses the page cache (``O_DIRECT``, through the staging ring),
    where the file system allows it; reads into pageable memory stay memory maps. A process
    names a directory one way: naming it again with the other ``direct_io`` raises
    `ValueError` where the location is used. Values reach a disk location only by ``ensure``
    or ``move``, and it cannot be borrowed. See docs/concepts/locations-and-budgets.md#disk.

    Args:
        path: The directory.
        direct_io: Read and write the location's files with direct I/O.

    Returns:
        The `DiskLocation`, named ``"disk:<path>"``.

    Raises:
        TypeError: ``path`` is not a string or path-like, or ``direct_io`` not a ``bool``.
        ValueError: An empty path or one containing a NUL character.

    Example:
        ```python
        import os
        import torch
        from fhelium.residency import PAGEABLE_HOST, ResidencyManager
        from fhelium.residency.disk import disk_location
        from fhelium.values import ResidentTensor

        disk = disk_location("spill")  # relative to the working directory
        with ResidencyManager({disk: 1 << 20}) as manager:
            handle = manager.adopt(ResidentTensor(torch.ones(1024)))
            manager.move(handle, disk)      # written as a safetensors file
            manager.move(handle, PAGEABLE_HOST)  # read back, the file deleted
        assert disk.name == "disk:" + os.path.abspath("spill")
        ```
    """
    return DiskLocation(path, direct_io)
