"""How bytes travel between a disk location and memory: straight into pinned memory,
through the disk tier's staging ring to and from a device (a chunk at a time, the
copies left in flight where a pipeline asks), and with direct I/O
(docs/concepts/locations-and-budgets.md#disk)."""

from __future__ import annotations

import mmap
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

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
from fhelium.residency._disk import store as disk_store
from fhelium.residency.controller import ResidencyController
from fhelium.residency.disk import disk_location
from fhelium.residency.request import ResidencyRequest, ResidencyRequirement
from fhelium.residency.simulation import SimulatedRuntime, Timeline, current_runtime, use_runtime
from fhelium.values import ResidentTensor, TensorBundle
from helpers.limits import capped_memory
from helpers.manager import assert_balanced

CUDA0 = cuda_location("cuda:0")
CHUNK = 4096


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks of one page, so small values cross in several chunks.
    monkeypatch.setattr(disk_staging, "CHUNK", CHUNK)


def _value() -> TensorBundle:
    base = torch.arange(5000, dtype=torch.float32)  # 20000 bytes: 5 chunks
    return TensorBundle(
        weight=base,
        window=base[100:300],  # shares the first storage
        index=torch.arange(3000, dtype=torch.int64),  # 24000 bytes
        empty=torch.empty(0, 4),
    )


def _equal(got: TensorBundle, expected: TensorBundle, *, shared: bool = True) -> None:
    for name in ("weight", "window", "index", "empty"):
        assert torch.equal(got[name].cpu(), expected[name]), name
        assert got[name].dtype == expected[name].dtype
    if shared:  # views and shared storages come back as they were
        window, weight = got["window"].untyped_storage(), got["weight"].untyped_storage()
        assert window.data_ptr() == weight.data_ptr()
        assert got.storage_nbytes == expected.storage_nbytes


def _pieces(storages: list[int]) -> int:
    """How many copies a read through the ring makes: one per chunk and storage that
    overlap (storages lie back to back after the header)."""
    count, begin = 0, 0
    for length in storages:
        if length:
            count += (begin + length - 1) // CHUNK - begin // CHUNK + 1
        begin += length
    return count


def _check(
    manager: ResidencyManager,
    handle: object,
    at: ResidencyLocation,
    expected: TensorBundle,
    *,
    shared: bool = True,
) -> None:
    runtime = current_runtime()
    stream = runtime.current_stream(at.device) if at.kind == "cuda" else None
    with manager.acquire([handle], at=at, consumer_stream=stream) as values:  # type: ignore[list-item]
        got = values[handle]  # type: ignore[index]
        assert isinstance(got, TensorBundle)
        _equal(got, expected, shared=shared)


@pytest.mark.parametrize("direct_io", [False, True])
def test_a_read_into_pinned_memory_goes_straight_there(tmp_path: Path, direct_io: bool) -> None:
    runtime = SimulatedRuntime(1)
    disk = disk_location(tmp_path / f"d{direct_io}", direct_io=direct_io)
    expected = _value()
    with use_runtime(runtime):
        manager = ResidencyManager({disk: 1 << 20, PINNED_HOST: 1 << 20})
        handle = manager.adopt(_value())
        manager.move(handle, disk)
        runtime.calls.clear()
        manager.move(handle, PINNED_HOST)
        # No copy of a copy: the file's bytes land in new pinned memory, one buffer per
        # storage, and no pageable value is made and pinned afterwards.
        assert runtime.calls["copy_to_pinned"] == 0
        assert runtime.calls["empty_pinned"] in (
            3,
            3 + disk_staging.SLOTS,
        )  # one per storage, the empty one too
        with manager.acquire([handle], at=PINNED_HOST) as values:
            got = values[handle]
            assert isinstance(got, TensorBundle)
            assert runtime.value_is_pinned(got)
            _equal(got, expected)
        assert_balanced(manager.snapshot())
        manager.close()


@pytest.mark.parametrize("direct_io", [False, True])
def test_a_device_reads_from_disk_through_the_staging_ring(tmp_path: Path, direct_io: bool) -> None:
    runtime = SimulatedRuntime(1)
    disk = disk_location(tmp_path / f"d{direct_io}", direct_io=direct_io)
    expected = _value()
    with use_runtime(runtime):
        manager = ResidencyManager({disk: 1 << 20, CUDA0: 1 << 20})
        handle = manager.adopt(
            runtime.to_device(_value(), "cuda:0"),
            replica_mode=ReplicaMode.EXCLUSIVE,
        )
        runtime.copies.clear()
        runtime.calls.clear()
        manager.move(handle, disk)
        # To disk: every byte crosses from the device in staging chunks, never as a
        # whole pageable copy of the value.
        assert runtime.calls["copy_to_pageable"] == 0
        downloads = [copy for copy in runtime.copies if copy.destination == PINNED_HOST]
        assert len(downloads) == len(runtime.copies) >= 44000 // CHUNK + 1
        assert all(copy.non_blocking for copy in downloads)
        runtime.copies.clear()
        runtime.calls.clear()
        manager.move(handle, CUDA0)
        # From disk: one non-blocking copy per chunk and storage, from pinned staging.
        assert runtime.calls["copy_to_cuda"] == 0
        assert runtime.calls["copy_to_pageable"] == runtime.calls["copy_to_pinned"] == 0
        # One per storage: `to_device` kept the window a view of the weight's storage.
        assert runtime.calls["empty_cuda"] == 3
        assert all(copy.destination == CUDA0 and copy.non_blocking for copy in runtime.copies)
        assert len(runtime.copies) == _pieces([20000, 24000, 0]) == 12
        with manager.acquire(
            [handle], at=CUDA0, consumer_stream=runtime.current_stream(CUDA0.device)
        ) as values:
            got = values[handle]
            assert isinstance(got, TensorBundle)
            assert runtime.placement(got) == CUDA0
            _equal(got, expected)
        assert_balanced(manager.snapshot())
        manager.close()


def test_without_pinned_memory_the_ring_is_pageable_and_still_works(tmp_path: Path) -> None:
    runtime = SimulatedRuntime(1, pinned=False)
    disk = disk_location(tmp_path / "d", direct_io=True)
    expected = _value()
    with use_runtime(runtime):
        manager = ResidencyManager({disk: 1 << 20, CUDA0: 1 << 20, PAGEABLE_HOST: 1 << 20})
        handle = manager.adopt(_value())
        manager.move(handle, disk)
        runtime.copies.clear()
        manager.move(handle, CUDA0)
        assert runtime.copies
        assert not any(copy.non_blocking for copy in runtime.copies)
        _check(manager, handle, CUDA0, expected)
        runtime.complete_events()  # the consumer stream is done reading
        manager.move(handle, disk)
        manager.move(handle, PAGEABLE_HOST)  # read through the ring into new memory
        _check(manager, handle, PAGEABLE_HOST, expected)
        assert_balanced(manager.snapshot())
        manager.close()


def test_direct_io_opens_files_with_o_direct_and_they_stay_standard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this platform")
    flags: list[int] = []
    real_open = os.open

    def recording_open(path: object, mode: int, *args: object) -> int:
        if str(path).endswith((".safetensors", ".safetensors.tmp")):
            flags.append(mode)
        return real_open(path, mode, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(disk_store.os, "open", recording_open)
    runtime = SimulatedRuntime(1)
    disk = disk_location(tmp_path / "d", direct_io=True)
    expected = _value()
    with use_runtime(runtime):
        manager = ResidencyManager({disk: 1 << 20, CUDA0: 1 << 20})
        handle = manager.adopt(_value())
        manager.move(handle, disk)
        (file,) = (Path(disk.path)).glob("*/*.safetensors")
        # Data starts on a page, and the file is exactly its bytes (no padding kept).
        header = int.from_bytes(file.read_bytes()[:8], "little")
        assert (8 + header) % 4096 == 0
        assert file.stat().st_size == 8 + header + 20000 + 24000
        with safe_open(str(file), framework="pt") as other:
            assert torch.equal(other.get_tensor("field.2"), expected["index"])
        manager.move(handle, CUDA0)
        assert len(flags) == 2
        assert all(mode & os.O_DIRECT for mode in flags)
        _check(manager, handle, CUDA0, expected)
        manager.close()


def test_a_file_system_without_direct_io_falls_back_to_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open
    refused: list[int] = []

    def no_direct(path: object, mode: int, *args: object) -> int:
        if mode & getattr(os, "O_DIRECT", 0):
            refused.append(mode)
            raise OSError(22, "Invalid argument")
        return real_open(path, mode, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(disk_store.os, "open", no_direct)
    monkeypatch.setattr(disk_store, "_O_DIRECT", 0o40000)
    runtime = SimulatedRuntime(1)
    disk = disk_location(tmp_path / "d", direct_io=True)
    expected = _value()
    with use_runtime(runtime):
        manager = ResidencyManager({disk: 1 << 20, PINNED_HOST: 1 << 20})
        handle = manager.adopt(_value())
        manager.move(handle, disk)
        manager.move(handle, PINNED_HOST)
        manager.move(handle, disk)
        manager.move(handle, PINNED_HOST)
        assert len(refused) == 1  # asked once, then buffered for good
        _check(manager, handle, PINNED_HOST, expected)
        manager.close()


def test_a_directory_is_named_one_way(tmp_path: Path) -> None:
    buffered = disk_location(tmp_path / "d")
    direct = disk_location(tmp_path / "d", direct_io=True)
    assert buffered != direct
    assert direct.name == buffered.name == f"disk:{tmp_path / 'd'}"
    with use_runtime(SimulatedRuntime(1)):
        manager = ResidencyManager({buffered: 1 << 20})
        with pytest.raises(ValueError, match="direct_io"):
            ResidencyManager({direct: 1 << 20})
        manager.close()
    with pytest.raises(TypeError, match="direct_io"):
        disk_location(tmp_path, direct_io=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("direct_io", [False, True])
def test_a_truncated_file_fails_a_staged_read_and_loses_nothing(
    tmp_path: Path, direct_io: bool
) -> None:
    runtime = SimulatedRuntime(1)
    disk = disk_location(tmp_path / f"d{direct_io}", direct_io=direct_io)
    with use_runtime(runtime):
        manager = ResidencyManager({disk: 1 << 20, CUDA0: 1 << 20, PINNED_HOST: 1 << 20})
        handle = manager.adopt(_value(), replica_mode=ReplicaMode.REPLICABLE)
        manager.move(handle, disk)
        (file,) = Path(disk.path).glob("*/*.safetensors")
        size = file.stat().st_size
        with open(file, "r+b") as handle_file:
            handle_file.truncate(size - 5000)
        for at in (CUDA0, PINNED_HOST):
            with pytest.raises(ResidencyMaterializationError, match="truncated"):
                manager.ensure(handle, at)
        books = {entry.location: entry for entry in manager.snapshot().locations}
        assert books[CUDA0].used_bytes == books[PINNED_HOST].used_bytes == 0
        assert runtime.pending_event_count() == 0
        assert_balanced(manager.snapshot())
        manager.close()


def test_a_prefetch_pipeline_leaves_disk_reads_in_flight_and_overlaps_them(
    tmp_path: Path,
) -> None:
    # Four 64 KiB layers on disk streamed through a device that holds two, with a
    # compute step per layer: with prefetch, the next layer's H2D copies run while the
    # current layer computes.
    layer = 16384
    timings: dict[int, float] = {}
    for prefetch in (0, 1):
        timeline = Timeline(h2d_bytes_per_s=64e6, d2h_bytes_per_s=64e6)
        runtime = SimulatedRuntime(1, timeline=timeline)
        disk = disk_location(tmp_path / f"p{prefetch}")
        with use_runtime(runtime):
            manager = ResidencyManager({disk: 1 << 24, CUDA0: 2 * layer * 4 + 4096})
            handles = []
            for index in range(4):
                handle = manager.adopt(
                    ResidentTensor(torch.full((layer,), float(index))),
                    replica_mode=ReplicaMode.REPLICABLE,
                )
                manager.move(handle, disk)
                handles.append(handle)
            controller = ResidencyController(manager)
            requests = [
                ResidencyRequest(f"step-{i}", [ResidencyRequirement(h, CUDA0)])
                for i, h in enumerate(handles * 2)
            ]
            consumer = runtime.create_stream(torch.device("cuda", 0))
            sums = []
            with controller.run(
                requests, prefetch=prefetch, consumer_streams={CUDA0: consumer}
            ) as steps:
                for step in steps:
                    (requirement,) = step.request.requirements
                    value = step.value(requirement.handle, at=CUDA0)
                    assert isinstance(value, ResidentTensor)
                    runtime.compute(consumer, 1e-3)
                    sums.append(float(value.tensor.sum()))
            assert sums == [float(layer * (i % 4)) for i in range(8)]
            runtime.synchronize_device(torch.device("cuda", 0))
            timings[prefetch] = timeline.makespan
            assert_balanced(manager.snapshot())
            manager.close()
    assert timings[1] < 0.8 * timings[0]


def _page_aligned(nbytes: int) -> torch.Tensor:
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes]


def _off_page(nbytes: int) -> torch.Tensor:
    buffer = mmap.mmap(-1, nbytes + 4096)
    return torch.frombuffer(buffer, dtype=torch.uint8, offset=64, count=nbytes)


def test_direct_io_moves_whole_pages_of_page_aligned_memory_straight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this platform")
    store = disk_store.DiskStore(tmp_path / "d", "owner", direct=True)
    staging = disk_staging.Staging(SimulatedRuntime(0, pinned=False))
    # Each file write and read: its length, and "ring" or "straight" (the memory it
    # moves is a staging slot, or the value's own).
    writes: list[tuple[int, str]] = []
    reads: list[tuple[int, str]] = []
    real_write, real_preadv = os.write, os.preadv

    def where(data: memoryview) -> str:
        address = np.frombuffer(data, dtype=np.uint8).ctypes.data
        for slot in staging.buffers:
            if slot.data_ptr() <= address < slot.data_ptr() + slot.numel():
                return "ring"
        return "straight"

    def write(descriptor: int, data: memoryview) -> int:
        writes.append((len(data), where(data)))
        return real_write(descriptor, data)

    def preadv(descriptor: int, buffers: list[memoryview], offset: int) -> int:
        reads.extend((len(buffer), where(buffer)) for buffer in buffers)
        return real_preadv(descriptor, buffers, offset)

    monkeypatch.setattr(disk_format.os, "write", write)
    monkeypatch.setattr(disk_staging.os, "preadv", preadv)
    nbytes = 5 * CHUNK + 100  # five whole pages and a tail
    memory = _page_aligned(nbytes)
    memory.copy_(torch.randint(0, 255, (nbytes,), dtype=torch.uint8))
    file = store.write("v", ResidentTensor(memory), staging=staging)
    # The header's page from the ring, the value's whole pages straight from its own
    # memory, then its tail from the ring padded to a page (and truncated after).
    page = (CHUNK, "ring")
    assert writes == [page, (5 * CHUNK, "straight"), page]
    assert file.path.stat().st_size == file.data_start + nbytes
    back = store.read(file, _page_aligned, staging=staging)
    # Whole pages straight, the tail's page staged.
    assert reads == [(5 * CHUNK, "straight"), page]
    assert isinstance(back, ResidentTensor)
    assert torch.equal(back.tensor, memory)
    reads.clear()
    unaligned = store.read(file, _off_page, staging=staging)
    assert reads == [page] * 6  # all through the ring
    assert isinstance(unaligned, ResidentTensor)
    assert torch.equal(unaligned.tensor, memory)
    # Straight pieces of two pages: written, read and hashed piece by piece (each
    # hashed while the next is read), and a damaged page among them is caught.
    monkeypatch.setattr(disk_staging, "STRAIGHT", 2 * CHUNK)
    writes.clear()
    reads.clear()
    pieces = [(2 * CHUNK, "straight"), (2 * CHUNK, "straight"), (CHUNK, "straight")]
    again = store.write("w", ResidentTensor(memory), staging=staging)
    assert writes == [page, *pieces, page]
    back = store.read(again, _page_aligned, staging=staging)
    assert reads == [*pieces, page]
    assert isinstance(back, ResidentTensor)
    assert torch.equal(back.tensor, memory)
    descriptor = os.open(again.path, os.O_WRONLY)
    try:
        flipped = bytes([int(memory[3 * CHUNK + 7]) ^ 0x01])
        os.pwrite(descriptor, flipped, again.data_start + 3 * CHUNK + 7)
    finally:
        os.close(descriptor)
    with pytest.raises(ResidencyIntegrityError, match=again.path.name):
        store.read(again, _page_aligned, staging=staging)
    staging.close()
    store.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_its_own_io_thread(tmp_path: Path) -> None:
    # The parent's ring has an I/O thread; a forked child inherits the pool but not the
    # thread, and must not wait forever on work nobody runs.
    store = disk_store.DiskStore(tmp_path / "d", "owner", direct=True)
    staging = disk_staging.Staging(SimulatedRuntime(0, pinned=False))
    value = ResidentTensor(torch.arange(20000, dtype=torch.uint8))  # five chunks
    store.write("parent", value, staging=staging)
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's outcome is its exit status
        capped_memory()
        signal.alarm(20)
        try:
            file = store.write("child", value, staging=staging)
            back = store.read(file, _page_aligned, staging=staging)
            ok = isinstance(back, ResidentTensor) and torch.equal(back.tensor, value.tensor)
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    staging.close()
    store.close()


def test_a_direct_read_into_pageable_memory_moves_whole_pages_straight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value read back to pageable memory (no allocator given, as the manager reads a
    disk copy back to `PAGEABLE_HOST`) from a direct store lands in memory that starts on
    a page: its whole pages come straight from the file, not through the ring and a
    second copy (torch's allocator only aligns to 64 bytes)."""
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this platform")
    store = disk_store.DiskStore(tmp_path / "d", "owner", direct=True)
    staging = disk_staging.Staging(SimulatedRuntime(0, pinned=False))
    nbytes = 5 * disk_staging.CHUNK + 100
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    file = store.write("v", ResidentTensor(data), staging=staging)
    drained: list[int] = []
    real_drain = disk_staging.Staging.drain

    def drain(
        ring: disk_staging.Staging, slot: int, at: int, target: torch.Tensor, stream: object
    ) -> None:
        drained.append(int(target.numel()))
        real_drain(ring, slot, at, target, stream)

    monkeypatch.setattr(disk_staging.Staging, "drain", drain)
    back = store.read(file, staging=staging)
    assert isinstance(back, ResidentTensor)
    assert torch.equal(back.tensor, data)
    assert back.tensor.data_ptr() % disk_format.ALIGN == 0
    assert back.tensor.untyped_storage().nbytes() == nbytes  # what the manager charges
    assert drained == [nbytes % disk_format.ALIGN]  # only the tail went through the ring
    staging.close()
    store.close()
