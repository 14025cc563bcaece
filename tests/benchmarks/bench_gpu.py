"""GPU benchmarks: manager transfers against raw torch copies of the same tensors
(pinned host to device, device to host, device to device), CUDA lease acquire +
release, and `decide` + `use` for one stage of a realistic working set.

Run on a GPU machine: python tests/benchmarks/bench_gpu.py [--quick]
Prints "no CUDA device" and exits 0 elsewhere; exits 1 when a target is missed.

Each figure is one short line, so `scripts/gpu-check` (which runs --quick, about 10 s on
an H200 after imports) leaves them grep-able in its results file:

    ratio H2D-pinned 64 MiB: 0.991 (raw 45.2 GiB/s, managed 44.8 GiB/s) ok
    lease acquire+release: 3.40 us (target <= 10) ok
    stage decide+use, 4 of 16 x 16 MiB shards: 2.10 ms

`ratio` is managed over raw bandwidth (raw time over managed time); from 64 MiB on it
must be at least 0.97.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

MIB = 1 << 20
RATIO_TARGET = 0.97  # managed / raw bandwidth, for transfers of 64 MiB and more
LEASE_TARGET_US = 10.0


def once(run: Callable[[], object]) -> float:
    """Seconds of one `run()`, from an idle device to its work done."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def timed_pair(
    raw: Callable[[], object], managed: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Median seconds of `raw()` and of `managed()`, after one untimed call of each.

    The samples alternate, so clock ramps and allocator warm-up weigh on both alike."""
    once(raw)
    once(managed)
    raw_samples, managed_samples = [], []
    for _ in range(repeats):
        raw_samples.append(once(raw))
        managed_samples.append(once(managed))
    return statistics.median(raw_samples), statistics.median(managed_samples)


def round_trip(manager: Any, handle: Any, location: Any) -> None:
    """One managed transfer: install at `location` (allocation, copy, sync), then drop."""
    manager.ensure(handle, location)
    manager.drop(handle, location)


def bandwidth_rows(
    sizes_mib: list[int], repeats: int
) -> Iterator[tuple[str, int, float, float, float]]:
    """(transfer, MiB, raw GiB/s, managed GiB/s, managed/raw) for each transfer and size,
    each as soon as it is measured."""
    from fhelium.residency import PAGEABLE_HOST, ReplicaMode, ResidencyManager, cuda_location
    from fhelium.values import ResidentTensor

    cuda0 = cuda_location("cuda:0")

    def row(
        name: str, size: int, raw: Callable[[], object], managed: Callable[[], object]
    ) -> tuple[str, int, float, float, float]:
        raw_s, managed_s = timed_pair(raw, managed, repeats)
        return (name, size, size / raw_s / 1024, size / managed_s / 1024, raw_s / managed_s)

    for size in sizes_mib:
        count = size * MIB // 4
        pinned = torch.empty(count, dtype=torch.float32, pin_memory=True).fill_(1.0)
        manager = ResidencyManager()
        on_host = manager.adopt(ResidentTensor(pinned), replica_mode=ReplicaMode.REPLICABLE)
        yield row(
            "H2D-pinned",
            size,
            partial(pinned.to, "cuda:0", non_blocking=True),
            partial(round_trip, manager, on_host, cuda0),
        )
        device = pinned.to("cuda:0")
        on_device = manager.adopt(ResidentTensor(device), replica_mode=ReplicaMode.REPLICABLE)
        yield row(
            "D2H-pageable",
            size,
            partial(device.to, "cpu", copy=True),
            partial(round_trip, manager, on_device, PAGEABLE_HOST),
        )
        if torch.cuda.device_count() > 1:
            yield row(
                "D2D",
                size,
                partial(device.to, "cuda:1", copy=True),
                partial(round_trip, manager, on_device, cuda_location("cuda:1")),
            )
        manager.close(force=True)
        del pinned, device
        torch.cuda.empty_cache()


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
    parser.add_argument(
        "--quick", action="store_true", help="fewer sizes, repeats and shards (gpu-check)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: GPU benchmarks skipped")
        return 0
    started = time.perf_counter()
    print(f"bench device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)
    sizes = [1, 16, 64, 256] if args.quick else [1, 4, 16, 64, 256, 1024]
    repeats = 7 if args.quick else 15
    failures = []
    for name, size, raw, managed, ratio in bandwidth_rows(sizes, repeats):
        verdict = ""
        if size >= 64:
            verdict = " ok" if ratio >= RATIO_TARGET else f" UNDER {RATIO_TARGET}"
            if ratio < RATIO_TARGET:
                failures.append(f"{name} {size} MiB")
        print(
            f"ratio {name} {size} MiB: {ratio:.3f} "
            f"(raw {raw:.1f} GiB/s, managed {managed:.1f} GiB/s){verdict}",
            flush=True,
        )
    lease = lease_us(2_000 if args.quick else 10_000)
    verdict = "ok" if lease <= LEASE_TARGET_US else "OVER"
    print(f"lease acquire+release: {lease:.2f} us (target <= {LEASE_TARGET_US:g}) {verdict}")
    if lease > LEASE_TARGET_US:
        failures.append("lease")
    shards = 16 if args.quick else 64
    stage = stage_ms(shards, 16, 4, 8)
    print(f"stage decide+use, 4 of {shards} x 16 MiB shards: {stage:.2f} ms")
    print(f"bench elapsed: {time.perf_counter() - started:.1f} s")
    if failures:
        print(f"BENCHMARK TARGETS MISSED: {', '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
