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


def disk_location(
    path: str | os.PathLike[str], *, direct_io: bool = False, verify: bool = True
) -> DiskLocation:
    """Return the location of directory ``path`` on local storage.

    The path is made absolute and normalised, so equal directories give equal locations. The
    directory need not exist yet; a manager creates it, and a directory of its own inside it
    (mode ``0700``, files ``0600``), when it first writes. Every file records a checksum
    (XXH3-64) of each of its storages, computed while it is written; every read, into
    pageable, pinned or device memory, lands in new memory of the process's own and is
    checked against them before the value is installed: a damaged file raises
    `fhelium.errors.ResidencyIntegrityError` and changes nothing. ``verify=False`` skips
    the check on reads (the checksums are still written). With ``direct_io=True`` every
    write and every read bypasses the page cache (``O_DIRECT``, through the staging ring),
    where the file system allows it. A process names a directory one way: naming it again
    with another ``direct_io`` or ``verify`` raises `ValueError` where the location is
    used. Values reach a disk location only by ``ensure`` or ``move``, and it cannot be
    borrowed. See docs/concepts/locations-and-budgets.md#disk.

    Args:
        path: The directory.
        direct_io: Read and write the location's files with direct I/O.
        verify: Check every read against the checksums recorded at write.

    Returns:
        The `DiskLocation`, named ``"disk:<path>"``.

    Raises:
        TypeError: ``path`` is not a string or path-like, or ``direct_io`` or ``verify``
            not a ``bool``.
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
    return DiskLocation(path, direct_io, verify)
