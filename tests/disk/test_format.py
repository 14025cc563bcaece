"""The disk file's header, byte for byte (docs/concepts/disk.md): format "1" as written
before the storage layout was shared with the distributed transfers, so that files and
the tools that read them see exactly what they saw; and the dtypes it refuses."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from fhelium.residency._disk.store import DiskStore
from fhelium.values import TensorBundle, TensorSequence

# A whole tensor, a storage shared by a tensor, its transpose and a row (stored once, as
# raw bytes), a view of a larger storage, and two tensors on zero-byte storages (each a
# zero-length storage of its own).
_HEADER = (
    '{"field.0":{"dtype":"I16","shape":[2,3],"data_offsets":[0,12]},'
    '"storage.1":{"dtype":"U8","shape":[24],"data_offsets":[12,36]},'
    '"storage.2":{"dtype":"U8","shape":[40],"data_offsets":[36,76]},'
    '"field.5":{"dtype":"F32","shape":[0],"data_offsets":[76,76]},'
    '"field.6":{"dtype":"BOOL","shape":[0],"data_offsets":[76,76]},'
    '"__metadata__":{"fhelium.format":"1","fhelium.checksum":"xxh3-64",'
    '"fhelium.fields":"[[0, \\"I16\\", 0, [2, 3], [3, 1]], [1, \\"F32\\", 0, [2, 3], [3, 1]], '
    '[1, \\"F32\\", 0, [3, 2], [1, 3]], [1, \\"F32\\", 3, [3], [1]], '
    '[2, \\"F32\\", 2, [3], [2]], [3, \\"F32\\", 0, [0], [1]], [4, \\"BOOL\\", 0, [0], [1]]]",'
    '"fhelium.checksums":"[\\"CHECKSUMS\\"]"}}'
)


def _value() -> TensorSequence:
    shared = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    larger = torch.arange(10, dtype=torch.float32)
    return TensorSequence(
        [
            torch.arange(6, dtype=torch.int16).reshape(2, 3),
            shared,
            shared.t(),
            shared[1],
            larger[2:8:2],
            torch.empty(0),
            torch.zeros(0, dtype=torch.bool),
        ]
    )


def test_the_header_is_format_1_byte_for_byte(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "disk", "owner")
    value = _value()
    file = store.write("v", value)
    raw = file.path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert file.data_start == 8 + length == 4096
    text = raw[8 : 8 + length].decode()
    assert text == text.rstrip(" ") + " " * (length - len(text.rstrip(" ")))
    checksums = json.loads(json.loads(text)["__metadata__"]["fhelium.checksums"])
    assert len(checksums) == 5
    recorded = '\\",\\"'.join(checksums)
    assert text.rstrip(" ") == _HEADER.replace("CHECKSUMS", recorded)
    # The data: each storage's bytes, back to back, in storage order.
    tensors = value._resident_tensors
    expected = b"".join(
        bytes(tensor.untyped_storage()) for tensor in (tensors[0], tensors[1], tensors[4])
    )
    assert raw[file.data_start :] == expected
    assert file.nbytes == len(raw)
    back = store.read(file)
    for got, want in zip(back._resident_tensors, tensors, strict=True):
        assert torch.equal(got, want)
        assert (got.stride(), got.storage_offset()) == (want.stride(), want.storage_offset())


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.uint16, torch.uint32, torch.uint64, torch.complex128]
)
def test_a_dtype_the_format_does_not_store_is_refused_before_any_file(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    store = DiskStore(tmp_path / "disk", "owner")
    value = TensorBundle(first=torch.ones(2), second=torch.zeros(2, dtype=dtype))
    with pytest.raises(TypeError, match=f"^cannot store a {dtype} tensor on disk$"):
        store.write("v", value)
    assert sorted(path.name for path in store.directory.iterdir()) == ["owner.json"]
