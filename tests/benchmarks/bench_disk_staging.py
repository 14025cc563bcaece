"""A pipeline over values on disk, on the simulated runtime: the wall time of its steps
when each file read takes ``--read-ms`` and each step's body ``--body-ms`` of host time
(both slept; the copies themselves cost nothing here).

A read from disk to a device is staged before the body: the disk tier's I/O thread
reads it and enqueues its copies while the body runs (docs/concepts/controller.md#staging).
The target is the overlapped time, one read and then the bodies,
``read + steps * max(read, body)``; reading on the pipeline's thread would take
``steps * (read + body)``. Prints the measured wall time against both, and the
fraction of the reads that ran on the I/O thread.

Run: python tests/benchmarks/bench_disk_staging.py [--steps 8] [--read-ms 20] [--body-ms 20]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from fhelium.residency import (
    PINNED_HOST,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    cuda_location,
)
from fhelium.residency.disk import disk_location
from fhelium.residency.simulation import SimulatedRuntime, use_runtime
from fhelium.values import ResidentTensor

CUDA0 = cuda_location("cuda:0")


def measure(steps: int, read_s: float, body_s: float) -> tuple[float, int, int]:
    """(wall seconds, reads on the I/O thread, reads in all) of one pass."""
    real = os.preadv
    counts = {"io": 0, "all": 0}

    def slow(*args: Any) -> int:
        counts["all"] += 1
        counts["io"] += threading.current_thread().name.startswith("fhelium-disk-io")
        time.sleep(read_s)
        return real(*args)

    runtime = SimulatedRuntime(1)
    with tempfile.TemporaryDirectory() as root, use_runtime(runtime):
        disk = disk_location(Path(root) / "disk")
        manager = ResidencyManager({disk: 1 << 26, CUDA0: 1 << 26, PINNED_HOST: 1 << 26})
        handles = []
        for index in range(steps):
            value = ResidentTensor(torch.full((16384,), float(index)))
            handle = manager.adopt(value, replica_mode=ReplicaMode.REPLICABLE)
            manager.move(handle, disk)
            handles.append(handle)
        requests = [
            ResidencyRequest(f"step-{i}", [ResidencyRequirement(h, CUDA0)])
            for i, h in enumerate(handles)
        ]
        consumer = runtime.create_stream(torch.device("cuda", 0))
        os.preadv = slow
        try:
            start = time.perf_counter()
            with ResidencyController(manager).run(
                requests, prefetch=1, consumer_streams={CUDA0: consumer}
            ) as pipeline:
                for number, step in enumerate(pipeline):
                    (requirement,) = step.request.requirements
                    value = step.value(requirement.handle, at=CUDA0)
                    assert isinstance(value, ResidentTensor)
                    assert float(value.tensor[0]) == number
                    time.sleep(body_s)
            wall = time.perf_counter() - start
        finally:
            os.preadv = real
        manager.close()
    return wall, counts["io"], counts["all"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--read-ms", type=float, default=20.0)
    parser.add_argument("--body-ms", type=float, default=20.0)
    args = parser.parse_args()
    read_s, body_s = args.read_ms / 1e3, args.body_ms / 1e3
    wall, io, reads = min(
        (measure(args.steps, read_s, body_s) for _ in range(3)), key=lambda r: r[0]
    )
    overlapped = read_s + args.steps * max(read_s, body_s)
    serial = args.steps * (read_s + body_s)
    print(
        f"{args.steps} steps, read {args.read_ms:g} ms, body {args.body_ms:g} ms: "
        f"wall {wall * 1e3:.0f} ms (target, overlapped: {overlapped * 1e3:.0f} ms; "
        f"reads on the pipeline's thread: {serial * 1e3:.0f} ms); "
        f"{io} of {reads} reads on the I/O thread"
    )


if __name__ == "__main__":
    main()
