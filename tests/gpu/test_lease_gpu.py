"""Lease lifetimes on a real GPU: a consumer kernel that keeps reading a borrowed value
after `release()` keeps it protected until the kernel ends.

The kernel spins on a flag in mapped pinned host memory (not a timed sleep), so the
test decides exactly when the consumer finishes. Skipped without CUDA.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from fhelium.errors import ResidencyInUseError
from fhelium.residency import PAGEABLE_HOST, ResidencyManager, cuda_location
from fhelium.values import ResidentTensor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

KERNEL = r"""
extern "C" __global__ void read_when_released(
    volatile int* flag, const float* data, float* out, int n)
{
    // Spin until the host flips the flag: the borrowed value is read after release().
    while (*flag == 0) { }
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) { sum += data[i]; }
    atomicAdd(out, sum);
}
"""


def _check(result: tuple[Any, ...]) -> tuple[Any, ...]:
    error = result[0]
    if int(error) != 0:
        raise RuntimeError(f"CUDA call failed: {error!r}")
    return result[1:]


class SpinKernel:
    """The compiled kernel plus a host flag the device can see (mapped pinned memory)."""

    def __init__(self) -> None:
        from cuda.bindings import driver, nvrtc
        from cuda.bindings import runtime as cudart

        self.driver = driver
        self.cudart = cudart
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # make the primary context current
        (program,) = _check(nvrtc.nvrtcCreateProgram(KERNEL.encode(), b"spin.cu", 0, [], []))
        major, minor = torch.cuda.get_device_capability()
        options = [f"--gpu-architecture=compute_{major}{minor}".encode()]
        compiled = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if int(compiled[0]) != 0:
            (size,) = _check(nvrtc.nvrtcGetProgramLogSize(program))
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(program, log)
            raise RuntimeError(log.decode(errors="replace"))
        (size,) = _check(nvrtc.nvrtcGetPTXSize(program))
        ptx = b" " * size
        _check(nvrtc.nvrtcGetPTX(program, ptx))
        (self.module,) = _check(driver.cuModuleLoadData(ptx))
        (self.function,) = _check(driver.cuModuleGetFunction(self.module, b"read_when_released"))
        (self.host_flag,) = _check(cudart.cudaHostAlloc(4, cudart.cudaHostAllocMapped))
        (self.device_flag,) = _check(cudart.cudaHostGetDevicePointer(self.host_flag, 0))
        self.set_flag(0)

    def set_flag(self, value: int) -> None:
        ctypes.c_int.from_address(int(self.host_flag)).value = value

    def launch(self, stream: torch.cuda.Stream, data: torch.Tensor, out: torch.Tensor) -> None:
        arguments = (
            (self.device_flag, data.data_ptr(), out.data_ptr(), data.numel()),
            (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int),
        )
        _check(
            self.driver.cuLaunchKernel(
                self.function, 1, 1, 1, 128, 1, 1, 0, stream.cuda_stream, arguments, 0
            )
        )

    def close(self) -> None:
        self.set_flag(1)
        torch.cuda.synchronize()
        self.cudart.cudaFreeHost(self.host_flag)
        self.driver.cuModuleUnload(self.module)


@pytest.fixture
def spin() -> Iterator[SpinKernel]:
    kernel = SpinKernel()
    try:
        yield kernel
    finally:
        kernel.close()


def test_released_lease_protects_memory_until_the_consumer_kernel_ends(
    spin: SpinKernel,
) -> None:
    cuda0 = cuda_location("cuda:0")
    manager = ResidencyManager()
    data = torch.arange(1024, dtype=torch.float32)
    expected = float(data.sum())
    handle = manager.adopt(ResidentTensor(data.clone()))
    manager.move(handle, cuda0)
    consumer = torch.cuda.Stream(device=0)
    out = torch.zeros(1, device="cuda")

    lease = manager.acquire([handle], at=cuda0, consumer_stream=consumer)
    borrowed = lease.values[handle]
    assert isinstance(borrowed, ResidentTensor)
    spin.launch(consumer, borrowed.tensor, out)
    del borrowed
    lease.release()  # wait=False: no device-wide synchronisation

    # The kernel is still spinning: the materialisation stays protected however often
    # the manager reaps, and its memory cannot be dropped and reused.
    for _ in range(5):
        time.sleep(0.05)
        snapshot = manager.snapshot()
        (entry,) = snapshot.values
        (materialization,) = entry.materializations
        assert materialization.pending_event_count == 1
        with pytest.raises(ResidencyInUseError, match="pending_events=1"):
            manager.drop(handle, cuda0)
        with pytest.raises(ResidencyInUseError):
            manager.move(handle, PAGEABLE_HOST)
        assert not consumer.query()

    spin.set_flag(1)
    consumer.synchronize()
    assert float(out.item()) == expected, "the kernel read the borrowed data intact"
    version = manager.state_version  # reaps the completed event
    snapshot = manager.snapshot()
    assert snapshot.state_version == version
    assert snapshot.values[0].materializations[0].pending_event_count == 0
    manager.move(handle, PAGEABLE_HOST)
    manager.close()


def test_release_with_wait_returns_only_after_the_kernel(spin: SpinKernel) -> None:
    cuda0 = cuda_location("cuda:0")
    manager = ResidencyManager()
    handle = manager.adopt(ResidentTensor(torch.ones(256, device="cuda")))
    consumer = torch.cuda.Stream(device=0)
    out = torch.zeros(1, device="cuda")
    lease = manager.acquire([handle], at=cuda0, consumer_stream=consumer)
    spin.launch(consumer, lease.values[handle].tensor, out)  # type: ignore[attr-defined]

    import threading

    releaser = threading.Timer(0.2, spin.set_flag, args=(1,))
    releaser.start()
    started = time.perf_counter()
    lease.release(wait=True)
    waited = time.perf_counter() - started
    releaser.join()
    assert waited >= 0.15, f"release(wait=True) returned after {waited:.3f}s, before the kernel"
    assert float(out.item()) == 256.0
    assert manager.snapshot().values[0].materializations[0].pending_event_count == 0
    manager.close()


def test_pooled_events_are_reused_after_completion() -> None:
    from fhelium.residency._runtime import torch_runtime
    from fhelium.residency._runtime.cuda_events import cuda_bindings_available

    if not cuda_bindings_available():
        pytest.skip("cuda-python is not usable here")
    cuda0 = cuda_location("cuda:0")
    manager = ResidencyManager()
    handle = manager.adopt(ResidentTensor(torch.ones(16, device="cuda")))
    stream = torch.cuda.Stream(device=0)
    for _ in range(4):
        manager.acquire([handle], at=cuda0, consumer_stream=stream).release(wait=True)
    assert torch_runtime._EVENT_POOL.pooled(0) >= 1
    manager.close()
