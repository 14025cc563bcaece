"""Where the demos compute: a CUDA device, or a simulated one with the timeline model
(docs/concepts/simulation.md#the-timeline)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from fhelium.residency import cuda_location
from fhelium.residency.simulation import SimulatedRuntime, Timeline, use_runtime

MIB = 1 << 20


class Compute:
    """Where the demo computes: a CUDA device, or a simulated one with a timeline."""

    def __init__(self, device: str, *, h2d_gbps: float, tflops: float, index: int = 0) -> None:
        self.on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        # A rank's own GPU is cuda:{LOCAL_RANK}; the simulated device is always cuda:0.
        self.location = cuda_location(f"cuda:{index if self.on_gpu else 0}")
        self.tflops = tflops
        self.runtime: SimulatedRuntime | None = None
        if self.on_gpu:
            self.torch_device = torch.device("cuda", index)
            self.description = torch.cuda.get_device_name(index)
            self.stream: Any = torch.cuda.current_stream(self.torch_device)
        else:
            bandwidth = h2d_gbps * 1e9
            self.runtime = SimulatedRuntime(
                1,
                pinned=True,
                timeline=Timeline(h2d_bytes_per_s=bandwidth, d2h_bytes_per_s=bandwidth),
            )
            self.torch_device = torch.device("cpu")
            self.description = (
                "simulated cuda:0 (no GPU: CPU tensors stand in for device memory; times are "
                f"the timeline model's, {h2d_gbps:g} GB/s per copy direction, "
                f"{tflops:g} TFLOP/s compute)"
            )
            self.stream = self.runtime.current_stream(torch.device("cuda", 0))
        self.simulated_device = torch.device("cuda", 0)

    @property
    def timeline(self) -> Timeline | None:
        return None if self.runtime is None else self.runtime.timeline

    def installed(self) -> contextlib.AbstractContextManager[Any]:
        if self.runtime is None:
            return contextlib.nullcontext()
        return use_runtime(self.runtime)

    def kernels(self) -> contextlib.AbstractContextManager[Any]:
        """Where the body's kernels go: the consumer stream the leases protect."""
        if self.on_gpu:
            return torch.cuda.stream(self.stream)
        return contextlib.nullcontext()

    def declare(self, flops: float, label: str) -> None:
        """On the simulated device, the body's compute time in the timeline model."""
        if self.runtime is not None:
            self.runtime.compute(self.stream, flops / (self.tflops * 1e12), label=label)

    def declare_seconds(self, seconds: float, label: str) -> None:
        """On the simulated device, ``seconds`` of compute in the timeline model."""
        if self.runtime is not None:
            self.runtime.compute(self.stream, seconds, label=label)

    def synchronize(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.torch_device)
        elif self.runtime is not None:
            self.runtime.synchronize_device(self.simulated_device)

    def clock_ns(self) -> int:
        """The plot's clock: wall time on a GPU; otherwise the model's virtual time at
        which the device finishes the work declared so far (the host runs ahead)."""
        timeline = self.timeline
        if timeline is None:
            return time.perf_counter_ns()
        ends = [span.end for span in timeline.spans if span.engine == "compute"]
        return round(max([timeline.now, *ends]) * 1e9)


class GpuTimer:
    """A run's makespan on the GPU, between two CUDA events on the consumer stream."""

    def __init__(self, compute: Compute) -> None:
        compute.synchronize()
        self._compute = compute
        self._start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self._start.record(compute.stream)

    def stop(self) -> float:
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end.record(self._compute.stream)
        end.synchronize()
        return float(self._start.elapsed_time(end)) / 1e3
