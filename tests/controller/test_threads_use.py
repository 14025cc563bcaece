"""Threads sharing one manager through the controller
(docs/concepts/lifetimes.md#thread-safety-at-a-glance, docs/concepts/controller.md#use and
#prefetch).

2, 4 and 8 threads each run a seeded mix of `controller.use(...)` entries and pipelines
(`controller.run`, prefetch 0 to 2) over values shared by every thread and values of
their own, all on ONE manager whose CUDA budget forces evictions. The budget fits every
thread's largest working set at once (an active step and two staged ones), so nothing is
infeasible: a refusal could only come from a race. A `use` and a pipeline step decide and
enter (and borrow) atomically or decide again, so every operation must succeed; the only
refusal the documentation allows, `ResidencyStaleStateError` after the bounded retries, is
counted and must stay rare. Every thread must finish before the watchdog's deadline, each
step must see its own values with their contents, and the books must balance at the end
with nothing held, reserved or leased.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import traceback
from typing import Any

import pytest
import torch

from fhelium.errors import ResidencyStaleStateError
from fhelium.residency import (
    PINNED_HOST,
    MemoryReservation,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    cuda_location,
)
from fhelium.residency._runtime import SimulatedRuntime, SimulatedStream, use_runtime
from fhelium.values import ResidentTensor
from helpers.manager import assert_balanced

CUDA = cuda_location("cuda:0")
N = 256  # floats per value
SIZE = 4 * N
SCRATCH = SIZE // 2  # a step's reservation, when it has one
SHARED = 2  # values every thread uses
PRIVATE = 5  # values of each thread's own
OPERATIONS = 40  # per thread: uses and pipelines
STEPS = 4  # per pipeline
DEADLINE_S = 30.0
SWITCH_INTERVAL_S = 1e-5


def _dump_stacks() -> str:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}) ---\n")
        parts.append("".join(traceback.format_stack(frame)))
    return "".join(parts)


@pytest.mark.parametrize("threads", [2, 4, 8])
def test_threads_use_and_pipelines_on_one_manager(threads: int) -> None:
    runtime = SimulatedRuntime(device_count=1, auto_complete=True)
    # Every thread's largest working set at once: three steps of one private value each,
    # the active step's scratch and the headroom kept for a staged one's, and the shared
    # values. Everything together is larger, so steps evict.
    budget = (3 * threads + SHARED) * SIZE + threads * 2 * SCRATCH
    with use_runtime(runtime), ResidencyManager({CUDA: budget}) as manager:
        controller = ResidencyController(manager)

        def adopt(fill: float) -> Any:
            value = runtime.pin(ResidentTensor(torch.full((N,), fill)))
            return manager.adopt(value, at=PINNED_HOST, replica_mode=ReplicaMode.REPLICABLE)

        shared = [adopt(float(index)) for index in range(SHARED)]
        fills: dict[Any, float] = {handle: float(index) for index, handle in enumerate(shared)}
        own: list[list[Any]] = []
        for thread in range(threads):
            handles = []
            for index in range(PRIVATE):
                fill = float(100 * (thread + 1) + index)
                handle = adopt(fill)
                fills[handle] = fill
                handles.append(handle)
            own.append(handles)

        errors: list[BaseException] = []
        stale: list[ResidencyStaleStateError] = []
        done = [0] * threads
        start = threading.Barrier(threads)

        def request(rng: random.Random, thread: int, name: str) -> ResidencyRequest:
            return ResidencyRequest(
                name,
                [
                    ResidencyRequirement(rng.choice(shared), CUDA),
                    ResidencyRequirement(rng.choice(own[thread]), CUDA),
                ],
                # Scratch for half the steps: a pipeline keeps headroom for its staged steps.
                [MemoryReservation(CUDA, SCRATCH, "scratch")] if rng.random() < 0.5 else [],
            )

        evicting: list[int] = []

        def check(step: Any, consumer: Any) -> None:
            if step.decision.evictions:
                evicting.append(1)
            for requirement in step.request.requirements:
                tensor = step.value(requirement.handle, at=CUDA).tensor
                assert float(tensor[0]) == fills[requirement.handle]

        def work(thread: int) -> None:
            rng = random.Random(1000 * threads + thread)
            consumer = SimulatedStream(runtime, CUDA.device)
            streams = {CUDA: consumer}
            start.wait()
            for operation in range(OPERATIONS):
                try:
                    if rng.random() < 0.5:
                        with controller.use(
                            request(rng, thread, f"use-{thread}-{operation}"),
                            consumer_streams=streams,
                        ) as step:
                            check(step, consumer)
                    else:
                        requests = [
                            request(rng, thread, f"run-{thread}-{operation}-{index}")
                            for index in range(STEPS)
                        ]
                        with controller.run(
                            requests, prefetch=rng.randrange(3), consumer_streams=streams
                        ) as steps:
                            for step in steps:
                                check(step, consumer)
                except ResidencyStaleStateError as error:
                    stale.append(error)
                except BaseException as error:
                    errors.append(error)
                    return
                done[thread] += 1

        workers = [
            threading.Thread(target=work, args=(thread,), name=f"worker-{thread}", daemon=True)
            for thread in range(threads)
        ]
        # Threads switch far more often than by default, so the races are met.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        try:
            started = time.monotonic()
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join(max(0.0, started + DEADLINE_S - time.monotonic()))
        finally:
            sys.setswitchinterval(interval)
        alive = [worker.name for worker in workers if worker.is_alive()]
        if alive:
            pytest.fail(f"threads still alive after {DEADLINE_S:.0f} s: {alive}\n" + _dump_stacks())
        if errors:
            raise AssertionError(
                f"{len(errors)} undocumented refusals "
                f"({sorted({type(error).__name__ for error in errors})}); the first: "
                f"{type(errors[0]).__name__}: {errors[0]}"
            ) from errors[0]
        assert done == [OPERATIONS] * threads
        assert evicting, "the budget was meant to force evictions"
        # The documented refusal after the bounded retries: rare, never the rule.
        assert len(stale) <= threads * OPERATIONS // 20, [str(error) for error in stale[:3]]

        runtime.synchronize_device(CUDA.device)
        snapshot = manager.snapshot()
        assert_balanced(snapshot)
        assert snapshot.reservations == ()
        for value in snapshot.values:
            for materialization in value.materializations:
                assert materialization.use_count == 0
                assert materialization.hold_count == 0
        gpu = next(entry for entry in snapshot.locations if entry.location == CUDA)
        assert gpu.used_bytes <= budget
