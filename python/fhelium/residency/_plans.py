"""Plans: `execute_actions`, `explain`, and scopes (docs/concepts/plans.md).

`execute_actions`, scope entry and scope exit are each one call into the core, which
takes the gate, checks, preflights and runs the phases; this module checks argument
shapes before and wraps a failure after, from what the core's `PlanRun` recorded.
`explain` is one call into the core's simulation. Transition records are built when
a report is read.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final

from fhelium.errors import (
    ResidencyPlanExecutionError,
)
from fhelium.residency import _lowering
from fhelium.residency._locations import location_of
from fhelium.residency._records import bulk_builder, trusted_builder
from fhelium.residency._validation import index_int, require_instance, require_non_empty_str
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.plan import (
    ACTION_TYPES,
    MemoryReservation,
    ResidencyAction,
    ResidencyPlan,
    lowered_plan,
)
from fhelium.residency.snapshot import (
    ResidencyActionExplanation,
    ResidencyPlanExplanation,
    ResidencyPlanReport,
    ResidencyTransitionReport,
)

if TYPE_CHECKING:
    from fhelium import _core
    from fhelium.residency._engine import Engine
    from fhelium.residency.model import ResidencyHandle

__all__ = [
    "ScopeRun",
    "abandon_scope",
    "enter_scope",
    "execute_actions",
    "exit_scope",
    "explain",
    "explanation_of",
    "optional_version",
    "run_actions",
    "staging_failure",
]

# The action classes themselves: a list of only these needs no per-action check.
_EXACT_ACTION_TYPES: Final = frozenset(ACTION_TYPES)
_new_report = trusted_builder(ResidencyPlanReport)
_ACTION_EXPLANATIONS = bulk_builder(ResidencyActionExplanation)
_time_ns = time.time_ns


def optional_version(value: object) -> int | None:
    """`expected_state_version`: None, or an index int (bool TypeError, < 0 ValueError)."""
    if value is None:
        return None
    return index_int(value, "expected_state_version")


def _execution_error(
    plan_name: str,
    phase: str,
    run: _core.PlanRun,
    started: int,
    error: BaseException,
    **failed: Any,
) -> ResidencyPlanExecutionError:
    partial = _new_report(plan_name, run.reports(), started, max(started, _time_ns()))
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


def _note_committed(error: BaseException, plan_name: str, committed: int) -> None:
    if committed:
        error.add_note(
            f"{committed} transition(s) of plan {plan_name!r} completed before this "
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
    asynchronous: bool = False,
    then: Callable[[], object] | None = None,
) -> ResidencyPlanReport:
    """Checks the arguments, then runs the whole plan in one call into the core.

    With ``asynchronous`` (a prefetch), the CUDA copies of ``ensure`` actions are left
    in flight (docs/concepts/controller.md#prefetch). ``then`` runs after the plan under
    the same hold of the gate (a prefetch holds what it staged there); what it raises
    propagates unchanged."""
    require_non_empty_str(name, "name")
    normalized = tuple(actions)
    if not _EXACT_ACTION_TYPES.issuperset(map(type, normalized)):
        for position, action in enumerate(normalized):
            if not isinstance(action, ACTION_TYPES):
                raise TypeError(
                    f"actions[{position}] must be a residency action, got {type(action).__name__}"
                )
    run, started = run_actions(
        engine, normalized, name, transfer_streams, expected_state_version, asynchronous, then
    )
    return _PlanReport._capture(name, run, started, max(started, _time_ns()))


def run_actions(
    engine: Engine,
    normalized: tuple[ResidencyAction, ...],
    name: str,
    transfer_streams: object,
    expected_state_version: object,
    asynchronous: bool,
    then: Callable[[], object] | None,
    lowered: _lowering.LoweredPlan | None = None,
    hold: tuple[tuple[tuple[tuple[ResidencyHandle[Any], ...], ResidencyLocation], ...], list[int]]
    | None = None,
) -> tuple[_core.PlanRun, int]:
    """Runs checked ``normalized`` actions as one plan (`execute_actions` once its
    arguments are checked); the run and its start. With ``hold``, `(groups, held)`,
    each `(handles, location)` pair of ``groups`` is held under the plan's hold of the
    manager, before ``then``, its token appended to ``held`` as it is taken (so no
    interrupt can lose it; taken out again if a later hold or ``then`` fails). A
    pipeline's staging calls it directly, asynchronously, with a decided plan's own
    records (checked when they were built) and ``lowered``, their lowering as one
    list."""
    if lowered is None:
        lowered = _lowering.lower_actions(name, normalized)
    run = engine.plan_run()
    started = _time_ns()
    after = _Then(then)
    try:
        engine.execute_plan(
            run,
            lowered.ir,
            lowered.handles,
            normalized,
            transfer_streams,
            expected_state_version,
            asynchronous=asynchronous,
            hold=hold,
            then=None if then is None else after._run,
        )
    except Exception as error:
        if after.started or (hold is not None and len(run) == len(normalized)):
            # Raised after the plan ran whole (by ``then``, or by a hold): unchanged.
            raise
        raise _failure(name, run, started, error, normalized, ()) from error
    except BaseException as error:
        if not after.started:
            _note_committed(error, name, len(run))
        raise
    return run, started


def staging_failure(
    plan_name: str,
    run: _core.PlanRun,
    started: int,
    error: BaseException,
    actions: tuple[ResidencyAction, ...],
) -> BaseException:
    """What `run_actions` raises for ``error`` from a pipeline staging's plan run with
    holds (and nothing after them) that the decide ran in the same call
    (`Decider.restage`): an `Exception` raised by the plan as its execution error (by a
    hold, after the whole plan, unchanged); any other error unchanged, noting the
    transitions that stay committed."""
    if isinstance(error, Exception):
        if len(run) == len(actions):
            return error
        return _failure(plan_name, run, started, error, actions, ())
    _note_committed(error, plan_name, len(run))
    return error


def _failure(
    plan_name: str,
    run: _core.PlanRun,
    started: int,
    error: Exception,
    actions: tuple[ResidencyAction, ...],
    reservations: tuple[MemoryReservation, ...],
) -> Exception:
    """`error` as the run left it: unchanged when it came before the first phase,
    else a `ResidencyPlanExecutionError` naming the failed action or reservation and
    carrying the committed prefix."""
    phase = run.phase
    if phase is None:
        return error
    position = run.position
    if phase == "reserve":
        failed = {
            "failed_reservation": reservations[position],
            "failed_reservation_index": position,
        }
    else:
        failed = {"failed_action": actions[position], "failed_action_index": position}
    return _execution_error(plan_name, phase, run, started, error, **failed)


# ---------------------------------------------------------------------- explain


def explain(
    engine: Engine, plan: ResidencyPlan, *, expected_state_version: object
) -> ResidencyPlanExplanation:
    """One call into the core, which takes the gate, checks the version and
    simulates; nothing is reaped (completed pending leases merely stop protecting)."""
    require_instance(plan, ResidencyPlan, "plan")
    lowered = lowered_plan(plan)
    simulation = engine.explain_plan(lowered.ir, lowered.handles, plan, expected_state_version)
    return _Explanation._capture(plan, simulation)


# The explanation record's field setters, in `_set`'s order.
_EXPLANATION_SETTERS: Final = tuple(
    ResidencyPlanExplanation.__dict__[name].__set__
    for name in ("plan_name", "reservations", "predicted_peak_bytes", "feasible", "reason")
)


class _LazyRecord:
    """Equality, hashing and pickling for a record subclass that builds a field on
    first access: exactly those of the plain record `_record` with the same fields."""

    __slots__ = ()
    _record: ClassVar[type]

    def _values(self) -> tuple[Any, ...]:
        return _field_values(self, self._record)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, self._record):
            return NotImplemented
        return self._values() == _field_values(other, self._record)

    def __hash__(self) -> int:
        return hash(self._values())

    def __reduce__(self) -> tuple[Any, ...]:
        return (self._record, self._values())


def _field_values(record: object, cls: type) -> tuple[Any, ...]:
    return tuple(getattr(record, field.name) for field in dataclasses.fields(cls))


class _Explanation(_LazyRecord, ResidencyPlanExplanation):
    """A `ResidencyPlanExplanation` whose per-action records are built on first
    access, once: an `explain` read only for `feasible` builds none of them."""

    __slots__ = ("_actions", "_plan", "_simulation")
    __qualname__ = "ResidencyPlanExplanation"
    _record = ResidencyPlanExplanation

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
        # One native call: the record's fields, its peaks' location records, and its
        # actions left to `_build_actions` (none for a plan without actions).
        return explanation_of(plan, simulation)  # type: ignore[no-any-return]

    def _set(
        self,
        plan_name: str,
        reservations: tuple[MemoryReservation, ...],
        peaks: tuple[tuple[ResidencyLocation, int], ...],
        source: Any,
    ) -> None:
        set_name, set_reservations, set_peaks, set_feasible, set_reason = _EXPLANATION_SETTERS
        set_name(self, plan_name)
        set_reservations(self, reservations)
        set_peaks(self, peaks)
        set_feasible(self, source.feasible)
        set_reason(self, source.reason)

    @property
    def actions(self) -> tuple[ResidencyActionExplanation, ...]:
        actions = self._actions
        if actions is None:
            actions = self._build_actions()
            object.__setattr__(self, "_actions", actions)
        return actions

    def _build_actions(self) -> tuple[ResidencyActionExplanation, ...]:
        # Both set when `actions` is left to build (`RecordBuilder.explanation`).
        plan: ResidencyPlan = self._plan  # type: ignore[assignment]
        simulation: _core.SimulationView = self._simulation  # type: ignore[assignment]
        ordered = (*plan.reclaim, *plan.enter, *plan.exit)
        collecting = gc.isenabled()
        gc.disable()
        try:
            return simulation.action_entries(ordered, _ACTION_EXPLANATIONS, location_of)
        finally:
            if collecting:
                gc.enable()


# ---------------------------------------------------------------------- scopes


@dataclass(slots=True)
class ScopeRun:
    """What an entered scope holds until it closes: the core's record of the run
    (its streams, reservation tokens and committed transitions) and its start."""

    plan: ResidencyPlan
    run: _core.PlanRun
    started: int


class _Then:
    """A ``then`` hook for the core's plan calls, remembering whether it started: an
    error raised by it propagates unchanged, not as the plan's. `hook` is a bound
    method (or ``None``), never a closure over the instance: no reference cycle keeps
    the hook, and what it refers to (a use, its scope and leases), alive until the
    collector runs (docs/project.md#per-step-cost)."""

    __slots__ = ("started", "then")

    def __init__(self, then: Callable[[], object] | None) -> None:
        self.started = False
        self.then = then

    @property
    def hook(self) -> Callable[[], object] | None:
        # A new bound method each time, not kept on the instance (that would be a cycle).
        return None if self.then is None else self._run

    def _run(self) -> object:
        self.started = True
        then = self.then
        # Only handed out as `hook` when there is one.
        assert then is not None
        return then()


# `_Explanation._capture`'s record, its fields and private slots set in one native
# call (`RecordBuilder.explanation`), in this order.
_new_explanation = bulk_builder(
    _Explanation,
    [
        "plan_name",
        "reservations",
        "predicted_peak_bytes",
        "feasible",
        "reason",
        "_actions",
        "_plan",
        "_simulation",
    ],
)

# `explanation_of(plan, simulation, peaks=None)`: the explanation of ``plan`` from the
# core's simulation of it, its per-action records built when first read; ``peaks`` are
# the simulation's ``peaks()`` when already read. One native call, no Python frame.
explanation_of: Final = functools.partial(_new_explanation.explanation, location_of)


def enter_scope(
    engine: Engine,
    plan: ResidencyPlan,
    expected: int | None,
    transfer_streams: object,
    then: Callable[[], object] | None = None,
) -> ScopeRun:
    """Scope entry in one call into the core: version check, streams, preflight,
    reclaim, reserve, enter (see docs/concepts/plans.md); then ``then``, under the same
    hold of the gate (a use borrows there). When ``then`` raises, the reservations are
    released and its error propagates unchanged."""
    lowered = lowered_plan(plan)
    run = engine.plan_run()
    started = _time_ns()
    after = _Then(then)
    try:
        engine.enter_scope(
            run, lowered.ir, lowered.handles, plan, transfer_streams, expected, then=after.hook
        )
    except Exception as error:
        if after.started:
            raise
        failed = (plan.reclaim, plan.enter)[run.phase == "enter"]
        raise _failure(plan.name, run, started, error, failed, plan.reservations) from error
    except BaseException as error:
        if not after.started:
            _note_committed(error, plan.name, len(run))
        raise
    return ScopeRun(plan, run, started)


def exit_scope(engine: Engine, scope: ScopeRun) -> ResidencyPlanReport:
    """Scope close: exit actions (no preflight), then the reservations."""
    plan, run = scope.plan, scope.run
    try:
        engine.exit_scope(run, plan.exit)
    except Exception as error:
        if run.phase != "exit":
            # The manager could not be entered: a reservation never outlives its
            # closed scope, so it goes back on the deferred path.
            abandon_scope(engine, scope)
            raise
        raise _failure(plan.name, run, scope.started, error, plan.exit, ()) from error
    except BaseException as error:
        if run.phase != "exit":
            abandon_scope(engine, scope)
        else:
            _note_committed(error, plan.name, len(run))
        raise
    return _PlanReport._capture(plan.name, run, scope.started, max(scope.started, _time_ns()))


def abandon_scope(engine: Engine, scope: ScopeRun) -> None:
    """Gives an entered scope's reservations back without running its exit actions."""
    for token in scope.run.take_tokens():
        try:
            engine.release_reservation(token, finalizing=True)
        except Exception:
            continue


# ---------------------------------------------------------------------- reports


class _PlanReport(_LazyRecord, ResidencyPlanReport):
    """A `ResidencyPlanReport` whose transition records are built on first access,
    once: a run read only for its timing builds none of them."""

    __slots__ = ("_built", "_run")
    __qualname__ = "ResidencyPlanReport"
    _record = ResidencyPlanReport

    _built: tuple[ResidencyTransitionReport, ...] | None
    _run: _core.PlanRun | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Called as the record's own constructor: validate and keep the fields.
        plain = ResidencyPlanReport(*args, **kwargs)
        self._set(plain.plan_name, plain.started_at_ns, plain.completed_at_ns)
        init = object.__setattr__
        init(self, "_built", plain.transitions)
        init(self, "_run", None)

    @classmethod
    def _capture(
        cls, plan_name: str, run: _core.PlanRun, started: int, completed: int
    ) -> _PlanReport:
        return _new_plan_report(  # type: ignore[no-any-return]
            plan_name, started, completed, None, run
        )

    def _set(self, plan_name: str, started: int, completed: int) -> None:
        slots = ResidencyPlanReport.__dict__
        slots["plan_name"].__set__(self, plan_name)
        slots["started_at_ns"].__set__(self, started)
        slots["completed_at_ns"].__set__(self, completed)

    @property
    def transitions(self) -> tuple[ResidencyTransitionReport, ...]:
        built = self._built
        if built is None:
            run: Any = self._run
            collecting = gc.isenabled()
            gc.disable()
            try:
                built = run.reports()
            finally:
                if collecting:
                    gc.enable()
            object.__setattr__(self, "_built", built)
        return built


# `_PlanReport._capture`'s record, its fields and private slots set in one native call,
# in this order.
_new_plan_report = bulk_builder(
    _PlanReport, ["plan_name", "started_at_ns", "completed_at_ns", "_built", "_run"]
)
