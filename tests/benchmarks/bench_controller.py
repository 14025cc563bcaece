"""Controller benchmark: N cached reconstructible values fill a budgeted location and
8 new values are requested; `decide` must choose 8 victims. The timing covers `decide`
alone: the decision's plan, evictions and explanation are built when first read, and
the benchmark reads only the evictions, after the clock stops. The same with the
schedule-aware policy, every cached value scheduled again after the request (no
target: printed for comparison). And the controller's own cost per step of a cyclic
stream of 64 layers through a simulated cuda:0 that holds 8, each step one `use` or
one step of `controller.run` with prefetch 0 or 1 (events complete at once, so the
figure is host-side bookkeeping only: decisions, staging, copies of small values,
leases and reports), every step's value read.

Run: python tests/benchmarks/bench_controller.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from fhelium.residency import (
    PAGEABLE_HOST,
    DeterministicTieredLRU,
    EnsureResident,
    Recoverability,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    ResidencyValueSpec,
)
from fhelium.residency.policy import ResidencyPolicy
from fhelium.residency.schedule import ScheduleAwarePolicy
from fhelium.values import ResidentTensor

SPEC = ResidencyValueSpec(
    ResidentTensor, 32, 32, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
)


class CachedSource:
    def __init__(self) -> None:
        self.value = ResidentTensor(torch.zeros(8))

    def load(self) -> ResidentTensor:
        return self.value


def decide_ms(count: int, repeats: int, *, scheduled: bool = False) -> float:
    manager = ResidencyManager({PAGEABLE_HOST: count * 32})
    cached = [manager.register_source(SPEC, CachedSource()) for _ in range(count)]
    manager.execute_actions([EnsureResident(handle, PAGEABLE_HOST) for handle in cached])
    wanted = [manager.register_source(SPEC, CachedSource()) for _ in range(8)]
    request = ResidencyRequest(
        "eight-new", [ResidencyRequirement(handle, PAGEABLE_HOST) for handle in wanted]
    )
    policy: ResidencyPolicy = DeterministicTieredLRU()
    if scheduled:
        policy = ScheduleAwarePolicy([wanted, *([handle] for handle in reversed(cached))])
    controller = ResidencyController(manager, policy=policy)
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        decision = controller.decide(request)
        timings.append((time.perf_counter() - started) * 1e3)
    assert len(decision.evictions) == 8
    manager.close()
    return statistics.median(timings)


def step_us(prefetch: int | None, steps: int, repeats: int) -> float:
    """Microseconds per step of a cyclic stream; `prefetch` None is a `use` per step."""
    from fhelium.residency import PINNED_HOST, cuda_location
    from fhelium.residency.simulation import SimulatedRuntime, use_runtime

    class Unsampled(SimulatedRuntime):
        """No allocator readings: the figure is the controller's bookkeeping alone
        (`bench_step.py` measures steps with them)."""

        def memory_sample(self, device: torch.device) -> tuple[int, int] | None:
            return None

    runtime = Unsampled(1, auto_complete=True)
    cuda0 = cuda_location("cuda:0")
    stream = runtime.current_stream(torch.device("cuda", 0))
    timings = []
    with use_runtime(runtime):
        manager = ResidencyManager({cuda0: 8 * 32, PINNED_HOST: 64 * 32})
        handles = [
            manager.adopt(
                runtime.pin(ResidentTensor(torch.zeros(8))),
                at=PINNED_HOST,
                replica_mode=ReplicaMode.REPLICABLE,
            )
            for _ in range(64)
        ]
        requests = [
            ResidencyRequest(f"step-{step}", [ResidencyRequirement(handles[step % 64], cuda0)])
            for step in range(steps)
        ]
        controller = ResidencyController(manager, policy=ScheduleAwarePolicy(requests))
        streams = {cuda0: stream}
        for _ in range(repeats):
            controller.policy.seek(0)  # type: ignore[attr-defined]
            started = time.perf_counter()
            if prefetch is None:
                for request in requests:
                    with controller.use(request, consumer_streams=streams) as use:
                        use.value(request.requirements[0].handle, at=cuda0)
            else:
                with controller.run(requests, prefetch=prefetch, consumer_streams=streams) as run:
                    for step in run:
                        step.value(step.request.requirements[0].handle, at=cuda0)
            timings.append((time.perf_counter() - started) / steps * 1e6)
        manager.close()
    return statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus; python {platform.python_version()}"
    )
    print(f"torch {torch.__version__}; medians of {repeats} repeats\n")
    rows = [
        ("decide, N = 1k cached values, 8 requested (ms)", decide_ms(1_000, repeats), 1.5),
        ("decide, N = 10k (ms)", decide_ms(10_000, repeats), 1.0),
        ("decide, N = 100k (ms)", decide_ms(100_000, max(1, repeats // 2)), 10.0),
        ("decide, schedule-aware, N = 10k (ms)", decide_ms(10_000, repeats, scheduled=True), None),
        (
            "decide, schedule-aware, N = 100k (ms)",
            decide_ms(100_000, max(1, repeats // 2), scheduled=True),
            None,
        ),
        ("stream step, use (us)", step_us(None, 512, repeats), None),
        ("stream step, run prefetch=0 (us)", step_us(0, 512, repeats), None),
        ("stream step, run prefetch=1 (us)", step_us(1, 512, repeats), None),
    ]
    width = max(len(name) for name, _, _ in rows)
    for name, measured, target in rows:
        if target is None:
            print(f"{name:<{width}}  {measured:9.2f}")
            continue
        verdict = "ok" if measured <= target else "OVER"
        print(f"{name:<{width}}  {measured:9.2f}   target <= {target:g}   {verdict}")


if __name__ == "__main__":
    main()
