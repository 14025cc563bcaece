"""Value protocols: what a managed value is made of and how it moves between devices.

Re-exports the public names of ``fhelium.values.tensor_resident``.
"""

from fhelium.values.tensor_resident import (
    ResidentTensor,
    TensorBundle,
    TensorResident,
    TensorSequence,
    as_resident,
)

__all__ = ["ResidentTensor", "TensorBundle", "TensorResident", "TensorSequence", "as_resident"]
