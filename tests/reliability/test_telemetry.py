"""Telemetry failure never fails a plan (docs/concepts/transitions.md#telemetry): allocator
sampling that raises at any point of a plan leaves the plan complete and its result
exact, with just that reading recorded as unavailable (None)."""

from __future__ import annotations

import pytest
import torch

from fhelium.residency import (
    PAGEABLE_HOST,
    DropResident,
    EnsureResident,
    MoveResident,
    ReplicaMode,
    ResidencyManager,
    cuda_location,
)
from fhelium.residency._runtime import SimulatedRuntime, use_runtime
from fhelium.values import ResidentTensor

CUDA0, CUDA1 = cuda_location("cuda:0"), cuda_location("cuda:1")


class FlakyTelemetry(SimulatedRuntime):
    """Raises from the `fail_at`-th allocator reading, once."""

    def __init__(self, fail_at: int) -> None:
        super().__init__(2)
        self.fail_at = fail_at
        self.readings = 0

    def memory_sample(self, device: torch.device) -> tuple[int, int] | None:
        self.readings += 1
        if self.readings == self.fail_at:
            raise RuntimeError("telemetry down")
        return super().memory_sample(device)


# Four CUDA actions, each sampled before and after: eight readings.
@pytest.mark.parametrize("fail_at", range(1, 9))
def test_allocator_sampling_failures_never_fail_a_plan(fail_at: int) -> None:
    runtime = FlakyTelemetry(fail_at)
    with use_runtime(runtime):
        manager = ResidencyManager()
    value = manager.adopt(ResidentTensor(torch.arange(4.0)), replica_mode=ReplicaMode.REPLICABLE)
    report = manager.execute_actions(
        [
            EnsureResident(value, CUDA0),
            MoveResident(value, CUDA1, CUDA0),
            EnsureResident(value, CUDA0),
            DropResident(value, CUDA1),
        ]
    )
    assert runtime.readings == 8
    assert len(report.transitions) == 4
    assert all(t.allocator_device is not None for t in report.transitions)
    unavailable = [
        t
        for t in report.transitions
        if t.allocator_allocated_bytes_before is None or t.allocator_allocated_bytes_after is None
    ]
    assert len(unavailable) == 1, "exactly the failed reading is unavailable"
    snapshot = manager.snapshot()
    (entry,) = snapshot.values
    assert {m.location for m in entry.materializations} == {PAGEABLE_HOST, CUDA0}
    used = {loc.location: loc.used_bytes for loc in snapshot.locations}
    assert used == {PAGEABLE_HOST: 16, CUDA0: 16, CUDA1: 0}
    manager.close()


def test_each_transition_samples_the_allocator_once_before_and_once_after() -> None:
    # A real allocator query costs more than a small copy, so a CUDA transition reads
    # both figures in one query before and one after it, and a snapshot one per CUDA
    # location: the simulated runtime counts the queries.
    runtime = SimulatedRuntime(2)
    with use_runtime(runtime):
        manager = ResidencyManager()
    value = manager.adopt(ResidentTensor(torch.arange(4.0)), replica_mode=ReplicaMode.REPLICABLE)
    runtime.calls.clear()
    ensured = manager.ensure(value, CUDA0)
    dropped = manager.drop(value, CUDA0)
    assert runtime.calls["memory_sample"] == 4
    assert runtime.calls["memory_allocated"] == 0
    assert runtime.calls["memory_reserved"] == 0
    assert ensured.allocator_allocated_bytes_after == 16
    assert ensured.allocator_reserved_bytes_after == 512
    assert dropped.allocator_allocated_bytes_after == 0
    runtime.calls.clear()
    snapshot = manager.snapshot()
    _ = snapshot.locations
    assert runtime.calls["memory_sample"] == 1
    assert runtime.calls["memory_allocated"] + runtime.calls["memory_reserved"] == 0
    manager.close()
