"""`host_copy`, the simulated runtime's copy of a plain one-tensor value, is exactly
`TensorResident.to("cpu", copy=True)` where it applies, and declines everything else.

The simulated CUDA copies (`SimulatedRuntime.copy_to_cuda`) take it instead of `to` for
most values; a copy that diverged from `to`'s in bytes, layout, autograd state or type
would make the simulation unfaithful, so every kind of field is compared here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch.autograd import forward_ad

from fhelium.residency import cuda_location
from fhelium.residency._runtime import SimulatedRuntime
from fhelium.values import ResidentTensor, TensorBundle, TensorResident
from fhelium.values.tensor_resident import host_copy


class Tagged(ResidentTensor):
    """A `ResidentTensor` subclass with its own metadata."""

    __slots__ = ("tag",)

    def __init__(self, tensor: torch.Tensor, tag: str) -> None:
        super().__init__(tensor)
        self.tag = tag


def _grad_leaf() -> torch.Tensor:
    return torch.arange(5, dtype=torch.float32).requires_grad_(True)


def _non_leaf() -> torch.Tensor:
    return _grad_leaf() * 2


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch
        return torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)


# Fields `host_copy` copies: a plain tensor over its whole storage, from offset 0.
COPIED: dict[str, Callable[[], torch.Tensor]] = {
    "float": lambda: torch.arange(8, dtype=torch.float32),
    "int16": lambda: torch.arange(7, dtype=torch.int16),
    "bool": lambda: torch.tensor([True, False, True]),
    "complex": lambda: torch.arange(3, dtype=torch.float32).mul(1 + 2j),
    "scalar": lambda: torch.tensor(3.5),
    "matrix": lambda: torch.arange(12, dtype=torch.float64).view(3, 4),
    "size-1 dims": lambda: torch.arange(4, dtype=torch.float32).view(4, 1, 1),
    "requires grad": _grad_leaf,
    "non-leaf": _non_leaf,
    "parameter": lambda: torch.nn.Parameter(torch.ones(3)),
    "frozen parameter": lambda: torch.nn.Parameter(torch.ones(3), requires_grad=False),
}

# Fields it leaves to `to`: views, partial storages, lazy bits, other layouts, no bytes.
DECLINED: dict[str, Callable[[], torch.Tensor]] = {
    "offset view": lambda: torch.arange(8, dtype=torch.float32)[2:],
    "prefix view": lambda: torch.arange(8, dtype=torch.float32)[:4],
    "strided view": lambda: torch.arange(8, dtype=torch.float32)[::2],
    "transposed": lambda: torch.arange(6, dtype=torch.float32).view(2, 3).t(),
    "channels last": lambda: torch.zeros(1, 2, 2, 2).to(memory_format=torch.channels_last),
    "expanded": lambda: torch.ones(1).expand(4),
    "empty": lambda: torch.empty(0),
    "empty matrix": lambda: torch.empty(0, 3),
    "conjugate": lambda: torch.arange(3, dtype=torch.float32).mul(1 + 2j).conj(),
    "negative": lambda: torch.arange(3, dtype=torch.float32).mul(1 + 2j).conj().imag,
    "sparse": lambda: torch.eye(3).to_sparse(),
    "quantized": _quantized,
    "meta": lambda: torch.empty(4, device="meta"),
}


# What the simulated runtime does not copy to a device (no storage, or no bytes to read).
UNCOPIED = ("meta", "sparse", "quantized")


def _same_copy(made: TensorResident, expected: TensorResident) -> None:
    """Two copies agree in kind, bytes, layout and autograd state."""
    assert type(made) is type(expected)
    (got,) = made._resident_tensors
    (want,) = expected._resident_tensors
    assert type(got) is type(want)
    assert got.device == want.device
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.stride() == want.stride()
    assert got.storage_offset() == want.storage_offset()
    assert got.untyped_storage().nbytes() == want.untyped_storage().nbytes()
    assert bytes(got.untyped_storage()) == bytes(want.untyped_storage())
    assert got.is_conj() == want.is_conj()
    assert got.is_neg() == want.is_neg()
    assert got.requires_grad == want.requires_grad
    assert got.is_leaf
    assert want.is_leaf
    assert got.grad_fn is None
    assert want.grad_fn is None


@pytest.mark.parametrize("field", COPIED.values(), ids=COPIED.keys())
def test_host_copy_is_to_copy(field: Callable[[], torch.Tensor]) -> None:
    source = field()
    value = ResidentTensor(source)
    made = host_copy(value)
    assert made is not None
    copy, storage, source_storage, nbytes = made
    _same_copy(copy, value.to("cpu", copy=True))
    (tensor,) = copy._resident_tensors
    # New storage, reported with the source's and the byte count both have.
    assert storage.data_ptr() == tensor.untyped_storage().data_ptr()
    assert storage.data_ptr() != source.untyped_storage().data_ptr()
    assert source_storage.data_ptr() == source.untyped_storage().data_ptr()
    assert nbytes == source.nbytes == tensor.nbytes == storage.nbytes()
    # The copy is independent of its source.
    with torch.no_grad():
        tensor.zero_()
    assert bytes(source.untyped_storage()) == bytes(field().untyped_storage())


@pytest.mark.parametrize("field", DECLINED.values(), ids=DECLINED.keys())
def test_host_copy_declines_what_to_copies_otherwise(field: Callable[[], torch.Tensor]) -> None:
    assert host_copy(ResidentTensor(field())) is None


def test_host_copy_declines_other_values() -> None:
    assert host_copy(Tagged(torch.ones(3), "kept")) is None
    assert host_copy(TensorBundle(only=torch.ones(3))) is None


# torch's `make_dual` scripts a helper on first use, which warns on this torch.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_host_copy_under_a_dual_level_carries_no_tangent() -> None:
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(torch.zeros(4), torch.ones(4))
        made = host_copy(ResidentTensor(dual))
        assert made is not None
        (tensor,) = made[0]._resident_tensors
        assert forward_ad.unpack_dual(tensor).tangent is None
        _same_copy(made[0], ResidentTensor(dual).to("cpu", copy=True))


@pytest.mark.parametrize(
    "field",
    [*COPIED.values(), *(f for name, f in DECLINED.items() if name not in UNCOPIED)],
    ids=[*COPIED.keys(), *(name for name in DECLINED if name not in UNCOPIED)],
)
@pytest.mark.parametrize("measured", [False, True], ids=["copy", "measured"])
def test_simulated_cuda_copy_is_to_copy(field: Callable[[], torch.Tensor], measured: bool) -> None:
    """Whichever path the runtime takes, its CUDA copy is `to`'s, placed on the device,
    and a measured copy's facts are what `measure` says of it."""
    runtime = SimulatedRuntime(1, auto_complete=True)
    device = torch.device("cuda", 0)
    stream = runtime.create_stream(device)
    value = ResidentTensor(field())
    if measured:
        copy, facts = runtime.copy_to_cuda_measured(value, device, stream, non_blocking=True)
        assert facts == runtime.measure(copy)
        assert type(facts) is type(runtime.measure(copy))
    else:
        copy = runtime.copy_to_cuda(value, device, stream, non_blocking=True)
    _same_copy(copy, value.to("cpu", copy=True))
    assert runtime.placement(copy) == cuda_location("cuda:0")
    assert runtime.memory_allocated(device) == copy.storage_nbytes
