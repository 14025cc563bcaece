"""A pipeline stages a read from disk, or a copy from pageable memory, only after the
active step's body (docs/concepts/controller.md#staging): such staging blocks the host,
and before the body it would keep the body's kernels from being queued, leaving the
device idle. After the body, the host blocks while those kernels run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fhelium.residency import (
    PINNED_HOST,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    cuda_location,
)
from fhelium.residency.disk import disk_location
from fhelium.residency.simulation import SimulatedRuntime, Timeline, use_runtime
from fhelium.values import ResidentTensor

CUDA0 = cuda_location("cuda:0")
LAYER = 16384  # floats: 64 KiB, 1 ms at 64 MB/s
COMPUTE_S = 2e-3


def _makespan(tmp_path: Path, tier: str) -> tuple[float, list[tuple[int, ...]]]:
    timeline = Timeline(h2d_bytes_per_s=64e6, d2h_bytes_per_s=64e6)
    runtime = SimulatedRuntime(1, timeline=timeline)
    staged_in_body: list[tuple[int, ...]] = []
    with use_runtime(runtime):
        disk = disk_location(tmp_path / tier)
        # Room for every layer: no step evicts, so nothing else delays the staging.
        manager = ResidencyManager({disk: 1 << 24, CUDA0: 8 * LAYER * 4, PINNED_HOST: 1 << 24})
        handles = []
        for index in range(4):
            value = ResidentTensor(torch.full((LAYER,), float(index)))
            handle = manager.adopt(value, replica_mode=ReplicaMode.REPLICABLE)
            if tier == "disk":
                manager.move(handle, disk)
            elif tier == "pinned":
                manager.move(handle, PINNED_HOST)
            handles.append(handle)
        requests = [
            ResidencyRequest(f"step-{i}", [ResidencyRequirement(h, CUDA0)])
            for i, h in enumerate(handles)
        ]
        consumer = runtime.create_stream(torch.device("cuda", 0))
        sums = []
        with ResidencyController(manager).run(
            requests, prefetch=1, consumer_streams={CUDA0: consumer}
        ) as steps:
            for step in steps:
                staged_in_body.append(steps.staged)
                (requirement,) = step.request.requirements
                value = step.value(requirement.handle, at=CUDA0)
                assert isinstance(value, ResidentTensor)
                runtime.compute(consumer, COMPUTE_S, reads=value)
                sums.append(float(value.tensor[0]))
        assert sums == [0.0, 1.0, 2.0, 3.0]
        runtime.synchronize_device(torch.device("cuda", 0))
        assert runtime.hazards == []
        manager.close()
    return timeline.makespan, staged_in_body


@pytest.mark.parametrize("tier", ["disk", "pageable"])
def test_blocking_staging_waits_for_the_body(tmp_path: Path, tier: str) -> None:
    makespan, staged = _makespan(tmp_path, tier)
    # Never staged before a body: each step's copy is issued after the previous body.
    assert staged == [(), (), (), ()]
    # The copies run while the previous steps compute: one copy, then compute only.
    assert makespan == pytest.approx(1e-3 + 4 * COMPUTE_S, rel=0.05)


def test_asynchronous_staging_still_runs_before_the_body(tmp_path: Path) -> None:
    makespan, staged = _makespan(tmp_path, "pinned")
    assert staged == [(1,), (2,), (3,), ()]
    assert makespan == pytest.approx(1e-3 + 4 * COMPUTE_S, rel=0.05)
