"""Lockstep checking (docs/concepts/distributed.md#lockstep-checking): SPMD ranks with
the same state and requests decide the same, and a rank that decides differently is
named, with the first action where it differs, on every rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fhelium.errors import ResidencyDivergenceError
from fhelium.residency import (
    PINNED_HOST,
    MemoryReservation,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
)
from fhelium.residency.distributed import (
    DecisionDigest,
    LockstepChecker,
    decision_digest,
    rank_location,
    rank_manager,
)
from fhelium.residency.schedule import ScheduleAwarePolicy
from fhelium.residency.simulation import SimulatedRuntime, current_runtime, use_runtime
from fhelium.values import ResidentTensor
from helpers.distributed import run_ranks

LAYER = 64 * 64 * 4


def _layers(manager: ResidencyManager, runtime: Any, count: int = 5) -> list[Any]:
    generator = torch.Generator().manual_seed(3)
    return [
        manager.adopt(
            runtime.pin(ResidentTensor(torch.randn(64, 64, generator=generator))),
            at=PINNED_HOST,
            replica_mode=ReplicaMode.REPLICABLE,
        )
        for _ in range(count)
    ]


def _requests(layers: list[Any], passes: int = 2) -> list[ResidencyRequest]:
    device = rank_location()
    return [
        ResidencyRequest(
            f"pass-{p}-layer-{i}",
            [ResidencyRequirement(layer, device)],
            [MemoryReservation(device, 1024, "activations")],
        )
        for p in range(passes)
        for i, layer in enumerate(layers)
    ]


def _stream_layers(rank: int, world: int, diverge: str | None) -> dict[str, Any]:
    """Every rank streams the same layers through a budget of two; ``diverge`` makes
    the last rank differ: a priority that changes a victim, or an extra lease that
    changes the state version."""
    device = rank_location()
    manager = rank_manager({device: 2 * LAYER + 1024, PINNED_HOST: 8 * LAYER})
    runtime = current_runtime()
    layers = _layers(manager, runtime)
    controller = ResidencyController(manager)
    if rank == world - 1 and diverge == "priority":
        controller.set_policy_metadata(layers[0], priority=10)  # kept longer: another victim
    if rank == world - 1 and diverge == "version":
        manager.hold([layers[1]], at=PINNED_HOST).release()
    checker = LockstepChecker(controller)
    stream = runtime.current_stream(device.device)
    digests = []
    evictions = 0
    for request in _requests(layers):
        with checker.use(request, consumer_streams={device: stream}) as use:
            evictions += len(use.decision.evictions)
            assert checker.last is not None
            digests.append(checker.last.digest)
    # The pipeline too: each step's decision, checked as it is entered.
    policy_checker = LockstepChecker(
        ResidencyController(manager, policy=ScheduleAwarePolicy(_requests(layers)))
    )
    steps = 0
    pipeline = policy_checker.run(_requests(layers), prefetch=1, consumer_streams={device: stream})
    for _step in pipeline:
        assert policy_checker.last is not None
        digests.append(policy_checker.last.digest)
        steps += 1
    runtime.synchronize_device(device.device)
    return {
        "digests": digests,
        "checks": checker.checks + policy_checker.checks,
        "steps": steps,
        "evictions": evictions,
    }


def test_identical_workloads_agree_on_every_decision() -> None:
    outcomes = [outcome.unwrap() for outcome in run_ranks(_stream_layers, 2, None)]
    first, second = outcomes
    assert first["digests"] == second["digests"]
    assert first["checks"] == 20
    assert first["steps"] == 10
    assert first["evictions"] > 0, "the budget forces evictions, so decisions are not trivial"
    assert len(set(first["digests"])) > 1


def test_a_divergent_rank_is_named_with_its_first_differing_action() -> None:
    outcomes = run_ranks(_stream_layers, 4, "priority")
    errors = [outcome.error for outcome in outcomes]
    assert all(isinstance(error, ResidencyDivergenceError) for error in errors), outcomes
    first = errors[0]
    assert isinstance(first, ResidencyDivergenceError)
    for error in errors:
        assert isinstance(error, ResidencyDivergenceError)
        assert (error.rank, error.reference_rank, error.action_index) == (3, 0, 0)
        assert error.request_name == first.request_name == "pass-0-layer-2"
        assert (error.expected, error.actual) == (first.expected, first.actual)
    # The reference evicts layer 0; rank 3 keeps it (priority) and evicts layer 1.
    assert first.expected.startswith("reclaim drop #0 at rank-device")
    assert first.actual.startswith("reclaim drop #1 at rank-device")
    assert "rank=3 differs from reference_rank=0 action_index=0" in str(first)


def test_a_rank_in_another_state_diverges_before_any_action() -> None:
    outcomes = run_ranks(_stream_layers, 2, "version")
    for outcome in outcomes:
        error = outcome.error
        assert isinstance(error, ResidencyDivergenceError), outcome
        assert (error.rank, error.action_index) == (1, None)
        assert error.expected.startswith("state_version ")
        assert error.actual.startswith("state_version ")
        assert error.expected != error.actual


def _one_manager(stable_keys: bool) -> tuple[list[DecisionDigest], ResidencyManager]:
    runtime = SimulatedRuntime(1, auto_complete=True)
    with use_runtime(runtime):
        device = rank_location()
        manager = ResidencyManager({device: 2 * LAYER + 1024, PINNED_HOST: 8 * LAYER})
        layers = _layers(manager, runtime)
        controller = ResidencyController(manager)
        if stable_keys:
            for index, layer in enumerate(layers):
                controller.set_policy_metadata(layer, stable_key=f"layer-{index}")
        stream = runtime.current_stream(device.device)
        digests = []
        for request in _requests(layers):
            with controller.use(request, consumer_streams={device: stream}) as use:
                digests.append(decision_digest(use.decision, controller))
        return digests, manager


def test_digests_do_not_depend_on_handle_ids() -> None:
    # Two managers issue different UUIDs for the same workload: the digests are equal.
    first, one = _one_manager(stable_keys=False)
    second, other = _one_manager(stable_keys=False)
    assert one.manager_id != other.manager_id
    assert first == second
    reclaiming = [digest for digest in first if any("reclaim" in a for a in digest.actions)]
    assert reclaiming, "the workload evicts"
    assert reclaiming[0].actions[0].startswith("reclaim drop #")
    assert reclaiming[0].header[1].startswith("state_version ")
    # A stable key names the value instead of its registration index.
    keyed, _ = _one_manager(stable_keys=True)
    assert [d.actions for d in keyed] != [d.actions for d in first]
    assert any("key:layer-0" in action for digest in keyed for action in digest.actions)
    for manager in (one, other):
        manager.close()


def test_decision_digest_argument_checks() -> None:
    digests, manager = _one_manager(stable_keys=False)
    controller = ResidencyController(manager)
    with pytest.raises(TypeError):
        decision_digest(object(), controller)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        LockstepChecker(manager)  # type: ignore[arg-type]
    assert len(digests[0].digest) == 64
    manager.close()
