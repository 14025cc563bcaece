"""The controller's decision records, `ResidencyEviction` and `ResidencyDecision`.

They live below the controller so that `ResidencyUse` (and the pipeline built on it)
can name them without importing the controller; `fhelium.residency.controller`
re-exports them, and they read as defined there
(docs/concepts/controller.md#decisions-and-evictions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fhelium.residency._validation import (
    require_count,
    require_instance,
    require_non_empty_str,
    require_strict_int,
    seal,
)
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.plan import DropResident, MoveResident, ResidencyPlan
from fhelium.residency.request import ResidencyRequest
from fhelium.residency.snapshot import ResidencyPlanExplanation

__all__ = ["ResidencyDecision", "ResidencyEviction"]


@dataclass(frozen=True, slots=True)
class ResidencyEviction:
    """One reclaim action the controller chose, and why.

    A frozen record; a decision has one per reclaim action (see
    docs/concepts/controller.md#decisions-and-evictions).

    Attributes:
        action: The `DropResident` or `MoveResident` (a spill) it runs.
        rank: The candidate's 0-based position in the policy's order when it was chosen.
        released_location: The location it was evicted from.
        released_nbytes: Its charge, freed there.
        reason: Why it was chosen, as text.

    Raises:
        TypeError: A field of the wrong kind.
        ValueError: A negative count or a blank reason.
    """

    action: DropResident[Any] | MoveResident[Any]
    rank: int
    released_location: ResidencyLocation
    released_nbytes: int
    reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.action, DropResident | MoveResident):
            raise TypeError(
                f"action must be a DropResident or MoveResident, got {type(self.action).__name__}"
            )
        require_count(self.rank, "rank")
        require_instance(self.released_location, ResidencyLocation, "released_location")
        require_count(self.released_nbytes, "released_nbytes")
        require_non_empty_str(self.reason, "reason")


@dataclass(frozen=True, slots=True, init=False)
class ResidencyDecision:
    """A tensor-free, manager-bound decision: the plan, its evictions and the evidence.

    Made by `ResidencyController.decide`; process-local and valid only for its manager at
    its version (`ResidencyController.scope` enforces both). See
    docs/concepts/controller.md#decisions-and-evictions.

    Attributes:
        manager_id: The manager it was made for.
        expected_state_version: The manager version it planned on.
        explored_states: How many search states it took (> 0).
        request: The request.
        plan: The plan: reclaim, enter and the request's reservations, no exit actions.
        policy_name: The policy's name.
        policy_config: The policy's ``config_identity``.
        evictions: One `ResidencyEviction` per reclaim action.
        explanation: The plan's feasible explanation at ``expected_state_version``.

    Raises:
        TypeError: A field of the wrong kind.
        ValueError: A bad count, a blank name, names that do not match across request, plan
            and explanation, or an infeasible explanation.
    """

    manager_id: str
    expected_state_version: int
    explored_states: int
    request: ResidencyRequest
    plan: ResidencyPlan
    policy_name: str
    policy_config: tuple[tuple[str, object], ...]
    evictions: tuple[ResidencyEviction, ...]
    explanation: ResidencyPlanExplanation

    def __init__(
        self,
        manager_id: str,
        expected_state_version: int,
        explored_states: int,
        request: ResidencyRequest,
        plan: ResidencyPlan,
        policy_name: str,
        policy_config: Any,
        evictions: Any,
        explanation: ResidencyPlanExplanation,
    ) -> None:
        require_non_empty_str(manager_id, "manager_id")
        require_count(expected_state_version, "expected_state_version")
        if require_strict_int(explored_states, "explored_states") <= 0:
            raise ValueError(f"explored_states must be > 0, got {explored_states}")
        require_instance(request, ResidencyRequest, "request")
        require_instance(plan, ResidencyPlan, "plan")
        require_non_empty_str(policy_name, "policy_name")
        config = tuple(policy_config)
        for item in config:
            if not isinstance(item, tuple) or len(item) != 2:
                raise TypeError(f"policy_config items must be 2-tuples, got {item!r}")
            require_non_empty_str(item[0], "policy_config key")
        chosen = tuple(evictions)
        for eviction in chosen:
            require_instance(eviction, ResidencyEviction, "evictions element")
        require_instance(explanation, ResidencyPlanExplanation, "explanation")
        if plan.name != request.name:
            raise ValueError(f"plan name {plan.name!r} differs from request {request.name!r}")
        if explanation.plan_name != plan.name:
            raise ValueError("the explanation is of another plan")
        if not explanation.feasible:
            raise ValueError("a decision needs a feasible explanation")
        fields = (
            ("manager_id", manager_id),
            ("expected_state_version", expected_state_version),
            ("explored_states", explored_states),
            ("request", request),
            ("plan", plan),
            ("policy_name", policy_name),
            ("policy_config", config),
            ("evictions", chosen),
            ("explanation", explanation),
        )
        for name, value in fields:
            object.__setattr__(self, name, value)


seal(ResidencyEviction, ResidencyDecision)

# Read as the controller's, which re-exports them (repr, pickling, documentation).
ResidencyEviction.__module__ = "fhelium.residency.controller"
ResidencyDecision.__module__ = "fhelium.residency.controller"
