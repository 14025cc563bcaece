"""Plans: `execute_actions`, `explain`, and scopes (contract section 5).

Preflight and `explain` are one call into the core's simulation; execution is the
manager's ordinary action path run in order, non-transactionally, with every
committed transition reported when something fails half-way.
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, cast

from fhelium import _core
from fhelium.errors import (
    ResidencyError,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
    ResidencyStaleStateError,
)
from fhelium.residency import _lowering
from fhelium.residency._records import trusted_builder
from fhelium.residency._validation import require_non_empty_str
from fhelium.residency.lease import _Lifetime
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
    from fhelium.residency.manager import ResidencyManager

__all__ = ["ResidencyScope", "execute_actions", "explain"]

_ACTION_TYPES: Final = (EnsureResident, MoveResident, DropResident, DiscardValue)
_new_report = trusted_builder(ResidencyPlanReport)
_new_action_explanation = trusted_builder(ResidencyActionExplanation)
_time_ns = time.time_ns


def optional_version(value: object) -> int | None:
    """`expected_state_version`: None, or an index int (bool TypeError, < 0 ValueError)."""
    if value is None:
        return None
    from fhelium.residency.manager import _index_int

    return _index_int(value, "expected_state_version")


def _check_version(manager: ResidencyManager, expected: int | None) -> None:
    if expected is not None:
        actual = manager._core.version
        if actual != expected:
            raise ResidencyStaleStateError(expected_version=expected, actual_version=actual)


def _streams(manager: ResidencyManager, transfer_streams: object) -> dict[ResidencyLocation, Any]:
    """Contract 4.1: a Mapping of validated CUDA locations to streams on them."""
    if transfer_streams is None:
        return {}
    if not isinstance(transfer_streams, Mapping):
        raise TypeError(
            f"transfer_streams must be a Mapping, got {type(transfer_streams).__name__}"
        )
    streams: dict[ResidencyLocation, Any] = {}
    for location, stream in transfer_streams.items():
        manager._location_code(location)
        manager._check_stream(stream, location)
        streams[location] = stream
    return streams


def _stream_for(action: ResidencyAction, streams: dict[ResidencyLocation, Any]) -> Any:
    if isinstance(action, EnsureResident):
        return streams.get(action.location)
    if isinstance(action, MoveResident):
        return streams.get(action.to)
    return None


def _simulate(
    manager: ResidencyManager,
    lowered: _lowering.LoweredPlan,
    reservations: Iterable[MemoryReservation],
    *,
    completed_leases: list[int],
) -> _core.SimulationView:
    """One call into the core's simulation, with the plan's handles resolved."""
    index = manager._index
    resolutions = [index.get(handle, -1) for handle in lowered.handles]
    errors: dict[int, str] = {}
    if -1 in resolutions:
        for slot, (handle, resolved) in enumerate(zip(lowered.handles, resolutions, strict=True)):
            if resolved == -1:
                try:
                    manager._resolve(handle)
                except ResidencyError as error:
                    errors[slot] = str(error)
    cuda_count = manager._cuda_count or -1
    labels = [repr(reservation.label) for reservation in reservations]
    return manager._core.simulate(
        lowered.ir, resolutions, errors, cuda_count, completed_leases, labels
    )


def _preflight(
    manager: ResidencyManager,
    lowered: _lowering.LoweredPlan,
    reservations: Iterable[MemoryReservation] = (),
) -> None:
    simulation = _simulate(manager, lowered, reservations, completed_leases=[])
    if not simulation.feasible:
        raise ResidencyPlanError(simulation.reason or "the plan is infeasible")


def _run_phase(
    manager: ResidencyManager,
    plan_name: str,
    phase: str,
    actions: tuple[ResidencyAction, ...],
    streams: dict[ResidencyLocation, Any],
    transitions: list[ResidencyTransitionReport],
    started: int,
) -> None:
    """Executes one phase in order; wraps a failure with the committed prefix.

    The cyclic garbage collector is paused for the loop: a plan allocates a report per
    action, and full collections triggered in the middle would scan the whole heap
    repeatedly for nothing. It runs again, once, after the phase.
    """
    if not actions:
        return
    execute = manager._execute
    append = transitions.append
    collecting = gc.isenabled()
    gc.disable()
    try:
        for index, action in enumerate(actions):
            try:
                append(execute(action, _stream_for(action, streams) if streams else None))
            except Exception as error:
                raise _execution_error(
                    plan_name,
                    phase,
                    transitions,
                    started,
                    error,
                    failed_action=action,
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
    manager: ResidencyManager,
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
    core = manager._core
    core.enter_transition()
    try:
        manager._reap()
        _check_version(manager, optional_version(expected_state_version))
        streams = _streams(manager, transfer_streams)
        _preflight(manager, _lowering.lower_actions(name, normalized))
        transitions: list[ResidencyTransitionReport] = []
        _run_phase(manager, name, "execute", normalized, streams, transitions, started)
        return _new_report(name, tuple(transitions), started, max(started, _time_ns()))
    finally:
        core.exit_transition()


# ---------------------------------------------------------------------- explain


def explain(
    manager: ResidencyManager, plan: ResidencyPlan, *, expected_state_version: object
) -> ResidencyPlanExplanation:
    if not isinstance(plan, ResidencyPlan):
        raise TypeError(f"plan must be a ResidencyPlan, got {type(plan).__name__}")
    core = manager._core
    core.enter(True, True)
    try:
        # No reap: explain observes; completed pending leases merely stop protecting.
        _check_version(manager, optional_version(expected_state_version))
        simulation = _simulate(
            manager,
            plan._lowered(),
            plan.reservations,
            completed_leases=manager._completed_pending_leases(),
        )
        return _Explanation._capture(manager, plan, simulation)
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
    def _capture(
        cls, manager: ResidencyManager, plan: ResidencyPlan, simulation: _core.SimulationView
    ) -> _Explanation:
        from fhelium.residency.manager import _location_of

        explanation = object.__new__(cls)
        peaks = tuple((_location_of(code), peak) for code, peak in simulation.peaks())
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
        from fhelium.residency.manager import _location_of

        plan = cast(ResidencyPlan, self._plan)
        simulation = cast(_core.SimulationView, self._simulation)
        ordered = (*plan.reclaim, *plan.enter, *plan.exit)
        collecting = gc.isenabled()
        gc.disable()
        try:
            return tuple(
                _new_action_explanation(
                    action,
                    executable,
                    no_op,
                    None if source < 0 else _location_of(source),
                    None if destination < 0 else _location_of(destination),
                    logical,
                    storage,
                    reason,
                )
                for action, (
                    executable,
                    no_op,
                    source,
                    destination,
                    logical,
                    storage,
                    reason,
                ) in zip(ordered, simulation.rows(), strict=False)
            )
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


class ResidencyScope(_Lifetime):
    """A single-use context for one plan: reclaim, reserve and enter on entry; exit
    actions and reservation release on exit. Nestable; never suppresses the body's
    exception."""

    __slots__ = (
        "_entered",
        "_expected",
        "_manager",
        "_plan",
        "_started",
        "_state",
        "_streams",
        "_tokens",
        "_transitions",
        "exit_error",
        "report",
    )

    def __init__(
        self,
        manager: ResidencyManager,
        plan: ResidencyPlan,
        *,
        transfer_streams: Mapping[ResidencyLocation, Any] | None = None,
        expected_state_version: int | None = None,
    ) -> None:
        from fhelium.residency.manager import ResidencyManager

        if not isinstance(manager, ResidencyManager):
            raise TypeError(f"manager must be a ResidencyManager, got {type(manager).__name__}")
        if not isinstance(plan, ResidencyPlan):
            raise TypeError(f"plan must be a ResidencyPlan, got {type(plan).__name__}")
        if transfer_streams is not None and not isinstance(transfer_streams, Mapping):
            raise TypeError(
                f"transfer_streams must be a Mapping, got {type(transfer_streams).__name__}"
            )
        self._expected = optional_version(expected_state_version)
        self._manager = manager
        self._plan = plan
        # A private copy: later changes to the caller's mapping do not reach the scope.
        self._streams: dict[Any, Any] = dict(transfer_streams or {})
        self._state = "new"
        self._active = False
        self._tokens: list[int] = []
        self._transitions: list[ResidencyTransitionReport] = []
        self._started = 0
        self.report: ResidencyPlanReport | None = None
        self.exit_error: ResidencyPlanExecutionError | None = None

    @property
    def manager(self) -> ResidencyManager:
        return self._manager

    @property
    def plan(self) -> ResidencyPlan:
        return self._plan

    @property
    def expected_state_version(self) -> int | None:
        return self._expected

    def __enter__(self) -> ResidencyScope:
        if self._state != "new":
            raise RuntimeError(f"scope of plan {self._plan.name!r} can be entered only once")
        self._state = "entering"
        try:
            _enter_scope(self._manager, self)
        except BaseException:
            self._state = "closed"
            raise
        self._state = "entered"
        self._track()
        return self

    def close(self) -> None:
        """Run the exit actions and release the reservations. Idempotent."""
        if self._state == "closed":
            return
        if self._state != "entered":
            raise RuntimeError(f"scope of plan {self._plan.name!r} was never entered")
        self._state = "closed"
        self._untrack()
        try:
            self.report = _exit_scope(self._manager, self)
        except ResidencyPlanExecutionError as error:
            self.exit_error = error
            raise

    def __exit__(self, exc_type: object, exc: BaseException | None, traceback: object) -> None:
        if self._state == "closed":
            return
        try:
            self.close()
        except BaseException as error:
            if exc is None:
                raise
            exc.add_note(
                f"closing the residency scope of plan {self._plan.name!r} also failed: "
                f"{type(error).__name__}: {error}"
            )

    def _finalize(self) -> None:
        # Abandoned after a successful entry: give the reservations back, never run
        # exit actions (what they would do may no longer be right).
        manager = self._manager
        for token in reversed(self._tokens):
            try:
                manager._release_reservation(token, finalizing=True)
            except Exception:
                continue
        self._tokens = []
        warnings.warn(
            f"the residency scope of plan {self._plan.name!r} was abandoned without "
            "close(); its reservations were released and its exit actions were not run",
            ResourceWarning,
            stacklevel=2,
        )

    def __repr__(self) -> str:
        return f"ResidencyScope(plan={self._plan.name!r}, {self._state})"


def _release_tokens_locked(manager: ResidencyManager, tokens: list[int]) -> None:
    """Releases scope reservations in reverse order while holding the gate."""
    core = manager._core
    while tokens:
        token = tokens.pop()
        manager._labels.pop(token, None)
        core.release_reservation(token)


def _enter_scope(manager: ResidencyManager, scope: ResidencyScope) -> None:
    """Contract 5.5 entry, under one gate hold."""
    plan = scope._plan
    name = plan.name
    started = _time_ns()
    core = manager._core
    core.enter_transition()
    try:
        manager._reap()
        _check_version(manager, scope._expected)
        streams = _streams(manager, scope._streams)
        _preflight(manager, plan._lowered(), plan.reservations)
        transitions: list[ResidencyTransitionReport] = []
        tokens: list[int] = []
        try:
            _run_phase(manager, name, "reclaim", plan.reclaim, streams, transitions, started)
            for position, reservation in enumerate(plan.reservations):
                try:
                    tokens.append(manager._reserve_locked(reservation))
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
            _run_phase(manager, name, "enter", plan.enter, streams, transitions, started)
        except BaseException:
            _release_tokens_locked(manager, tokens)
            raise
        scope._streams = streams
        scope._tokens = tokens
        scope._transitions = transitions
        scope._started = started
    finally:
        core.exit_transition()


def _exit_scope(manager: ResidencyManager, scope: ResidencyScope) -> ResidencyPlanReport:
    """Contract 5.5 `close()`: exit actions (no preflight), then the reservations."""
    plan = scope._plan
    core = manager._core
    try:
        core.enter_transition()
    except BaseException:
        # 10.5: a reservation never outlives its closed scope, even when the manager
        # cannot be entered now (a release during another thread's callback defers).
        for token in reversed(scope._tokens):
            manager._release_reservation(token, finalizing=True)
        scope._tokens = []
        raise
    try:
        transitions = scope._transitions
        try:
            _run_phase(
                manager, plan.name, "exit", plan.exit, scope._streams, transitions, scope._started
            )
        finally:
            _release_tokens_locked(manager, scope._tokens)
        return _new_report(
            plan.name, tuple(transitions), scope._started, max(scope._started, _time_ns())
        )
    finally:
        core.exit_transition()
