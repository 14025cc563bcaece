"""`fhelium.residency.nn`: run a PyTorch module whose weights do not fit on its device.

`offload(module, device=..., budget=...)` returns an `Offload`; while it is open the
module computes on the device with each unit's weights resident only around its forward.
See docs/concepts/offload.md and docs/tutorials/offload.md.
"""

from fhelium.residency.nn._offload import Offload, OffloadStats, OffloadUnit, offload

__all__ = ["Offload", "OffloadStats", "OffloadUnit", "offload"]
