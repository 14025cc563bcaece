"""fhelium: managed residency of tensor-backed values across host and CUDA memory.

The residency API lives in ``fhelium.residency``; this package root exposes the value
protocol and the exception module.
"""

from fhelium import errors
from fhelium._version import __version__ as __version__
from fhelium.values import ResidentTensor, TensorBundle, TensorResident

__all__ = ["ResidentTensor", "TensorBundle", "TensorResident", "errors"]
