"""`ResidencyManager` and `ResidencyScope`: the public face of one manager.

Both are thin: they check argument shapes, build the action records, and hand the
work to the manager's engine (`_engine.Engine`), which owns everything else. The
behaviour they promise is written in docs/concepts/.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from fhelium.errors import ResidencyPlanExecutionError
from fhelium.residency import _plans
from fhelium.residency._engine import Engine
from fhelium.residency._lifetime import FinalizedLifetime, chain_context
from fhelium.residency.lease import ResidencyHold, ResidencyLease, ResidencyReservation
from fhelium.residency.location import PAGEABLE_HOST, ResidencyLocation
from fhelium.residency.model import (
    ReplicaMode,
    ResidencyHandle,
    ResidencySource,
    ResidencyValueSpec,
)
from fhelium.residency.plan import (
    DiscardValue,
    ResidencyAction,
    ResidencyPlan,
)
from fhelium.residency.snapshot import (
    ResidencyPlanExplanation,
    ResidencyPlanReport,
    ResidencySnapshot,
    ResidencyTransitionReport,
)
from fhelium.values.tensor_resident import TensorResident

__all__ = ["ResidencyManager", "ResidencyScope"]

ValueT = TypeVar("ValueT", bound=TensorResident)


def engine_of(manager: ResidencyManager) -> Engine:
    """The engine behind `manager`, for the controller and other internal users."""
    return manager._engine


class ResidencyManager:
    """Owns where managed values live, under strict per-location byte budgets.

    Every value gets an opaque `ResidencyHandle`. The four primitives (`ensure`/`copy`,
    `move`, `drop`, `discard`) change where its materialisations live, with exact
    accounting at every location and optional strict budgets.
    """

    __slots__ = ("__weakref__", "_core", "_engine")

    def __init__(
        self,
        budgets: Mapping[ResidencyLocation, int] | None = None,
        *,
        trace_capacity: int = 4096,
    ) -> None:
        self._engine = Engine(budgets, trace_capacity)
        self._engine.owner = weakref.ref(self)
        # The core runs each primitive end to end (the engine's `transition`); the
        # facade calls it directly on the per-step hot path.
        self._core = self._engine.core

    # ------------------------------------------------------------------ identity

    @property
    def manager_id(self) -> str:
        """The process-unique id carried by every handle this manager issues."""
        return self._engine.manager_id

    @property
    def state_version(self) -> int:
        """The monotonic state version. Reading it reaps completed CUDA leases."""
        return self._engine.state_version

    @property
    def locations(self) -> tuple[ResidencyLocation, ...]:
        """Registered locations: budgeted ones first, then in first-use order."""
        return self._engine.locations

    def __repr__(self) -> str:
        engine = self._engine
        return (
            f"ResidencyManager(manager_id={engine.manager_id!r}, runtime={engine.runtime.name!r})"
        )

    # ------------------------------------------------------------------ registration

    def adopt(
        self,
        value: ValueT,
        *,
        at: ResidencyLocation | None = None,
        replica_mode: ReplicaMode = ReplicaMode.EXCLUSIVE,
    ) -> ResidencyHandle[ValueT]:
        """Take ownership of an existing value as a MUST_PRESERVE managed value."""
        handle: ResidencyHandle[ValueT] = self._core.adopt(value, at, replica_mode)
        return handle

    def register_source(
        self,
        spec: ResidencyValueSpec[ValueT],
        source: ResidencySource[ValueT],
        *,
        source_location: ResidencyLocation = PAGEABLE_HOST,
    ) -> ResidencyHandle[ValueT]:
        """Register a reconstructible value; `source.load()` runs only when needed."""
        handle: ResidencyHandle[ValueT] = self._core.register_source(spec, source, source_location)
        return handle

    # ------------------------------------------------------------------ primitives

    def ensure(
        self, handle: ResidencyHandle[Any], at: ResidencyLocation, *, stream: Any = None
    ) -> ResidencyTransitionReport:
        """Install the value at `at`, keeping existing replicas (no-op if resident)."""
        # One call: the core builds the action record (checking argument classes).
        return self._core.ensure(handle, at, stream)  # type: ignore[no-any-return]

    def copy(
        self, handle: ResidencyHandle[Any], to: ResidencyLocation, *, stream: Any = None
    ) -> ResidencyTransitionReport:
        """Exactly `ensure` under another parameter name."""
        return self.ensure(handle, to, stream=stream)

    def move(
        self,
        handle: ResidencyHandle[Any],
        to: ResidencyLocation,
        *,
        from_location: ResidencyLocation | None = None,
        stream: Any = None,
    ) -> ResidencyTransitionReport:
        """Install at `to`, then remove the selected source materialisation."""
        return self._core.move_to(handle, to, from_location, stream)  # type: ignore[no-any-return]

    def drop(
        self, handle: ResidencyHandle[Any], at: ResidencyLocation
    ) -> ResidencyTransitionReport:
        """Remove one unprotected materialisation, keeping the managed value."""
        return self._core.drop(handle, at)  # type: ignore[no-any-return]

    def discard(self, handle: ResidencyHandle[Any]) -> ResidencyTransitionReport:
        """End the managed value: remove every materialisation and its source."""
        return self._engine.transition(DiscardValue(handle), None)

    # ------------------------------------------------------------------ plans

    def execute_actions(
        self,
        actions: Iterable[ResidencyAction],
        *,
        name: str = "residency-actions",
        transfer_streams: Mapping[ResidencyLocation, Any] | None = None,
        expected_state_version: int | None = None,
    ) -> ResidencyPlanReport:
        """Preflight, then run one ordered action sequence.

        Infeasible sequences raise `ResidencyPlanError` before anything runs. A
        runtime failure raises `ResidencyPlanExecutionError` carrying the committed
        prefix: execution is not transactional.
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
        """Simulate `plan` without executing it; never raises for an infeasible plan,
        and changes nothing."""
        return _plans.explain(self._engine, plan, expected_state_version=expected_state_version)

    def scope(
        self,
        plan: ResidencyPlan,
        *,
        transfer_streams: Mapping[ResidencyLocation, Any] | None = None,
        expected_state_version: int | None = None,
    ) -> ResidencyScope:
        """A single-use scope for `plan`; nothing happens until it is entered."""
        if not isinstance(plan, ResidencyPlan):
            raise TypeError(f"plan must be a ResidencyPlan, got {type(plan).__name__}")
        return ResidencyScope(
            self,
            plan,
            transfer_streams=transfer_streams,
            expected_state_version=expected_state_version,
        )

    # ------------------------------------------------------------------ lifetimes

    def acquire(
        self,
        handles: Iterable[ResidencyHandle[Any]],
        *,
        at: ResidencyLocation,
        consumer_stream: Any = None,
    ) -> ResidencyLease:
        """Borrow already-ready materialisations at `at` atomically; never materialises.

        CUDA locations need the `consumer_stream` that will read the values.
        """
        lease: ResidencyLease = self._core.acquire(self._engine, handles, at, consumer_stream)
        return lease

    def hold(
        self, handles: Iterable[ResidencyHandle[Any]], *, at: ResidencyLocation
    ) -> ResidencyHold:
        """Protect already-ready materialisations at `at` from removal until released."""
        return self._engine.hold(handles, at=at)

    def reserve(
        self, location: ResidencyLocation, nbytes: int, *, label: str
    ) -> ResidencyReservation:
        """Charge `nbytes` of accounting headroom at `location` until released."""
        return self._engine.reserve(location, nbytes, label=label)

    # ------------------------------------------------------------------ observations

    def snapshot(self) -> ResidencySnapshot[Any]:
        """One atomic, tensor-free observation. O(1) to capture; entries build lazily."""
        return self._engine.snapshot()

    def trace(self) -> tuple[ResidencyTransitionReport, ...]:
        """The retained transition reports, oldest first."""
        return self._engine.trace()

    def clear_trace(self) -> None:
        """Empty the trace; residency state and the version are unchanged."""
        self._engine.clear_trace()

    # ------------------------------------------------------------------ close

    def close(self, *, wait: bool = True, force: bool = False) -> None:
        """Close the manager; a closed manager returns silently."""
        self._engine.close(wait=wait, force=force)

    def __enter__(self) -> ResidencyManager:
        self._engine.core.check_open()
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, traceback: object) -> None:
        try:
            self._engine.close()
        except BaseException as error:
            # Errors raised from the core carry no implicit context; chain the body's.
            chain_context(error, exc)
            raise


class ResidencyScope(FinalizedLifetime):
    """A single-use context for one plan: reclaim, reserve and enter on entry; exit
    actions and reservation release on exit. Nestable; never suppresses the body's
    exception."""

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
        manager: ResidencyManager,
        plan: ResidencyPlan,
        *,
        transfer_streams: Mapping[ResidencyLocation, Any] | None = None,
        expected_state_version: int | None = None,
    ) -> None:
        if not isinstance(manager, ResidencyManager):
            raise TypeError(f"manager must be a ResidencyManager, got {type(manager).__name__}")
        if not isinstance(plan, ResidencyPlan):
            raise TypeError(f"plan must be a ResidencyPlan, got {type(plan).__name__}")
        if transfer_streams is not None and not isinstance(transfer_streams, Mapping):
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
            self._run = _plans.enter_scope(
                self._manager._engine, self._plan, self._expected, self._streams
            )
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
        if self._state != "entered" or self._run is None:
            raise RuntimeError(f"scope of plan {self._plan.name!r} was never entered")
        self._state = "closed"
        self._untrack()
        try:
            self.report = _plans.exit_scope(self._manager._engine, self._run)
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
        if self._run is not None:
            _plans.abandon_scope(self._manager._engine, self._run)
        warnings.warn(
            f"the residency scope of plan {self._plan.name!r} was abandoned without "
            "close(); its reservations were released and its exit actions were not run",
            ResourceWarning,
            stacklevel=2,
        )

    def __repr__(self) -> str:
        return f"ResidencyScope(plan={self._plan.name!r}, {self._state})"
