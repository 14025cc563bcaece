"""fhelium: managed residency of tensor-backed values across host and CUDA memory.

The residency API lives in ``fhelium.residency``; this package root exposes the value
protocol and the exception module.
"""

from importlib.metadata import PackageNotFoundError, version

from fhelium import errors
from fhelium.values import ResidentTensor, TensorBundle, TensorResident

try:
    __version__ = version("fhelium-residency")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["ResidentTensor", "TensorBundle", "TensorResident", "errors"]
