"""The simulated allocator readings are kept incrementally: a sample costs the same however
many simulated storages are alive (docs/concepts/simulation.md#allocator-readings)."""

from __future__ import annotations

import gc
import sys
import threading
from types import FrameType
from typing import Any

import pytest
import torch

from fhelium.residency import PAGEABLE_HOST, cuda_location
from fhelium.residency.simulation import SimulatedRuntime
from fhelium.values import ResidentTensor, TensorBundle

CUDA0 = torch.device("cuda", 0)
CUDA1 = torch.device("cuda", 1)
BLOCK = 512


def _calls_during(action: Any) -> int:
    """How many Python and C functions ``action`` calls (generator resumptions included):
    a count of the work done, not a time."""
    count = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return count


def _live(runtime: SimulatedRuntime, count: int) -> list[ResidentTensor]:
    """``count`` live simulated storages of 40 bytes on cuda:0, as many in pinned memory."""
    kept = [runtime.to_device(ResidentTensor(torch.zeros(10)), 0) for _ in range(count)]
    kept += [runtime.pin(ResidentTensor(torch.zeros(10))) for _ in range(count)]
    return kept


@pytest.mark.parametrize("method", ["memory_sample", "memory_allocated", "memory_reserved"])
def test_a_reading_does_not_visit_the_live_storages(method: str) -> None:
    visits = {}
    for count in (4, 400):
        runtime = SimulatedRuntime(1)
        kept = _live(runtime, count)
        reading = getattr(runtime, method)
        reading(CUDA0)  # no storage was freed since: nothing left to take out
        visits[count] = _calls_during(lambda: reading(CUDA0))  # noqa: B023
        assert len(runtime._storage.entries) == 2 * count
        assert runtime.memory_sample(CUDA0) == (40 * count, BLOCK * count)
        del kept
    assert visits[4] == visits[400]


def test_readings_follow_frees_views_and_other_threads() -> None:
    runtime = SimulatedRuntime(2)
    kept = [runtime.to_device(ResidentTensor(torch.zeros(10)), 0) for _ in range(6)]
    on_one = runtime.to_device(ResidentTensor(torch.zeros(1000)), 1)
    assert runtime.memory_sample(CUDA0) == (240, 6 * BLOCK)
    assert runtime.memory_sample(CUDA1) == (4000, 8 * BLOCK)
    # Two fields over one storage: one storage, counted once.
    base = torch.zeros(16)
    shared = runtime.to_device(TensorBundle({"a": base[:8], "b": base[8:]}), 1)
    tensors = shared._resident_tensors
    assert tensors[0].untyped_storage()._cdata == tensors[1].untyped_storage()._cdata
    assert runtime.memory_sample(CUDA1) == (4064, 9 * BLOCK)
    # A view keeps its storage alive; the storage's last reference going frees it.
    view = kept[0].tensor[2:4]
    del kept[:3]
    assert runtime.memory_sample(CUDA0) == (160, 4 * BLOCK)
    del view
    assert runtime.memory_sample(CUDA0) == (120, 3 * BLOCK)
    # Freed on another thread.
    worker = threading.Thread(target=kept.clear)
    worker.start()
    worker.join()
    assert runtime.memory_sample(CUDA0) == (0, 0)
    del shared, tensors, base
    assert runtime.memory_allocated(CUDA1) == 4000
    del on_one
    gc.collect()
    assert runtime.memory_sample(CUDA1) == (0, 0)
    assert runtime._storage.entries == {}


def test_a_freed_storage_s_identity_is_not_taken_while_its_entry_remains() -> None:
    """A storage freed after a copy keeps its entry until the next registration or
    reading; until then no new storage may get its identity, or a fresh host tensor
    would read as living on the simulated device."""
    runtime = SimulatedRuntime(1, auto_complete=True)
    stream = runtime.current_stream(CUDA0)
    source = runtime.pin(ResidentTensor(torch.zeros(8)))
    for _ in range(50):
        copied = runtime.copy_to_cuda(source, CUDA0, stream, non_blocking=True)
        assert runtime.placement(copied) == cuda_location("cuda:0")
        del copied  # freed: its entry waits in the registry for the next drain
        fresh = [ResidentTensor(torch.zeros(8)) for _ in range(8)]
        assert [runtime.placement(value) for value in fresh] == [PAGEABLE_HOST] * 8
    assert runtime.memory_sample(CUDA0) == (0, 0)
    del source
    gc.collect()
    runtime.memory_sample(CUDA0)
    assert runtime._storage.entries == {}


def test_a_new_storage_at_a_freed_one_s_address_is_its_own() -> None:
    """A copy freed and the next copy made at once: the new storage may be allocated where
    the freed one was, while the freed one's entry still waits to be taken out. Each
    copy reads as its own (on the device, its bytes counted once), and the freed one's
    entry, taken out later, leaves the new one's in place."""
    runtime = SimulatedRuntime(1, auto_complete=True)
    stream = runtime.create_stream(CUDA0)
    source = runtime.pin(ResidentTensor(torch.zeros(8)))
    copied = runtime.copy_to_cuda_measured(source, CUDA0, stream, non_blocking=True)[0]
    reused = 0
    for _ in range(200):
        address = copied.tensor.untyped_storage()._cdata
        del copied  # freed: its entry waits in the registry
        copied, facts = runtime.copy_to_cuda_measured(source, CUDA0, stream, non_blocking=True)
        reused += copied.tensor.untyped_storage()._cdata == address
        assert facts == runtime.measure(copied)
        assert runtime.placement(copied) == cuda_location("cuda:0")
        assert runtime.memory_sample(CUDA0) == (32, BLOCK)
        assert runtime.placement(ResidentTensor(torch.zeros(8))) == PAGEABLE_HOST
    del copied
    # Then many freed at once and as many made: the allocator hands the new storages the
    # freed ones' addresses (whatever state earlier tests left its free lists in).
    for _ in range(5):
        batch = [
            runtime.copy_to_cuda_measured(source, CUDA0, stream, non_blocking=True)[0]
            for _ in range(64)
        ]
        freed = {copy.tensor.untyped_storage()._cdata for copy in batch}
        del batch
        batch = []
        for _ in range(64):
            copy, facts = runtime.copy_to_cuda_measured(source, CUDA0, stream, non_blocking=True)
            reused += copy.tensor.untyped_storage()._cdata in freed
            assert facts == runtime.measure(copy)
            assert runtime.placement(copy) == cuda_location("cuda:0")
            batch.append(copy)
            assert runtime.memory_sample(CUDA0) == (32 * len(batch), BLOCK * len(batch))
        del batch, copy
    assert reused > 0, "no storage was allocated at a freed one's address: nothing checked"
    assert runtime.memory_sample(CUDA0) == (0, 0)
