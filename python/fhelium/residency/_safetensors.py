"""What the safetensors format says about dtypes, shared by every reader of its files.

The names are the format's (``"F32"``, ``"BF16"``, ...); the data are always
little-endian. `SafetensorsSource` sizes tensors with this table and the checkpoint
reader of `fhelium.residency.nn` parses headers with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import torch

# The format's dtype names and the torch dtype each stands for; an element's size is the
# torch dtype's ``itemsize``.
DTYPES: Final[Mapping[str, torch.dtype]] = MappingProxyType(
    {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
        "F8_E5M2": torch.float8_e5m2,
        "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U64": torch.uint64,
        "U32": torch.uint32,
        "U16": torch.uint16,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "C64": torch.complex64,
    }
)

# The most bytes a header may declare: what the safetensors library itself accepts.
MAX_HEADER: Final = 100_000_000


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name.

    Raises:
        ValueError: A name the format does not define (or this reader does not know).
    """
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported safetensors dtype {name!r}") from None


def dtype_size(name: str) -> int:
    """Bytes per element of a safetensors dtype name.

    Raises:
        ValueError: A name the format does not define.
    """
    return dtype_of(name).itemsize
