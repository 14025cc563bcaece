"""Lifetime hot paths: lease acquire + release of one value on the host and on a
simulated CUDA location, hold and reservation round trips. Prints medians beside the
targets listed in README.md (Benchmarks).

Run: python tests/benchmarks/bench_lifetimes.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from fhelium.residency import PAGEABLE_HOST, ResidencyManager, cuda_location
from fhelium.residency._runtime import SimulatedRuntime, use_runtime
from fhelium.values import ResidentTensor


def per_op(run: Callable[[], object], count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        run()
    return (time.perf_counter() - started) / count


def median_us(measure: Callable[[], float], repeats: int) -> float:
    return statistics.median(measure() for _ in range(repeats)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats, count = (3, 5_000) if args.quick else (9, 20_000)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus; python {platform.python_version()}"
    )
    print(f"torch {torch.__version__}; medians of {repeats} repeats of {count} operations\n")

    manager = ResidencyManager()
    handle = manager.adopt(ResidentTensor(torch.zeros(4)))
    handles = (handle,)
    acquire, hold, reserve = manager.acquire, manager.hold, manager.reserve

    rows: list[tuple[str, float, float | None]] = [
        (
            "lease acquire + release, host (us)",
            median_us(
                lambda: per_op(lambda: acquire(handles, at=PAGEABLE_HOST).release(), count), repeats
            ),
            1.5,
        ),
        (
            "hold + release, host (us)",
            median_us(
                lambda: per_op(lambda: hold(handles, at=PAGEABLE_HOST).release(), count), repeats
            ),
            None,
        ),
        (
            "reserve + release (us)",
            median_us(
                lambda: per_op(lambda: reserve(PAGEABLE_HOST, 64, label="w").release(), count),
                repeats,
            ),
            None,
        ),
    ]

    runtime = SimulatedRuntime(1, auto_complete=True)
    with use_runtime(runtime):
        cuda = ResidencyManager()
        cuda0 = cuda_location("cuda:0")
        on_device = (cuda.adopt(runtime.to_device(ResidentTensor(torch.zeros(4)), "cuda:0")),)
        stream = runtime.current_stream(torch.device("cuda", 0))
        cuda_acquire = cuda.acquire

        def cuda_round_trip() -> None:
            cuda_acquire(on_device, at=cuda0, consumer_stream=stream).release()

        rows.append(
            (
                "lease acquire + release, simulated CUDA (us)",
                median_us(lambda: per_op(cuda_round_trip, count), repeats),
                3.0,
            )
        )

    if torch.cuda.is_available():
        real = ResidencyManager()
        cuda0 = cuda_location("cuda:0")
        on_gpu = (real.adopt(ResidentTensor(torch.zeros(4, device="cuda"))),)
        consumer = torch.cuda.Stream(device=0)
        real_acquire = real.acquire

        def real_round_trip() -> None:
            real_acquire(on_gpu, at=cuda0, consumer_stream=consumer).release()

        rows.append(
            (
                "lease acquire + release, real CUDA (us)",
                median_us(lambda: per_op(real_round_trip, count), repeats),
                None,
            )
        )

    width = max(len(name) for name, _, _ in rows)
    for name, measured, target in rows:
        if target is None:
            print(f"{name:<{width}}  {measured:8.2f}")
        else:
            verdict = "ok" if measured <= target else "OVER"
            print(f"{name:<{width}}  {measured:8.2f}   target <= {target:g}   {verdict}")


if __name__ == "__main__":
    main()
