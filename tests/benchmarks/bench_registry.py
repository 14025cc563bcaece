"""Registration at scale: `register_source` time per value and resident memory per
registered value (counting the handle the caller keeps), at a million values.

Run: python tests/benchmarks/bench_registry.py [--quick] [--count N]

Memory is the growth of the process's resident set size over the registration,
divided by the count: it includes everything the manager keeps per value (core
records, the handle index, the binding's object arrays) and the handle objects the
caller holds. The source object is shared by every value, as a loader keyed by
value id would be.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from fhelium.residency import (
    Recoverability,
    ReplicaMode,
    ResidencyHandle,
    ResidencyManager,
    ResidencyValueSpec,
)
from fhelium.values import ResidentTensor

# Run as a script: the tests' helpers are beside this folder.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers.limits import capped


class Loader:
    def load(self) -> ResidentTensor:
        return ResidentTensor(torch.zeros(16))


SPEC = ResidencyValueSpec(
    ResidentTensor, 64, 64, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def register(count: int) -> tuple[float, float]:
    """(seconds per value, resident bytes per value) for one fresh manager."""
    gc.collect()
    manager = ResidencyManager()
    source = Loader()
    register_source = manager.register_source
    handles: list[ResidencyHandle[ResidentTensor]] = []
    keep = handles.append
    # The list of handles the caller keeps is preallocated, so its own growth is not
    # counted as the manager's.
    handles.extend([None] * count)  # type: ignore[list-item]
    handles.clear()
    before = rss_bytes()
    started = time.perf_counter()
    for _ in range(count):
        keep(register_source(SPEC, source))
    elapsed = time.perf_counter() - started
    grown = rss_bytes() - before
    per_value = (elapsed / count, grown / count)
    manager.close()
    del handles
    return per_value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="100k values, one repeat")
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    count = 100_000 if args.quick else args.count
    if args.one:
        print(*register(count))
        return
    repeats = 1 if args.quick else 3
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus; python {platform.python_version()}"
    )
    print(f"torch {torch.__version__}; {count} values, medians of {repeats} repeats\n")
    # Each repeat in a fresh process: memory freed by an earlier run would hide growth.
    runs = []
    for _ in range(repeats):
        output = subprocess.run(
            capped([sys.executable, __file__, "--one", "--count", str(count)]),
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        runs.append((float(output[0]), float(output[1])))
    seconds = statistics.median(run[0] for run in runs)
    memory = statistics.median(run[1] for run in runs)
    print(f"{'register_source, per value (us)':48s} {seconds * 1e6:8.2f}   target <= 2")
    print(f"{'resident memory per registered value (bytes)':48s} {memory:8.0f}   target <= 300")


if __name__ == "__main__":
    main()
