"""The disk tier, split by concept (docs/architecture.md):

- `format`: the file format (a safetensors file per value, a checksum per storage),
  the value's storage layout in the header (`fhelium.residency._storage_layout`
  describes it), and the file reads and writes;
- `store`: `DiskStore`, one owner's directory of files: ownership, stale directories,
  atomic writes, checked reads;
- `staging`: the `Staging` ring, and the transfers that stream a file or a host value
  through it;
- `tier`: `DiskTier`, a manager's stores and ring, which the binding calls.
"""

from __future__ import annotations

from fhelium.residency._disk.format import DiskFile
from fhelium.residency._disk.staging import Staging
from fhelium.residency._disk.store import DiskStore
from fhelium.residency._disk.tier import DiskTier

__all__ = ["DiskFile", "DiskStore", "DiskTier", "Staging"]
