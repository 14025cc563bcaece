"""Manager hot-path benchmarks: adopt, ensure-from-source plus drop, snapshot capture
and snapshot entry building. Prints measured figures beside the targets in README.md.

Run: python tests/benchmarks/bench_manager.py [--quick]
Figures are medians over repeats of per-operation times on small two-field float64
values, the shape the targets were set for.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from fhelium.residency import (
    PAGEABLE_HOST,
    Recoverability,
    ReplicaMode,
    ResidencyManager,
    ResidencyValueSpec,
)
from fhelium.values import TensorBundle


def small_value() -> TensorBundle:
    return TensorBundle(
        keys=torch.zeros(4, dtype=torch.float64), values=torch.zeros(4, dtype=torch.float64)
    )


class SmallSource:
    """Builds a fresh value per load, as a deserialising source would."""

    def load(self) -> TensorBundle:
        return small_value()


class CachedSource:
    """Returns one host value each time: isolates the manager's own cost. Legal,
    because the dropped materialisation gives its storage back before the next load."""

    def __init__(self) -> None:
        self.value = small_value()

    def load(self) -> TensorBundle:
        return self.value


SPEC = ResidencyValueSpec(
    TensorBundle, 64, 64, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
)


def median_us(run: Callable[[], float], repeats: int) -> float:
    """Median over `repeats` of `run()`, which returns seconds per operation."""
    return statistics.median(run() for _ in range(repeats)) * 1e6


def bench_adopt(count: int) -> float:
    values = [small_value() for _ in range(count)]
    manager = ResidencyManager()
    adopt = manager.adopt
    started = time.perf_counter()
    for value in values:
        adopt(value)
    elapsed = time.perf_counter() - started
    manager.close()
    return elapsed / count


def bench_ensure_drop(count: int, source: SmallSource | CachedSource | None = None) -> float:
    manager = ResidencyManager()
    handle = manager.register_source(SPEC, source or SmallSource())
    ensure, drop = manager.ensure, manager.drop
    started = time.perf_counter()
    for _ in range(count):
        ensure(handle, PAGEABLE_HOST)
        drop(handle, PAGEABLE_HOST)
    elapsed = time.perf_counter() - started
    manager.close()
    return elapsed / count


def bench_load(count: int = 2_000) -> float:
    source = SmallSource()
    started = time.perf_counter()
    for _ in range(count):
        source.load()
    return (time.perf_counter() - started) / count


def populated(count: int) -> ResidencyManager:
    manager = ResidencyManager()
    source = SmallSource()
    for _ in range(count):
        manager.register_source(SPEC, source)
    return manager


def bench_snapshot_capture(manager: ResidencyManager, count: int) -> float:
    snapshot = manager.snapshot
    started = time.perf_counter()
    for _ in range(count):
        snapshot()
    return (time.perf_counter() - started) / count


def bench_snapshot_build(manager: ResidencyManager) -> float:
    snapshot = manager.snapshot()
    started = time.perf_counter()
    _ = snapshot.values, snapshot.locations, snapshot.reservations
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, for smoke runs")
    args = parser.parse_args()
    repeats = 3 if args.quick else 9
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cpus")
    print(f"python {platform.python_version()}, torch {torch.__version__}")
    print(f"gc enabled: {gc.isenabled()}; medians of {repeats} repeats\n")

    ensure_drop = median_us(lambda: bench_ensure_drop(2_000), repeats)
    load = median_us(bench_load, repeats)
    rows: list[tuple[str, float, float | None]] = [
        ("adopt (us/op)", median_us(lambda: bench_adopt(2_000), repeats), 3.0),
        ("ensure from source + drop (us/op)", ensure_drop, None),
        ("  the fresh source's own load() (us/op)", load, None),
        ("  the manager's share: the two minus load() (us/op)", ensure_drop - load, 5.0),
        (
            "  same, source returns a cached value (us/op)",
            median_us(lambda: bench_ensure_drop(2_000, CachedSource()), repeats),
            None,
        ),
    ]
    big = populated(100_000)
    rows.append(
        (
            "snapshot() capture at 100k values (us)",
            median_us(lambda: bench_snapshot_capture(big, 1_000), repeats),
            10.0,
        )
    )
    big.close()
    ten_k = populated(10_000)
    rows.append(
        (
            "build every entry, 10k-value snapshot (ms)",
            median_us(lambda: bench_snapshot_build(ten_k), repeats) / 1e3,
            5.0,
        )
    )
    ten_k.close()

    width = max(len(name) for name, _, _ in rows)
    for name, measured, target in rows:
        if target is None:  # an informational row
            print(f"{name:<{width}}  {measured:10.2f}")
            continue
        verdict = "ok" if measured <= target else "OVER"
        print(f"{name:<{width}}  {measured:10.2f}   target <= {target:g}   {verdict}")


if __name__ == "__main__":
    main()
