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
    pipeline prefetch=1, 32 x 64 MiB layers: 101.3 ms; bound 98.0 ms (ratio 1.034, target
        <= 1.10) ok; hand double-buffered loop 100.9 ms (ratio 1.004, target <= 1.05) ok

`ratio` is managed over raw bandwidth (raw time over managed time); from 64 MiB on it
must be at least 0.97. The disk lines time a spill from the device to a disk location
and back (buffered, then direct I/O) against a plain spill and read-back through pinned
memory in the same directory; their target is 0.90. The pipeline line streams layers
that never fit (every step copies) through a budget of two layers with
`controller.run(prefetch=1)`: its makespan, from CUDA events, against the overlap bound
(the first layer's copy plus the larger of the total compute and the total copy time,
each measured alone) and against the best loop a user could write by hand, two device
buffers filled on a copy stream while the other is computed on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

MIB = 1 << 20
RATIO_TARGET = 0.97  # managed / raw bandwidth, for transfers of 64 MiB and more
LEASE_TARGET_US = 10.0
BOUND_TARGET = 1.10  # pipeline makespan / overlap bound
HAND_TARGET = 1.05  # pipeline makespan / hand-written double-buffered loop
DISK_TARGET = 0.90  # disk-tier round trip device -> disk -> device / a plain pinned one


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


def _elapsed_s(stream: Any, run: Callable[[], object]) -> float:
    """Seconds from an idle device to `run`'s work done, between CUDA events on
    `stream` (the stream the work ends on)."""
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record(stream)
    run()
    end.record(stream)
    end.synchronize()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / 1e3


def pipeline_row(layers: int, layer_mib: int, steps: int, repeats: int) -> tuple[float, ...]:
    """(pipeline, bound, hand loop) makespans in seconds, medians of `repeats`."""
    from fhelium.residency import (
        PINNED_HOST,
        ReplicaMode,
        ResidencyController,
        ResidencyManager,
        ResidencyRequest,
        ResidencyRequirement,
        cuda_location,
    )
    from fhelium.values import ResidentTensor

    cuda0 = cuda_location("cuda:0")
    width = int((layer_mib * MIB // 4) ** 0.5)
    layer_bytes = width * width * 4
    host = [torch.randn(width, width).pin_memory() for _ in range(layers)]
    # Rows chosen so one step's matmul takes about as long as one layer's copy.
    batch = 2048
    x = torch.randn(batch, width, device="cuda:0")
    compute_stream = torch.cuda.Stream(device=0)
    copy_stream = torch.cuda.Stream(device=0)

    def body(weight: torch.Tensor) -> None:
        torch.tanh(x @ weight)

    # The bound's parts, each measured alone.
    device_buffer = torch.empty(width, width, device="cuda:0")

    def copy_one() -> None:
        with torch.cuda.stream(copy_stream):
            device_buffer.copy_(host[0], non_blocking=True)

    def compute_one() -> None:
        with torch.cuda.stream(compute_stream):
            body(device_buffer)

    copy_s = statistics.median(_elapsed_s(copy_stream, copy_one) for _ in range(repeats))
    compute_s = statistics.median(_elapsed_s(compute_stream, compute_one) for _ in range(repeats))
    bound = copy_s + max(steps * compute_s, steps * copy_s)

    # The hand-written loop: two buffers, a copy stream and a compute stream.
    buffers = [torch.empty(width, width, device="cuda:0") for _ in range(2)]
    copied = [torch.cuda.Event() for _ in range(2)]
    computed = [torch.cuda.Event() for _ in range(2)]

    def hand() -> None:
        for step in range(steps + 1):
            if step < steps:
                slot = step % 2
                with torch.cuda.stream(copy_stream):
                    if step >= 2:
                        copy_stream.wait_event(computed[slot])
                    buffers[slot].copy_(host[step % layers], non_blocking=True)
                    copied[slot].record(copy_stream)
            if step >= 1:
                slot = (step - 1) % 2
                with torch.cuda.stream(compute_stream):
                    compute_stream.wait_event(copied[slot])
                    body(buffers[slot])
                    computed[slot].record(compute_stream)

    manager = ResidencyManager({cuda0: 2 * layer_bytes, PINNED_HOST: layers * layer_bytes})
    handles = [
        manager.adopt(ResidentTensor(tensor), at=PINNED_HOST, replica_mode=ReplicaMode.REPLICABLE)
        for tensor in host
    ]
    requests = [
        ResidencyRequest(f"step-{step}", [ResidencyRequirement(handles[step % layers], cuda0)])
        for step in range(steps)
    ]
    controller = ResidencyController(manager)

    def pipelined() -> None:
        with controller.run(
            requests,
            prefetch=1,
            consumer_streams={cuda0: compute_stream},
            transfer_streams={cuda0: copy_stream},
        ) as pipeline:
            for step in pipeline:
                (requirement,) = step.request.requirements
                weight = step.value(requirement.handle, at=cuda0)
                with torch.cuda.stream(compute_stream):
                    body(weight.tensor)  # type: ignore[attr-defined]

    hand_samples, pipeline_samples = [], []
    for _ in range(repeats):
        hand_samples.append(_elapsed_s(compute_stream, hand))
        pipeline_samples.append(_elapsed_s(compute_stream, pipelined))
    manager.close(force=True)
    return statistics.median(pipeline_samples), bound, statistics.median(hand_samples)


def _raw_spill(tensor: torch.Tensor, path: str) -> None:
    """A user's plain spill: the device tensor to pinned memory, then written and synced."""
    host = torch.empty(tensor.numel(), dtype=torch.uint8, pin_memory=True)
    host.copy_(tensor.view(torch.uint8).view(-1))
    with open(path, "wb") as file:
        file.write(host.numpy().data)
        file.flush()
        os.fsync(file.fileno())


def _raw_read_back(path: str, nbytes: int) -> torch.Tensor:
    """A user's plain read-back: the file into pinned memory, then copied to the device."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    with open(path, "rb") as file:
        file.readinto(host.numpy().data)
    return host.cuda(non_blocking=True)


def _raw_round_trip(tensor: torch.Tensor, path: str) -> None:
    _raw_spill(tensor, path)
    _raw_read_back(path, tensor.numel())


def _managed_round_trip(manager: Any, handle: Any, disk: Any, device: Any) -> None:
    manager.move(handle, disk)
    manager.move(handle, device)


def disk_rows(sizes: list[int], repeats: int) -> Iterator[tuple[str, int, float, float, float]]:
    """(name, MiB, raw GiB/s, managed GiB/s, ratio) for a spill from the device to a
    disk location and a read-back to the device, buffered and direct, against a plain
    pinned-memory spill and read-back of the same bytes in the same directory."""
    from fhelium.residency import ResidencyManager, cuda_location
    from fhelium.residency.disk import disk_location
    from fhelium.values import ResidentTensor

    cuda0 = cuda_location("cuda:0")
    with tempfile.TemporaryDirectory() as root:
        for direct in (False, True):
            disk = disk_location(os.path.join(root, f"direct-{direct}"), direct_io=direct)
            manager = ResidencyManager({cuda0: 8 << 30, disk: 8 << 30})
            raw_path = os.path.join(root, "raw.bin")
            for size in sizes:
                tensor = torch.randint(0, 255, (size * MIB,), dtype=torch.uint8, device="cuda")
                handle = manager.adopt(ResidentTensor(tensor.clone()))

                raw, managed = timed_pair(
                    partial(_raw_round_trip, tensor, raw_path),
                    partial(_managed_round_trip, manager, handle, disk, cuda0),
                    repeats,
                )
                name = "disk round trip" + (" direct" if direct else "")
                yield name, size, size / raw / 1024, size / managed / 1024, raw / managed
                manager.discard(handle)
            manager.close()


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
    layer_mib, steps = (64, 32) if args.quick else (128, 64)
    piped, bound, hand = pipeline_row(4, layer_mib, steps, 3 if args.quick else 5)
    bound_ratio, hand_ratio = piped / bound, piped / hand
    bound_ok, hand_ok = bound_ratio <= BOUND_TARGET, hand_ratio <= HAND_TARGET
    print(
        f"pipeline prefetch=1, {steps} x {layer_mib} MiB layers: {piped * 1e3:.1f} ms; "
        f"bound {bound * 1e3:.1f} ms (ratio {bound_ratio:.3f}, target <= {BOUND_TARGET}) "
        f"{'ok' if bound_ok else 'OVER'}; hand double-buffered loop {hand * 1e3:.1f} ms "
        f"(ratio {hand_ratio:.3f}, target <= {HAND_TARGET}) {'ok' if hand_ok else 'OVER'}",
        flush=True,
    )
    if not bound_ok:
        failures.append("pipeline bound")
    if not hand_ok:
        failures.append("pipeline vs hand loop")
    for name, size, raw, managed, ratio in disk_rows([64, 256], 3 if args.quick else 5):
        verdict = " ok" if ratio >= DISK_TARGET else f" UNDER {DISK_TARGET}"
        if ratio < DISK_TARGET:
            failures.append(f"{name} {size} MiB")
        print(
            f"ratio {name} {size} MiB: {ratio:.3f} "
            f"(raw {raw:.2f} GiB/s, managed {managed:.2f} GiB/s){verdict}",
            flush=True,
        )
    print(f"bench elapsed: {time.perf_counter() - started:.1f} s")
    if failures:
        print(f"BENCHMARK TARGETS MISSED: {', '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
