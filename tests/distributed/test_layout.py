"""A value's storage layout, written once (`fhelium.residency._storage_layout`) for the
disk tier and the transfers between ranks: both describe a value with the same fields,
differing only where a tensor sits on a zero-byte storage (a zero-length storage of its
own on disk, none in transit), and both rebuild it as views of one buffer per storage."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch

from fhelium.residency import ReplicaMode
from fhelium.residency._disk.store import DiskStore
from fhelium.residency._storage_layout import Field, describe, rebuild
from fhelium.residency.distributed import _layout as transit
from fhelium.values import ResidentTensor, TensorSequence


def _value(*, empties: bool) -> TensorSequence:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = [base, base.t(), base[2], torch.arange(5, dtype=torch.int64), base[1, ::2]]
    if empties:
        tensors[3:3] = [torch.empty(0, dtype=torch.float16), torch.zeros(0, dtype=torch.bool)]
    return TensorSequence(tensors)


def _shares(value: TensorSequence) -> list[list[bool]]:
    pointers = [tensor.untyped_storage().data_ptr() for tensor in value._resident_tensors]
    nbytes = [tensor.untyped_storage().nbytes() for tensor in value._resident_tensors]
    return [
        [a == b and m > 0 and n > 0 for b, n in zip(pointers, nbytes, strict=True)]
        for a, m in zip(pointers, nbytes, strict=True)
    ]


def test_the_disk_and_a_transfer_describe_a_value_alike(tmp_path: Path) -> None:
    value = _value(empties=False)
    stored = DiskStore(tmp_path / "disk", "owner").write("v", value)
    sent, flats = transit.describe(value, ReplicaMode.EXCLUSIVE)
    assert all(type(field) is Field for field in (*stored.fields, *sent.fields))
    assert stored.fields == sent.fields
    assert stored.fields == (
        Field(0, 0, (4, 6), (6, 1), torch.float32),
        Field(0, 0, (6, 4), (1, 6), torch.float32),
        Field(0, 12, (6,), (1,), torch.float32),
        Field(1, 0, (5,), (1,), torch.int64),
        Field(0, 6, (3,), (2,), torch.float32),
    )
    assert tuple(length for _, length in stored.storages) == sent.storages == (96, 40)
    assert [flat.untyped_storage().data_ptr() for flat in flats] == [
        value[0].untyped_storage().data_ptr(),
        value[3].untyped_storage().data_ptr(),
    ]


def test_a_zero_byte_storage_is_its_own_on_disk_and_none_in_transit(tmp_path: Path) -> None:
    value = _value(empties=True)
    stored = DiskStore(tmp_path / "disk", "owner").write("v", value)
    sent, flats = transit.describe(value, ReplicaMode.EXCLUSIVE)
    assert [field.storage for field in stored.fields] == [0, 0, 0, 1, 2, 3, 0]
    assert [length for _, length in stored.storages] == [96, 0, 0, 40]
    assert [field.storage for field in sent.fields] == [0, 0, 0, -1, -1, 1, 0]
    assert sent.storages == (96, 40)
    assert len(flats) == 2
    assert [field[1:] for field in stored.fields] == [field[1:] for field in sent.fields]


@pytest.mark.parametrize("empties", [False, True])
def test_both_rebuild_the_views_of_one_buffer_per_storage(tmp_path: Path, empties: bool) -> None:
    value = _value(empties=empties)
    store = DiskStore(tmp_path / "disk", "owner")
    sent, flats = transit.describe(value, ReplicaMode.EXCLUSIVE)
    made: list[int] = []

    def empty(nbytes: int) -> torch.Tensor:
        made.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    received = transit.rebuild(sent, [flat.clone() for flat in flats], empty)
    assert made == ([0, 0] if empties else [])
    for back in (store.read(store.write("v", value)), received):
        assert isinstance(back, TensorSequence)
        assert _shares(back) == _shares(value)
        for got, want in zip(back._resident_tensors, value._resident_tensors, strict=True):
            assert torch.equal(got, want)
            assert (got.dtype, got.stride(), got.storage_offset()) == (
                want.dtype,
                want.stride(),
                want.storage_offset(),
            )


def test_a_transfer_describes_dtypes_the_disk_does_not_store() -> None:
    value = ResidentTensor(torch.zeros(3, dtype=torch.complex128))
    sent, flats = transit.describe(value, ReplicaMode.EXCLUSIVE)
    assert sent.fields == (Field(0, 0, (3,), (1,), torch.complex128),)
    back = transit.rebuild(sent, flats, lambda n: torch.empty(n, dtype=torch.uint8))
    assert back.tensor.dtype == torch.complex128


def test_a_skeleton_that_is_not_a_value_is_refused() -> None:
    sent, _ = transit.describe(ResidentTensor(torch.ones(2)), ReplicaMode.EXCLUSIVE)
    forged = dataclasses.replace(sent, skeleton=pickle.dumps([1, 2]))
    with pytest.raises(TypeError, match=r"^the layout describes a list, not a TensorResident$"):
        transit.rebuild(forged, [], lambda n: torch.empty(n, dtype=torch.uint8))


def test_a_field_without_storage_bytes_needs_an_empty_buffer() -> None:
    value = TensorSequence([torch.ones(2), torch.empty(0)])
    described, flats = describe(value._resident_tensors, "none")
    with pytest.raises(ValueError, match="needs `empty`"):
        rebuild(value, described.fields, flats, None)
    own, blobs = describe(value._resident_tensors, "own")
    assert own.storages == (8, 0)
    assert own.whole == (0, 1)
    back = rebuild(value, own.fields, blobs, None)
    assert torch.equal(back[0], value[0])
    assert back[1].shape == (0,)
