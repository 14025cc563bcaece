"""The controller: declarative requests decided by a bounded, deterministic search.

`decide` reads the manager's state and asks the core's search which values to evict
or spill, so the request fits; it changes nothing. `scope` runs a decision, `use`
decides, runs and borrows in one context.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final, NamedTuple, cast

from fhelium import _core
from fhelium._core import ActionKind, PolicyKeys, decide_request
from fhelium.errors import ResidencyHandleError, ResidencyOwnershipError, ResidencyPlanError
from fhelium.residency import _lowering
from fhelium.residency._decisions import ResidencyDecision, ResidencyEviction
from fhelium.residency._locations import location_of
from fhelium.residency._plans import _Explanation
from fhelium.residency._records import trusted_builder
from fhelium.residency._use import ResidencyUse
from fhelium.residency._validation import (
    byte_count,
    require_non_empty_str,
    require_strict_int,
)
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.manager import ResidencyManager, ResidencyScope, engine_of
from fhelium.residency.model import ReplicaMode, ResidencyHandle
from fhelium.residency.pipeline import ResidencyPipeline
from fhelium.residency.plan import DropResident, EnsureResident, MoveResident, ResidencyPlan
from fhelium.residency.policy import (
    DeterministicTieredLRU,
    ResidencyEvictionCandidate,
    ResidencyPolicy,
    ResidencyPolicyMetadata,
)
from fhelium.residency.request import ResidencyRequest
from fhelium.residency.schedule import ScheduleAwarePolicy
from fhelium.residency.snapshot import ResidencyPlanExplanation

__all__ = ["ResidencyController", "ResidencyDecision", "ResidencyEviction", "ResidencyUse"]

_DEFAULT_METADATA: Final = ResidencyPolicyMetadata()
_I64 = (1 << 63) - 1
# The most requests a controller keeps lowered (see `ResidencyController._lowered`); past
# it, the cache starts again empty.
_LOWERED_REQUESTS: Final = 4096
# Up to this many actions, a decided plan's records are built with the collector on.
_FEW_ACTIONS: Final = 16


class _LoweredRequest(NamedTuple):
    """A request as `decide_request` reads it."""

    rows: list[tuple[int, int]]
    name: str
    reservations: list[tuple[int, int, str]]
    labels: list[str]


_new_ensure = trusted_builder(EnsureResident)
_new_move = trusted_builder(MoveResident)
_new_drop = trusted_builder(DropResident)
_new_eviction = trusted_builder(ResidencyEviction)
_new_plan = trusted_builder(ResidencyPlan)
_new_candidate = trusted_builder(ResidencyEvictionCandidate)


# The record's slot setters, for the fields `_Decision._set` fills.
_DECISION_SETTERS: Final = tuple(
    ResidencyDecision.__dict__[name].__set__
    for name in (
        "manager_id",
        "expected_state_version",
        "explored_states",
        "request",
        "policy_name",
        "policy_config",
    )
)


class _Decision(ResidencyDecision):
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
    # (core, plan IR, simulation, handle index per slot, reclaim rows, enter rows,
    # eviction rows), as `decide_request` returned them.
    _source: tuple[Any, ...] | None

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

    @classmethod
    def _capture(
        cls,
        manager_id: str,
        state_version: int,
        explored: int,
        request: ResidencyRequest,
        policy: ResidencyPolicy,
        source: tuple[Any, ...],
    ) -> _Decision:
        decision = object.__new__(cls)
        decision._set(
            manager_id,
            state_version,
            explored,
            request,
            policy.name,
            tuple(policy.config_identity),
        )
        init = object.__setattr__
        init(decision, "_built_plan", None)
        init(decision, "_built_evictions", None)
        init(decision, "_built_explanation", None)
        init(decision, "_source", source)
        return decision

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
            source = cast("tuple[Any, ...]", self._source)
            evictions = tuple(
                _new_eviction(reclaim[position], rank, location_of(code), nbytes, reason)
                for position, rank, code, nbytes, reason in source[6]
            )
            object.__setattr__(self, "_built_evictions", evictions)
        return evictions

    @property
    def explanation(self) -> ResidencyPlanExplanation:
        explanation = self._built_explanation
        if explanation is None:
            source = cast("tuple[Any, ...]", self._source)
            explanation = _Explanation._capture(self.plan, source[2])
            object.__setattr__(self, "_built_explanation", explanation)
        return explanation

    def _build_plan(self) -> ResidencyPlan:
        # A string type: nothing is built at run time (`tuple[Any, ...]` would be).
        core, ir, _simulation, slots, reclaim_rows, enter_rows, _evictions = cast(
            "tuple[Any, ...]", self._source
        )
        request = self.request
        if not slots:
            # Nothing to do (a request already satisfied): no action to build.
            plan = _new_plan(request.name, (), (), request.reservations, ())
            object.__setattr__(plan, "_ir", _lowering.LoweredPlan(ir, ()))
            return plan
        handle_of = core.handle
        handles = tuple([handle_of(index) for index in slots])

        def action(row: tuple[ActionKind, int, int, int]) -> Any:
            kind, slot, code, from_code = row
            handle = handles[slot]
            if kind == ActionKind.ENSURE:
                return _new_ensure(handle, location_of(code))
            if kind == ActionKind.MOVE:
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
        object.__setattr__(plan, "_ir", _lowering.LoweredPlan(ir, handles))
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
_Decision.__name__ = "ResidencyDecision"


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


def stable_key_of(controller: ResidencyController, handle: ResidencyHandle[Any]) -> str | None:
    """The stable key ``controller``'s policy metadata gives ``handle``, or ``None``; for
    internal users (the lockstep digests of `fhelium.residency.distributed`)."""
    metadata = controller._metadata.get(handle)
    return None if metadata is None else metadata.stable_key


@contextlib.contextmanager
def _standing_at(policy: ScheduleAwarePolicy, position: int) -> Iterator[None]:
    """The policy stands at step ``position`` for the block, then where it stood."""
    standing = policy.position
    policy._stand(position)
    try:
        yield
    finally:
        policy._stand(standing)


class ResidencyController:
    """Decides what to evict or spill so a request fits, the same way every time.

    An optional layer over one manager: the caller says what a step needs (a
    `ResidencyRequest`); the controller searches, bounded by ``search_state_limit``, for the
    evictions and spills (per the policy's fallback tiers) that make it fit, builds the plan
    and can run it and borrow the values in one context (`use`) or as a prefetching
    pipeline (`run`). It keeps only per-handle policy metadata and access epochs. See
    docs/concepts/controller.md.

    Args:
        manager: The manager to decide for.
        policy: The eviction policy; `DeterministicTieredLRU` without tiers by default.
        search_state_limit: The most search states `decide` explores before giving up
            (a strict int > 0). The search's depth and memory are bounded whatever it is
            (docs/concepts/controller.md#search-bounds).

    Raises:
        TypeError: ``manager`` is not a `ResidencyManager`; ``policy`` does not implement
            `ResidencyPolicy`; ``policy.name`` or ``search_state_limit`` of the wrong kind.
        ValueError: A blank policy name, or ``search_state_limit <= 0``.

    Example:
        ```python
        import torch
        from fhelium.residency import (
            PAGEABLE_HOST, PINNED_HOST, DeterministicTieredLRU, ReplicaMode,
            ResidencyController, ResidencyManager, ResidencyRequest, ResidencyRequirement,
        )
        from fhelium.residency.simulation import SimulatedRuntime, use_runtime
        from fhelium.values import ResidentTensor

        with use_runtime(SimulatedRuntime(device_count=0)), ResidencyManager(
            {PINNED_HOST: 8192}
        ) as manager:
            a, b = (
                manager.adopt(ResidentTensor(torch.ones(1024)), replica_mode=ReplicaMode.REPLICABLE)
                for _ in range(2)
            )
            controller = ResidencyController(
                manager, policy=DeterministicTieredLRU({PINNED_HOST: [PAGEABLE_HOST]})
            )
            for handle in (a, b, a):  # room for one value of 4096 bytes plus headroom
                request = ResidencyRequest("step", [ResidencyRequirement(handle, PINNED_HOST)])
                with controller.use(request) as use:
                    use.value(handle, at=PINNED_HOST)
        ```
    """

    __slots__ = (
        "_empty_plans",
        "_engine",
        "_epoch",
        "_epochs",
        "_limit",
        "_lock",
        "_lowered_requests",
        "_manager",
        "_metadata",
        "_native_keys",
        "_native_tiers",
        "_policy",
        "_schedule_cache",
        "_shapes",
    )

    def __init__(
        self,
        manager: ResidencyManager,
        *,
        policy: ResidencyPolicy | None = None,
        search_state_limit: int = 100_000,
    ) -> None:
        if not isinstance(manager, ResidencyManager):
            raise TypeError(f"manager must be a ResidencyManager, got {type(manager).__name__}")
        chosen = DeterministicTieredLRU() if policy is None else policy
        if not isinstance(chosen, ResidencyPolicy):
            raise TypeError(
                "policy must implement ResidencyPolicy (name, config_identity, "
                "fallback_locations, order_candidates)"
            )
        require_non_empty_str(chosen.name, "policy.name")
        if require_strict_int(search_state_limit, "search_state_limit") <= 0:
            raise ValueError(f"search_state_limit must be > 0, got {search_state_limit}")
        self._manager = manager
        self._engine = engine_of(manager)
        self._policy = chosen
        self._limit = search_state_limit
        self._metadata: dict[ResidencyHandle[Any], ResidencyPolicyMetadata] = {}
        self._epochs: dict[ResidencyHandle[Any], int] = {}
        # The same two maps by handle index, kept in the core as they change (one
        # entry per change), for the native policy: `decide` hands them on without
        # resolving or converting every handle again. A discarded value keeps its
        # entries; it has no materialisation, so it is never a candidate and its keys
        # are never compared.
        self._native_keys = PolicyKeys()
        self._epoch = 0
        # The schedule-aware policy's steps as handle indices (see `_schedule_index`).
        self._schedule_cache: tuple[ScheduleAwarePolicy, Any] | None = None
        # Requests as the core reads them, by request object (see `_lowered`).
        self._lowered_requests: dict[int, tuple[ResidencyRequest, int, _LoweredRequest]] = {}
        # The empty plan of each request decided satisfied, by request object (see
        # `_decide`).
        self._empty_plans: dict[int, tuple[ResidencyRequest, ResidencyPlan]] = {}
        # What a pipeline derives from each request, by request object (see
        # `pipeline._shape`).
        self._shapes: dict[int, Any] = {}
        # The tiered policy's tiers as location codes (see `_search`).
        self._native_tiers: tuple[Any, list[tuple[int, list[int]]]] | None = None
        self._lock = threading.RLock()

    @property
    def manager(self) -> ResidencyManager:
        """The manager the controller decides for."""
        return self._manager

    @property
    def policy(self) -> ResidencyPolicy:
        """The eviction policy."""
        return self._policy

    def __repr__(self) -> str:
        return f"ResidencyController(policy={self._policy.name!r}, limit={self._limit})"

    # ------------------------------------------------------------------ metadata

    def set_policy_metadata(
        self, handle: ResidencyHandle[Any], *, priority: int = 0, stable_key: str | None = None
    ) -> None:
        """Set the controller-local eviction metadata of a live handle, replacing any before.

        Metadata does not advance the manager's version and is never pruned. See
        docs/concepts/controller.md#policy-metadata.

        Args:
            handle: A live handle of the controller's manager.
            priority: A strict int of any sign; a higher priority is kept longer.
            stable_key: ``None`` or a non-empty string, unique among this controller's handles.

        Raises:
            TypeError: ``priority`` is not a strict int, or ``stable_key`` not a string.
            ValueError: A blank ``stable_key``, or one another handle already holds.
            ResidencyHandleError: ``handle`` is not a live, non-discarded handle of the manager
                (any other object included).
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of the manager is running.
        """
        metadata = ResidencyPolicyMetadata(priority, stable_key)
        # A forked child is refused before the lock (docs/concepts/lifetimes.md#fork).
        self._engine.core.check_process()
        with self._lock:
            manager = self._manager
            manager.snapshot()  # the lookup goes through a snapshot: reaps, refuses when closed
            index = (
                self._engine.core.resolve(handle) if isinstance(handle, ResidencyHandle) else None
            )
            if index is None:
                raise ResidencyHandleError(
                    f"{handle!r} is not a live handle of manager {manager.manager_id!r}"
                )
            if stable_key is not None:
                for other, known in self._metadata.items():
                    if known.stable_key == stable_key and other != handle:
                        raise ValueError(
                            f"stable_key {stable_key!r} is already used by another handle"
                        )
            self._metadata[handle] = metadata
            self._native_keys.set_metadata(
                index, max(-_I64, min(_I64, metadata.priority)), metadata.stable_key
            )

    # ------------------------------------------------------------------ decide

    def decide(self, request: ResidencyRequest) -> ResidencyDecision:
        """Plan a request against the current state; change nothing.

        The search finds the reclaim (evictions and spills) and enter actions that satisfy the
        request, under one hold of the manager, and explains the plan at the version it read.
        It runs no transition, takes no lease and never calls a source. A satisfied request gives
        an empty plan. See docs/concepts/controller.md#decide.

        Args:
            request: What must be resident where, and the reservations to hold.

        Returns:
            The decision: the plan (without exit actions), its evictions and explanation, bound
            to the manager and version it was made against.

        Raises:
            TypeError: ``request`` is not a `ResidencyRequest`.
            ResidencyHandleError: A requirement's handle is foreign, unknown or discarded.
            ResidencyOwnershipError: An EXCLUSIVE value is required at several locations.
            ResidencySearchLimitError: The search reached ``search_state_limit``, its depth
                bound or its memo's memory bound without a verdict (``bound`` says which).
            ResidencyPlanError: The request is infeasible, or its plan's explanation is not
                feasible (an unusable CUDA location, say).
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of the manager is running.
            RuntimeError: The policy's ``order_candidates`` did not return each candidate
                exactly once.

        Example:
            ```python
            import torch
            from fhelium.residency import (
                PAGEABLE_HOST, ResidencyController, ResidencyManager, ResidencyRequest,
                ResidencyRequirement,
            )
            from fhelium.values import ResidentTensor

            with ResidencyManager() as manager:
                handle = manager.adopt(ResidentTensor(torch.ones(4)))
                controller = ResidencyController(manager)
                request = ResidencyRequest("noop", [ResidencyRequirement(handle, PAGEABLE_HOST)])
                decision = controller.decide(request)
                assert decision.plan.enter == () and decision.evictions == ()
                with controller.scope(decision):
                    pass
            ```
        """
        if not isinstance(request, ResidencyRequest):
            raise TypeError(f"request must be a ResidencyRequest, got {type(request).__name__}")
        return self._decide(request, None)

    def _decide(self, request: ResidencyRequest, position: int | None) -> ResidencyDecision:
        """`decide`, with a schedule-aware policy standing at step ``position`` when one
        is given (a prefetch decides for a later step)."""
        # A forked child is refused before the lock (docs/concepts/lifetimes.md#fork).
        self._engine.core.check_process()
        policy = self._policy
        if isinstance(policy, ScheduleAwarePolicy):
            # A one-pass schedule that has run out says so, once, before anything is
            # decided (docs/concepts/controller.md#schedule-aware-eviction).
            policy._deciding_at(policy.position if position is None else position)
        with self._lock:
            manager = self._manager
            engine = self._engine
            core = engine.core

            # The core holds the gate from the state read to the explanation: no other
            # thread can change what was planned on in between. A completed event reaped
            # afterwards makes the decision stale at scope entry, never here (see
            # docs/concepts/controller.md#decide).
            def planned(completed: list[int]) -> tuple[Any, ...]:
                # The search, the plan's core IR and its simulation (the explanation),
                # in one core call; explain's rule for completed pending leases.
                return self._search(request, self._lowered(request), completed, position)

            state_version, found = core.decide(planned)
            (ir, simulation, slots, reclaim, enter, evictions, explored, _version) = found
            if not simulation.feasible:
                raise ResidencyPlanError(simulation.reason or "the decided plan is infeasible")
            decision = _Decision._capture(
                manager.manager_id,
                state_version,
                explored,
                request,
                self._policy,
                (core, ir, simulation, slots, reclaim, enter, evictions),
            )
            if not slots:
                # A satisfied request (a staged step at its entry): its empty plan is
                # the same record every time, a request being immutable, so it is
                # built once per request object.
                empty = self._empty_plans.get(id(request))
                if empty is not None and empty[0] is request:
                    object.__setattr__(decision, "_built_plan", empty[1])
                else:
                    if len(self._empty_plans) >= _LOWERED_REQUESTS:
                        self._empty_plans.clear()
                    self._empty_plans[id(request)] = (request, decision.plan)
            return decision

    def _lowered(self, request: ResidencyRequest) -> _LoweredRequest:
        """The request validated and lowered for the core (`_requirement_rows`, then its
        name and reservations), kept per request object while no value is discarded: a
        request is immutable, and a handle's index changes only when a value is
        discarded. Called under the core's gate."""
        discards = self._engine.core.discard_count()
        cached = self._lowered_requests.get(id(request))
        if cached is not None and cached[0] is request and cached[1] == discards:
            return cached[2]
        rows = self._requirement_rows(request)
        lowered = _LoweredRequest(
            rows,
            # The name appears in the search's errors and as the plan IR's name; the
            # core holds it as UTF-8 text.
            _lowering.diagnostic_text(request.name),
            [
                (
                    _lowering.location_code(reservation.location),
                    byte_count(reservation.nbytes, f"reservation {reservation.label!r}"),
                    _lowering.diagnostic_text(reservation.label),
                )
                for reservation in request.reservations
            ],
            [repr(reservation.label) for reservation in request.reservations],
        )
        if len(self._lowered_requests) >= _LOWERED_REQUESTS:
            self._lowered_requests.clear()
        self._lowered_requests[id(request)] = (request, discards, lowered)
        return lowered

    def _requirement_rows(self, request: ResidencyRequest) -> list[tuple[int, int]]:
        """Request validation (docs/concepts/controller.md#decide, step 3), then the core's
        `(handle index, location code)` rows."""
        manager = self._manager
        core = self._engine.core
        rows: list[tuple[int, int]] = []
        locations: dict[int, set[ResidencyLocation]] = {}
        for requirement in request.requirements:
            handle = requirement.handle
            if handle.manager_id != manager.manager_id:
                raise ResidencyHandleError(
                    f"handle {handle.handle_id!r} belongs to manager {handle.manager_id!r}"
                )
            index = core.resolve(handle)
            if index is None:
                if core.is_discarded(handle):
                    raise ResidencyHandleError(f"Value {handle.handle_id!r} is discarded")
                raise ResidencyHandleError(f"unknown handle {handle.handle_id!r}")
            rows.append((index, _lowering.location_code(requirement.location)))
            locations.setdefault(index, set()).add(requirement.location)
        for index, places in locations.items():
            spec = core.spec(index)
            if spec.replica_mode is ReplicaMode.EXCLUSIVE and len(places) > 1:
                raise ResidencyOwnershipError(
                    f"EXCLUSIVE value {core.handle(index).handle_id!r} is required at "
                    f"{len(places)} locations at once"
                )
        return rows

    def _search(
        self,
        request: ResidencyRequest,
        lowered: _LoweredRequest,
        completed_leases: list[int],
        position: int | None = None,
    ) -> _core._Decision:
        """The core's decided plan IR and its simulation; the core raises each search
        failure as its error."""
        engine = self._engine
        core = engine.core
        rows, name, reservations, labels = lowered
        simulated = (engine.cuda_count or -1, completed_leases, labels)
        policy = self._policy
        tiered: DeterministicTieredLRU | None = None
        schedule: tuple[Any, int] | None = None
        if type(policy) is DeterministicTieredLRU:
            tiered = policy
        elif type(policy) is ScheduleAwarePolicy:
            tiered = policy._tiered
            # The same order, natively: the schedule as handle indices (one pass or
            # repeating), resolved once per policy until a value is discarded, and the
            # policy's position (docs/concepts/controller.md#schedule-aware-eviction).
            schedule = (
                self._schedule_index(policy),
                policy.position if position is None else position,
            )
        if tiered is not None:
            tiers = self._native_tiers
            if tiers is None or tiers[0] is not tiered._tiers:
                # The policy's tiers as location codes (an immutable table, lowered once).
                tiers = self._native_tiers = (
                    tiered._tiers,
                    [
                        (
                            _lowering.location_code(source),
                            [_lowering.location_code(target) for target in targets],
                        )
                        for source, targets in tiered._tiers
                    ],
                )
            native = (self._native_keys, tiers[1])
            return decide_request(
                core,
                name,
                rows,
                reservations,
                self._limit,
                *simulated,
                native=native,
                schedule=schedule,
            )
        standing: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if position is not None and isinstance(policy, ScheduleAwarePolicy):
            # A Python schedule-aware policy reads its own position: it stands at the
            # step decided for, and back where it was afterwards.
            standing = _standing_at(policy, position)
        with standing:
            return decide_request(
                core,
                name,
                rows,
                reservations,
                self._limit,
                *simulated,
                python=(self._order, self._fallbacks),
            )

    def _schedule_index(self, policy: ScheduleAwarePolicy) -> Any:
        core = self._engine.core
        cached = self._schedule_cache
        if (
            cached is not None
            and cached[0] is policy
            and cached[1].discards == core.discard_count()
        ):
            return cached[1]
        index = core.schedule_index([list(step) for step in policy.schedule], cyclic=policy.cyclic)
        self._schedule_cache = (policy, index)
        return index

    def _order(self, rows: list[tuple[int, int, int]]) -> list[int]:
        """A Python policy's ordering, as positions into `rows`
        (docs/concepts/controller.md#candidates)."""
        handle_of = self._engine.core.handle
        candidates = []
        for index, code, charged in rows:
            handle = handle_of(index)
            candidates.append(
                _new_candidate(
                    handle,
                    location_of(code),
                    charged,
                    index,
                    self._epochs.get(handle),
                    self._metadata.get(handle, _DEFAULT_METADATA),
                )
            )
        ordered = tuple(self._policy.order_candidates(tuple(candidates)))
        positions = {id(candidate): position for position, candidate in enumerate(candidates)}
        result: list[int] = []
        seen: set[int] = set()
        for candidate in ordered:
            position = positions.get(id(candidate))
            if position is None or position in seen:
                break
            seen.add(position)
            result.append(position)
        if len(result) != len(candidates) or len(ordered) != len(candidates):
            raise RuntimeError(
                f"policy {self._policy.name!r} must return each of its {len(candidates)} "
                "candidates exactly once from order_candidates"
            )
        return result

    def _fallbacks(self, code: int) -> list[int]:
        return [
            _lowering.location_code(location)
            for location in self._policy.fallback_locations(location_of(code))
        ]

    # ------------------------------------------------------------------ scope and use

    def scope(
        self,
        decision: ResidencyDecision,
        *,
        transfer_streams: Mapping[ResidencyLocation, Any] | None = None,
    ) -> ResidencyScope:
        """Build the manager scope of a decision's plan, stale-checked at entry.

        Needs no manager state. A decision made stale by any change since it was decided raises
        `ResidencyStaleStateError` at scope entry, before any reclaim or reservation; it is never
        silently planned again. See docs/concepts/controller.md#scope-of-a-decision.

        Args:
            decision: A decision of this controller's manager and policy.
            transfer_streams: CUDA streams by destination location, as for
                `ResidencyManager.scope`.

        Returns:
            The scope, not yet entered.

        Raises:
            TypeError: ``decision`` is not a `ResidencyDecision`, or ``transfer_streams`` not a
                mapping.
            ResidencyHandleError: The decision was made for another manager.
            ResidencyPlanError: The decision was made by another policy name or configuration.
        """
        if not isinstance(decision, ResidencyDecision):
            raise TypeError(f"decision must be a ResidencyDecision, got {type(decision).__name__}")
        manager = self._manager
        if decision.manager_id != manager.manager_id:
            raise ResidencyHandleError(
                f"the decision was made for manager {decision.manager_id!r}, "
                f"not {manager.manager_id!r}"
            )
        policy = self._policy
        if decision.policy_name != policy.name or decision.policy_config != tuple(
            policy.config_identity
        ):
            raise ResidencyPlanError(
                f"the decision was made by policy {decision.policy_name!r} with another "
                "configuration; decide again"
            )
        return manager.scope(
            decision.plan,
            expected_state_version=decision.expected_state_version,
            transfer_streams=transfer_streams,
        )

    def use(
        self,
        request: ResidencyRequest,
        *,
        consumer_streams: Mapping[ResidencyLocation, Any] | None = None,
        transfer_streams: Mapping[ResidencyLocation, Any] | None = None,
    ) -> ResidencyUse:
        """Decide, enter the scope and borrow the required values, as one context.

        Entering the returned `ResidencyUse` decides the request, enters the decision's scope
        and acquires the values by location under one hold of the manager, and records access
        epochs; a decision another thread made stale first is decided again (up to 64 times,
        then `ResidencyStaleStateError`); any failure unwinds what was entered. Exit releases
        the leases (``wait=False``) and closes the scope; the values stay cached where they
        are. See docs/concepts/controller.md#use.

        Args:
            request: What must be resident where.
            consumer_streams: The stream that reads the values, for exactly each CUDA location
                among the requirements; ``None`` for a host-only request.
            transfer_streams: CUDA streams by destination location for the copies.

        Returns:
            The use, not yet entered.

        Raises:
            TypeError: ``request`` is not a `ResidencyRequest`; a stream mapping is not a
                mapping, or has a non-location key or a non-stream value.
            ValueError: A host key, a stream on another device, or ``consumer_streams`` keys that
                are not exactly the request's CUDA locations.

        Example:
            ```python
            import torch
            from fhelium.residency import (
                ResidencyController, ResidencyManager, ResidencyRequest, ResidencyRequirement,
                cuda_location,
            )
            from fhelium.residency.simulation import SimulatedRuntime, use_runtime
            from fhelium.values import ResidentTensor

            runtime = SimulatedRuntime(device_count=1)
            gpu = cuda_location("cuda:0")
            with use_runtime(runtime), ResidencyManager({gpu: 1 << 20}) as manager:
                handle = manager.adopt(ResidentTensor(torch.ones(256)))
                controller = ResidencyController(manager)
                stream = runtime.current_stream(gpu.device)
                request = ResidencyRequest("step", [ResidencyRequirement(handle, gpu)])
                with controller.use(request, consumer_streams={gpu: stream}) as use:
                    value = use.value(handle, at=gpu)
                assert use.report is not None
            ```
        """
        return ResidencyUse(
            controller=self,
            request=request,
            consumer_streams=consumer_streams,
            transfer_streams=transfer_streams,
        )

    def run(
        self,
        requests: Iterable[ResidencyRequest],
        *,
        prefetch: int = 0,
        consumer_streams: Mapping[ResidencyLocation, Any] | None = None,
        transfer_streams: Mapping[ResidencyLocation, Any] | None = None,
    ) -> ResidencyPipeline:
        """Use ``requests`` in order, one step at a time, prefetching the next ``prefetch`` steps.

        Each step is an entered `ResidencyUse`, active until the next step is requested; copies
        for later steps run while the current one computes, with every byte charged before it is
        copied. See docs/concepts/controller.md#prefetch.

        Args:
            requests: Any iterable of `ResidencyRequest`, read lazily, at most ``prefetch + 1``
                ahead.
            prefetch: How many later steps to stage while a step runs (a strict int >= 0); 0 is a
                plain `use` per request.
            consumer_streams: The reading stream per CUDA location, as for `use`.
            transfer_streams: Copy streams per CUDA location; with ``prefetch > 0`` a missing
                one is created once by the runtime.

        Returns:
            The pipeline: an iterator of steps and a context manager.

        Raises:
            TypeError: ``requests`` is a string, a single request or not iterable; ``prefetch``
                is not a strict int; a stream mapping of the wrong kind. (An element that is
                not a request raises `TypeError` naming its index when it is reached.)
            ValueError: A negative ``prefetch``; a host key or a stream on another device.

        Example:
            ```python
            import torch
            from fhelium.residency import (
                PINNED_HOST, ReplicaMode, ResidencyController, ResidencyManager, ResidencyRequest,
                ResidencyRequirement, cuda_location,
            )
            from fhelium.residency.schedule import ScheduleAwarePolicy
            from fhelium.residency.simulation import SimulatedRuntime, Timeline, use_runtime
            from fhelium.values import ResidentTensor

            runtime = SimulatedRuntime(1, timeline=Timeline())
            gpu = cuda_location("cuda:0")
            with use_runtime(runtime), ResidencyManager({gpu: 3 << 16}) as manager:
                layers = [
                    manager.adopt(
                        runtime.pin(ResidentTensor(torch.randn(128, 128))),
                        replica_mode=ReplicaMode.REPLICABLE,
                    )
                    for _ in range(4)
                ]
                requests = [
                    ResidencyRequest(f"layer-{i}", [ResidencyRequirement(layer, gpu)])
                    for i, layer in enumerate(layers)
                ]
                controller = ResidencyController(manager, policy=ScheduleAwarePolicy(requests))
                stream = runtime.current_stream(gpu.device)
                with controller.run(requests, prefetch=1, consumer_streams={gpu: stream}) as steps:
                    for step in steps:
                        runtime.compute(stream, 50e-6)
                runtime.synchronize_device(gpu.device)
            ```
        """
        return ResidencyPipeline(
            self,
            requests,
            prefetch=prefetch,
            consumer_streams=consumer_streams,
            transfer_streams=transfer_streams,
        )

    def _record_access(self, request: ResidencyRequest) -> None:
        # A forked child is refused before the lock (docs/concepts/lifetimes.md#fork).
        self._engine.core.check_process()
        with self._lock:
            self._epoch += 1
            resolve = self._engine.core.resolve
            for requirement in request.requirements:
                handle = requirement.handle
                self._epochs[handle] = self._epoch
                index = resolve(handle)
                if index is not None:
                    self._native_keys.set_epoch(index, self._epoch)
        # A policy that follows a schedule is told what was used, outside the lock
        # (docs/concepts/controller.md#schedule-aware-eviction).
        observe = getattr(self._policy, "observe", None)
        if callable(observe):
            observe(tuple([requirement.handle for requirement in request.requirements]))
