"""Per-step cost of the pipeline: one step of `controller.run(..., prefetch=1)` on the
simulated runtime, with tiny tensors, while the manager holds 10, 1k or 10k values.

A handful of values (8 "layers" of 32 bytes) cycle through a simulated cuda:0 that holds
4 of them, so every step loads one layer from pinned host and evicts another; every
other managed value is only there: half adopted in simulated pinned memory, half
registered as a source and never loaded. Events complete at once and the simulation's
allocator readings stay on, so the figure is the host-side cost of a step: decisions,
staging, copies of small values, leases, reports and the memory samples, in CPU time of
the process (the fastest of several passes).

The target (issue 26, "per-step cost") is 30 us or less per step, independent of the
number of managed values. Per policy (the tiered LRU and the schedule-aware one) it
prints the step at each count and the ratio of the largest count's figure to the
smallest's; then the smallest count with as many simulated cuda:0 storages alive
outside the manager as the largest count (activations, say); then the largest count
with half its values used once before the stream (each then has an access epoch, as
every unit of a model does after a forward); then the smallest and largest counts with
the caller reading every record each step offers (its decision's plan, evictions and
explanation, and its report's transitions): what a caller reads is built on demand, and
this is the cost when all of it is.

`--profile` also prints where the time goes at the largest count (cProfile, the
entries with the most own time, per policy).

Run: python tests/benchmarks/bench_step.py [--quick] [--profile] [--counts 10,1000,10000]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import time

import torch

from fhelium.residency import (
    PINNED_HOST,
    DeterministicTieredLRU,
    Recoverability,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    ResidencyValueSpec,
    cuda_location,
)
from fhelium.residency.policy import ResidencyPolicy
from fhelium.residency.schedule import ScheduleAwarePolicy
from fhelium.residency.simulation import SimulatedRuntime, use_runtime
from fhelium.values import ResidentTensor

TARGET_US = 30.0
LAYERS = 8  # the values the steps use, cyclically
HELD = 4  # how many of them the device holds
NBYTES = 32  # torch.zeros(8), float32
SPEC = ResidencyValueSpec(
    ResidentTensor, NBYTES, NBYTES, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
)


class ZeroSource:
    """A reconstructible value's source; never loaded by the benchmark."""

    def load(self) -> ResidentTensor:
        return ResidentTensor(torch.zeros(8))


class Bench:
    """One manager with ``count`` values, and a cyclic stream of ``steps`` steps."""

    def __init__(
        self, count: int, steps: int, policy_name: str, live: int = 0, touched: bool = False
    ) -> None:
        self.runtime = SimulatedRuntime(1, auto_complete=True)
        # Simulated cuda:0 storages the manager does not own (activations, say): the
        # allocator readings each transition takes must not grow with them.
        self.live = [self.runtime.to_device(ResidentTensor(torch.zeros(8)), 0) for _ in range(live)]
        self.cuda0 = cuda_location("cuda:0")
        self.stream = self.runtime.current_stream(torch.device("cuda", 0))
        with use_runtime(self.runtime):
            self.manager = ResidencyManager(
                {self.cuda0: HELD * NBYTES, PINNED_HOST: max(count, LAYERS) * NBYTES}
            )
        self.layers = [self._adopt() for _ in range(LAYERS)]
        others = max(0, count - LAYERS)
        self.others = [self._adopt() for _ in range(others // 2)] + [
            self.manager.register_source(SPEC, ZeroSource()) for _ in range(others - others // 2)
        ]
        self.requests = [
            ResidencyRequest(
                f"step-{step}",
                [ResidencyRequirement(self.layers[step % LAYERS], self.cuda0)],
            )
            for step in range(steps)
        ]
        policy: ResidencyPolicy
        if policy_name == "lru":
            policy = DeterministicTieredLRU()
        else:
            policy = ScheduleAwarePolicy(self.requests)
        self.policy = policy
        self.controller = ResidencyController(self.manager, policy=policy)
        if touched:
            # Every adopted value used once where it is (no copy): the policy then has an
            # access epoch for each, as when every unit of a model runs each forward.
            for handle in self.others[: others // 2]:
                request = ResidencyRequest("touch", [ResidencyRequirement(handle, PINNED_HOST)])
                with self.controller.use(request):
                    pass

    def _adopt(self) -> object:
        return self.manager.adopt(
            self.runtime.pin(ResidentTensor(torch.zeros(8))),
            at=PINNED_HOST,
            replica_mode=ReplicaMode.REPLICABLE,
        )

    def run(self, reads: bool = False) -> float:
        """One pass over the stream; returns the process's CPU microseconds per step (CPU
        time, not wall time: other processes on the machine do not count). With
        ``reads``, the caller also reads every record a step offers: its decision's plan,
        evictions and per-action explanation, and (once it has ended) its report's
        transitions."""
        if isinstance(self.policy, ScheduleAwarePolicy):
            self.policy.seek(0)
        streams = {self.cuda0: self.stream}
        started = time.process_time()
        with self.controller.run(self.requests, prefetch=1, consumer_streams=streams) as run:
            if reads:
                previous = None
                for step in run:
                    step.value(step.request.requirements[0].handle, at=self.cuda0)
                    decision = step.decision
                    read = (decision.plan, decision.evictions, decision.explanation.actions)
                    if previous is not None:
                        read += (previous.report.transitions,)
                    previous = step
            else:
                for step in run:
                    step.value(step.request.requirements[0].handle, at=self.cuda0)
        return (time.process_time() - started) / len(self.requests) * 1e6

    def close(self) -> None:
        self.manager.close()


def step_us(
    count: int,
    policy: str,
    steps: int,
    repeats: int,
    live: int = 0,
    touched: bool = False,
    reads: bool = False,
) -> float:
    bench = Bench(count, steps, policy, live, touched)
    try:
        bench.run(reads)  # warm up: the device fills, code paths are compiled
        return min(bench.run(reads) for _ in range(repeats))
    finally:
        bench.close()


def profile(count: int, policy: str, steps: int, top: int) -> str:
    bench = Bench(count, steps, policy)
    try:
        bench.run()
        profiler = cProfile.Profile()
        profiler.enable()
        bench.run()
        profiler.disable()
    finally:
        bench.close()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    lines = out.getvalue().splitlines()
    # Drop pstats' preamble up to the table header.
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join(line for line in lines[start:] if line.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", action="store_true", help="cProfile the largest count")
    parser.add_argument("--counts", default="10,1000,10000", help="managed values, comma-separated")
    parser.add_argument("--top", type=int, default=15, help="profile entries to print")
    args = parser.parse_args()
    counts = [int(part) for part in args.counts.split(",")]
    repeats = 3 if args.quick else 7
    steps = 256 if args.quick else 512
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus; python {platform.python_version()}"
    )
    print(
        f"torch {torch.__version__}; controller.run, prefetch 1, simulated cuda:0; "
        f"{steps} steps; CPU time of the process, fastest of {repeats} passes (the machine "
        "is shared: the fastest is the least disturbed)\n"
    )
    policies: list[tuple[str, str]] = [("lru", "tiered LRU"), ("aware", "schedule-aware")]
    width = max(len(label) for _, label in policies) + len(
        f" step, N = {counts[0]}, {counts[-1]} other cuda:0 storages (us)"
    )
    for policy, label in policies:
        figures = []
        for count in counts:
            measured = step_us(count, policy, steps, repeats)
            figures.append(measured)
            verdict = "ok" if measured <= TARGET_US else "OVER"
            name = f"{label} step, N = {count} (us)"
            print(f"{name:<{width}}  {measured:9.2f}   target <= {TARGET_US:g}   {verdict}")
        growth = figures[-1] / figures[0]
        name = f"{label}: N = {counts[-1]} / N = {counts[0]}"
        verdict = "ok" if growth <= 1.5 else "GROWS"
        print(f"{name:<{width}}  {growth:9.2f}   target ~1 (independent of N)   {verdict}")
        live = counts[-1]
        measured = step_us(counts[0], policy, steps, repeats, live)
        verdict = "ok" if measured <= TARGET_US else "OVER"
        name = f"{label} step, N = {counts[0]}, {live} other cuda:0 storages (us)"
        print(f"{name:<{width}}  {measured:9.2f}   target <= {TARGET_US:g}   {verdict}")
        growth = measured / figures[0]
        name = f"{label}: with them / without"
        verdict = "ok" if growth <= 1.5 else "GROWS"
        print(f"{name:<{width}}  {growth:9.2f}   target ~1 (independent of them)   {verdict}")
        measured = step_us(counts[-1], policy, steps, repeats, touched=True)
        verdict = "ok" if measured <= TARGET_US else "OVER"
        name = f"{label} step, N = {counts[-1]}, half used once before (us)"
        print(f"{name:<{width}}  {measured:9.2f}   target <= {TARGET_US:g}   {verdict}")
        for count in (counts[0], counts[-1]):
            measured = step_us(count, policy, steps, repeats, reads=True)
            verdict = "ok" if measured <= TARGET_US else "OVER"
            name = f"{label} step, N = {count}, every record read (us)"
            print(f"{name:<{width}}  {measured:9.2f}   target <= {TARGET_US:g}   {verdict}")
        print()
    if args.profile:
        for policy, label in policies:
            print(f"profile, {label}, N = {counts[-1]}, one pass of {steps} steps (by own time):")
            print(profile(counts[-1], policy, steps, args.top))
            print()


if __name__ == "__main__":
    main()
