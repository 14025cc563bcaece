"""On a real GPU, the behaviours tests/runtime/test_gpu_readiness.py models on the CPU:
empty fields and pinned memory, default-stream handles of the CUDA stream protocol, and
the one-query allocator sample. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from fhelium.residency import (
    PAGEABLE_HOST,
    PINNED_HOST,
    ReplicaMode,
    ResidencyManager,
    cuda_location,
)
from fhelium.residency._runtime import TorchCudaRuntime
from fhelium.values import ResidentTensor, TensorBundle

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class LegacyDefaultStream:
    """What cuda.core reports for a default stream: handle 1 (CU_STREAM_LEGACY)."""

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, 1)


def test_torch_never_pins_an_empty_tensor_and_the_manager_copes() -> None:
    empty = torch.empty(0, pin_memory=True)
    # The premise: torch's pinned allocator gives zero bytes no pinned storage.
    assert not empty.is_pinned()
    value = TensorBundle(keys=torch.arange(8.0), empty=torch.zeros(0))
    manager = ResidencyManager()
    handle = manager.adopt(value, replica_mode=ReplicaMode.REPLICABLE)
    manager.ensure(handle, PINNED_HOST)
    manager.move(handle, cuda_location("cuda:0"), from_location=PINNED_HOST)
    manager.move(handle, PINNED_HOST, from_location=cuda_location("cuda:0"))
    with manager.acquire([handle], at=PINNED_HOST) as values:
        back = values[handle]
        assert isinstance(back, TensorBundle)
        assert back["keys"].is_pinned()
        assert torch.equal(back["keys"], torch.arange(8.0))
    assert {m.location for m in manager.snapshot().values[0].materializations} == {
        PAGEABLE_HOST,
        PINNED_HOST,
    }
    manager.close()


def test_a_legacy_default_stream_handle_serves_as_consumer_and_transfer_stream() -> None:
    cuda0 = cuda_location("cuda:0")
    manager = ResidencyManager()
    value = ResidentTensor(torch.arange(1024.0))
    handle = manager.adopt(value, replica_mode=ReplicaMode.REPLICABLE)
    legacy = LegacyDefaultStream()
    manager.ensure(handle, cuda0, stream=legacy)
    lease = manager.acquire([handle], at=cuda0, consumer_stream=legacy)
    assert float(lease[handle].tensor.sum()) == float(torch.arange(1024.0).sum())
    lease.release(wait=True)
    manager.close()


def test_the_allocator_sample_matches_torchs_own_figures() -> None:
    device = torch.device("cuda", 0)
    keep = torch.zeros(1 << 20, device=device)
    sample = TorchCudaRuntime().memory_sample(device)
    assert sample == (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))
    del keep
