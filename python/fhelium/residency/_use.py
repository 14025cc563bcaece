"""`ResidencyUse`: decide, enter the decision's scope and borrow, as one context.

It lives below the controller so that the pipeline, which the controller builds, can
make its steps without importing the controller; `fhelium.residency.controller`
re-exports it, and it reads as defined there. See docs/concepts/controller.md#use.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol

from fhelium.errors import ResidencyStaleStateError
from fhelium.residency._decided import satisfied
from fhelium.residency._decider import ControllerBase, Decider, decider_of
from fhelium.residency._decisions import ResidencyDecision
from fhelium.residency._engine import Engine
from fhelium.residency._records import trusted_builder
from fhelium.residency._scope import (
    ResidencyScope,
    close_deferred,
    engine_of,
    enter_with,
    new_scope,
)
from fhelium.residency._validation import require_instance
from fhelium.residency.lease import (
    BorrowedValues,
    ResidencyLease,
    borrowed_value,
    check_borrowed,
    enter_new,
    protecting_tokens,
    release_deferred,
)
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.model import ResidencyHandle
from fhelium.residency.policy import DeterministicTieredLRU
from fhelium.residency.request import ResidencyRequest, ResidencyRequirement
from fhelium.residency.schedule import ScheduleAwarePolicy, deciding_at
from fhelium.residency.snapshot import ResidencyPlanReport
from fhelium.values.tensor_resident import TensorResident

if TYPE_CHECKING:
    from fhelium import _core

__all__ = [
    "STALE_RETRIES",
    "Borrows",
    "Controller",
    "ResidencyUse",
    "enter_staged",
    "exit_deferred",
    "normalize_streams",
    "step_tokens",
    "use_for_step",
]

# A decision goes stale when another thread changes the manager, or a pending lease
# completes and is reaped, between `decide` and scope entry; a use decides again this
# many times at most before `ResidencyStaleStateError` propagates
# (docs/concepts/controller.md#use).
STALE_RETRIES: Final = 64

_new_report = trusted_builder(ResidencyPlanReport)
_time_ns = time.time_ns


class Controller(Protocol):
    """What a use and a pipeline ask of the controller they serve: its `Decider` (see
    `_decider`), or a wrapper that checks its decisions."""

    @property
    def manager(self) -> ResidencyManager: ...
    @property
    def policy(self) -> Any: ...
    @property
    def engine(self) -> Engine: ...
    @property
    def shapes(self) -> dict[int, Any]:
        """What a pipeline derives from each request, by request object."""
        ...

    def decide(self, request: ResidencyRequest, position: int | None = None) -> ResidencyDecision:
        """A decision for ``request``, for the step at schedule ``position`` when given
        (a prefetch), else for the step about to run."""
        ...

    def record_access(self, request: ResidencyRequest) -> None:
        """Records that ``request``'s values were used (access epochs, schedule)."""
        ...


def normalize_streams(manager: ResidencyManager, streams: object, name: str) -> dict[Any, Any]:
    """Stream-mapping normalisation for `use` (docs/concepts/controller.md#use); CUDA
    availability is not checked here."""
    if streams is None:
        return {}
    if not isinstance(streams, Mapping):
        raise TypeError(f"{name} must be a Mapping, got {type(streams).__name__}")
    runtime = engine_of(manager).runtime
    normalized: dict[Any, Any] = {}
    for location, stream in streams.items():
        if not isinstance(location, ResidencyLocation):
            raise TypeError(f"{name} keys must be ResidencyLocation, got {type(location).__name__}")
        if not runtime.is_stream(stream):
            raise TypeError(f"{name} values must be CUDA streams, got {type(stream).__name__}")
        if location.kind != "cuda":
            raise ValueError(f"{name} key {location} is not a CUDA location")
        if runtime.stream_device(stream) != location.device:
            raise ValueError(f"{name} stream for {location} is on another device")
        # Kept as bound to the location's device: a default-stream handle would
        # otherwise name whichever device is current when the use runs
        # (docs/concepts/simulation.md#current-device-and-default-streams).
        normalized[location] = runtime.bind_stream(stream, location.device)
    return normalized


class Borrows:
    """A request's requirements grouped by location in order of first appearance, as a
    use borrows them: per location, its handles (in requirement order) and its
    requirements. Made once per request (a request is immutable)."""

    __slots__ = ("groups", "positions")

    def __init__(self, request: ResidencyRequest) -> None:
        by_location: dict[ResidencyLocation, list[ResidencyRequirement]] = {}
        for requirement in request.requirements:
            by_location.setdefault(requirement.location, []).append(requirement)
        self.groups = tuple(
            [
                (location, tuple([requirement.handle for requirement in group]), group)
                for location, group in by_location.items()
            ]
        )
        # Each requirement's group by the identities of its handle and location (the
        # request keeps both alive): `ResidencyUse.value` finds the pair without
        # hashing the records.
        self.positions = {
            (id(requirement.handle), id(location)): position
            for position, (location, _, requirements) in enumerate(self.groups)
            for requirement in requirements
        }


class _UseValues(Mapping[ResidencyRequirement, TensorResident]):
    """Borrowed values by requirement; valid while the use's leases are active. Each
    group's lease is a `ResidencyLease` (its `BorrowedValues` in ``values``) or, for a
    staged step, one of the leases of its `_core.StepEntry` (``entry``, at the group's
    position). The maps by requirement and by (handle, location) pair are built when
    first read."""

    __slots__ = ("_borrows", "_entry", "_pairs", "_positions", "_values")

    def __init__(
        self,
        borrows: Borrows,
        values: list[BorrowedValues] | None,
        entry: _core.StepEntry | None = None,
    ) -> None:
        self._borrows = borrows
        # Each group's borrowed values, in the order of ``borrows.groups``.
        self._values = values
        self._entry = entry
        self._positions: dict[ResidencyRequirement, int] | None = None
        self._pairs: dict[tuple[Any, Any], int] | None = None

    def _by_requirement(self) -> dict[ResidencyRequirement, int]:
        positions = self._positions
        if positions is None:
            positions = {}
            for position, (_, _, requirements) in enumerate(self._borrows.groups):
                for requirement in requirements:
                    positions[requirement] = position
            self._positions = positions
        return positions

    def find(self, handle: object, at: object) -> int | None:
        """The group of the pair ``(handle, at)`` by equality, or None (also for an
        unhashable one). `ResidencyUse.value` looks up the request's own objects by
        identity first (`Borrows.positions`)."""
        pairs = self._pairs
        if pairs is None:
            pairs = self._pairs = {
                (requirement.handle, requirement.location): position
                for requirement, position in self._by_requirement().items()
            }
        try:
            return pairs.get((handle, at))
        except TypeError:
            return None  # unhashable: the requirement the caller builds says why

    def at_group(self, position: int, handle: ResidencyHandle[Any]) -> TensorResident:
        """The value of ``handle``, one of group ``position``'s handles."""
        entry = self._entry
        if entry is not None:
            value: TensorResident = entry.value(position, handle)
            return value
        return borrowed_value(self._values[position], handle)  # type: ignore[index]

    def _check(self, position: int) -> None:
        entry = self._entry
        if entry is not None:
            entry.check(position)
        else:
            check_borrowed(self._values[position])  # type: ignore[index]

    def __getitem__(self, requirement: ResidencyRequirement) -> TensorResident:
        return self.at_group(self._by_requirement()[requirement], requirement.handle)

    def __iter__(self) -> Iterator[ResidencyRequirement]:
        for requirement, position in self._by_requirement().items():
            self._check(position)
            yield requirement

    def __len__(self) -> int:
        positions = self._by_requirement()
        for position in positions.values():
            self._check(position)
        return len(positions)


class ResidencyUse:
    """Decide, enter the plan's scope and borrow, as one context: made by `ResidencyController.use`.

    Single use. Entry decides, enters the scope and acquires each location's values under
    one hold of the manager (deciding again when another thread made the decision stale),
    and records access epochs, unwinding everything on failure; exit releases the leases
    and closes the scope, and never suppresses exceptions. Constructed by the controller.
    See docs/concepts/controller.md#use.

    Attributes:
        request: The request it uses.

    Raises:
        RuntimeError: Entering it a second time.
        ResidencyStaleStateError: At entry, the decision went stale again after 64 new
            decisions.
    """

    __slots__ = (
        "_consumer_streams",
        "_controller",
        "_decision",
        "_entry",
        "_exited",
        "_exits",
        "_grouped",
        "_leases",
        "_scope",
        "_state",
        "_step_tokens",
        "_transfer_streams",
        "_values",
        "request",
    )

    def __init__(
        self,
        *,
        controller: Controller | ControllerBase,
        request: ResidencyRequest,
        consumer_streams: Mapping[ResidencyLocation, Any] | None,
        transfer_streams: Mapping[ResidencyLocation, Any] | None,
    ) -> None:
        require_instance(request, ResidencyRequest, "request")
        served: Controller = decider_of(controller)
        manager = served.manager
        consumers = normalize_streams(manager, consumer_streams, "consumer_streams")
        needed = {
            requirement.location
            for requirement in request.requirements
            if requirement.location.kind == "cuda"
        }
        if set(consumers) != needed:
            missing = sorted(str(location) for location in needed - set(consumers))
            unexpected = sorted(str(location) for location in set(consumers) - needed)
            raise ValueError(
                "consumer_streams must name exactly the request's CUDA locations; "
                f"missing {missing}, unexpected {unexpected}"
            )
        self._init(
            served,
            request,
            consumers,
            normalize_streams(manager, transfer_streams, "transfer_streams"),
            None,
        )

    def _init(
        self,
        controller: Controller,
        request: ResidencyRequest,
        consumers: dict[ResidencyLocation, Any],
        transfers: dict[ResidencyLocation, Any],
        borrows: Borrows | None,
    ) -> None:
        """Every field, once the arguments are checked and the streams normalized."""
        self._controller = controller
        self.request = request
        self._consumer_streams = consumers
        self._transfer_streams = transfers
        # The decision, or what a staged step's entry read to build it when first read
        # (`enter_staged`).
        self._decision: ResidencyDecision | _Satisfied | None = None
        # The decision's scope; for a staged step's entry (`enter_staged`), which runs
        # no plan, what stands in for it.
        self._scope: ResidencyScope | _Unscoped | None = None
        self._exits: list[Callable[[Any, Any, Any], object]] | None = None
        # The requirements by location (made at entry, or given by the pipeline).
        self._grouped = borrows
        self._values: _UseValues | None = None
        self._leases: list[ResidencyLease] = []
        # A staged step's leases, in place of ``_leases`` (`enter_staged`).
        self._entry: _core.StepEntry | None = None
        # What its CUDA leases leave protected, when its entry read it (`step_tokens`).
        self._step_tokens: list[int] | None = None
        self._exited = False
        self._state = "new"

    @property
    def decision(self) -> ResidencyDecision:
        """The decision taken at entry; kept after exit.

        Raises:
            RuntimeError: Before a decision succeeded.
        """
        decision = self._decision
        if decision is None:
            raise RuntimeError("no decision yet: enter the use first")
        if type(decision) is _Satisfied:
            decision = self._decision = decision.build()
        return decision  # type: ignore[return-value]

    @property
    def values(self) -> Mapping[ResidencyRequirement, TensorResident]:
        """The borrowed values, by `ResidencyRequirement`, while the use is active.

        Raises:
            RuntimeError: Outside the active context.
        """
        values = self._values
        if values is None and self._state == "active" and self._entry is not None:
            # A staged step's, made when first read.
            values = self._values = _UseValues(self._grouped, None, self._entry)  # type: ignore[arg-type]
        if self._state != "active" or values is None:
            raise RuntimeError("values are available only inside the active use")
        return values

    def value(self, handle: ResidencyHandle[Any], *, at: ResidencyLocation) -> TensorResident:
        """Return the borrowed value of ``handle`` at ``at``.

        The same as ``values[ResidencyRequirement(handle, at)]``.

        Args:
            handle: A required handle.
            at: The location it is required at.

        Returns:
            The managed object itself (not a copy), valid while the use is active.

        Raises:
            RuntimeError: Outside the active context.
            KeyError: The pair is not among the request's requirements.
            TypeError: ``handle`` is not a handle or ``at`` not a location.
            ResidencyLifetimeClosedError: The lease was released.
        """
        entry = self._entry
        if entry is not None and self._state == "active":
            # A staged step's: the request's own objects, by identity, natively.
            value: TensorResident | None = entry.lookup(handle, at)
            if value is not None:
                return value
            return self.values[ResidencyRequirement(handle, at)]
        values = self._values
        if values is not None and self._state == "active":
            # The request's own objects (alive as long as it is): this very pair.
            position = values._borrows.positions.get((id(handle), id(at)))
            if position is None:
                position = values.find(handle, at)
            if position is not None:
                # A handle and a location equal only their own kind: the pair is a
                # requirement's, so the handle is one the lease borrows.
                return values.at_group(position, handle)
        return self.values[ResidencyRequirement(handle, at)]

    @property
    def report(self) -> ResidencyPlanReport | None:
        """The scope's report after a successful entry and exit, otherwise ``None``."""
        if self._scope is None or not self._exited:
            return None
        return self._scope.report

    @property
    def exit_error(self) -> BaseException | None:
        """The scope's exit error (a `ResidencyPlanExecutionError`), otherwise ``None``."""
        return None if self._scope is None else self._scope.exit_error

    def __enter__(self) -> ResidencyUse:
        self._begin()
        controller = self._controller
        manager = controller.manager
        request = self.request
        # What closing the use runs, in reverse: the scope's exit, then each lease's.
        exits: list[Callable[[Any, Any, Any], object]] = []
        borrows = self._grouped
        if borrows is None:
            borrows = self._grouped = Borrows(request)
        borrowed: list[BorrowedValues] = []

        def borrow() -> None:
            self._borrow(manager, borrows, exits, borrowed)

        try:
            stale = 0
            while True:
                decision = self._decision = controller.decide(request)
                # The controller's own fresh decision: its manager and policy are this
                # controller's, so the scope is the manager's directly, its plan a
                # plan and its version an index.
                scope = new_scope(
                    manager,
                    decision.plan,
                    decision.expected_state_version,
                    self._transfer_streams,
                )
                # Closing a scope whose entry failed does nothing.
                exits.append(scope.__exit__)
                try:
                    # Entered and borrowed under one hold of the manager: no other
                    # thread can take what the entry made resident before it is leased.
                    enter_with(scope, borrow)
                except ResidencyStaleStateError:
                    # Another thread changed the manager since the decision: decide again.
                    exits.clear()  # only the refused scope's exit, which does nothing
                    stale += 1
                    if stale > STALE_RETRIES:
                        raise
                    continue
                break
            self._scope = scope
            controller.record_access(request)
        except BaseException:
            self._state = "closed"
            _unwind(exits, None, None, None)
            raise
        self._exits = exits
        self._values = _UseValues(borrows, borrowed)
        self._state = "active"
        return self

    def _begin(self) -> None:
        """Entry starts: once only."""
        if self._state != "new":
            raise RuntimeError("a ResidencyUse can be entered only once")
        self._state = "entering"

    def _borrow(
        self,
        manager: ResidencyManager,
        borrows: Borrows,
        exits: list[Callable[[Any, Any, Any], object]],
        borrowed: list[BorrowedValues],
    ) -> None:
        """Acquires and enters each location's lease, its exit onto ``exits`` and its
        values onto ``borrowed``, under the scope entry's hold of the manager; unwinding
        ``exits`` releases them."""
        consumers = self._consumer_streams
        acquire = manager.acquire
        leases = self._leases
        for location, handles, _ in borrows.groups:
            lease: ResidencyLease = acquire(
                handles,
                at=location,
                consumer_stream=consumers.get(location) if consumers else None,
            )
            # Just admitted, under the gate: active and never entered.
            values = enter_new(lease)
            exits.append(lease.__exit__)
            leases.append(lease)
            borrowed.append(values)

    def __exit__(self, exc_type: Any, exc: BaseException | None, traceback: Any) -> bool:
        if self._state != "active" or self._exits is None:
            return False
        self._state = "closed"
        exits, self._exits = self._exits, None
        entry = self._entry
        if entry is not None:
            scope: _Unscoped = self._scope  # type: ignore[assignment]
            if exc_type is None:
                # A staged step ended by its pipeline: `_unwind` of its two exits, the
                # leases' then the stand-in scope's (which never raises).
                frame_exc = sys.exc_info()[1]
                try:
                    entry.release()
                except BaseException as error:
                    _fix_context(error, None, frame_exc)
                    raise
                finally:
                    self._values = None
                    # `scope.close(None, None, None)`, inline.
                    if scope._completed is None:
                        scope._completed = max(scope._started, _time_ns())
                self._exited = True
                return False
            exits = [scope.close, entry.exit]
        try:
            suppressed = _unwind(exits, exc_type, exc, traceback)
        finally:
            self._values = None
        self._exited = True
        return suppressed


def use_for_step(
    controller: Controller,
    request: ResidencyRequest,
    consumers: dict[ResidencyLocation, Any],
    transfers: dict[ResidencyLocation, Any],
    cuda: tuple[ResidencyLocation, ...],
    by_location: Borrows,
) -> ResidencyUse:
    """A use for a pipeline's step: ``request`` is a `ResidencyRequest`, the stream maps
    are normalized, ``cuda`` is its CUDA locations and ``by_location`` its requirements
    by location (the pipeline derives both once per request). Consumer streams that are
    not exactly the request's CUDA locations are refused as the constructor refuses
    them."""
    if len(consumers) != len(cuda):
        return ResidencyUse(
            controller=controller,
            request=request,
            consumer_streams=consumers,
            transfer_streams=transfers,
        )
    use = object.__new__(ResidencyUse)
    use._init(controller, request, consumers, transfers, by_location)
    return use


def step_tokens(use: ResidencyUse) -> list[int]:
    """What an entered use's CUDA leases leave protected once it ends: each lease's own
    token and those of the copies still in flight into its values (its consumers
    waited for them, so waiting for the step waits for them): as a staged step's entry
    read them, else read now."""
    tokens = use._step_tokens
    return protecting_tokens(use._leases) if tokens is None else tokens


def exit_deferred(use: ResidencyUse) -> None:
    """Ends an active use as finalizers do, without their warnings: its leases and its
    scope's reservations are released, or queued while this thread cannot enter the
    manager (docs/concepts/controller.md#ending-a-pipeline)."""
    if use._state != "active" or use._exits is None:
        return
    use._state = "closed"
    use._exits = None
    use._values = None
    entry = use._entry
    if entry is not None:
        entry.release_deferred()
    for lease in use._leases:
        release_deferred(lease)
    if isinstance(use._scope, ResidencyScope):
        close_deferred(use._scope)
    use._exited = True


class _Unscoped:
    """What a staged step's use keeps in place of a scope (`enter_staged`): its entry
    ran no plan and admitted no reservation, so closing it only notes when the step
    ended. `report` is then the report of its empty plan's scope, as a scope entered and
    closed at those times gives it (no transition); closed as finalizers close, it has
    none, as such a scope has none."""

    __slots__ = ("_completed", "_name", "_report", "_started", "exit_error")

    def __init__(self, name: str, started: int) -> None:
        self._name = name
        self._started = started
        self._completed: int | None = None
        self._report: ResidencyPlanReport | None = None
        # An empty plan has no exit action to fail.
        self.exit_error: None = None

    def close(self, exc_type: Any, exc: BaseException | None, traceback: Any) -> None:
        if self._completed is None:
            self._completed = max(self._started, _time_ns())

    @property
    def report(self) -> ResidencyPlanReport | None:
        report = self._report
        if report is None and self._completed is not None:
            report = self._report = _new_report(self._name, (), self._started, self._completed)
        return report


def enter_staged(
    controller: Controller,
    request: ResidencyRequest,
    streams: tuple[dict[ResidencyLocation, Any], dict[ResidencyLocation, Any]],
    shape: Any,
    holds: list[int],
) -> ResidencyUse:
    """Enters a pipeline's step whose staging made its values resident and holds them
    until now (``holds``, the list of its hold tokens), for a request without reservations
    and the plain decider (``shape`` is its request's `_staging.Shape`: its empty plan,
    its `(location, handles)` groups, its CUDA locations and its requirements by
    location; ``streams`` its consumer and transfer streams): the use
    `ResidencyUse.__enter__` would enter, with no search and no plan. The state is read,
    the leases are taken and then the holds released under one hold of the manager
    (`Engine.enter_step`), so the decision is the one `decide` takes there
    (`_decided.satisfied`: nothing to evict, nothing to run, never stale); then access
    epochs are recorded. The holds are taken out of ``holds`` once the manager has
    them. On failure everything taken is released and the error propagates, as from
    `__enter__` (docs/concepts/controller.md#steps).
    """
    consumers, transfers = streams
    if len(consumers) != len(shape.cuda):
        # Refused as the constructor refuses it.
        use_for_step(controller, request, consumers, transfers, shape.cuda, shape.grouped)
    use: ResidencyUse = _new_object(ResidencyUse)
    use._controller = controller
    use.request = request
    use._consumer_streams = consumers
    use._transfer_streams = transfers
    use._grouped = shape.grouped
    use._decision = None
    use._scope = None
    use._exits = None
    use._values = None
    use._leases = []
    use._step_tokens = None
    use._entry = None
    use._exited = False
    use._state = "entering"
    engine = controller.engine
    policy = controller.policy
    unscoped: _Unscoped | None = None
    try:
        # What `decide` does first: a forked child is refused (by the manager's gate,
        # the first thing `enter_step` passes, or here first), and a one-pass schedule
        # that ran out says so.
        if isinstance(policy, ScheduleAwarePolicy):
            engine.check_process()
            deciding_at(policy, policy.position)
        # `_Unscoped(request.name, now)`, without its frame.
        unscoped = _new_object(_Unscoped)
        unscoped._name = request.name
        unscoped._started = _time_ns()
        unscoped._completed = None
        unscoped._report = None
        unscoped.exit_error = None
        # The manager takes the holds out of ``holds`` and releases them, whatever
        # happens. Its leases are one object, released by the use's exit.
        # The plain decider (the pipeline's condition), whose process the gate checked.
        decider: Decider = controller  # type: ignore[assignment]
        # A built-in policy's access epochs are recorded as the leases are taken.
        keys = decider.epoch_keys
        view, step, use._step_tokens = engine.enter_step(
            engine, shape.entry, consumers, holds, keys
        )
        use._entry = step
        identity = decider.identity
        if identity is None:
            # A policy whose identity may change: read now.
            use._decision = satisfied(
                engine.manager_id, view, request, policy, shape.empty_plan, None
            )
        else:
            use._decision = _new_satisfied(
                _Satisfied, (engine.manager_id, view, request, policy, shape, identity)
            )
        use._scope = unscoped
        if keys is None or type(policy) is not DeterministicTieredLRU:
            decider.record_staged(request, shape.used)
    except BaseException:
        use._state = "closed"
        # What `__enter__` unwinds: the leases, then the stand-in scope.
        exits: list[Callable[[Any, Any, Any], object]] = []
        if unscoped is not None:
            exits.append(unscoped.close)
        if use._entry is not None:
            exits.append(use._entry.exit)
        _unwind(exits, None, None, None)
        raise
    # Its exits are the leases' and the stand-in scope's (`__exit__`); the values map
    # is made when first read (`values`).
    use._exits = _STAGED_EXITS
    use._state = "active"
    return use


# A staged step's `_exits` while it is active: its exits are its `_entry`'s and its
# `_scope`'s, run by `__exit__` (and never through this list, which stays empty).
_STAGED_EXITS: Final[list[Callable[[Any, Any, Any], object]]] = []
_new_object = object.__new__


class _Satisfied(tuple[Any, ...]):
    """A staged step's decision as its entry read it: `_decided.satisfied`'s arguments,
    with its request's shape in place of the shape's empty plan (the state view is
    immutable and the policy's identity fixed), built when first read: a step whose
    decision nobody reads builds none."""

    __slots__ = ()

    def build(self) -> ResidencyDecision:
        manager_id, view, request, policy, shape, identity = self
        return satisfied(manager_id, view, request, policy, shape.empty_plan, identity)


_new_satisfied = tuple.__new__


def _unwind(
    exits: list[Callable[[Any, Any, Any], object]],
    exc_type: Any,
    exc: BaseException | None,
    traceback: Any,
) -> bool:
    """Runs ``exits`` last first and empties it, as `contextlib.ExitStack` closes: each
    is given the exception propagating so far (a new error raised by one replaces it,
    chained to it), and that error is raised at the end. True when an exit suppressed
    the exception the caller passed."""
    received = exc_type is not None
    suppressed = False
    pending = False
    details: tuple[Any, Any, Any] = (exc_type, exc, traceback)
    frame_exc = sys.exc_info()[1]
    while exits:
        callback = exits.pop()
        try:
            if callback(*details):
                suppressed = True
                pending = False
                details = (None, None, None)
        except BaseException as error:
            _fix_context(error, details[1], frame_exc)
            pending = True
            details = (type(error), error, error.__traceback__)
    if pending:
        raised: BaseException = details[1]
        fixed = raised.__context__
        try:
            raise raised
        except BaseException:
            raised.__context__ = fixed
            raise
    return received and suppressed


def _fix_context(
    error: BaseException, previous: BaseException | None, frame_exc: BaseException | None
) -> None:
    """`contextlib.ExitStack`'s context fix: ``error``'s chain ends at ``previous``."""
    while True:
        context = error.__context__
        if context is None or context is previous:
            return
        if context is frame_exc:
            break
        error = context
    error.__context__ = previous


# Reads as the controller's, which re-exports it (repr, messages, documentation).
ResidencyUse.__module__ = "fhelium.residency.controller"
