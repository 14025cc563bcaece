"""Checksums on the disk tier (docs/concepts/locations-and-budgets.md#integrity): every
file records an XXH3-64 checksum per storage in its safetensors metadata (the file
stays standard), and every read path (pageable, pinned and device memory, buffered and
direct I/O) checks it before the value is installed. A damaged file raises
`ResidencyIntegrityError` naming it, with nothing charged, no event pending and the
value's other copies intact; ``verify=False`` turns the check off."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from fhelium._core import Checksum, checksum
from fhelium.errors import ResidencyIntegrityError, ResidencyMaterializationError
from fhelium.residency import (
    PAGEABLE_HOST,
    PINNED_HOST,
    ReplicaMode,
    ResidencyLocation,
    ResidencyManager,
    cuda_location,
)
from fhelium.residency._disk import format as disk_format
from fhelium.residency._disk import staging as disk_staging
from fhelium.residency.disk import DiskLocation, disk_location
from fhelium.residency.simulation import SimulatedRuntime, use_runtime
from fhelium.values import TensorBundle
from helpers.manager import assert_balanced, state_key

CUDA0 = cuda_location("cuda:0")
TARGETS = {"pageable": PAGEABLE_HOST, "pinned": PINNED_HOST, "device": CUDA0}


@pytest.fixture(autouse=True, params=["serial", "overlapped"])
def _small_chunks(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    # Chunks and pieces of one page, so the values cross in many of each and each
    # storage's checksum is fed in many parts, across chunk boundaries. Buffered reads
    # hash each piece right after reading it ("serial"), or, for storages of two
    # overlapped pieces or more, on the hashing thread while the next piece is read.
    monkeypatch.setattr(disk_staging, "CHUNK", 4096)
    monkeypatch.setattr(disk_format, "PIECE", 4096)
    overlapped = 8192 if request.param == "overlapped" else 1 << 40
    monkeypatch.setattr(disk_format, "OVERLAPPED", overlapped)


def _value() -> TensorBundle:
    base = torch.arange(5000, dtype=torch.float32)  # 20000 bytes
    return TensorBundle(
        weight=base,
        window=base[100:300],  # shares the first storage
        index=torch.arange(3000, dtype=torch.int64),  # 24000 bytes
        empty=torch.empty(0, 4),
    )


def _equal(got: TensorBundle, expected: TensorBundle) -> bool:
    return all(
        torch.equal(got[name].cpu(), expected[name])
        for name in ("weight", "window", "index", "empty")
    )


def _data_start(file: Path) -> int:
    with open(file, "rb") as handle:
        return 8 + int.from_bytes(handle.read(8), "little")


def _damage(file: Path, how: str) -> None:
    """A flipped bit in the first storage, or a zeroed range across the second; the
    size stays the same."""
    size = file.stat().st_size
    start = _data_start(file)
    with open(file, "r+b") as handle:
        if how == "flip":
            handle.seek(start + 5001)
            byte = handle.read(1)[0]
            handle.seek(start + 5001)
            handle.write(bytes([byte ^ 0x04]))
        else:
            handle.seek(start + 21000)
            handle.write(bytes(5000))
    assert file.stat().st_size == size


def test_each_file_records_a_checksum_per_storage_and_stays_standard(tmp_path: Path) -> None:
    disk = disk_location(tmp_path)
    manager = ResidencyManager({PAGEABLE_HOST: 1 << 20, disk: 1 << 20})
    handle = manager.adopt(_value(), replica_mode=ReplicaMode.REPLICABLE)
    manager.ensure(handle, disk)
    (file,) = Path(disk.path).glob("*/*.safetensors")
    with safe_open(str(file), framework="pt") as other:
        metadata = other.metadata()
        assert torch.equal(other.get_tensor("field.2"), _value()["index"])
    assert metadata["fhelium.checksum"] == "xxh3-64"
    recorded = json.loads(metadata["fhelium.checksums"])
    # One per storage (the shared weight/window storage, index, empty), each the
    # XXH3-64 of that storage's bytes in the file.
    data = file.read_bytes()[_data_start(file) :]
    ranges = [(0, 20000), (20000, 44000), (44000, 44000)]
    assert recorded == [f"{checksum(data[a:b]):016x}" for a, b in ranges]
    assert all(len(entry) == 16 for entry in recorded)
    manager.close()


def test_the_checksum_binding_streams_and_checks_its_input() -> None:
    data = bytes(range(256)) * 1000
    streaming = Checksum()
    for begin in range(0, len(data), 999):
        streaming.update(memoryview(data)[begin : begin + 999])
    assert streaming.digest() == checksum(data)
    assert streaming.hexdigest() == f"{checksum(data):016x}"
    assert Checksum.algorithm == "xxh3-64"
    assert checksum(b"") == 0x2D06800538D394C2  # the reference value of no bytes
    with pytest.raises(ValueError, match="contiguous"):
        checksum(np.zeros((8, 8), dtype=np.uint8)[:, ::2])


def _setup(
    tmp_path: Path, target: str, direct_io: bool, *, verify: bool = True
) -> tuple[SimulatedRuntime, DiskLocation, ResidencyLocation]:
    runtime = SimulatedRuntime(1)
    disk = disk_location(tmp_path / f"{target}-{direct_io}", direct_io=direct_io, verify=verify)
    # The value's other copy: on the device, or in pageable memory for a device read.
    other = PAGEABLE_HOST if target == "device" else CUDA0
    return runtime, disk, other


@pytest.mark.parametrize("how", ["flip", "zero"])
@pytest.mark.parametrize("direct_io", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_a_damaged_file_is_refused_on_every_read_path(
    tmp_path: Path, target: str, direct_io: bool, how: str
) -> None:
    runtime, disk, other = _setup(tmp_path, target, direct_io)
    at = TARGETS[target]
    with use_runtime(runtime):
        manager = ResidencyManager(
            {disk: 1 << 20, PAGEABLE_HOST: 1 << 20, PINNED_HOST: 1 << 20, CUDA0: 1 << 20}
        )
        value = runtime.to_device(_value(), "cuda:0") if other == CUDA0 else _value()
        handle = manager.adopt(value, replica_mode=ReplicaMode.REPLICABLE)
        manager.ensure(handle, disk)
        (file,) = Path(disk.path).glob("*/*.safetensors")
        _damage(file, how)
        before = state_key(manager.snapshot())
        with pytest.raises(ResidencyIntegrityError) as raised:
            manager.move(handle, at, from_location=disk)
        error = raised.value
        assert isinstance(error, ResidencyMaterializationError)
        assert error.path == str(file)
        assert str(file) in str(error)
        assert error.expected != error.actual
        assert len(error.expected) == len(error.actual) == 16
        # Nothing installed, charged, reserved or left pending; the file and the
        # value's other copy are as they were.
        assert state_key(manager.snapshot()) == before
        books = {entry.location: entry for entry in manager.snapshot().locations}
        assert books[at].used_bytes == books[at].reserved_bytes == 0
        assert runtime.pending_event_count() == 0
        assert_balanced(manager.snapshot())
        assert file.exists()
        stream = runtime.current_stream(other.device) if other == CUDA0 else None
        with manager.acquire([handle], at=other, consumer_stream=stream) as values:
            got = values[handle]
            assert isinstance(got, TensorBundle)
            assert _equal(got, _value())
        manager.close()


@pytest.mark.parametrize("direct_io", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_without_verification_the_damaged_bytes_come_back(
    tmp_path: Path, target: str, direct_io: bool
) -> None:
    runtime, disk, other = _setup(tmp_path, target, direct_io, verify=False)
    at = TARGETS[target]
    with use_runtime(runtime):
        manager = ResidencyManager(
            {disk: 1 << 20, PAGEABLE_HOST: 1 << 20, PINNED_HOST: 1 << 20, CUDA0: 1 << 20}
        )
        value = runtime.to_device(_value(), "cuda:0") if other == CUDA0 else _value()
        handle = manager.adopt(value, replica_mode=ReplicaMode.REPLICABLE)
        manager.ensure(handle, disk)
        (file,) = Path(disk.path).glob("*/*.safetensors")
        # The checksums are still written.
        with safe_open(str(file), framework="pt") as reader:
            metadata = reader.metadata()
        # One per storage (each field names the storage it views).
        storages = {field[0] for field in json.loads(metadata["fhelium.fields"])}
        assert len(json.loads(metadata["fhelium.checksums"])) == len(storages) >= 3
        _damage(file, "zero")
        manager.move(handle, at, from_location=disk)
        runtime.synchronize_device(torch.device("cuda", 0))
        stream = runtime.current_stream(at.device) if at == CUDA0 else None
        with manager.acquire([handle], at=at, consumer_stream=stream) as values:
            got = values[handle]
            assert isinstance(got, TensorBundle)
            assert torch.equal(got["weight"].cpu(), _value()["weight"])
            assert not torch.equal(got["index"].cpu(), _value()["index"])  # zeroed
        manager.close()


def test_verify_is_part_of_the_location(tmp_path: Path) -> None:
    checked = disk_location(tmp_path / "v")
    unchecked = disk_location(tmp_path / "v", verify=False)
    assert checked.verify
    assert not unchecked.verify
    assert checked != unchecked
    assert checked.name == unchecked.name
    assert pickle.loads(pickle.dumps(unchecked)) == unchecked
    with use_runtime(SimulatedRuntime(1)):
        manager = ResidencyManager({checked: 1 << 20})
        with pytest.raises(ValueError, match="verify"):
            ResidencyManager({unchecked: 1 << 20})
        manager.close()
    with pytest.raises(TypeError, match="verify"):
        disk_location(tmp_path, verify="no")  # type: ignore[arg-type]


def test_the_integrity_error_pickles_with_its_fields() -> None:
    error = ResidencyIntegrityError(path="/x/v.safetensors", expected="0" * 16, actual="f" * 16)
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is ResidencyIntegrityError
    assert (clone.path, clone.expected, clone.actual) == ("/x/v.safetensors", "0" * 16, "f" * 16)
    assert str(clone) == str(error)
    assert "/x/v.safetensors" in str(error)
