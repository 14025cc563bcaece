"""Lease lifetimes on a real GPU: a consumer kernel that keeps reading a borrowed value
after `release()` keeps it protected until the kernel ends.

The kernel spins on a flag in mapped pinned host memory (not a timed sleep), so the
test decides exactly when the consumer finishes. Skipped without CUDA.

`scripts/gpu-check` runs `-k released_lease_protects` as a stage of its own: that test
is the functional check of the lease guarantee (the manager refuses to free or reuse
the borrowed memory while the kernel runs, and the kernel reads the bytes intact).
"""

from __future__ import annotations

import ctypes
import threading
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
KERNEL_NAME = b"read_when_released"


def _check(result: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    error = result[0]
    if int(error) != 0:
        raise RuntimeError(f"{what} failed: {error!r}")
    return result[1:]


def _nvrtc_image(nvrtc: Any, arch: str) -> bytes:
    """Compiles KERNEL for `arch`: `sm_XY` gives a CUBIN, `compute_XY` PTX."""
    (program,) = _check(
        nvrtc.nvrtcCreateProgram(KERNEL.encode(), b"spin.cu", 0, [], []), "nvrtcCreateProgram"
    )
    try:
        options = [f"--gpu-architecture={arch}".encode()]
        (compiled,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if int(compiled) != 0:
            (size,) = _check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(program, log)
            text = log.decode(errors="replace").rstrip("\0").strip()
            raise RuntimeError(f"NVRTC for {arch} failed: {compiled!r}: {text}")
        if arch.startswith("sm_"):
            get_size, get = nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN
        else:
            get_size, get = nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX
        (size,) = _check(get_size(program), get_size.__name__)
        image = b" " * size  # filled in place by NVRTC; PTX includes its NUL terminator
        _check(get(program, image), get.__name__)
        return image
    finally:
        nvrtc.nvrtcDestroyProgram(program)


class SpinKernel:
    """The compiled kernel plus a host flag the device can see (mapped pinned memory).

    Built for the device's own architecture as a CUBIN: PTX from a newer NVRTC than the
    driver is rejected (CUDA_ERROR_UNSUPPORTED_PTX_VERSION), a CUBIN is not. PTX for the
    device's virtual architecture is only the fallback, if the CUBIN does not compile or
    load. Only the driver API and NVRTC are used here, never cuda-python's runtime module.
    """

    def __init__(self) -> None:
        from cuda.bindings import driver, nvrtc

        self.driver = driver
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # make the primary context current on this thread
        major, minor = torch.cuda.get_device_capability()
        failures = []
        self.module: Any = None
        for arch in (f"sm_{major}{minor}", f"compute_{major}{minor}"):
            try:
                image = _nvrtc_image(nvrtc, arch)
            except RuntimeError as error:
                failures.append(str(error))
                continue
            error, module = driver.cuModuleLoadData(image)
            if int(error) == 0:
                self.module = module
                self.image = f"{'cubin' if arch.startswith('sm_') else 'ptx'} {arch}"
                break
            failures.append(f"cuModuleLoadData of the {arch} image failed: {error!r}")
        if self.module is None:
            raise RuntimeError("the spin kernel could not be built: " + "; ".join(failures))
        (self.function,) = _check(
            driver.cuModuleGetFunction(self.module, KERNEL_NAME), "cuModuleGetFunction"
        )
        (self.host_flag,) = _check(
            driver.cuMemHostAlloc(
                4, driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE
            ),
            "cuMemHostAlloc",
        )
        error, device_flag = driver.cuMemHostGetDevicePointer(self.host_flag, 0)
        # With unified addressing (every 64-bit platform CUDA 12+ runs on) the device sees
        # pinned host memory at its host address, should the query itself be refused.
        self.device_flag = int(device_flag) if int(error) == 0 else int(self.host_flag)
        self.set_flag(0)

    def set_flag(self, value: int) -> None:
        ctypes.c_int.from_address(int(self.host_flag)).value = value

    def launch(self, stream: torch.cuda.Stream, data: torch.Tensor, out: torch.Tensor) -> None:
        """Launches the kernel on `stream` (one block of 128 threads), which first waits
        for the current stream: `data` and `out` were written there (torch's legacy
        default stream), and the pooled `stream` is non-blocking, so nothing else orders
        the kernel's reads after those writes."""
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        arguments = (
            (self.device_flag, data.data_ptr(), out.data_ptr(), data.numel()),
            (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int),
        )
        _check(
            self.driver.cuLaunchKernel(
                self.function, 1, 1, 1, 128, 1, 1, 0, stream.cuda_stream, arguments, 0
            ),
            "cuLaunchKernel",
        )

    def close(self) -> None:
        self.set_flag(1)  # whatever failed, no kernel keeps spinning
        torch.cuda.synchronize()
        self.driver.cuMemFreeHost(self.host_flag)
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
    expected = float(data.sum())  # 523776: every partial sum is exact in float32
    handle = manager.adopt(ResidentTensor(data.clone()))
    manager.move(handle, cuda0)  # copied on the current stream, ready on return
    consumer = torch.cuda.Stream(device=0)
    out = torch.zeros(1, device="cuda")

    lease = manager.acquire([handle], at=cuda0, consumer_stream=consumer)
    borrowed = lease.values[handle]
    assert isinstance(borrowed, ResidentTensor)
    nbytes = borrowed.tensor.nbytes
    # Load the fill kernel used below before the spin starts: with lazy module loading,
    # loading a kernel may wait for the running ones, and the spinning one would never end.
    torch.full((nbytes // 4,), -1.0, device="cuda")
    spin.launch(consumer, borrowed.tensor, out)
    del borrowed
    lease.release()  # wait=False: no device-wide synchronisation

    # The kernel is still spinning: the materialisation stays protected however often
    # the manager reaps, and its memory cannot be dropped and reused.
    refusals = 0
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
        refusals += 2
        assert not consumer.query()

    # Allocation pressure on the stream the materialisation was allocated on: had the
    # manager let its block go, the caching allocator would hand it to one of these and
    # the fill would overwrite what the kernel has yet to read.
    scribbles = [torch.full((nbytes // 4,), -1.0, device="cuda") for _ in range(64)]
    torch.cuda.current_stream().synchronize()  # not the consumer: the kernel still spins
    assert not consumer.query(), "the kernel ended before the flag was set"

    spin.set_flag(1)
    consumer.synchronize()
    total = float(out.item())
    # gpu-check shows this line (pytest -rP) in its results.
    print(
        f"lease guarantee: {spin.image} kernel read sum {total:.0f} (expected {expected:.0f});"
        f" {refusals} drops/moves refused while it ran"
    )
    assert total == expected, "the kernel read the borrowed data intact"
    del scribbles
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
        pytest.skip("cuda-python is not usable here (release events are torch.cuda.Event)")
    cuda0 = cuda_location("cuda:0")
    manager = ResidencyManager()
    handle = manager.adopt(ResidentTensor(torch.ones(16, device="cuda")))
    stream = torch.cuda.Stream(device=0)
    for _ in range(4):
        manager.acquire([handle], at=cuda0, consumer_stream=stream).release(wait=True)
    assert torch_runtime._EVENT_POOL.pooled(0) >= 1
    manager.close()
