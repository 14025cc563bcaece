"""`fhelium.residency.nn`: run a PyTorch module whose weights do not fit on its device.

`offload(module, device=..., budget=...)` returns an `Offload`; while it is open the
module computes on the device with each unit's weights resident only around its forward.
`init_empty_weights()` builds a module without weights, for `offload(..., checkpoint=...)`.
See docs/concepts/offload.md and docs/tutorials/offload.md.
"""

from fhelium.residency.nn._empty import init_empty_weights
from fhelium.residency.nn._offload import Offload, offload
from fhelium.residency.nn._stats import OffloadStats
from fhelium.residency.nn._values import OffloadUnit

__all__ = ["Offload", "OffloadStats", "OffloadUnit", "init_empty_weights", "offload"]
