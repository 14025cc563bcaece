"""The disk tier on a real GPU (docs/concepts/locations-and-budgets.md#staging-and-direct-io):
values spilled from the device to disk and read back through the pinned staging ring,
with buffered and direct I/O, bitwise equal, with views and shared storages kept, a
prefetch pipeline reading layers from disk with its copies in flight, and nothing left
protected or charged. Each staging copy can be delayed by a `torch.cuda._sleep` on its
stream, so the pipeline test fails if a consumer reads a layer before its copy landed.
Skipped without CUDA; the same rules run in CI on the simulated runtime (tests/disk/)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fhelium.residency import (
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    cuda_location,
)
from fhelium.residency._runtime.torch_runtime import TorchCudaRuntime, _as_stream
from fhelium.residency.disk import disk_location
from fhelium.values import ResidentTensor, TensorBundle

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA0 = cuda_location("cuda:0")
MIB = 1 << 20
# About 5 ms of GPU time at 2 GHz per staged chunk: far longer than its copy.
SLEEP_CYCLES = 10_000_000


@pytest.mark.parametrize("direct_io", [False, True])
def test_a_device_value_round_trips_through_disk(tmp_path: Path, direct_io: bool) -> None:
    disk = disk_location(tmp_path / f"spill-{direct_io}", direct_io=direct_io)
    generator = torch.Generator().manual_seed(5)
    # 40 MiB + a tail: three staging chunks, the last one partial.
    base = torch.randn(10 * MIB + 123, generator=generator).cuda()
    value = TensorBundle(weight=base, window=base[1000:5000], ids=torch.arange(77).cuda())
    expected = {name: value[name].cpu() for name in ("weight", "window", "ids")}
    torch.cuda.synchronize()
    manager = ResidencyManager({CUDA0: 1 << 30, disk: 1 << 30})
    handle = manager.adopt(value, replica_mode=ReplicaMode.EXCLUSIVE)
    del value, base
    manager.move(handle, disk)
    assert [m.location for m in _entry(manager, handle).materializations] == [disk]
    stream = torch.cuda.Stream()
    manager.move(handle, CUDA0, stream=stream)
    with manager.acquire([handle], at=CUDA0, consumer_stream=torch.cuda.current_stream()) as values:
        got = values[handle]
        assert isinstance(got, TensorBundle)
        for name, tensor in expected.items():
            assert got[name].device == torch.device("cuda", 0)
            assert torch.equal(got[name].cpu(), tensor), name
        weight, window = got["weight"].untyped_storage(), got["window"].untyped_storage()
        assert weight.data_ptr() == window.data_ptr()
    torch.cuda.synchronize()
    manager.close()
    assert not any(Path(disk.path).glob("*/*.safetensors"))


@pytest.mark.parametrize("delayed", [False, True])
def test_a_prefetch_pipeline_streams_layers_from_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, delayed: bool
) -> None:
    disk = disk_location(tmp_path / "layers")
    width = 1024
    layer = width * width * 4
    manager = ResidencyManager({CUDA0: 2 * layer + MIB, disk: 1 << 30})
    generator = torch.Generator().manual_seed(9)
    weights = [torch.randn(width, width, generator=generator) for _ in range(6)]
    handles = []
    for weight in weights:
        handle = manager.adopt(ResidentTensor(weight.clone()), replica_mode=ReplicaMode.REPLICABLE)
        manager.move(handle, disk)
        handles.append(handle)
    requests = [
        ResidencyRequest(f"step-{i}", [ResidencyRequirement(h, CUDA0)])
        for i, h in enumerate(handles * 2)
    ]
    compute = torch.cuda.Stream()
    if delayed:
        real = TorchCudaRuntime.copy_bytes
        slept: list[torch.cuda.Stream] = []

        def delayed_copy(
            self: TorchCudaRuntime, destination: torch.Tensor, source: torch.Tensor, stream: object
        ) -> None:
            cuda_stream = _as_stream(stream)
            if destination.is_cuda:
                # Every staging copy to the device lands long after it is enqueued.
                slept.append(cuda_stream)
                with torch.cuda.device(cuda_stream.device), torch.cuda.stream(cuda_stream):
                    torch.cuda._sleep(SLEEP_CYCLES)
            real(self, destination, source, stream)

        monkeypatch.setattr(TorchCudaRuntime, "copy_bytes", delayed_copy)
    sums = []
    with ResidencyController(manager).run(
        requests, prefetch=1, consumer_streams={CUDA0: compute}
    ) as steps:
        for step in steps:
            (requirement,) = step.request.requirements
            value = step.value(requirement.handle, at=CUDA0)
            assert isinstance(value, ResidentTensor)
            with torch.cuda.stream(compute):
                # The bits, summed as integers: exact in any order, so the device's sum
                # equals the host's only if every byte arrived.
                sums.append(value.tensor.view(torch.int32).to(torch.int64).sum())
    torch.cuda.synchronize()
    for index, total in enumerate(sums):
        expected = weights[index % 6].view(torch.int32).to(torch.int64).sum()
        assert int(total) == int(expected), index
    if delayed:
        assert any(stream != compute for stream in slept)  # prefetched on a stream of its own
    manager.close()


def _entry(manager: ResidencyManager, handle: object) -> object:
    return next(v for v in manager.snapshot().values if v.handle == handle)
