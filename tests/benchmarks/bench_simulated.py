"""The simulated runtime's own cost per operation: what one seam call of the simulation
costs the host, apart from the library that makes it. `bench_step.py`'s step makes about
one copy to cuda:0, one measurement, two event records and three event queries.

Each row is one seam call on a `SimulatedRuntime(1, auto_complete=True)` (as
`bench_step.py` builds it) and one on a runtime without ``auto_complete``, with tiny
tensors (8 float32): the copies cost nothing, so the figure is the simulation's
bookkeeping (the registry, the memory-reuse order, the counting) and the torch calls a
copy needs. "copy to cuda" keeps four copies alive, so each call also frees one, as a
pipeline step does. Medians of CPU time per call (the machine is shared).

Run: python tests/benchmarks/bench_simulated.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections import deque
from collections.abc import Callable

import torch

from fhelium.residency.simulation import SimulatedRuntime
from fhelium.values import ResidentTensor


def per_call_us(run: Callable[[], object], count: int, repeats: int) -> float:
    """The median over ``repeats`` of the CPU time of ``count`` calls, per call."""
    figures = []
    for _ in range(repeats):
        started = time.process_time()
        for _ in range(count):
            run()
        figures.append((time.process_time() - started) / count * 1e6)
    return statistics.median(figures)


def rows(runtime: SimulatedRuntime, count: int, repeats: int) -> list[tuple[str, float]]:
    cuda0 = torch.device("cuda", 0)
    stream = runtime.current_stream(cuda0)
    source = runtime.pin(ResidentTensor(torch.zeros(8)))
    alive: deque[ResidentTensor] = deque(maxlen=4)

    log = runtime.copies

    def copy() -> None:
        alive.append(runtime.copy_to_cuda(source, cuda0, stream, non_blocking=True))
        if len(log) > 64:
            # The log keeps every copy; a long one only adds garbage-collector work.
            log.clear()

    copy_us = per_call_us(copy, count, repeats)
    on_device = alive[-1]
    event = runtime.record_event(stream)
    figures = [
        ("copy to cuda:0, pinned source (frees one)", copy_us),
        ("record_event", per_call_us(lambda: runtime.record_event(stream), count, repeats)),
        ("event_query", per_call_us(lambda: runtime.event_query(event), count, repeats)),
        (
            "measure, value on cuda:0",
            per_call_us(lambda: runtime.measure(on_device), count, repeats),
        ),
        ("measure, pinned value", per_call_us(lambda: runtime.measure(source), count, repeats)),
        ("memory_sample", per_call_us(lambda: runtime.memory_sample(cuda0), count, repeats)),
        ("current_stream", per_call_us(lambda: runtime.current_stream(cuda0), count, repeats)),
        ("wait_event", per_call_us(lambda: runtime.wait_event(stream, event), count, repeats)),
    ]
    runtime.waits.clear()
    runtime.copies.clear()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats, count = (5, 4_000) if args.quick else (9, 20_000)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus; python {platform.python_version()}"
    )
    print(f"torch {torch.__version__}; medians of {repeats} repeats of {count} calls (CPU time)\n")
    auto = rows(SimulatedRuntime(1, auto_complete=True), count, repeats)
    pending = rows(SimulatedRuntime(1), count, repeats)
    width = max(len(name) for name, _ in auto)
    print(f"{'per call (us)':<{width}}  {'auto_complete':>13}  {'pending events':>14}")
    for (name, figure), (_, other) in zip(auto, pending, strict=True):
        print(f"{name:<{width}}  {figure:13.2f}  {other:14.2f}")


if __name__ == "__main__":
    main()
