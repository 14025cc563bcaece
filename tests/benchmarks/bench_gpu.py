"""GPU benchmarks: manager transfers against raw torch copies of the same tensors
(pinned host to device, device to host, device to device), CUDA lease acquire +
release, and `decide` + `use` for one stage of a realistic working set.

Run on a GPU machine: python tests/benchmarks/bench_gpu.py [--quick]
Prints "no CUDA device" and exits 0 elsewhere.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

MIB = 1 << 20


def timed(run: Callable[[], object], repeats: int) -> float:
    """Median seconds of `run()`, each followed by a device synchronisation."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def round_trip(manager: Any, handle: Any, location: Any) -> None:
    """One managed transfer: install at `location` (allocation, copy, sync), then drop."""
    manager.ensure(handle, location)
    manager.drop(handle, location)


def bandwidth_rows(sizes_mib: list[int], repeats: int) -> list[tuple[str, float, float, float]]:
    from fhelium.residency import PAGEABLE_HOST, ReplicaMode, ResidencyManager, cuda_location
    from fhelium.values import ResidentTensor

    cuda0 = cuda_location("cuda:0")
    rows = []

    def row(name: str, size: int, raw: Callable[[], object], managed: Callable[[], object]) -> None:
        raw_s, managed_s = timed(raw, repeats), timed(managed, repeats)
        rows.append((name, size / raw_s / 1024, size / managed_s / 1024, raw_s / managed_s))

    for size in sizes_mib:
        count = size * MIB // 4
        pinned = torch.empty(count, dtype=torch.float32, pin_memory=True).fill_(1.0)
        manager = ResidencyManager()
        on_host = manager.adopt(ResidentTensor(pinned), replica_mode=ReplicaMode.REPLICABLE)
        row(
            f"H2D pinned {size} MiB",
            size,
            partial(pinned.to, "cuda:0", non_blocking=True),
            partial(round_trip, manager, on_host, cuda0),
        )
        device = pinned.to("cuda:0")
        on_device = manager.adopt(ResidentTensor(device), replica_mode=ReplicaMode.REPLICABLE)
        row(
            f"D2H pageable {size} MiB",
            size,
            partial(device.to, "cpu", copy=True),
            partial(round_trip, manager, on_device, PAGEABLE_HOST),
        )
        if torch.cuda.device_count() > 1:
            row(
                f"D2D {size} MiB",
                size,
                partial(device.to, "cuda:1", copy=True),
                partial(round_trip, manager, on_device, cuda_location("cuda:1")),
            )
        manager.close(force=True)
        del pinned, device
        torch.cuda.empty_cache()
    return rows


def lease_us(count: int) -> float:
    from fhelium.residency import ResidencyManager, cuda_location
    from fhelium.values import ResidentTensor

    cuda0 = cuda_location("cuda:0")
    manager = ResidencyManager()
    handles = (manager.adopt(ResidentTensor(torch.zeros(4, device="cuda:0"))),)
    stream = torch.cuda.Stream(device=0)
    acquire = manager.acquire
    samples = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(count):
            acquire(handles, at=cuda0, consumer_stream=stream).release()
        samples.append((time.perf_counter() - started) / count * 1e6)
    manager.close(force=True)
    return statistics.median(samples)


def stage_ms(shards: int, shard_mib: int, window: int, repeats: int) -> float:
    from fhelium.residency import (
        PINNED_HOST,
        EnsureResident,
        MemoryReservation,
        ReplicaMode,
        ResidencyController,
        ResidencyManager,
        ResidencyRequest,
        ResidencyRequirement,
        cuda_location,
    )
    from fhelium.values import ResidentTensor

    cuda0 = cuda_location("cuda:0")
    shard_bytes = shard_mib * MIB
    manager = ResidencyManager({cuda0: (window * 2) * shard_bytes + 64 * MIB})
    handles = [
        manager.adopt(
            ResidentTensor(torch.randn(shard_bytes // 4).pin_memory()),
            at=PINNED_HOST,
            replica_mode=ReplicaMode.REPLICABLE,
        )
        for _ in range(shards)
    ]
    controller = ResidencyController(manager)
    stream = torch.cuda.Stream(device=0)
    manager.execute_actions([EnsureResident(handle, cuda0) for handle in handles[: window * 2]])
    samples = []
    for step in range(repeats):
        first = (step * window) % shards
        request = ResidencyRequest(
            f"stage-{step}",
            [
                ResidencyRequirement(handles[(first + offset) % shards], cuda0)
                for offset in range(window)
            ],
            [MemoryReservation(cuda0, 64 * MIB, "workspace")],
        )
        torch.cuda.synchronize()
        started = time.perf_counter()
        with controller.use(request, consumer_streams={cuda0: stream}):
            pass
        samples.append((time.perf_counter() - started) * 1e3)
    manager.close(force=True)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: GPU benchmarks skipped")
        return 0
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    sizes = [1, 16, 64, 256] if args.quick else [1, 4, 16, 64, 256, 1024]
    repeats = 5 if args.quick else 9
    print(f"\n{'transfer':<24} {'raw GiB/s':>10} {'managed GiB/s':>14} {'ratio':>7}")
    failures = []
    for name, raw, managed, ratio in bandwidth_rows(sizes, repeats):
        size = int(name.split()[-2])
        verdict = ""
        if size >= 64:
            verdict = "ok" if ratio >= 0.97 else "UNDER 97%"
            if ratio < 0.97:
                failures.append(name)
        print(f"{name:<24} {raw:>10.1f} {managed:>14.1f} {ratio:>6.1%} {verdict}")
    lease = lease_us(2_000 if args.quick else 10_000)
    print(f"\nCUDA lease acquire + release: {lease:.2f} us (target <= 10)")
    if lease > 10:
        failures.append("lease")
    print(f"decide + use, 4 of 64 x 16 MiB shards: {stage_ms(64, 16, 4, 8):.2f} ms")
    if failures:
        print(f"BENCHMARK TARGETS MISSED: {', '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
