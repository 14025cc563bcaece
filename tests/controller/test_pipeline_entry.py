"""A pipeline's staged step is entered without a search or a plan
(docs/concepts/controller.md#steps): its staging's holds keep its values until its
leases are taken, and its decision and report are the records a `use` entering it
would have given."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from fhelium.residency import (
    PINNED_HOST,
    DeterministicTieredLRU,
    MemoryReservation,
    ReplicaMode,
    ResidencyController,
    ResidencyDecision,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    _lowering,
    cuda_location,
)
from fhelium.residency._decider import Decider, decider_of
from fhelium.residency._runtime import SimulatedRuntime, use_runtime
from fhelium.residency.pipeline import ResidencyPipeline
from fhelium.residency.policy import ResidencyPolicy
from fhelium.residency.schedule import ScheduleAwarePolicy
from fhelium.values import ResidentTensor

CUDA = cuda_location("cuda:0")
LAYERS = 8
HELD = 4
NBYTES = 32  # torch.zeros(8), float32


class _Decisions:
    """The controller a pipeline works with (the `Controller` protocol of `_use`), but
    not the plain one: every step is entered through `use`, with its own decision."""

    def __init__(self, decider: Decider) -> None:
        self._decider = decider
        self.manager = decider.manager
        self.policy = decider.policy
        self.engine = decider.engine
        self.shapes = decider.shapes

    def decide(self, request: ResidencyRequest, position: int | None = None) -> ResidencyDecision:
        return self._decider.decide(request, position)

    def record_access(self, request: ResidencyRequest) -> None:
        self._decider.record_access(request)


class _Cycle:
    """8 layers cycling through a device that holds 4: every step loads one and evicts
    another. Every third step reserves scratch space on the device."""

    def __init__(self, policy_name: str, steps: int) -> None:
        self.runtime = SimulatedRuntime(1, auto_complete=True)
        self.stream = self.runtime.current_stream(torch.device("cuda", 0))
        with use_runtime(self.runtime):
            self.manager = ResidencyManager(
                {CUDA: HELD * NBYTES + NBYTES, PINNED_HOST: LAYERS * NBYTES}
            )
        self.layers = [
            self.manager.adopt(
                self.runtime.pin(ResidentTensor(torch.zeros(8))),
                at=PINNED_HOST,
                replica_mode=ReplicaMode.REPLICABLE,
            )
            for _ in range(LAYERS)
        ]
        self.requests = [
            ResidencyRequest(
                f"step-{step}",
                [ResidencyRequirement(self.layers[step % LAYERS], CUDA)],
                [MemoryReservation(CUDA, NBYTES, "scratch")] if step % 3 == 2 else [],
            )
            for step in range(steps)
        ]
        policy: ResidencyPolicy = (
            DeterministicTieredLRU() if policy_name == "lru" else ScheduleAwarePolicy(self.requests)
        )
        self.controller = ResidencyController(self.manager, policy=policy)

    def steps(self, plain: bool) -> list[dict[str, Any]]:
        """Runs the pipeline with prefetch 1, through the plain controller or through
        `_Decisions`; what each step's records say, read in its body and after it."""
        controller: Any = decider_of(self.controller)
        if not plain:
            controller = _Decisions(controller)
        seen: list[dict[str, Any]] = []
        uses = []
        with ResidencyPipeline(
            controller,
            self.requests,
            prefetch=1,
            consumer_streams={CUDA: self.stream},
            transfer_streams=None,
        ) as pipeline:
            for step in pipeline:
                handle = step.request.requirements[0].handle
                assert step.value(handle, at=CUDA) is not None
                decision = step.decision
                seen.append(
                    {
                        "staged": pipeline.position > 1,
                        "decision": decision,
                        "policy config": tuple(self.controller.policy.config_identity),
                        "manager id": self.manager.manager_id,
                        "plan": decision.plan,
                        "actions by layer": tuple(
                            tuple(
                                (type(action).__name__, self.layers.index(action.handle))
                                for action in actions
                            )
                            for actions in (
                                decision.plan.reclaim,
                                decision.plan.enter,
                                decision.plan.exit,
                            )
                        ),
                        "evictions": decision.evictions,
                        "explanation": decision.explanation,
                        "actions": decision.explanation.actions,
                        "report": step.report,
                        "version": self.manager.state_version,
                    }
                )
                uses.append(step)
        for record, use in zip(seen, uses, strict=True):
            report = use.report
            assert report is not None
            record["after"] = (report.plan_name, report.transitions, use.exit_error)
            record["timing"] = (report.started_at_ns, report.completed_at_ns)
            record["same report"] = use.report is report
        return seen


@pytest.mark.parametrize("policy_name", ["lru", "aware"])
def test_a_staged_step_is_entered_with_no_decide(
    policy_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cycle = _Cycle(policy_name, 24)
    decided: list[str] = []
    # Every search goes through `decide_found` (`decide` builds its record from it; a
    # staging runs its plan without one).
    decide = Decider.decide_found

    def counted(self: Decider, request: ResidencyRequest, position: int | None = None) -> Any:
        decided.append(request.name)
        return decide(self, request, position)

    monkeypatch.setattr(Decider, "decide_found", counted)
    steps = cycle.steps(plain=True)
    assert all(step["staged"] for step in steps[1:])
    # The first step is decided at its entry, each later one at its staging; only those
    # with reservations are decided again at their entry (before, every step was).
    assert {name: decided.count(name) for name in decided} == {
        f"step-{step}": 2 if step % 3 == 2 else 1 for step in range(24)
    }
    cycle.manager.close()


@pytest.mark.parametrize("policy_name", ["lru", "aware"])
def test_a_staged_steps_records_are_those_of_its_use(policy_name: str) -> None:
    fast = _Cycle(policy_name, 24).steps(plain=True)
    slow = _Cycle(policy_name, 24).steps(plain=False)
    assert len(fast) == len(slow) == 24
    for step, (got, want) in enumerate(zip(fast, slow, strict=True)):
        decision, reference = got["decision"], want["decision"]
        assert isinstance(decision, ResidencyDecision)
        # Every record but the version, field by field and whole; the request is the
        # twin's, so it is compared by name and shape.
        assert decision.request.name == reference.request.name
        for name in ("explored_states", "policy_name"):
            assert getattr(decision, name) == getattr(reference, name), (step, name)
        # The schedule's identity names each manager's own handles.
        assert decision.policy_config == got["policy config"]
        assert reference.policy_config == want["policy config"]
        assert decision.manager_id == got["manager id"]
        assert got["plan"].name == want["plan"].name
        assert got["plan"].reservations == want["plan"].reservations
        assert got["actions by layer"] == want["actions by layer"]
        if got["staged"]:
            assert got["actions by layer"] == ((), (), ())
            assert got["evictions"] == want["evictions"] == ()
        else:
            assert got["actions by layer"][1] == (("EnsureResident", step % LAYERS),)
        assert got["explanation"].feasible
        assert want["explanation"].feasible
        assert got["explanation"].reason is None
        assert got["explanation"].predicted_peak_bytes == want["explanation"].predicted_peak_bytes
        assert got["explanation"].reservations == want["explanation"].reservations
        assert len(got["actions"]) == len(want["actions"]) == len(got["plan"].enter)
        assert got["report"] is None
        assert want["report"] is None
        assert got["after"][0] == want["after"][0] == decision.request.name
        assert len(got["after"][1]) == len(want["after"][1]) == len(got["plan"].enter)
        assert got["after"][2] is want["after"][2] is None
        started, completed = got["timing"]
        assert started <= completed
        assert got["same report"]
        # Compared as the record and as a plain copy of it.
        assert decision == dataclasses.replace(decision)
        assert hash(decision) == hash(dataclasses.replace(decision))
        # The version its leases were taken at: a staged step's holds go after them
        # (one release each, one hold here), a use's before its decision.
        held = 1 if got["staged"] and not decision.request.reservations else 0
        assert decision.expected_state_version == reference.expected_state_version - held
        assert decision.expected_state_version < got["version"]


def test_a_staging_decided_as_before_is_not_built_or_lowered_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The tiered LRU decides the same in the same state whatever came before.
    cycle = _Cycle("lru", 24)
    lowered: list[str] = []
    lower = _lowering.lower_actions

    def counted(name: str, actions: Any) -> Any:
        lowered.append(name)
        return lower(name, actions)

    monkeypatch.setattr(_lowering, "lower_actions", counted)
    first = cycle.steps(plain=True)
    assert len(lowered) == 23  # each staging, once
    lowered.clear()
    second = cycle.steps(plain=True)
    # The second pass starts with the device as the first left it, so its first steps
    # decide otherwise and build their own plans; from the second cycle of layers on,
    # the same requests are decided the same in the same state, and their stagings run
    # the plans the first pass built and lowered.
    assert len(lowered) < LAYERS
    assert all(int(name.removeprefix("step-")) < LAYERS for name in lowered), lowered
    assert [step["actions by layer"] for step in second] == [
        step["actions by layer"] for step in first
    ]
    cycle.manager.close()
