"""Plans on a manager: `ResidencyManager.execute_actions`, `explain` and `scope`, and
`ResidencyScope`, the single-use context a scope is.

`ResidencyManager` takes its plan methods from `ManagerPlans`, the base that also
holds its engine; `fhelium.residency.manager` re-exports `ResidencyScope`, which reads
as defined there. The rules are in docs/concepts/plans.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fhelium.errors import ResidencyPlanExecutionError
from fhelium.residency import _plans
from fhelium.residency._engine import Engine
from fhelium.residency._lifetime import FinalizedLifetime
from fhelium.residency._validation import require_instance, wrong_type
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.plan import ResidencyAction, ResidencyPlan
from fhelium.residency.snapshot import ResidencyPlanExplanation, ResidencyPlanReport

__all__ = [
    "ManagerPlans",
    "ResidencyScope",
    "close_deferred",
    "engine_of",
    "enter_with",
    "new_scope",
]


def engine_of(manager: ManagerPlans) -> Engine:
    """The engine behind `manager`, for the controller and other internal users."""
    return manager._engine


class ManagerPlans:
    """The plan methods of `ResidencyManager`, which is the only class built on it, and
    the engine they run on."""

    __slots__ = ()

    _engine: Engine

    def execute_actions(
        self,
        actions: Iterable[ResidencyAction],
        *,
        name: str = "residency-actions",
        transfer_streams: Mapping[ResidencyLocation, Any] | None = None,
        expected_state_version: int | None = None,
    ) -> ResidencyPlanReport:
        """Preflight, then run one ordered action list.

        The whole list is simulated first (see docs/concepts/plans.md#preflight): an infeasible
        list raises `ResidencyPlanError` before anything runs. Then the actions run in order, each
        CUDA destination on its transfer stream. A runtime failure raises
        `ResidencyPlanExecutionError` with ``phase="execute"`` carrying the committed prefix:
        execution is not transactional. An empty list is valid. See
        docs/concepts/plans.md#execute-actions.

        Args:
            actions: `EnsureResident`, `MoveResident`, `DropResident` and `DiscardValue` records,
                in order; any iterable.
            name: The report's plan name; a non-empty string.
            transfer_streams: CUDA streams by destination location; other destinations use the
                device's current stream. Host keys are refused.
            expected_state_version: Refuse to run unless `state_version` (after reaping) equals
                it; an index int or ``None``.

        Returns:
            The plan report, with one transition per action, no-ops included.

        Raises:
            TypeError: ``name`` is not a string; an element of ``actions`` is not an action;
                ``transfer_streams`` is not a mapping, or has a non-location key or a non-stream
                value; ``expected_state_version`` is not an integer.
            ValueError: A blank ``name``; a negative ``expected_state_version``; an unusable CUDA
                key; a stream for a host key or on another device.
            ResidencyStaleStateError: ``expected_state_version`` differs from the current
                version.
            ResidencyPlanError: The preflight finds the list infeasible; nothing ran.
            ResidencyPlanExecutionError: An action failed at run time; earlier transitions stay
                committed and are in ``partial_report``.
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of this manager is running, or this
                thread is inside a transition.

        Example:
            ```python
            import torch
            from fhelium.residency import (
                PAGEABLE_HOST, PINNED_HOST, DropResident, EnsureResident, ReplicaMode,
                ResidencyManager,
            )
            from fhelium.residency.simulation import SimulatedRuntime, use_runtime
            from fhelium.values import ResidentTensor

            with use_runtime(SimulatedRuntime(device_count=0)), ResidencyManager() as manager:
                value = ResidentTensor(torch.ones(4))
                handle = manager.adopt(value, replica_mode=ReplicaMode.REPLICABLE)
                report = manager.execute_actions(
                    [EnsureResident(handle, PINNED_HOST), DropResident(handle, PAGEABLE_HOST)],
                    name="to-pinned",
                    expected_state_version=manager.state_version,
                )
                assert [t.no_op for t in report.transitions] == [False, False]
            ```
        """
        return _plans.execute_actions(
            self._engine,
            actions,
            name=name,
            transfer_streams=transfer_streams,
            expected_state_version=expected_state_version,
        )

    def explain(
        self, plan: ResidencyPlan, *, expected_state_version: int | None = None
    ) -> ResidencyPlanExplanation:
        """Simulate a plan without running it: a dry run that never raises for infeasibility.

        It simulates ``reclaim + enter + exit``, admitting the reservations after the reclaim
        actions, over a copy of the manager's numbers; bad handles, unusable locations, budgets
        and protections all become ``feasible=False`` with a reason. It changes nothing, calls no
        source and does not reap. An explanation is evidence at one point in time: pass its
        `state_version` as ``expected_state_version`` to a later run. See
        docs/concepts/plans.md#explain.

        Args:
            plan: The plan to simulate.
            expected_state_version: Refuse to explain unless `state_version` equals it; an index
                int or ``None``.

        Returns:
            The explanation: feasibility, the first failure's reason, per-action records up to
            it, and the predicted peak per location.

        Raises:
            TypeError: ``plan`` is not a `ResidencyPlan`; ``expected_state_version`` is not an
                integer.
            ValueError: A negative ``expected_state_version``.
            ResidencyStaleStateError: ``expected_state_version`` differs from the current
                version.
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of this manager is running, or this
                thread is inside a transition.

        Example:
            ```python
            import torch
            from fhelium.residency import (
                PAGEABLE_HOST, EnsureResident, MemoryReservation, ResidencyManager, ResidencyPlan,
            )
            from fhelium.values import ResidentTensor

            with ResidencyManager({PAGEABLE_HOST: 8192}) as manager:
                handle = manager.adopt(ResidentTensor(torch.ones(1024)))  # 4096 bytes
                plan = ResidencyPlan(
                    "stage",
                    enter=[EnsureResident(handle, PAGEABLE_HOST)],
                    reservations=[MemoryReservation(PAGEABLE_HOST, 8192, "workspace")],
                )
                explanation = manager.explain(plan)
                assert not explanation.feasible
                assert "exceeds budget" in explanation.reason
            ```
        """
        return _plans.explain(self._engine, plan, expected_state_version=expected_state_version)

    def scope(
        self,
        plan: ResidencyPlan,
        *,
        transfer_streams: Mapping[ResidencyLocation, Any] | None = None,
        expected_state_version: int | None = None,
    ) -> ResidencyScope:
        """Build a single-use scope for a plan; nothing happens until it is entered.

        Entering it (``with manager.scope(plan) as scope:``) checks the version, validates the
        streams, preflights the whole plan, runs the reclaim actions, admits the reservations and
        runs the enter actions; leaving it runs the exit actions (without a new preflight) and
        releases the reservations in every case. Construction touches no manager state. See
        docs/concepts/plans.md#scopes.

        Args:
            plan: The plan to run.
            transfer_streams: CUDA streams by destination location, copied now and validated at
                entry.
            expected_state_version: Refuse to enter unless `state_version` equals it; an index
                int or ``None``, checked now.

        Returns:
            The scope, not yet entered.

        Raises:
            TypeError: ``plan`` is not a `ResidencyPlan`, ``transfer_streams`` is not a mapping,
                or ``expected_state_version`` is not an integer.
            ValueError: A negative ``expected_state_version``.

        Example:
            ```python
            import torch
            from fhelium.residency import (
                PAGEABLE_HOST, PINNED_HOST, DropResident, EnsureResident, MemoryReservation,
                ReplicaMode, ResidencyManager, ResidencyPlan,
            )
            from fhelium.residency.simulation import SimulatedRuntime, use_runtime
            from fhelium.values import ResidentTensor

            with use_runtime(SimulatedRuntime(device_count=0)), ResidencyManager() as manager:
                value = ResidentTensor(torch.ones(4))
                handle = manager.adopt(value, replica_mode=ReplicaMode.REPLICABLE)
                plan = ResidencyPlan(
                    "stage",
                    enter=[EnsureResident(handle, PINNED_HOST)],
                    exit=[DropResident(handle, PINNED_HOST)],
                    reservations=[MemoryReservation(PAGEABLE_HOST, 1 << 10, "workspace")],
                )
                with manager.scope(plan) as scope:
                    books = {entry.location: entry for entry in manager.snapshot().locations}
                    assert books[PAGEABLE_HOST].reserved_bytes == 1 << 10
                assert len(scope.report.transitions) == 2
            ```
        """
        require_instance(plan, ResidencyPlan, "plan")
        return ResidencyScope(
            self,
            plan,
            transfer_streams=transfer_streams,
            expected_state_version=expected_state_version,
        )


class ResidencyScope(FinalizedLifetime):
    """A single-use context for one plan, built by `ResidencyManager.scope`.

    Entry checks the version, validates the streams and preflights the whole plan (errors
    raised unwrapped), then runs the reclaim actions, admits the reservations and runs the
    enter actions; a failure there raises `ResidencyPlanExecutionError` with the committed
    prefix and closes the scope. Exit (`close`, or leaving the ``with`` block) runs the exit
    actions without a new preflight and releases the reservations in reverse order in every
    case. Scopes nest and never suppress the body's exception; a scope abandoned after entry
    releases its reservations and warns (`ResourceWarning`), never running exit actions. See
    docs/concepts/plans.md#scopes.

    Args:
        manager: The manager to run the plan on.
        plan: The plan.
        transfer_streams: CUDA streams by destination location; copied, validated at entry.
        expected_state_version: Refuse to enter unless the manager's version equals it.

    Attributes:
        report: The `ResidencyPlanReport` of a successful exit (entry transitions, then exit
            transitions), otherwise ``None``.
        exit_error: The `ResidencyPlanExecutionError` of a failed exit, otherwise ``None``.

    Raises:
        TypeError: ``manager`` is not a `ResidencyManager`, ``plan`` not a `ResidencyPlan`,
            ``transfer_streams`` not a mapping, or ``expected_state_version`` not an integer.
        ValueError: A negative ``expected_state_version``.
    """

    __slots__ = (
        "_expected",
        "_manager",
        "_plan",
        "_run",
        "_state",
        "_streams",
        "exit_error",
        "report",
    )

    def __init__(
        self,
        manager: ManagerPlans,
        plan: ResidencyPlan,
        *,
        transfer_streams: Mapping[ResidencyLocation, Any] | None = None,
        expected_state_version: int | None = None,
    ) -> None:
        if not isinstance(manager, ManagerPlans):
            raise wrong_type("manager", "a ResidencyManager", manager)
        require_instance(plan, ResidencyPlan, "plan")
        if (
            transfer_streams is not None
            and type(transfer_streams) is not dict
            and not isinstance(transfer_streams, Mapping)
        ):
            raise TypeError(
                f"transfer_streams must be a Mapping, got {type(transfer_streams).__name__}"
            )
        self._expected = _plans.optional_version(expected_state_version)
        self._manager = manager
        self._plan = plan
        # A private copy: later changes to the caller's mapping do not reach the scope.
        self._streams: dict[Any, Any] = dict(transfer_streams or {})
        self._state = "new"
        self._active = False
        self._entered = False
        self._run: _plans.ScopeRun | None = None
        self.report: ResidencyPlanReport | None = None
        self.exit_error: ResidencyPlanExecutionError | None = None

    @property
    def manager(self) -> ManagerPlans:
        """The manager the scope runs on."""
        return self._manager

    @property
    def plan(self) -> ResidencyPlan:
        """The plan the scope runs."""
        return self._plan

    @property
    def expected_state_version(self) -> int | None:
        """The version entry requires, or ``None`` for no check."""
        return self._expected

    def __enter__(self) -> ResidencyScope:
        return self._enter(None)

    def _enter(self, then: Callable[[], object] | None) -> ResidencyScope:
        """Entry; ``then`` runs under the same hold of the manager right after it (a
        use borrows there, docs/concepts/controller.md#use), and when it raises the
        scope is closed with its reservations released."""
        if self._state != "new":
            raise RuntimeError(f"scope of plan {self._plan.name!r} can be entered only once")
        self._state = "entering"
        try:
            self._run = _plans.enter_scope(
                engine_of(self._manager), self._plan, self._expected, self._streams, then
            )
        except BaseException:
            self._state = "closed"
            raise
        self._state = "entered"
        self._track()
        return self

    def close(self) -> None:
        """Run the exit actions and release the reservations; idempotent.

        The exit actions run against whatever exists now, without a new preflight. The
        reservations are released in reverse order in every case, also when entering the
        manager fails. On success `report` holds the whole scope's transitions. See
        docs/concepts/plans.md#scope-exit.

        Raises:
            RuntimeError: The scope was never entered.
            ResidencyPlanExecutionError: An exit action failed; also stored in `exit_error`.
            ResidencyClosedError: The manager is closed (the reservations are still released).
            ResidencyReentrancyError: A source callback of this manager is running, or this
                thread is inside a transition.
        """
        if self._state == "closed":
            return
        if self._state != "entered" or self._run is None:
            raise RuntimeError(f"scope of plan {self._plan.name!r} was never entered")
        self._state = "closed"
        self._untrack()
        try:
            self.report = _plans.exit_scope(engine_of(self._manager), self._run)
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

    def _close_deferred(self) -> None:
        """Gives the reservations back as a finalizer does, without its warning and
        without running exit actions: queued while this thread cannot enter the manager
        (a use's scope has none; docs/concepts/controller.md#ending-a-pipeline)."""
        if self._state != "entered" or self._run is None:
            return
        self._state = "closed"
        self._untrack()
        _plans.abandon_scope(engine_of(self._manager), self._run)

    def _finalize(self) -> None:
        # Abandoned after a successful entry: give the reservations back, never run
        # exit actions (what they would do may no longer be right).
        if self._run is not None:
            _plans.abandon_scope(engine_of(self._manager), self._run)
        warnings.warn(
            f"the residency scope of plan {self._plan.name!r} was abandoned without "
            "close(); its reservations were released and its exit actions were not run",
            ResourceWarning,
            stacklevel=2,
        )

    def __repr__(self) -> str:
        return f"ResidencyScope(plan={self._plan.name!r}, {self._state})"


# Reads as the manager's, which re-exports it (repr, messages, documentation).
ResidencyScope.__module__ = "fhelium.residency.manager"


def new_scope(
    manager: ManagerPlans,
    plan: ResidencyPlan,
    expected_state_version: int,
    transfer_streams: dict[Any, Any],
) -> ResidencyScope:
    """A scope for a use's own fresh decision: ``plan`` is a `ResidencyPlan`, the
    version an index and the streams a normalized dict, so nothing is checked again
    (the constructor's fields, set directly)."""
    scope = object.__new__(ResidencyScope)
    scope._expected = expected_state_version
    scope._manager = manager
    scope._plan = plan
    # A private copy, as the constructor keeps.
    scope._streams = dict(transfer_streams)
    scope._state = "new"
    scope._active = False
    scope._entered = False
    scope._run = None
    scope.report = None
    scope.exit_error = None
    return scope


def enter_with(scope: ResidencyScope, then: Callable[[], object] | None) -> ResidencyScope:
    """Enters ``scope``, then runs ``then`` under the same hold of the manager (a use
    borrows there, docs/concepts/controller.md#use)."""
    return scope._enter(then)


def close_deferred(scope: ResidencyScope) -> None:
    """Ends an entered scope as a finalizer does, without its warning: its reservations
    are given back (queued while this thread cannot enter the manager), its exit actions
    never run (docs/concepts/controller.md#ending-a-pipeline)."""
    scope._close_deferred()
