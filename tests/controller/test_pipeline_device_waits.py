"""A pipeline evicts around reads still in flight with device waits, not host ones
(docs/concepts/controller.md#evicting-around-reads-in-flight): a step that evicts a
value an ended step's kernels may still read issues its next copy with no host
synchronisation, the simulation's memory-reuse check finds every reuse ordered after
its reads (and catches a missing device wait), and a prefetch's asynchronous plans
take no allocator readings.

The simulated runtime here has no timeline and completes no event on its own, so any
host wait shows as a synchronisation call; each body declares its reads
(docs/concepts/simulation.md#memory-reuse)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
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
from fhelium.residency.schedule import ScheduleAwarePolicy
from fhelium.residency.simulation import SimulatedRuntime, use_runtime
from fhelium.values import ResidentTensor
from helpers.controller import leftovers

CUDA = cuda_location("cuda:0")
DEVICE = torch.device("cuda", 0)
N = 256
SIZE = 4 * N
HOST_WAITS = ("synchronize_event", "synchronize_stream", "synchronize_device")


@pytest.fixture
def runtime() -> Iterator[SimulatedRuntime]:
    simulated = SimulatedRuntime(1, pinned=True)
    with use_runtime(simulated):
        yield simulated


def _pinned_layers(runtime: SimulatedRuntime, manager: ResidencyManager, count: int) -> list[Any]:
    return [
        manager.adopt(
            runtime.pin(ResidentTensor(torch.full((N,), float(index)))),
            at=PINNED_HOST,
            replica_mode=ReplicaMode.REPLICABLE,
        )
        for index in range(count)
    ]


class _Source:
    def __init__(self, runtime: SimulatedRuntime, index: int) -> None:
        self.runtime = runtime
        self.index = index

    def load(self) -> ResidentTensor:
        return self.runtime.pin(ResidentTensor(torch.full((N,), float(self.index))))


def _loaded_layers(runtime: SimulatedRuntime, manager: ResidencyManager, count: int) -> list[Any]:
    spec = ResidencyValueSpec(
        ResidentTensor, SIZE, SIZE, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
    )
    return [
        manager.register_source(spec, _Source(runtime, index), source_location=PINNED_HOST)
        for index in range(count)
    ]


def _cycle(handles: list[Any], passes: int) -> tuple[list[int], list[ResidencyRequest]]:
    order = [layer for _ in range(passes) for layer in range(len(handles))]
    requests = [
        ResidencyRequest(f"step-{step}", [ResidencyRequirement(handles[layer], CUDA)])
        for step, layer in enumerate(order)
    ]
    return order, requests


def _run(
    runtime: SimulatedRuntime,
    manager: ResidencyManager,
    controller: ResidencyController,
    requests: list[ResidencyRequest],
    *,
    check: Callable[[int, Any], None] | None = None,
    budgets: bool = True,
) -> list[float]:
    """Runs the pipeline with prefetch 1 on a consumer stream of its own, each body
    declaring that it reads its value; returns what each step read."""
    consumer = runtime.create_stream(DEVICE)
    seen: list[float] = []
    with controller.run(requests, prefetch=1, consumer_streams={CUDA: consumer}) as steps:
        for index, step in enumerate(steps):
            (requirement,) = step.request.requirements
            value = step.value(requirement.handle, at=CUDA)
            assert isinstance(value, ResidentTensor)
            runtime.read(consumer, value)
            seen.append(float(value.tensor[0]))
            if check is not None:
                check(index, steps)
            if not budgets:
                continue  # a snapshot reads the allocator
            for entry in manager.snapshot().locations:
                if entry.budget_bytes is not None:
                    assert entry.used_bytes + entry.reserved_bytes <= entry.budget_bytes
    return seen


@pytest.mark.parametrize("aware", [False, True])
@pytest.mark.parametrize("loaded", [False, True])
def test_a_step_that_evicts_issues_its_copy_without_a_host_wait(
    runtime: SimulatedRuntime, aware: bool, loaded: bool
) -> None:
    # Two layers fit: every step from the second on evicts the layer an ended step's
    # kernels may still be reading, to stage the next one.
    manager = ResidencyManager({CUDA: 2 * SIZE, PINNED_HOST: 64 * SIZE})
    handles = (_loaded_layers if loaded else _pinned_layers)(runtime, manager, 5)
    order, requests = _cycle(handles, 3)
    policy = ScheduleAwarePolicy(requests) if aware else DeterministicTieredLRU()
    controller = ResidencyController(manager, policy=policy)

    waits: list[int] = []

    def check(index: int, steps: Any) -> None:
        # Every step after the first was staged (its copy issued during the step
        # before, after that step's body), and nothing has waited on the host since
        # the first step's own synchronous copy.
        if index > 0:
            assert steps.current.decision.plan.enter == (), index
        waits.append(sum(runtime.calls[name] for name in HOST_WAITS))
        assert waits[-1] == waits[0], index

    assert _run(runtime, manager, controller, requests, check=check) == [
        float(layer) for layer in order
    ]
    # The stream that owns the victims waited for their readers on the device.
    assert runtime.calls["wait_event"] > len(requests)
    assert runtime.hazards == []
    assert runtime.pending_event_count() > 0  # nothing was completed by a host wait
    runtime.complete_events()
    assert leftovers(manager) == (0, 0, 0)
    assert manager._engine.core.transfer_count() == 0
    (device,) = [entry for entry in manager.snapshot().locations if entry.location == CUDA]
    assert device.peak_charged_bytes <= 2 * SIZE
    manager.close()


def test_the_memory_reuse_check_catches_a_missing_device_wait(
    runtime: SimulatedRuntime,
) -> None:
    manager = ResidencyManager({CUDA: 2 * SIZE, PINNED_HOST: 64 * SIZE})
    handles = _pinned_layers(runtime, manager, 5)
    _order, requests = _cycle(handles, 2)
    controller = ResidencyController(manager, policy=ScheduleAwarePolicy(requests))
    consumers: set[int] = set()
    real_wait = runtime.wait_event

    def wait_only_for_copies(stream: Any, event: Any) -> None:
        # Keeps the consumers' waits for the copies, drops the owning stream's waits
        # for the consumers: the eviction is then unordered with the reads.
        if id(stream) in consumers:
            real_wait(stream, event)

    runtime.wait_event = wait_only_for_copies  # type: ignore[method-assign]
    consumer = runtime.create_stream(DEVICE)
    consumers.add(id(consumer))
    with controller.run(requests, prefetch=1, consumer_streams={CUDA: consumer}) as steps:
        for step in steps:
            (requirement,) = step.request.requirements
            runtime.read(consumer, step.value(requirement.handle, at=CUDA))
    assert runtime.hazards
    assert {hazard.reader for hazard in runtime.hazards} == {consumer}
    runtime.complete_events()
    manager.close()


def test_a_value_whose_owning_stream_is_unknown_is_waited_for_on_the_host(
    runtime: SimulatedRuntime,
) -> None:
    # Values placed on the device by the caller: the manager did not allocate them, so
    # their lease is waited for on the host before they are evicted, never on the
    # device, and never before the body.
    manager = ResidencyManager({CUDA: 2 * SIZE, PINNED_HOST: 64 * SIZE})
    handles = _pinned_layers(runtime, manager, 3)
    placed = manager.adopt(
        runtime.to_device(ResidentTensor(torch.full((N,), 9.0)), DEVICE),
        at=CUDA,
        replica_mode=ReplicaMode.REPLICABLE,
    )
    manager.ensure(placed, PINNED_HOST)
    order = [placed, handles[1], handles[2]]
    requests = [
        ResidencyRequest(f"step-{step}", [ResidencyRequirement(handle, CUDA)])
        for step, handle in enumerate(order)
    ]
    controller = ResidencyController(manager, policy=ScheduleAwarePolicy(requests))
    synchronized: list[int] = []

    def check(index: int, steps: Any) -> None:
        synchronized.append(runtime.calls["synchronize_event"])

    assert _run(runtime, manager, controller, requests, check=check) == [9.0, 1.0, 2.0]
    # Staging step 2 evicts the adopted value after step 1's body: a host wait then,
    # none before any body.
    assert synchronized == [0, 0, 1]
    assert runtime.hazards == []
    runtime.complete_events()
    manager.close()


def test_asynchronous_plans_take_no_allocator_readings(runtime: SimulatedRuntime) -> None:
    manager = ResidencyManager({CUDA: 2 * SIZE, PINNED_HOST: 64 * SIZE})
    handles = _pinned_layers(runtime, manager, 4)
    _order, requests = _cycle(handles, 2)
    controller = ResidencyController(manager, policy=ScheduleAwarePolicy(requests))
    samples: list[int] = []
    _run(
        runtime,
        manager,
        controller,
        requests,
        check=lambda index, steps: samples.append(runtime.calls["memory_sample"]),
        budgets=False,
    )
    # Step 0 is entered synchronously (its readings are taken); every later step was
    # staged by an asynchronous plan (a copy and an eviction each) and read nothing.
    assert samples[1:] == [samples[0]] * (len(samples) - 1)
    staged = [
        report
        for report in manager.trace()
        if report.allocator_device is not None and report.destination != PINNED_HOST
    ][2:]
    assert staged
    for report in staged:
        assert report.allocator_allocated_bytes_before is None
        assert report.allocator_reserved_bytes_after is None
    runtime.complete_events()
    manager.close()
