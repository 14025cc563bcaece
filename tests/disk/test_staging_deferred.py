"""A pipeline stages a read from disk to a device before the active step's body: the
disk tier's I/O thread reads the chunks and enqueues the copies, and the host returns
as soon as the read is queued (docs/concepts/controller.md#staging). A copy from
pageable memory still blocks the host, so it is staged only after the body: before it,
it would keep the body's kernels from being queued, leaving the device idle."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fhelium.errors import (
    ResidencyIntegrityError,
    ResidencyMaterializationError,
    ResidencyPlanExecutionError,
)
from fhelium.residency import (
    PINNED_HOST,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    cuda_location,
)
from fhelium.residency._disk import staging as disk_staging
from fhelium.residency.disk import disk_location
from fhelium.residency.simulation import SimulatedRuntime, Timeline, use_runtime
from fhelium.values import ResidentTensor

CUDA0 = cuda_location("cuda:0")
LAYER = 16384  # floats: 64 KiB, 1 ms at 64 MB/s
COMPUTE_S = 2e-3
IO_THREAD = "fhelium-disk-io"

# Runs in each step's body, given the step's index and the pipeline.
Body = Callable[[int, Any], None]


def _run(
    tmp_path: Path,
    tier: str,
    body: Body | None = None,
    *,
    stop: int | None = None,
    prepare: Callable[[Path], None] | None = None,
) -> tuple[float, list[tuple[int, ...]], list[float], ResidencyManager, list[Any]]:
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
        if prepare is not None:
            prepare(tmp_path / tier)
        consumer = runtime.create_stream(torch.device("cuda", 0))
        sums: list[float] = []
        with ResidencyController(manager).run(
            requests, prefetch=1, consumer_streams={CUDA0: consumer}
        ) as steps:
            for number, step in enumerate(steps):
                staged_in_body.append(steps.staged)
                if body is not None:
                    body(number, steps)
                (requirement,) = step.request.requirements
                value = step.value(requirement.handle, at=CUDA0)
                assert isinstance(value, ResidentTensor)
                runtime.compute(consumer, COMPUTE_S, reads=value)
                assert torch.equal(value.tensor, torch.full((LAYER,), float(number)))
                sums.append(float(value.tensor[0]))
                if number == stop:
                    break
        runtime.synchronize_device(torch.device("cuda", 0))
        assert runtime.hazards == []
    return timeline.makespan, staged_in_body, sums, manager, handles


def _makespan(tmp_path: Path, tier: str) -> tuple[float, list[tuple[int, ...]]]:
    makespan, staged, sums, manager, _ = _run(tmp_path, tier)
    assert sums == [0.0, 1.0, 2.0, 3.0]
    manager.close()
    return makespan, staged


def test_a_read_from_disk_is_staged_before_the_body(tmp_path: Path) -> None:
    makespan, staged = _makespan(tmp_path, "disk")
    # Each step's read is issued before the previous step's body, as from pinned memory.
    assert staged == [(1,), (2,), (3,), ()]
    # The copies run while the previous steps compute: one copy, then compute only.
    assert makespan == pytest.approx(1e-3 + 4 * COMPUTE_S, rel=0.05)


def test_blocking_staging_waits_for_the_body(tmp_path: Path) -> None:
    makespan, staged = _makespan(tmp_path, "pageable")
    # Never staged before a body: each step's copy is issued after the previous body.
    assert staged == [(), (), (), ()]
    assert makespan == pytest.approx(1e-3 + 4 * COMPUTE_S, rel=0.05)


def test_asynchronous_staging_still_runs_before_the_body(tmp_path: Path) -> None:
    makespan, staged = _makespan(tmp_path, "pinned")
    assert staged == [(1,), (2,), (3,), ()]
    assert makespan == pytest.approx(1e-3 + 4 * COMPUTE_S, rel=0.05)


@pytest.fixture
def io_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """File reads on the disk tier's I/O thread, made to wait for ``gate`` (set by
    default) and to fail where ``fail`` (a set of read numbers, counted from 0) says."""
    real = os.preadv
    state: dict[str, Any] = {
        "gate": threading.Event(),
        "waiting": threading.Event(),
        "count": 0,
        "done": 0,
        "fail": set(),
    }
    state["gate"].set()

    def preadv(descriptor: int, buffers: Any, offset: int, *flags: int) -> int:
        if not threading.current_thread().name.startswith(IO_THREAD):
            return real(descriptor, buffers, offset, *flags)
        number = state["count"]
        state["count"] += 1
        state["waiting"].set()
        if not state["gate"].wait(10):
            raise AssertionError("the test never opened the gate")
        if number in state["fail"]:
            raise OSError(5, "Input/output error (injected)")
        got = real(descriptor, buffers, offset, *flags)
        state["done"] += 1
        return got

    monkeypatch.setattr(os, "preadv", preadv)
    return state


def test_the_host_returns_before_the_read_completes(
    tmp_path: Path, io_reads: dict[str, Any]
) -> None:
    io_reads["gate"].clear()
    seen: list[tuple[tuple[int, ...], int]] = []

    def body(number: int, steps: Any) -> None:
        if number == 0:
            # Step 1's read is queued, and the I/O thread is inside it: the host got
            # here, to step 0's body, without waiting for it.
            assert io_reads["waiting"].wait(10)
            seen.append((steps.staged, io_reads["done"]))
            io_reads["gate"].set()

    _, _, sums, manager, _ = _run(tmp_path, "disk", body)
    manager.close()
    assert seen == [((1,), 0)]
    assert sums == [0.0, 1.0, 2.0, 3.0]  # and every value arrived right
    assert io_reads["done"] == 3  # steps 1 to 3 read on the I/O thread


def _nothing_left(manager: ResidencyManager, handles: list[Any], failed: int) -> None:
    # The steps that ran released their leases behind their consumers' work.
    manager._engine.runtime.synchronize_device(torch.device("cuda", 0))
    assert manager.state_version > 0  # reading it reaps what completed
    snapshot = manager.snapshot()
    for value in snapshot.values:
        for materialization in value.materializations:
            assert (
                materialization.use_count,
                materialization.hold_count,
                materialization.pending_event_count,
            ) == (0, 0, 0)
    # The failed read's device copy is gone; its disk copy stays.
    (failed_value,) = [v for v in snapshot.values if v.handle == handles[failed]]
    assert [m.location.kind for m in failed_value.materializations] == ["disk"]
    (cuda,) = [entry for entry in snapshot.locations if entry.location == CUDA0]
    assert cuda.reserved_bytes == 0
    assert cuda.used_bytes == sum(
        m.charged_nbytes for v in snapshot.values for m in v.materializations if m.location == CUDA0
    )


def test_a_read_failing_midway_raises_at_the_step_that_needs_it(
    tmp_path: Path, io_reads: dict[str, Any]
) -> None:
    io_reads["fail"] = {1}  # step 2's read (step 1's is read 0)
    reached: list[int] = []
    with pytest.raises(ResidencyMaterializationError, match="injected"):
        _run(tmp_path, "disk", lambda number, _: reached.append(number))
    # Steps 0 and 1 ran; step 2, whose value failed to read, raised on entry.
    assert reached == [0, 1]
    manager = _last_manager(tmp_path)
    handles = [value.handle for value in manager.snapshot().values]
    _nothing_left(manager, handles, 2)
    # The value is intact on disk: read again, it arrives right.
    manager.ensure(handles[2], CUDA0)
    stream = manager._engine.runtime.current_stream(torch.device("cuda", 0))
    with manager.acquire([handles[2]], at=CUDA0, consumer_stream=stream) as values:
        assert torch.equal(values[handles[2]].tensor, torch.full((LAYER,), 2.0))
    manager.close()


def _last_manager(tmp_path: Path) -> ResidencyManager:
    return _MANAGERS[-1]


_MANAGERS: list[ResidencyManager] = []


@pytest.fixture(autouse=True)
def _keep_managers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Keeps the managers the test builds, so that one whose run raised can be looked
    at (and closed) afterwards."""
    real = ResidencyManager.__init__

    def init(self: ResidencyManager, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        _MANAGERS.append(self)

    monkeypatch.setattr(ResidencyManager, "__init__", init)
    yield
    while _MANAGERS:
        _MANAGERS.pop().close()


def test_a_checksum_mismatch_raises_at_the_step_that_needs_it(tmp_path: Path) -> None:
    def corrupt(directory: Path) -> None:
        # The files are named in write order: the third is step 2's value.
        (store,) = directory.iterdir()
        files = sorted(store.glob("value-*.safetensors"), key=lambda p: int(p.name.split("-")[2]))
        with open(files[2], "r+b") as file:
            file.seek(-1, os.SEEK_END)
            byte = file.read(1)
            file.seek(-1, os.SEEK_END)
            file.write(bytes([byte[0] ^ 0xFF]))

    reached: list[int] = []
    with pytest.raises(ResidencyIntegrityError):
        _run(tmp_path, "disk", lambda number, _: reached.append(number), prepare=corrupt)
    assert reached == [0, 1]
    manager = _last_manager(tmp_path)
    _nothing_left(manager, [value.handle for value in manager.snapshot().values], 2)


def test_an_error_staging_before_the_body_is_raised_after_it(tmp_path: Path) -> None:
    def truncate(directory: Path) -> None:
        (store,) = directory.iterdir()
        files = sorted(store.glob("value-*.safetensors"), key=lambda p: int(p.name.split("-")[2]))
        os.truncate(files[2], files[2].stat().st_size - 1)

    reached: list[int] = []
    # Step 2's file is found cut short while it is staged, before step 1's body: step 1
    # still runs, and the error comes from the iteration that ends it.
    with pytest.raises(ResidencyPlanExecutionError, match="truncated"):
        _run(tmp_path, "disk", lambda number, _: reached.append(number), prepare=truncate)
    assert reached == [0, 1]
    manager = _last_manager(tmp_path)
    _nothing_left(manager, [value.handle for value in manager.snapshot().values], 2)


def test_a_failed_read_of_a_step_never_entered_is_dropped_quietly(
    tmp_path: Path, io_reads: dict[str, Any]
) -> None:
    io_reads["fail"] = {1}  # step 2's read, staged while step 1 runs
    _, _, sums, manager, handles = _run(tmp_path, "disk", stop=1)
    # The pipeline ended after step 1: no step needed the value, nothing raised.
    assert sums == [0.0, 1.0]
    assert io_reads["count"] == 2
    _nothing_left(manager, handles, 2)


def test_a_value_of_many_chunks_arrives_right(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chunks of 8 KiB: each value is 8 of them through the two slots, each slot
    # refilled on the I/O thread once its copy completed.
    monkeypatch.setattr(disk_staging, "CHUNK", 8192)
    _, staged = _makespan(tmp_path, "disk")
    assert staged == [(1,), (2,), (3,), ()]
