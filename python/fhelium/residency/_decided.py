"""The decisions `decide` returns: a `ResidencyDecision` over the core's decided plan
IR and its simulation, whose records are built when they are first read
(docs/concepts/controller.md#decisions-and-evictions).
"""

from __future__ import annotations

import gc
from typing import Any, Final

from fhelium.residency import _lowering
from fhelium.residency._decisions import ResidencyDecision, ResidencyEviction
from fhelium.residency._locations import location_of
from fhelium.residency._plans import explanation_of
from fhelium.residency._records import bulk_builder, trusted_builder
from fhelium.residency.plan import (
    DropResident,
    EnsureResident,
    MoveResident,
    ResidencyAction,
    ResidencyPlan,
    set_lowered,
)
from fhelium.residency.policy import ResidencyPolicy
from fhelium.residency.request import ResidencyRequest
from fhelium.residency.snapshot import ResidencyPlanExplanation

__all__ = ["LazyDecision", "StagedRuns", "decided", "satisfied", "staged_found_run", "staged_run"]

# Up to this many actions, a decided plan's records are built with the collector on.
_FEW_ACTIONS: Final = 16

# The action kinds as the core's decided rows name them (`_core.Decided`).
_ENSURE: Final = 0
_MOVE: Final = 1

_new_ensure = trusted_builder(EnsureResident)
_new_move = trusted_builder(MoveResident)
_new_drop = trusted_builder(DropResident)
_new_eviction = trusted_builder(ResidencyEviction)
_new_plan = trusted_builder(ResidencyPlan)


# The fields a decision is built with here (its plan, evictions and explanation are
# built on demand), and their slot setters, for `LazyDecision._set`.
_DECISION_FIELDS: Final = (
    "manager_id",
    "expected_state_version",
    "explored_states",
    "request",
    "policy_name",
    "policy_config",
)
_DECISION_SETTERS: Final = tuple(
    ResidencyDecision.__dict__[name].__set__ for name in _DECISION_FIELDS
)


class LazyDecision(ResidencyDecision):
    """A `ResidencyDecision` over the core's decided plan IR and its simulation: the
    plan's records, the evictions and the explanation are built on first access, once.
    `decide` itself builds none of them, and a plan built from here carries the IR it
    was decided as, so scope entry never lowers it again. It compares, hashes and
    pickles like the plain record."""

    __slots__ = ("_built_evictions", "_built_explanation", "_built_plan", "_source")
    __qualname__ = "ResidencyDecision"

    _built_evictions: tuple[ResidencyEviction, ...] | None
    _built_explanation: ResidencyPlanExplanation | None
    _built_plan: ResidencyPlan | None
    # (the engine's `handle_at`, the core's decision: its plan IR, simulation, handle
    # index per slot, reclaim, enter and eviction rows, read on demand), as the
    # engine's search returned them.
    _source: tuple[Any, Any] | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Called as the record's own constructor (`dataclasses.replace`): validate like
        # ResidencyDecision and keep the fields.
        plain = ResidencyDecision(*args, **kwargs)
        self._set(
            plain.manager_id,
            plain.expected_state_version,
            plain.explored_states,
            plain.request,
            plain.policy_name,
            plain.policy_config,
        )
        init = object.__setattr__
        init(self, "_built_plan", plain.plan)
        init(self, "_built_evictions", plain.evictions)
        init(self, "_built_explanation", plain.explanation)
        init(self, "_source", None)

    def _set(
        self,
        manager_id: str,
        state_version: int,
        explored: int,
        request: ResidencyRequest,
        policy_name: str,
        policy_config: tuple[tuple[str, object], ...],
    ) -> None:
        (
            set_manager_id,
            set_version,
            set_explored,
            set_request,
            set_policy_name,
            set_policy_config,
        ) = _DECISION_SETTERS
        set_manager_id(self, manager_id)
        set_version(self, state_version)
        set_explored(self, explored)
        set_request(self, request)
        set_policy_name(self, policy_name)
        set_policy_config(self, policy_config)

    @property
    def plan(self) -> ResidencyPlan:
        plan = self._built_plan
        if plan is None:
            plan = self._build_plan()
            object.__setattr__(self, "_built_plan", plan)
        return plan

    @property
    def evictions(self) -> tuple[ResidencyEviction, ...]:
        evictions = self._built_evictions
        if evictions is None:
            reclaim = self.plan.reclaim
            source: Any = self._source
            # A plan that reclaims nothing evicts nothing.
            evictions = (
                tuple(
                    [
                        _new_eviction(reclaim[position], rank, location_of(code), nbytes, reason)
                        for position, rank, code, nbytes, reason in source[1].eviction_rows()
                    ]
                )
                if reclaim
                else ()
            )
            object.__setattr__(self, "_built_evictions", evictions)
        return evictions

    @property
    def explanation(self) -> ResidencyPlanExplanation:
        explanation = self._built_explanation
        if explanation is None:
            source: Any = self._source
            found = source[1]
            plan = self._built_plan
            if plan is None:
                plan = self.plan
            if type(found) is _Unchanged:
                # The state's charged bytes, read off it without a simulation.
                explanation = explanation_of(plan, found, found[0].charged_peaks())
            else:
                explanation = explanation_of(plan, found.simulation())
            object.__setattr__(self, "_built_explanation", explanation)
        return explanation

    def _build_plan(self) -> ResidencyPlan:
        # A string type: nothing is built at run time (`tuple[Any, ...]` would be).
        source: Any = self._source
        handle_of, found = source
        request = self.request
        if found.empty:
            # Nothing to do (a request already satisfied): no action to build.
            plan = _new_plan(request.name, (), (), request.reservations, ())
            set_lowered(plan, _lowering.LoweredPlan(found.ir(), ()))
            return plan
        handles = tuple([handle_of(index) for index in found.slots()])
        reclaim_rows = found.reclaim_rows()
        enter_rows = found.enter_rows()

        def action(row: tuple[int, int, int, int]) -> Any:
            kind, slot, code, from_code = row
            handle = handles[slot]
            if kind == _ENSURE:
                return _new_ensure(handle, location_of(code))
            if kind == _MOVE:
                return _new_move(
                    handle, location_of(code), None if from_code < 0 else location_of(from_code)
                )
            return _new_drop(handle, location_of(code))

        # A large plan is built with the collector off (its records are all new and
        # all kept); a few actions are not worth switching it.
        collecting = len(enter_rows) + len(reclaim_rows) > _FEW_ACTIONS and gc.isenabled()
        if collecting:
            gc.disable()
        try:
            plan = _new_plan(
                request.name,
                tuple([action(row) for row in enter_rows]),
                (),
                request.reservations,
                tuple([action(row) for row in reclaim_rows]),
            )
        finally:
            if collecting:
                gc.enable()
        # Already the core's IR of exactly these records: never lowered again.
        set_lowered(plan, _lowering.LoweredPlan(found.ir(), handles))
        return plan

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ResidencyDecision):
            return NotImplemented
        return _decision_fields(self) == _decision_fields(other)

    def __hash__(self) -> int:
        return hash(_decision_fields(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (ResidencyDecision, _decision_fields(self))


# Reads as the record it stands for, by name as by qualified name (repr, messages).
LazyDecision.__name__ = "ResidencyDecision"


def _decision_fields(decision: ResidencyDecision) -> tuple[Any, ...]:
    """The record's fields in declaration order (what the dataclass compares and
    hashes)."""
    return (
        decision.manager_id,
        decision.expected_state_version,
        decision.explored_states,
        decision.request,
        decision.plan,
        decision.policy_name,
        decision.policy_config,
        decision.evictions,
        decision.explanation,
    )


def decided(
    manager_id: str,
    state_version: int,
    explored: int,
    request: ResidencyRequest,
    policy: ResidencyPolicy,
    source: tuple[Any, ...],
    plan: ResidencyPlan | None = None,
    identity: tuple[str, tuple[tuple[str, object], ...]] | None = None,
) -> LazyDecision:
    """A decision of ``policy`` for ``request`` at ``state_version``, over what the
    engine's search returned (``source``); ``plan`` is its plan when already built (a
    satisfied request's empty plan, the same record every time), and ``identity`` the
    policy's name and ``config_identity`` when known to be fixed (a built-in policy's,
    read once by the decider)."""
    if identity is None:
        identity = (policy.name, tuple(policy.config_identity))
    return _new_decision(  # type: ignore[no-any-return]
        manager_id,
        state_version,
        explored,
        request,
        identity[0],
        identity[1],
        plan,
        None,
        None,
        source,
    )


# `decided`'s record, its fields and private slots set in one native call, in this order.
_new_decision = bulk_builder(
    LazyDecision,
    [*_DECISION_FIELDS, "_built_plan", "_built_evictions", "_built_explanation", "_source"],
)


class _Unchanged(tuple[Any]):
    """The core's simulation of a plan with no action and no reservation, read off the
    state it would run on (its one item, a published core state): feasible, and each
    location's peak is its ``used + reserved`` bytes, registered locations in
    registration order, as the core's simulation reports them. It stands in for the
    core's decision (`_core.Decided`), and its `SimulationView`, of a decision that
    `satisfied` builds without a search: no plan IR, no slot, no row. A tuple, made
    without running Python code (`_new_unchanged`)."""

    __slots__ = ()

    feasible: Final = True
    reason: Final = None
    empty: Final = True

    def simulation(self) -> _Unchanged:
        return self

    @staticmethod
    def ir() -> None:
        return None

    @staticmethod
    def eviction_rows() -> list[Any]:
        return []

    @staticmethod
    def same_actions(other: object) -> bool:
        return False

    def peaks(self) -> list[tuple[int, int]]:
        return self[0].charged_peaks()  # type: ignore[no-any-return]

    @staticmethod
    def action_entries(actions: tuple[Any, ...], builder: Any, locations: Any) -> tuple[Any, ...]:
        return ()


_new_unchanged = tuple.__new__


def satisfied(
    manager_id: str,
    view: Any,
    request: ResidencyRequest,
    policy: ResidencyPolicy,
    plan: ResidencyPlan,
    identity: tuple[str, tuple[tuple[str, object], ...]] | None = None,
) -> LazyDecision:
    """The decision `decide` takes for ``request`` at the state ``view`` (a published
    core state) when every requirement is already resident there and the request has
    no reservations: explored_states 1, ``plan`` its empty plan, no eviction, and a
    feasible explanation with the state's charged bytes as the peaks
    (docs/concepts/controller.md#decide). A pipeline's staged step enters with it: its
    staging made its values resident and held them until its leases were taken."""
    if identity is None:
        identity = (policy.name, tuple(policy.config_identity))
    # `decided`, with its evictions: its plan reclaims nothing, so it evicts nothing.
    return _new_decision(  # type: ignore[no-any-return]
        manager_id,
        view.version,
        1,
        request,
        identity[0],
        identity[1],
        plan,
        (),
        None,
        (None, _new_unchanged(_Unchanged, (view,))),
    )


# A staged run: a plan, its actions as one list, and their lowering.
_Run = tuple[ResidencyPlan, tuple[ResidencyAction, ...], _lowering.LoweredPlan]


class StagedRuns:
    """What a pipeline's staging last ran for one request (see `staged_run`): a cyclic
    schedule stages the same decision again on every pass. One attribute, replaced
    whole: pipelines on other threads may stage the same request meanwhile."""

    __slots__ = ("kit", "last")

    def __init__(self) -> None:
        # (decided request, discards, the core's decision), then what ran for it.
        self.last: tuple[tuple[Any, ...], _Run] | None = None
        # The discard count, and the native arguments a staging runs `last` again with
        # (`_restaging.restage_first`), lowered at that count: they serve any
        # `last` decided at it.
        self.kit: tuple[Any, ...] | None = None


def staged_found_run(
    manager_id: str,
    request: ResidencyRequest,
    policy: ResidencyPolicy,
    identity: tuple[str, tuple[tuple[str, object], ...]] | None,
    found: tuple[tuple[Any, Any], int, int],
    runs: StagedRuns,
    discards: int,
) -> _Run:
    """`staged_run` for the decision `Decider.decide_found` found (its source, state
    version and explored states), without building the decision when ``runs`` kept
    the run of the same one."""
    source, state_version, explored = found
    last = runs.last
    if last is not None:
        kept, run = last
        if kept[0] is request and kept[1] == discards and kept[2].same_actions(source[1]):
            return run
    decision = decided(manager_id, state_version, explored, request, policy, source, None, identity)
    return staged_run(decision, runs, discards)


def staged_run(decision: ResidencyDecision, runs: StagedRuns, discards: int) -> _Run:
    """A decision's plan, its actions as one list (reclaim, then enter) and that list
    lowered, for a pipeline's staging to run as one plan. A decision for the same
    request object as the last one ``runs`` kept, with the same rows over the same
    handle slots while the manager has discarded ``discards`` values (so the slots name
    the same handles), takes that decision's plan, which is then its own: an equal
    record, already lowered, so nothing is built or lowered again."""
    lazy = decision if isinstance(decision, LazyDecision) else None
    source = None if lazy is None or lazy._built_plan is not None else lazy._source
    if source is None:
        plan = decision.plan
        actions = (*plan.reclaim, *plan.enter)
        return plan, actions, _lowering.lower_actions(plan.name, actions)
    key = (decision.request, discards, source[1])
    last = runs.last
    if last is not None:
        kept, run = last
        if kept[0] is key[0] and kept[1] == discards and kept[2].same_actions(key[2]):
            object.__setattr__(decision, "_built_plan", run[0])
            return run
    plan = decision.plan
    actions = (*plan.reclaim, *plan.enter)
    run = (plan, actions, _lowering.lower_actions(plan.name, actions))
    runs.last = (key, run)
    return run
