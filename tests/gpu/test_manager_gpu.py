"""The manager on a real GPU: host to device and back through pinned staging, device to
device, copies on a caller's transfer stream, wrong-device streams, allocator samples.

Skipped without CUDA; the same rules run in CI through the simulated runtime.
"""

from __future__ import annotations

import pytest
import torch

from fhelium.residency import (
    PAGEABLE_HOST,
    PINNED_HOST,
    EnsureResident,
    MoveResident,
    ReplicaMode,
    ResidencyLocation,
    ResidencyManager,
    cuda_location,
)
from fhelium.values import ResidentTensor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

needs_two = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)


def _payload(count: int = 1 << 16) -> torch.Tensor:
    return torch.arange(count, dtype=torch.float32)


def test_host_to_device_and_back_through_pinned_staging() -> None:
    cuda0 = cuda_location("cuda:0")
    manager = ResidencyManager({cuda0: 1 << 24})
    data = _payload()
    handle = manager.adopt(ResidentTensor(data.clone()), replica_mode=ReplicaMode.REPLICABLE)

    def locations() -> set[ResidencyLocation]:
        return {entry.location for entry in manager.snapshot().values[0].materializations}

    manager.ensure(handle, PINNED_HOST)  # ensure keeps the others
    assert locations() == {PAGEABLE_HOST, PINNED_HOST}
    # A move installs at `to`, then removes the selected source (the pinned copy) only.
    report = manager.move(handle, cuda0, from_location=PINNED_HOST)
    assert report.source == PINNED_HOST
    assert report.destination == cuda0
    assert locations() == {PAGEABLE_HOST, cuda0}
    manager.drop(handle, PAGEABLE_HOST)
    assert locations() == {cuda0}
    report = manager.move(handle, PAGEABLE_HOST, from_location=cuda0)
    assert report.source == cuda0
    assert locations() == {PAGEABLE_HOST}
    with manager.acquire([handle], at=PAGEABLE_HOST) as values:
        back = values[handle]
        assert isinstance(back, ResidentTensor)
        assert back.tensor.device.type == "cpu"
        assert torch.equal(back.tensor, data)
    assert locations() == {PAGEABLE_HOST}
    manager.close()


def test_copy_on_the_callers_transfer_stream_is_ready_on_return() -> None:
    cuda0 = cuda_location("cuda:0")
    manager = ResidencyManager()
    data = _payload(1 << 20)
    handle = manager.adopt(ResidentTensor(data.clone()), replica_mode=ReplicaMode.REPLICABLE)
    transfer = torch.cuda.Stream(device=0)
    report = manager.ensure(handle, cuda0, stream=transfer)
    # Materialisation is synchronous for the caller: no synchronize needed here.
    assert transfer.query()
    assert report.allocator_device == torch.device("cuda", 0)
    assert isinstance(report.allocator_allocated_bytes_before, int)
    assert isinstance(report.allocator_allocated_bytes_after, int)
    assert report.allocator_allocated_bytes_after >= report.allocator_allocated_bytes_before
    consumer = torch.cuda.Stream(device=0)
    with manager.acquire([handle], at=cuda0, consumer_stream=consumer) as values:
        on_device = values[handle]
        assert isinstance(on_device, ResidentTensor)
        with torch.cuda.stream(consumer):
            # float64: exact for these integers in any order; a float32 reduction of 2**20
            # values rounds its partial sums, and the GPU adds in another order than the CPU.
            total = on_device.tensor.sum(dtype=torch.float64)
        consumer.synchronize()
        assert float(total) == float(data.sum(dtype=torch.float64))
    snapshot = manager.snapshot()
    entry = next(loc for loc in snapshot.locations if loc.location == cuda0)
    assert isinstance(entry.allocator_allocated_bytes, int)
    assert isinstance(entry.allocator_reserved_bytes, int)
    manager.close()


def test_plans_use_their_transfer_streams() -> None:
    cuda0 = cuda_location("cuda:0")
    manager = ResidencyManager()
    handles = [manager.adopt(ResidentTensor(_payload(1 << 12) + index)) for index in range(4)]
    transfer = torch.cuda.Stream(device=0)
    report = manager.execute_actions(
        [MoveResident(handle, cuda0) for handle in handles],
        transfer_streams={cuda0: transfer},
    )
    assert len(report.transitions) == 4
    assert all(transition.destination == cuda0 for transition in report.transitions)
    with pytest.raises(ValueError, match="host"):
        manager.execute_actions(
            [EnsureResident(handles[0], cuda0)], transfer_streams={PAGEABLE_HOST: transfer}
        )
    manager.close()


def test_streams_on_the_wrong_location_are_rejected() -> None:
    cuda0 = cuda_location("cuda:0")
    manager = ResidencyManager()
    handle = manager.adopt(ResidentTensor(_payload()), replica_mode=ReplicaMode.REPLICABLE)
    stream = torch.cuda.Stream(device=0)
    with pytest.raises(ValueError, match="host location"):
        manager.ensure(handle, PINNED_HOST, stream=stream)
    with pytest.raises(ValueError, match="host location"):
        manager.acquire([handle], at=PAGEABLE_HOST, consumer_stream=stream)
    with pytest.raises(TypeError):
        manager.ensure(handle, cuda0, stream=object())
    manager.close()


@needs_two
def test_device_to_device_and_wrong_device_streams() -> None:
    cuda0, cuda1 = cuda_location("cuda:0"), cuda_location("cuda:1")
    manager = ResidencyManager({cuda0: 1 << 24, cuda1: 1 << 24})
    data = _payload()
    handle = manager.adopt(ResidentTensor(data.clone().cuda(0)))
    wrong = torch.cuda.Stream(device=0)
    with pytest.raises(ValueError, match="stream"):
        manager.move(handle, cuda1, stream=wrong)
    report = manager.move(handle, cuda1, stream=torch.cuda.Stream(device=1))
    assert report.source == cuda0
    snapshot = manager.snapshot()
    used = {entry.location: entry.used_bytes for entry in snapshot.locations}
    assert used[cuda0] == 0
    assert used[cuda1] == data.nbytes
    with manager.acquire([handle], at=cuda1, consumer_stream=torch.cuda.Stream(device=1)) as v:
        moved = v[handle]
        assert isinstance(moved, ResidentTensor)
        assert moved.tensor.device == torch.device("cuda", 1)
        assert torch.equal(moved.tensor.cpu(), data)
    manager.close()
