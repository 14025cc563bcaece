"""The `TensorResident` value protocol and its private helpers
(docs/concepts/values.md#tensorresident)."""

# Exception types are fixed; ValueError wording is not (docs/concepts/conventions.md#check-order).

from __future__ import annotations

import abc
import copy
import pickle

import pytest
import torch

from fhelium.values import ResidentTensor, TensorBundle, TensorResident
from fhelium.values.tensor_resident import cpu_pinning_is_uniform, storage_keys
from helpers.records import Empty, Pair, Single

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
needs_no_cuda = pytest.mark.skipif(CUDA, reason="pinning works when CUDA is available")


def _key(t: torch.Tensor) -> tuple[torch.device, int]:
    return (t.device, t.untyped_storage().data_ptr())


# --- abstract base -------------------------------------------------------------------------------


def test_is_abstract_base_class() -> None:
    assert issubclass(TensorResident, abc.ABC)
    with pytest.raises(TypeError):
        TensorResident()  # type: ignore[abstract]


def test_subclass_must_implement_both_members() -> None:
    class OnlyTensors(TensorResident):
        @property
        def _resident_tensors(self) -> tuple[torch.Tensor, ...]:
            return ()

    class OnlyRebuild(TensorResident):
        def _with_resident_tensors(self, tensors):  # type: ignore[no-untyped-def]
            return self

    with pytest.raises(TypeError):
        OnlyTensors()  # type: ignore[abstract]
    with pytest.raises(TypeError):
        OnlyRebuild()  # type: ignore[abstract]
    assert isinstance(Empty(), TensorResident)


def test_library_values_are_tensor_residents() -> None:
    t = torch.arange(6, dtype=torch.int16)
    rt = ResidentTensor(t)
    assert isinstance(rt, TensorResident)
    assert rt.tensor is t
    assert rt.nbytes == 12
    assert rt.storage_nbytes == 12
    assert rt.device == torch.device("cpu")
    bundle = TensorBundle({"x": t, "y": torch.zeros(2, dtype=torch.float64)})
    assert isinstance(bundle, TensorResident)
    assert bundle["x"] is t
    assert set(bundle.names) == {"x", "y"}
    assert len(bundle.tensors) == 2
    assert bundle.nbytes == 12 + 16
    assert bundle.to("cpu") is bundle
    copied = bundle.to("cpu", copy=True)
    assert isinstance(copied, TensorBundle)
    assert torch.equal(copied["x"], t)
    assert copied["x"].data_ptr() != t.data_ptr()


# --- device --------------------------------------------------------------------------------------


def test_device_is_first_tensor_device(pair: Pair) -> None:
    assert pair.device == torch.device("cpu")
    meta = Pair(torch.empty(2, device="meta"), torch.empty(3, device="meta"))
    assert meta.device == torch.device("meta")


def test_device_without_tensors_raises() -> None:
    with pytest.raises(RuntimeError):
        Empty().device  # noqa: B018


def test_mixed_devices_raise() -> None:
    mixed = Pair(torch.zeros(2), torch.empty(2, device="meta"))
    with pytest.raises(RuntimeError):
        mixed.device  # noqa: B018
    with pytest.raises(RuntimeError):
        Pair(torch.empty(2, device="meta"), torch.zeros(2)).device  # noqa: B018


def test_is_cpu_is_cuda(pair: Pair) -> None:
    assert pair.is_cpu is True
    assert pair.is_cuda is False
    meta = Single(torch.empty(1, device="meta"))
    assert meta.is_cpu is False
    assert meta.is_cuda is False
    assert meta.is_pinned is False


# --- byte measures -------------------------------------------------------------------------------


def test_nbytes_sums_logical_payload(pair: Pair) -> None:
    assert pair.nbytes == 4 * 4 + 3 * 8
    assert Empty().nbytes == 0


def test_storage_nbytes_of_dense_value(pair: Pair) -> None:
    assert pair.storage_nbytes == 16 + 24
    assert Empty().storage_nbytes == 0


def test_view_into_larger_storage() -> None:
    base = torch.zeros(100, dtype=torch.float32)  # 400 bytes of storage
    view = base[10:20]
    value = Pair(view, torch.zeros(1, dtype=torch.uint8))
    assert value.nbytes == 40 + 1
    assert value.storage_nbytes == 400 + 1
    assert value.storage_nbytes > value.nbytes


def test_strided_view_counts_whole_allocation() -> None:
    base = torch.zeros(8, 8, dtype=torch.float64)
    column = base[:, 0]
    value = Single(column)
    assert value.nbytes == 8 * 8
    assert value.storage_nbytes == 8 * 8 * 8


def test_shared_storage_counted_once() -> None:
    base = torch.zeros(100, dtype=torch.float32)
    value = Pair(base[:10], base[50:])
    assert value.nbytes == 40 + 200
    assert value.storage_nbytes == 400
    same = Pair(base, base)
    assert same.nbytes == 800
    assert same.storage_nbytes == 400
    assert same.storage_nbytes < same.nbytes


def test_zero_size_tensors() -> None:
    value = Pair(torch.empty(0), torch.empty(0, 3, dtype=torch.int64))
    assert value.nbytes == 0
    assert value.storage_nbytes == 0
    assert storage_keys(value) == frozenset()
    mixed = Pair(torch.empty(0), torch.ones(2, dtype=torch.float64))
    assert mixed.nbytes == 16
    assert mixed.storage_nbytes == 16
    assert storage_keys(mixed) == frozenset({_key(mixed.b)})


def test_zero_size_view_of_nonempty_storage_still_counts_storage() -> None:
    base = torch.zeros(10, dtype=torch.float32)
    value = Single(base[3:3])
    assert value.nbytes == 0
    assert value.storage_nbytes == 40
    assert storage_keys(value) == frozenset({_key(base)})


def test_same_key_with_different_storage_sizes_raises() -> None:
    buffer = bytearray(100)
    whole = torch.frombuffer(buffer, dtype=torch.uint8)
    prefix = torch.frombuffer(buffer, dtype=torch.uint8, count=50)
    assert _key(whole) == _key(prefix)
    value = Pair(whole, prefix)
    assert value.nbytes == 150
    with pytest.raises(RuntimeError):
        value.storage_nbytes  # noqa: B018


# --- helpers -------------------------------------------------------------------------------------


def test_storage_keys(pair: Pair) -> None:
    keys = storage_keys(pair)
    assert isinstance(keys, frozenset)
    assert keys == frozenset({_key(pair.a), _key(pair.b)})
    base = torch.zeros(10)
    shared = storage_keys(Pair(base[:2], base[5:]))
    assert shared == frozenset({(torch.device("cpu"), base.untyped_storage().data_ptr())})
    assert storage_keys(Empty()) == frozenset()


def test_cpu_pinning_is_uniform_for_pageable_and_non_cpu(pair: Pair) -> None:
    assert cpu_pinning_is_uniform(pair) is True
    assert cpu_pinning_is_uniform(Single(torch.empty(3, device="meta"))) is True


# --- to / cpu ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=repr)
def test_to_same_device_returns_self(pair: Pair, device: object) -> None:
    assert pair.to(device) is pair
    assert pair.to(device, non_blocking=True) is pair


def test_to_with_copy_returns_independent_copy(pair: Pair) -> None:
    copied = pair.to("cpu", copy=True)
    assert copied is not pair
    assert isinstance(copied, Pair)
    assert copied.tag == pair.tag  # built through _with_resident_tensors
    assert torch.equal(copied.a, pair.a)
    assert torch.equal(copied.b, pair.b)
    assert copied.a.dtype == pair.a.dtype
    assert storage_keys(copied).isdisjoint(storage_keys(pair))
    pair.a.add_(100)
    assert not torch.equal(copied.a, pair.a)
    assert copied.is_pinned is False


def test_to_copy_of_view_may_compact() -> None:
    base = torch.arange(100, dtype=torch.float32)
    value = Single(base[10:20])
    copied = value.to("cpu", copy=True)
    assert torch.equal(copied.t, base[10:20])
    assert copied.storage_nbytes <= value.storage_nbytes
    assert copied.nbytes == value.nbytes


def test_to_other_device_rebuilds_and_keeps_identical_tensors() -> None:
    original = Pair(torch.zeros(2), torch.empty(3, device="meta"), tag="mixed")
    moved = original.to("meta")
    assert moved is not original
    assert isinstance(moved, Pair)
    assert moved.tag == "mixed"
    assert moved.a.device == torch.device("meta")
    assert moved.b is original.b  # tensor.to returned the same object
    assert moved.device == torch.device("meta")


def test_to_accepts_torch_device_target() -> None:
    value = Pair(torch.zeros(2), torch.zeros(1))
    moved = value.to(torch.device("meta"))
    assert moved.device.type == "meta"
    assert value.device.type == "cpu"


def test_cpu_of_pageable_value(pair: Pair) -> None:
    assert pair.cpu() is pair
    copied = pair.cpu(copy=True)
    assert copied is not pair
    assert storage_keys(copied).isdisjoint(storage_keys(pair))
    assert copied.is_pinned is False
    assert torch.equal(copied.a, pair.a)


# --- pinning -------------------------------------------------------------------------------------


def test_is_pinned_false_for_pageable(pair: Pair) -> None:
    assert pair.is_pinned is False


@needs_no_cuda
@pytest.mark.parametrize("copy", [False, True])
def test_pin_memory_without_pinned_runtime_raises(pair: Pair, copy: bool) -> None:
    with pytest.raises(RuntimeError) as info:
        pair.pin_memory(copy=copy)
    assert "pinned host storage" in str(info.value).lower()
    assert info.value.__cause__ is not None
    assert isinstance(info.value.__cause__, RuntimeError)
    # The value itself is untouched.
    assert pair.is_pinned is False
    assert torch.equal(pair.a, torch.arange(4, dtype=torch.float32))


@needs_cuda
def test_pin_memory_creates_pinned_copy() -> None:
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # non-contiguous strides
    b = torch.ones(2, requires_grad=True)
    value = Pair(a, b, tag="p")
    pinned = value.pin_memory()
    assert pinned is not value
    assert pinned.tag == "p"
    assert pinned.is_pinned is True
    assert pinned.is_cpu is True
    assert pinned.a.stride() == a.stride()
    assert pinned.a.shape == a.shape
    assert torch.equal(pinned.a, a)
    assert pinned.b.requires_grad is True
    assert pinned.b.grad_fn is None
    assert storage_keys(pinned).isdisjoint(storage_keys(value))
    assert cpu_pinning_is_uniform(pinned) is True
    # Already pinned: identity without copy, a new pinned value with copy.
    assert pinned.pin_memory() is pinned
    again = pinned.pin_memory(copy=True)
    assert again is not pinned
    assert again.is_pinned is True
    # cpu() of a pinned value always copies to pageable storage.
    pageable = pinned.cpu()
    assert pageable is not pinned
    assert pageable.is_pinned is False
    assert torch.equal(pageable.a, a)
    # Host copies from CPU produce pageable storage.
    assert pinned.to("cpu", copy=True).is_pinned is False


@needs_cuda
def test_mixed_pinning_is_not_uniform() -> None:
    value = Pair(torch.zeros(2).pin_memory(), torch.zeros(2))
    assert value.is_pinned is False
    assert cpu_pinning_is_uniform(value) is False
    assert cpu_pinning_is_uniform(Pair(torch.zeros(1).pin_memory(), torch.zeros(1).pin_memory()))


@needs_cuda
def test_cuda_values() -> None:
    value = Pair(torch.zeros(2, device="cuda:0"), torch.ones(1, device="cuda:0"))
    assert value.is_cuda is True
    assert value.is_cpu is False
    assert value.is_pinned is False
    assert cpu_pinning_is_uniform(value) is True
    assert value.device == torch.device("cuda", 0)
    host = value.pin_memory()
    assert host.is_pinned is True
    assert torch.equal(host.b, torch.ones(1))
    back = host.to("cuda:0")
    assert back.is_cuda is True
    cpu_copy = value.cpu()
    assert cpu_copy.is_cpu is True
    assert cpu_copy.is_pinned is False


# --- ResidentTensor's field ----------------------------------------------------------------------


class _Counted(ResidentTensor):
    """Overrides the fields with a property that counts its reads, as a probe would."""

    __slots__ = ("reads", "tag")

    reads: int
    tag: str

    def __init__(self, tensor: torch.Tensor, tag: str) -> None:
        super().__init__(tensor)
        self.reads = 0
        self.tag = tag

    @property
    def _resident_tensors(self) -> tuple[torch.Tensor, ...]:
        self.reads += 1
        return (self._tensor,)


def test_a_resident_tensor_s_field_is_one_however_it_is_read_or_replaced() -> None:
    first, second = torch.arange(4.0), torch.zeros(3)
    value = ResidentTensor(first)
    assert value.tensor is first
    assert value._tensor is first
    assert value._resident_tensors == (first,)
    assert value._resident_tensors[0] is first
    # Replacing it the way a subclass's `_with_resident_tensors` may.
    object.__setattr__(value, "_tensor", second)
    assert value.tensor is second
    assert value._resident_tensors[0] is second
    assert "tensor=" not in repr(value)
    assert "shape=(3,)" in repr(value)
    with pytest.raises(AttributeError):
        value.tensor = first  # type: ignore[misc]


def test_a_subclass_keeps_its_metadata_and_overrides_through_copies() -> None:
    value = _Counted(torch.arange(4.0), "w")
    clone = copy.copy(value)
    assert value.reads == 0  # copying does not read the fields
    assert clone.tag == "w"
    assert clone.tensor is value.tensor
    moved = value.to("cpu", copy=True)
    assert type(moved) is _Counted
    assert moved.tag == "w"
    assert torch.equal(moved.tensor, value.tensor)
    assert moved.tensor is not value.tensor
    assert moved._resident_tensors == (moved.tensor,)
    restored = pickle.loads(pickle.dumps(ResidentTensor(torch.arange(3))))
    assert type(restored) is ResidentTensor
    assert torch.equal(restored.tensor, torch.arange(3))
    assert restored._resident_tensors[0] is restored.tensor
