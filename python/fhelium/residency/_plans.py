"""Plans: `execute_actions`, `explain`, and scopes (docs/concepts/plans.md).

Preflight and `explain` are one call into the core's simulation; execution is the
manager's ordinary action path run in order, non-transactionally, with every
committed transition reported when something fails half-way.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, cast

from fhelium import _core
from fhelium.errors import (
    ResidencyError,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
    ResidencyStaleStateError,
)
from fhelium.residency import _lowering
from fhelium.residency._locations import location_of
from fhelium.residency._records import bulk_builder, trusted_builder
from fhelium.residency._validation import index_int, require_non_empty_str
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.plan import (
    DiscardValue,
    DropResident,
    EnsureResident,
    MemoryReservation,
    MoveResident,
    ResidencyAction,
    ResidencyPlan,
)
from fhelium.residency.snapshot import (
    ResidencyActionExplanation,
    ResidencyPlanExplanation,
    ResidencyPlanReport,
    ResidencyTransitionReport,
)

if TYPE_CHECKING:
    from fhelium.residency._engine import Engine

__all__ = [
    "ScopeRun",
    "abandon_scope",
    "enter_scope",
    "execute_actions",
    "exit_scope",
    "explain",
    "optional_version",
]

_ACTION_TYPES: Final = (EnsureResident, MoveResident, DropResident, DiscardValue)
_new_report = trusted_builder(ResidencyPlanReport)
_ACTION_EXPLANATIONS = bulk_builder(ResidencyActionExplanation)
_time_ns = time.time_ns


def optional_version(value: object) -> int | None:
    """`expected_state_version`: None, or an index int (bool TypeError, < 0 ValueError)."""
    if value is None:
        return None
    return index_int(value, "expected_state_version")


def _check_version(engine: Engine, expected: int | None) -> None:
    if expected is not None:
        actual = engine.core.version
        if actual != expected:
            raise ResidencyStaleStateError(expected_version=expected, actual_version=actual)


def _streams(engine: Engine, transfer_streams: object) -> dict[ResidencyLocation, Any]:
    """A Mapping of validated CUDA locations to streams on them (see
    docs/concepts/plans.md#transfer-streams)."""
    if transfer_streams is None:
        return {}
    if not isinstance(transfer_streams, Mapping):
        raise TypeError(
            f"transfer_streams must be a Mapping, got {type(transfer_streams).__name__}"
        )
    streams: dict[ResidencyLocation, Any] = {}
    for location, stream in transfer_streams.items():
        engine.location_code(location)
        engine.check_stream(stream, location)
        streams[location] = stream
    return streams


def _stream_for(action: ResidencyAction, streams: dict[ResidencyLocation, Any]) -> Any:
    if isinstance(action, EnsureResident):
        return streams.get(action.location)
    if isinstance(action, MoveResident):
        return streams.get(action.to)
    return None


def _simulate(
    engine: Engine,
    lowered: _lowering.LoweredPlan,
    reservations: Iterable[MemoryReservation],
    *,
    completed_leases: list[int],
) -> _core.SimulationView:
    """One call into the core's simulation, with the plan's handles resolved."""
    resolutions = engine.core.resolve_many(list(lowered.handles))
    errors: dict[int, str] = {}
    if -1 in resolutions:
        for slot, (handle, resolved) in enumerate(zip(lowered.handles, resolutions, strict=True)):
            if resolved == -1:
                try:
                    engine.resolve(handle)
                except ResidencyError as error:
                    errors[slot] = str(error)
    cuda_count = engine.cuda_count or -1
    labels = [repr(reservation.label) for reservation in reservations]
    return engine.core.simulate(
        lowered.ir, resolutions, errors, cuda_count, completed_leases, labels
    )


def _preflight(
    engine: Engine,
    lowered: _lowering.LoweredPlan,
    reservations: Iterable[MemoryReservation] = (),
) -> None:
    simulation = _simulate(engine, lowered, reservations, completed_leases=[])
    if not simulation.feasible:
        raise ResidencyPlanError(simulation.reason or "the plan is infeasible")


def _run_phase(
    engine: Engine,
    plan_name: str,
    phase: str,
    actions: tuple[ResidencyAction, ...],
    streams: dict[ResidencyLocation, Any],
    transitions: list[ResidencyTransitionReport],
    started: int,
) -> None:
    """Executes one phase in order; wraps a failure with the committed prefix.

    The whole phase is one call into the core: each action takes the one-call host
    path, or the engine's general path where that declines, and its report is
    appended to `transitions` as it commits. On a failure the list holds exactly the
    committed prefix, so its growth is the index of the failed action.

    The cyclic garbage collector is paused for the phase: a plan allocates a report
    per action, and full collections triggered in the middle would scan the whole heap
    repeatedly for nothing. It runs again, once, after the phase.
    """
    if not actions:
        return
    committed = len(transitions)
    stream_for = (lambda action: _stream_for(action, streams)) if streams else None
    collecting = gc.isenabled()
    gc.disable()
    try:
        engine.core.run_phase(actions, transitions, stream_for)
    except Exception as error:
        index = len(transitions) - committed
        raise _execution_error(
            plan_name,
            phase,
            transitions,
            started,
            error,
            failed_action=actions[index],
            failed_action_index=index,
        ) from error
    except BaseException as error:
        _note_committed(error, plan_name, transitions)
        raise
    finally:
        if collecting:
            gc.enable()


def _execution_error(
    plan_name: str,
    phase: str,
    transitions: list[ResidencyTransitionReport],
    started: int,
    error: BaseException,
    **failed: Any,
) -> ResidencyPlanExecutionError:
    partial = _new_report(plan_name, tuple(transitions), started, max(started, _time_ns()))
    return ResidencyPlanExecutionError(
        plan_name=plan_name,
        phase=phase,
        partial_report=partial,
        detail=str(error),
        failed_action=failed.get("failed_action"),
        failed_action_index=failed.get("failed_action_index"),
        failed_reservation=failed.get("failed_reservation"),
        failed_reservation_index=failed.get("failed_reservation_index"),
    )


def _note_committed(
    error: BaseException, plan_name: str, transitions: list[ResidencyTransitionReport]
) -> None:
    if transitions:
        error.add_note(
            f"{len(transitions)} transition(s) of plan {plan_name!r} completed before this "
            "and stay committed"
        )


# ---------------------------------------------------------------------- execute_actions


def execute_actions(
    engine: Engine,
    actions: Iterable[ResidencyAction],
    *,
    name: str,
    transfer_streams: object,
    expected_state_version: object,
) -> ResidencyPlanReport:
    require_non_empty_str(name, "name")
    normalized = tuple(actions)
    for position, action in enumerate(normalized):
        if not isinstance(action, _ACTION_TYPES):
            raise TypeError(
                f"actions[{position}] must be a residency action, got {type(action).__name__}"
            )
    started = _time_ns()
    core = engine.core
    core.enter_transition()
    try:
        engine.reap()
        _check_version(engine, optional_version(expected_state_version))
        streams = _streams(engine, transfer_streams)
        _preflight(engine, _lowering.lower_actions(name, normalized))
        transitions: list[ResidencyTransitionReport] = []
        _run_phase(engine, name, "execute", normalized, streams, transitions, started)
        return _new_report(name, tuple(transitions), started, max(started, _time_ns()))
    finally:
        core.exit_transition()


# ---------------------------------------------------------------------- explain


def explain(
    engine: Engine, plan: ResidencyPlan, *, expected_state_version: object
) -> ResidencyPlanExplanation:
    if not isinstance(plan, ResidencyPlan):
        raise TypeError(f"plan must be a ResidencyPlan, got {type(plan).__name__}")
    core = engine.core
    core.enter(True, True)
    try:
        # No reap: explain observes; completed pending leases merely stop protecting.
        _check_version(engine, optional_version(expected_state_version))
        simulation = _simulate(
            engine,
            plan._lowered(),
            plan.reservations,
            completed_leases=engine.completed_pending_leases(),
        )
        return _Explanation._capture(plan, simulation)
    finally:
        core.exit()


class _Explanation(ResidencyPlanExplanation):
    """A `ResidencyPlanExplanation` whose per-action records are built on first
    access, once: an `explain` read only for `feasible` builds none of them."""

    __slots__ = ("_actions", "_plan", "_simulation")
    __qualname__ = "ResidencyPlanExplanation"

    _actions: tuple[ResidencyActionExplanation, ...] | None
    _plan: ResidencyPlan | None
    _simulation: _core.SimulationView | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Called as the record's own constructor: validate and keep the fields.
        plain = ResidencyPlanExplanation(*args, **kwargs)
        self._set(plain.plan_name, plain.reservations, plain.predicted_peak_bytes, plain)
        init = object.__setattr__
        init(self, "_actions", plain.actions)
        init(self, "_plan", None)
        init(self, "_simulation", None)

    @classmethod
    def _capture(cls, plan: ResidencyPlan, simulation: _core.SimulationView) -> _Explanation:
        explanation = object.__new__(cls)
        peaks = tuple((location_of(code), peak) for code, peak in simulation.peaks())
        explanation._set(plan.name, plan.reservations, peaks, simulation)
        init = object.__setattr__
        init(explanation, "_actions", None)
        init(explanation, "_plan", plan)
        init(explanation, "_simulation", simulation)
        return explanation

    def _set(
        self,
        plan_name: str,
        reservations: tuple[MemoryReservation, ...],
        peaks: tuple[tuple[ResidencyLocation, int], ...],
        source: Any,
    ) -> None:
        slots = ResidencyPlanExplanation.__dict__
        slots["plan_name"].__set__(self, plan_name)
        slots["reservations"].__set__(self, reservations)
        slots["predicted_peak_bytes"].__set__(self, peaks)
        slots["feasible"].__set__(self, source.feasible)
        slots["reason"].__set__(self, source.reason)

    @property
    def actions(self) -> tuple[ResidencyActionExplanation, ...]:
        actions = self._actions
        if actions is None:
            actions = self._build_actions()
            object.__setattr__(self, "_actions", actions)
        return actions

    def _build_actions(self) -> tuple[ResidencyActionExplanation, ...]:
        plan = cast(ResidencyPlan, self._plan)
        simulation = cast(_core.SimulationView, self._simulation)
        ordered = (*plan.reclaim, *plan.enter, *plan.exit)
        collecting = gc.isenabled()
        gc.disable()
        try:
            return simulation.action_entries(ordered, _ACTION_EXPLANATIONS, location_of)
        finally:
            if collecting:
                gc.enable()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ResidencyPlanExplanation):
            return NotImplemented
        return _explanation_fields(self) == _explanation_fields(other)

    def __hash__(self) -> int:
        return hash(_explanation_fields(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (ResidencyPlanExplanation, _explanation_fields(self))


def _explanation_fields(explanation: ResidencyPlanExplanation) -> tuple[Any, ...]:
    return (
        explanation.plan_name,
        explanation.actions,
        explanation.reservations,
        explanation.predicted_peak_bytes,
        explanation.feasible,
        explanation.reason,
    )


# ---------------------------------------------------------------------- scopes


@dataclass(slots=True)
class ScopeRun:
    """What an entered scope holds until it closes: its normalised streams, its
    reservation tokens and the transitions committed so far."""

    plan: ResidencyPlan
    streams: dict[ResidencyLocation, Any]
    tokens: list[int] = field(default_factory=list)
    transitions: list[ResidencyTransitionReport] = field(default_factory=list)
    started: int = 0


def _release_tokens_locked(engine: Engine, tokens: list[int]) -> None:
    """Releases scope reservations in reverse order while holding the gate."""
    core = engine.core
    while tokens:
        core.release_reservation(tokens.pop())


def enter_scope(
    engine: Engine, plan: ResidencyPlan, expected: int | None, transfer_streams: object
) -> ScopeRun:
    """Scope entry under one gate hold: version check, preflight, reclaim, reserve,
    enter (see docs/concepts/plans.md)."""
    name = plan.name
    started = _time_ns()
    core = engine.core
    core.enter_transition()
    try:
        engine.reap()
        _check_version(engine, expected)
        streams = _streams(engine, transfer_streams)
        _preflight(engine, plan._lowered(), plan.reservations)
        run = ScopeRun(plan, streams, started=started)
        transitions, tokens = run.transitions, run.tokens
        try:
            _run_phase(engine, name, "reclaim", plan.reclaim, streams, transitions, started)
            for position, reservation in enumerate(plan.reservations):
                try:
                    tokens.append(engine.reserve_locked(reservation))
                except Exception as error:
                    raise _execution_error(
                        name,
                        "reserve",
                        transitions,
                        started,
                        error,
                        failed_reservation=reservation,
                        failed_reservation_index=position,
                    ) from error
            _run_phase(engine, name, "enter", plan.enter, streams, transitions, started)
        except BaseException:
            _release_tokens_locked(engine, tokens)
            raise
        return run
    finally:
        core.exit_transition()


def exit_scope(engine: Engine, run: ScopeRun) -> ResidencyPlanReport:
    """Scope close: exit actions (no preflight), then the reservations."""
    plan = run.plan
    core = engine.core
    try:
        core.enter_transition()
    except BaseException:
        # A reservation never outlives its closed scope, even when the manager cannot
        # be entered now (a release during another thread's callback defers).
        abandon_scope(engine, run)
        raise
    try:
        transitions = run.transitions
        try:
            _run_phase(engine, plan.name, "exit", plan.exit, run.streams, transitions, run.started)
        finally:
            _release_tokens_locked(engine, run.tokens)
        return _new_report(plan.name, tuple(transitions), run.started, max(run.started, _time_ns()))
    finally:
        core.exit_transition()


def abandon_scope(engine: Engine, run: ScopeRun) -> None:
    """Gives an entered scope's reservations back without running its exit actions."""
    tokens, run.tokens = run.tokens, []
    for token in reversed(tokens):
        try:
            engine.release_reservation(token, finalizing=True)
        except Exception:
            continue
