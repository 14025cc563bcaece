"""Added cost of `fhelium.residency.nn.offload` per unit per forward, against Accelerate.

A stack of ``--units`` tiny linear layers (each a unit) runs ``model(x)`` plain, offloaded
by `offload` on the simulated runtime with a device budget that holds the whole model
(so after the first forward nothing moves: what is left is the hooks' cost), and offloaded
by Accelerate's ``cpu_offload(model, execution_device="cpu")`` in the same run. The figure
is (offloaded - plain) / units, the fastest of several passes, in microseconds; the target
(issue 26, "per-step cost") is 30 us or less per unit.

Accelerate is a benchmark-only dependency (``pip install ".[bench]"``); without it the
comparison row says so.

Run: python tests/benchmarks/bench_offload.py [--units 100] [--repeats 30]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import time
from collections.abc import Callable

import torch
from torch import nn

from fhelium.residency.nn import offload
from fhelium.residency.simulation import SimulatedRuntime, use_runtime

TARGET_US = 30.0


def fastest(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def build(units: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(units)]).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=100)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    units, repeats = args.units, args.repeats
    x = torch.randn(1, args.width)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
        f"torch {torch.__version__}; {units} units of Linear({args.width}, {args.width})"
    )
    rows: list[tuple[str, float]] = []
    with torch.no_grad():
        model = build(units, args.width)
        reference = model(x)
        plain = fastest(lambda: model(x), repeats)
        rows.append(("plain model(x)", plain))
        for prefetch in (0, 1):
            offloaded = build(units, args.width)
            with (
                use_runtime(SimulatedRuntime(1, auto_complete=True)),
                offload(offloaded, budget=1 << 30, prefetch=prefetch),
            ):
                assert torch.equal(offloaded(x), reference)
                rows.append(
                    (
                        f"fhelium offload, prefetch {prefetch}",
                        fastest(lambda model=offloaded: model(x), repeats),
                    )
                )
        # Streaming, for scale: a budget of a third of the weights, every forward
        # loads most units (the per-step cost of the pipeline, bench_step.py).
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        streamed = build(units, args.width)
        with (
            use_runtime(SimulatedRuntime(1, auto_complete=True)),
            offload(streamed, budget=weights // 3, prefetch=1),
        ):
            assert torch.equal(streamed(x), reference)
            rows.append(
                (
                    "streaming: a third fits, prefetch 1",
                    fastest(lambda: streamed(x), max(10, repeats // 3)),
                )
            )
        try:
            from accelerate import cpu_offload
        except ImportError:
            print("accelerate: not installed (pip install '.[bench]'); no comparison")
        else:
            accelerated = cpu_offload(copy.deepcopy(model), execution_device="cpu")
            assert torch.equal(accelerated(x), reference)
            rows.append(("accelerate cpu_offload(cpu)", fastest(lambda: accelerated(x), repeats)))
    print(f"{'':34} {'forward':>10} {'added per unit':>15}")
    for name, seconds in rows:
        added = (seconds - plain) / units * 1e6
        mark = ""
        if name.startswith("fhelium offload"):
            mark = "  (target <= 30 us: " + ("met" if added <= TARGET_US else "MISSED") + ")"
        print(f"{name:34} {seconds * 1e3:8.2f} ms {added:12.1f} us{mark}")


if __name__ == "__main__":
    main()
