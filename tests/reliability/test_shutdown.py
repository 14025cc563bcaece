"""Interpreter exit with everything still open (docs/concepts/lifetimes.md#finalizers): live
leases, holds,
reservations, an entered scope with reservations, and a CUDA lease released with
wait=False whose simulated event never completed. Exit code 0, the documented
ResourceWarnings, no traceback and no hang."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from helpers.limits import capped

SCRIPT = textwrap.dedent(
    """
    import torch
    from fhelium.residency import (
        PAGEABLE_HOST, DropResident, EnsureResident, MemoryReservation, Recoverability,
        ReplicaMode, ResidencyManager, ResidencyPlan, ResidencyValueSpec, cuda_location,
    )
    from fhelium.residency._runtime import SimulatedRuntime, SimulatedStream, use_runtime
    from fhelium.values import ResidentTensor

    class Source:
        def load(self):
            return ResidentTensor(torch.zeros(4))

    CUDA0 = cuda_location("cuda:0")
    runtime = SimulatedRuntime(2)
    with use_runtime(runtime):
        manager = ResidencyManager({PAGEABLE_HOST: 1 << 20})
    value = manager.adopt(ResidentTensor(torch.zeros(4)), replica_mode=ReplicaMode.REPLICABLE)
    manager.ensure(value, CUDA0)
    stream = SimulatedStream(runtime, torch.device("cuda", 0))
    # Released without waiting: its event stays pending (nothing completes it).
    manager.acquire([value], at=CUDA0, consumer_stream=stream).release()
    spec = ResidencyValueSpec(
        ResidentTensor, 16, 16, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
    )
    sourced = manager.register_source(spec, Source())
    plan = ResidencyPlan(
        "stage",
        enter=[EnsureResident(sourced, PAGEABLE_HOST)],
        exit=[DropResident(sourced, PAGEABLE_HOST)],
        reservations=[MemoryReservation(PAGEABLE_HOST, 64, "workspace")],
    )
    scope = manager.scope(plan)
    scope.__enter__()
    keep = [
        scope,
        manager.acquire([value], at=PAGEABLE_HOST),
        manager.acquire([value], at=CUDA0, consumer_stream=stream),
        manager.hold([value], at=PAGEABLE_HOST),
        manager.reserve(PAGEABLE_HOST, 16, label="left open"),
    ]
    snapshot = manager.snapshot()
    print("PENDING", sum(entry.pending_event_count for entry in snapshot.locations), flush=True)
    print("MANAGER", manager.manager_id, flush=True)
    """
)


def test_interpreter_exit_with_everything_open() -> None:
    try:
        result = subprocess.run(
            capped([sys.executable, "-W", "always::ResourceWarning", "-c", SCRIPT]),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"interpreter exit hung: {exc}")
    assert result.returncode == 0, result.stderr
    assert "PENDING 1" in result.stdout, result.stdout
    stderr = result.stderr
    assert "Traceback" not in stderr, stderr
    lowered = stderr.lower()
    for kind in ("lease", "hold", "reservation", "scope of plan 'stage'"):
        assert kind in lowered, stderr
    # Two leases, a hold, a reservation and the scope: five abandoned lifetimes.
    assert stderr.count("ResourceWarning") >= 5, stderr
