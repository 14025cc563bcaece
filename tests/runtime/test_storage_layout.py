"""Copies keep a value's storage layout (docs/concepts/values.md#copies-keep-the-storage-layout).

Each unique backing storage is copied once, whole, and every field is rebuilt over its
copy with its dtype, storage offset, size and stride: fields that shared a storage still
share one (across dtypes too), views stay views, and the copy's storage bytes are the
source's, which is what the manager charges. Checked for `TensorResident.to` and
`pin_memory`, for both runtimes' copies to pageable, pinned and CUDA memory, and for a
manager moving such a value through every location and back.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.autograd import forward_ad

from fhelium.residency import PAGEABLE_HOST, PINNED_HOST, ResidencyManager, cuda_location
from fhelium.residency._runtime import SimulatedRuntime, TorchCudaRuntime, use_runtime
from fhelium.values import ResidentTensor, TensorBundle, TensorResident
from helpers.manager import assert_balanced, used

CUDA0 = cuda_location("cuda:0")
CUDA1 = cuda_location("cuda:1")
DEV0 = torch.device("cuda", 0)
DEV1 = torch.device("cuda", 1)

# One field's layout: dtype, size, stride, storage offset, the index of its storage among
# the value's unique storages (None for a field without storage bytes), and conj/neg bits.
Layout = tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int, int | None, bool, bool]


def _layout_value(*, requires_grad: bool = False) -> TensorBundle:
    """Views, one storage shared across dtypes, a second storage, empty fields, odd sizes."""
    base = torch.arange(1001, dtype=torch.float32)  # 4004 bytes: not a power of two
    base.requires_grad_(requires_grad)
    as_bytes = torch.empty(0, dtype=torch.uint8).set_(base.detach().untyped_storage())
    small = torch.arange(7, dtype=torch.int16)  # 14 bytes
    return TensorBundle(
        weight=base,
        strided=base.detach()[1::3],  # a strided view
        window=base.detach()[10:20].view(2, 5).t(),  # a transposed window
        raw=as_bytes[3:20],  # the same storage as uint8, at an odd byte offset
        small=small,
        small_tail=small[5:],
        empty=torch.empty(0, 3),
        empty_view=base.detach()[7:7],  # no elements, but a view of the big storage
        conj=torch.arange(6, dtype=torch.float32).mul(1 + 2j).conj(),  # a lazy conjugate
    )


def _storages(value: TensorResident) -> list[torch.UntypedStorage]:
    unique: dict[int, torch.UntypedStorage] = {}
    for tensor in value._resident_tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            unique.setdefault(storage.data_ptr(), storage)
    return list(unique.values())


def _layout(value: TensorResident) -> list[Layout]:
    order = [storage.data_ptr() for storage in _storages(value)]
    layout: list[Layout] = []
    for tensor in value._resident_tensors:
        storage = tensor.untyped_storage()
        index = order.index(storage.data_ptr()) if storage.nbytes() else None
        layout.append(
            (
                tensor.dtype,
                tuple(tensor.shape),
                tensor.stride(),
                tensor.storage_offset(),
                index,
                tensor.is_conj(),
                tensor.is_neg(),
            )
        )
    return layout


def _bytes(value: TensorResident) -> list[bytes]:
    """Each unique storage's bytes, whole (unreferenced bytes included), in field order."""
    return [bytes(storage.cpu()) for storage in _storages(value)]


def _assert_same_layout(copy: TensorResident, source: TensorResident) -> None:
    assert _layout(copy) == _layout(source)
    assert [s.nbytes() for s in _storages(copy)] == [s.nbytes() for s in _storages(source)]
    assert copy.storage_nbytes == source.storage_nbytes
    assert _bytes(copy) == _bytes(source)
    for got, expected in zip(copy._resident_tensors, source._resident_tensors, strict=True):
        assert torch.equal(got.detach().cpu(), expected.detach().cpu())
        assert got.requires_grad == expected.requires_grad
    # New memory: nothing of the source is shared.
    fresh = {s.data_ptr() for s in _storages(copy)}
    assert fresh.isdisjoint(s.data_ptr() for s in _storages(source))


def test_the_value_has_the_layout_under_test() -> None:
    value = _layout_value()
    layout = _layout(value)
    assert [field[4] for field in layout] == [0, 0, 0, 0, 1, 1, None, 0, 2]
    assert value.storage_nbytes == 4004 + 14 + 48
    assert value.storage_nbytes < value.nbytes + 4004  # shared storage counted once


# --------------------------------------------------------------------------------------------
# TensorResident's own copies.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("requires_grad", [False, True], ids=["plain", "requires-grad"])
def test_to_copy_keeps_the_layout(requires_grad: bool) -> None:
    value = _layout_value(requires_grad=requires_grad)
    copy = value.to("cpu", copy=True)
    _assert_same_layout(copy, value)
    # A leaf, as every copy the manager makes: no autograd history to the source.
    assert copy["weight"].grad_fn is None


def test_to_without_copy_on_the_same_device_is_the_value() -> None:
    value = _layout_value()
    assert value.to("cpu") is value
    assert value.cpu() is value


def test_single_tensor_view_copies_its_whole_storage() -> None:
    backing = torch.arange(64, dtype=torch.float64)
    value = ResidentTensor(backing[8:24:2])
    copy = value.to("cpu", copy=True)
    # The view stays a view of a copy of the whole allocation: the bytes charged.
    assert copy.storage_nbytes == value.storage_nbytes == 64 * 8
    assert copy.tensor.storage_offset() == 8
    assert copy.tensor.stride() == (2,)
    assert torch.equal(copy.tensor, value.tensor)


@pytest.mark.parametrize(
    "source",
    [
        torch.arange(6.0).reshape(2, 3),
        torch.nn.Parameter(torch.arange(6.0).reshape(2, 3)),
        torch.arange(6, dtype=torch.int16),
    ],
    ids=["tensor", "parameter", "int16"],
)
def test_single_whole_storage_tensor_copies_as_a_new_leaf(source: torch.Tensor) -> None:
    # A one-field value that is its whole storage (a layer's weight, typically) is
    # copied in one torch call: the copy must be what the layout rebuild gives.
    value = ResidentTensor(source)
    copy = value.to("cpu", copy=True)
    tensor = copy.tensor
    assert type(copy) is ResidentTensor
    assert type(tensor) is torch.Tensor
    assert tensor.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    assert (tensor.dtype, tensor.size(), tensor.stride()) == (
        source.dtype,
        source.size(),
        source.stride(),
    )
    assert tensor.storage_offset() == 0
    assert copy.storage_nbytes == value.storage_nbytes == source.untyped_storage().nbytes()
    assert tensor.is_leaf
    assert tensor.grad_fn is None
    assert tensor.requires_grad == source.requires_grad
    assert torch.equal(tensor.detach(), source.detach())
    source.data.fill_(7)  # independent of the source
    assert not torch.equal(tensor.detach(), source.detach())


# torch's `make_dual` scripts a helper on first use, which warns on this torch.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_a_copy_carries_no_tangent_and_no_history() -> None:
    # Under a forward-mode dual level a tensor may carry a tangent, which a plain copy
    # would inherit; and a tensor computed with autograd has a history the copy must
    # not share. Each copy is a leaf of its own.
    computed = torch.ones(4, requires_grad=True) * 2
    copy = ResidentTensor(computed).to("cpu", copy=True).tensor
    assert (copy.is_leaf, copy.requires_grad, copy.grad_fn) == (True, True, None)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(torch.zeros(4), torch.ones(4))
        assert forward_ad.unpack_dual(dual).tangent is not None
        copy = ResidentTensor(dual).to("cpu", copy=True).tensor
        assert forward_ad.unpack_dual(copy).tangent is None
        assert (copy.is_leaf, copy.requires_grad) == (True, False)
    # Outside any dual level, a tensor without grad is copied as it is: a plain leaf.
    copy = ResidentTensor(torch.zeros(4)).to("cpu", copy=True).tensor
    assert (copy.is_leaf, copy.requires_grad, copy.grad_fn) == (True, False, None)


def test_fields_disagreeing_on_one_storage_size_are_refused() -> None:
    class Disagreeing(TensorResident):
        """Two fields reporting one address with different storage sizes."""

        def __init__(self) -> None:
            self.buffer = bytearray(64)
            self.a = torch.frombuffer(self.buffer, dtype=torch.uint8)
            self.b = torch.frombuffer(self.buffer, dtype=torch.uint8, count=32)

        @property
        def _resident_tensors(self) -> tuple[torch.Tensor, ...]:
            return (self.a, self.b)

        def _with_resident_tensors(self, tensors: tuple[torch.Tensor, ...]) -> Disagreeing:
            return self

    with pytest.raises(RuntimeError, match="different storage sizes"):
        Disagreeing().to("cpu", copy=True)


# --------------------------------------------------------------------------------------------
# The runtimes' copies.
# --------------------------------------------------------------------------------------------


def test_simulated_copies_keep_the_layout_everywhere_and_back() -> None:
    runtime = SimulatedRuntime(2)
    source = _layout_value()
    pinned = runtime.copy_to_pinned(source)
    assert runtime.placement(pinned) == PINNED_HOST
    _assert_same_layout(pinned, source)

    on0 = runtime.copy_to_cuda(pinned, DEV0, runtime.current_stream(DEV0), non_blocking=True)
    assert runtime.placement(on0) == CUDA0
    _assert_same_layout(on0, source)
    # The allocator reading is the storage bytes, each storage counted once.
    assert runtime.memory_allocated(DEV0) == source.storage_nbytes

    on1 = runtime.copy_to_cuda(on0, DEV1, runtime.current_stream(DEV1), non_blocking=True)
    _assert_same_layout(on1, source)
    assert runtime.memory_allocated(DEV1) == source.storage_nbytes

    back_pinned = runtime.copy_to_pinned(on1)
    back = runtime.copy_to_pageable(back_pinned)
    assert runtime.placement(back) == PAGEABLE_HOST
    for copy in (back_pinned, back):
        _assert_same_layout(copy, source)
    assert runtime.measure(back).storage_nbytes == source.storage_nbytes


def _torch_copies() -> list[
    tuple[str, Callable[[TorchCudaRuntime, TensorResident], TensorResident]]
]:
    copies: list[tuple[str, Callable[[TorchCudaRuntime, TensorResident], TensorResident]]] = [
        ("pageable", lambda runtime, value: runtime.copy_to_pageable(value)),
    ]
    if torch.cuda.is_available():
        copies.append(("pinned", lambda runtime, value: runtime.copy_to_pinned(value)))
        copies.append(
            (
                "cuda",
                lambda runtime, value: runtime.copy_to_cuda(value, DEV0, None, non_blocking=False),
            )
        )
    return copies


@pytest.mark.parametrize(("name", "copy"), _torch_copies(), ids=[c[0] for c in _torch_copies()])
def test_torch_copies_keep_the_layout(
    name: str, copy: Callable[[TorchCudaRuntime, TensorResident], TensorResident]
) -> None:
    runtime = TorchCudaRuntime()
    source = _layout_value()
    copied = copy(runtime, source)
    _assert_same_layout(copied, source)
    facts = runtime.measure(copied)
    assert facts.storage_nbytes == source.storage_nbytes
    # And back to the host.
    _assert_same_layout(runtime.copy_to_pageable(copied), source)


# --------------------------------------------------------------------------------------------
# The manager: the charge matches, nothing is refused, the bytes round-trip.
# --------------------------------------------------------------------------------------------


def _views_only() -> TensorBundle:
    """Views into a storage no field covers whole: more storage bytes than logical ones."""
    base = torch.arange(1001, dtype=torch.float32)
    as_bytes = torch.empty(0, dtype=torch.uint8).set_(base.untyped_storage())
    return TensorBundle(strided=base[1::3], raw=as_bytes[3:20], empty=torch.empty(0))


@pytest.mark.parametrize("make", [_layout_value, _views_only], ids=["shared-storage", "views-only"])
def test_manager_moves_a_shared_storage_value_everywhere_and_back(
    make: Callable[[], TensorBundle],
) -> None:
    runtime = SimulatedRuntime(2, auto_complete=True)
    source = make()
    # What the manager charges (docs/concepts/values.md#install).
    charge = max(source.nbytes, source.storage_nbytes)
    expected = _bytes(source)
    # Budgets of exactly the charge: a copy whose storage grew above it is refused.
    budgets = {PINNED_HOST: charge, CUDA0: charge, CUDA1: charge}
    with use_runtime(runtime), ResidencyManager(budgets) as manager:
        handle = manager.adopt(make())
        for location in (PINNED_HOST, CUDA0, CUDA1, PINNED_HOST, PAGEABLE_HOST):
            manager.move(handle, location)
            snapshot = manager.snapshot()
            assert used(snapshot, location) == charge
            assert_balanced(snapshot)
            with manager.acquire(
                [handle],
                at=location,
                consumer_stream=(
                    runtime.current_stream(location.device) if location.kind == "cuda" else None
                ),
            ) as values:
                held = values[handle]
                assert runtime.placement(held) == location
                assert runtime.measure(held).storage_nbytes == source.storage_nbytes
                assert _layout(held) == _layout(source)
                assert _bytes(held) == expected
