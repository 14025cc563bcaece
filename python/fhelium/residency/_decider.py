"""The controller's decider: what `ResidencyController` keeps and how it decides.

`ResidencyController` is the public face; the decider holds its state (the policy,
the per-handle metadata and access epochs, the caches of lowered requests) and asks
the engine's search which values to evict or spill so a request fits. Uses and
pipelines work with the decider, through the `Controller` protocol of `_use`. The
rules are in docs/concepts/controller.md.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Final

from fhelium.errors import ResidencyHandleError, ResidencyOwnershipError, ResidencyPlanError
from fhelium.residency import _lowering
from fhelium.residency._decided import LazyDecision, decided
from fhelium.residency._engine import Engine
from fhelium.residency._locations import location_of
from fhelium.residency._records import trusted_builder
from fhelium.residency._scope import engine_of
from fhelium.residency._validation import byte_count
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.model import ReplicaMode, ResidencyHandle
from fhelium.residency.plan import ResidencyPlan
from fhelium.residency.policy import (
    DeterministicTieredLRU,
    ResidencyEvictionCandidate,
    ResidencyPolicy,
    ResidencyPolicyMetadata,
    tier_table,
)
from fhelium.residency.request import ResidencyRequest
from fhelium.residency.schedule import (
    ScheduleAwarePolicy,
    deciding_at,
    observed,
    standing_at,
    tiered_of,
)

if TYPE_CHECKING:
    from fhelium._core import LoweredRequest, TierTable

__all__ = ["ControllerBase", "Decider", "decider_of"]

_DEFAULT_METADATA: Final = ResidencyPolicyMetadata()
_I64 = (1 << 63) - 1
# The most requests a decider keeps lowered (see `Decider._lowered`); past it, the
# cache starts again empty.
_LOWERED_REQUESTS: Final = 4096

_new_candidate = trusted_builder(ResidencyEvictionCandidate)
# The schedule-aware policy's own `observe`, taken before anything may replace it.
_OBSERVE: Final = ScheduleAwarePolicy.observe


class Decider:
    """A controller's state and its decisions: one per `ResidencyController`.

    `decide`, `record_access`, `set_metadata`, `engine` and `shapes` are what the
    controller, its uses and its pipelines call (the `Controller` protocol of `_use`).
    """

    __slots__ = (
        "_empty_plans",
        "_epochs",
        "_lowered_requests",
        "_metadata",
        "_native",
        "_native_keys",
        "_native_tiers",
        "_schedule_cache",
        "engine",
        "epoch_keys",
        "identity",
        "limit",
        "lock",
        "manager",
        "policy",
        "shapes",
    )

    def __init__(self, manager: ResidencyManager, policy: ResidencyPolicy, limit: int) -> None:
        self.manager = manager
        self.engine: Engine = engine_of(manager)
        self.policy = policy
        # A built-in policy's name and `config_identity`, which never change: read once
        # for every decision (`_decided.decided`); None for any other policy.
        self.identity = (
            (policy.name, tuple(policy.config_identity))
            if type(policy) in (DeterministicTieredLRU, ScheduleAwarePolicy)
            else None
        )
        # The most search states one decision explores.
        self.limit = limit
        self._metadata: dict[ResidencyHandle[Any], ResidencyPolicyMetadata] = {}
        self._epochs: dict[ResidencyHandle[Any], int] = {}
        # The same two maps by handle index, kept in the core as they change (one
        # entry per change), for the native policy: a decision hands them on without
        # resolving or converting every handle again. A discarded value keeps its
        # entries; it has no materialisation, so it is never a candidate and its keys
        # are never compared.
        self._native_keys = self.engine.policy_keys()
        # What a pipeline's staged step records its access epochs in, natively, as it
        # enters (`Engine.enter_step`): the built-in policies' keys; None for any other
        # policy, whose steps record by handle (`record_checked`).
        self.epoch_keys = self._native_keys if self.identity is not None else None
        # The schedule-aware policy's steps as handle indices (see `_schedule_index`).
        self._schedule_cache: tuple[ScheduleAwarePolicy, Any] | None = None
        # Requests as the core reads them, by request object (see `_lowered`).
        self._lowered_requests: dict[int, tuple[ResidencyRequest, int, LoweredRequest]] = {}
        # The empty plan of each request decided satisfied, by request object (see
        # `decide`).
        self._empty_plans: dict[int, tuple[ResidencyRequest, ResidencyPlan]] = {}
        # What a pipeline derives from each request, by request object (see
        # `_staging.shape_of`).
        self.shapes: dict[int, Any] = {}
        # The tiered policy, and the native configuration the core's decide takes for
        # it: the keys and its tiers, converted once (see `_decide_request`).
        self._native_tiers: tuple[Any, tuple[Any, TierTable]] | None = None
        # The policy (this controller's) and that native configuration, as the last
        # native decision took them (see `restage`).
        self._native: tuple[Any, tuple[Any, TierTable]] | None = None
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ metadata

    def set_metadata(self, handle: ResidencyHandle[Any], metadata: ResidencyPolicyMetadata) -> None:
        """`ResidencyController.set_policy_metadata` once its arguments are checked."""
        # A forked child is refused before the lock (docs/concepts/lifetimes.md#fork).
        engine = self.engine
        engine.check_process()
        with self.lock:
            manager = self.manager
            manager.snapshot()  # the lookup goes through a snapshot: reaps, refuses when closed
            index = engine.resolve(handle) if isinstance(handle, ResidencyHandle) else None
            if index is None:
                raise ResidencyHandleError(
                    f"{handle!r} is not a live handle of manager {manager.manager_id!r}"
                )
            stable_key = metadata.stable_key
            if stable_key is not None:
                for other, known in self._metadata.items():
                    if known.stable_key == stable_key and other != handle:
                        raise ValueError(
                            f"stable_key {stable_key!r} is already used by another handle"
                        )
            self._metadata[handle] = metadata
            self._native_keys.set_metadata(
                index, max(-_I64, min(_I64, metadata.priority)), stable_key
            )

    def metadata_of(self, handle: ResidencyHandle[Any]) -> ResidencyPolicyMetadata | None:
        """The policy metadata set for ``handle``, or None."""
        return self._metadata.get(handle)

    def record_access(self, request: ResidencyRequest) -> None:
        """Records a use of ``request``'s values (their access epochs), then tells a
        policy that follows a schedule what was used."""
        # A forked child is refused before the lock (docs/concepts/lifetimes.md#fork).
        self.engine.check_process()
        self.record_checked(request)

    def record_checked(self, request: ResidencyRequest) -> None:
        """`record_access` where this process was just checked (a pipeline's staged
        step, whose entry checks it first)."""
        with self.lock:
            # The counter is kept with the keys (every use takes the next epoch there).
            epoch = self._native_keys.next_epoch()
            epochs = self._epochs
            resolve = self.engine.resolve
            set_epoch = self._native_keys.set_epoch
            for requirement in request.requirements:
                handle = requirement.handle
                epochs[handle] = epoch
                index = resolve(handle)
                if index is not None:
                    set_epoch(index, epoch)
        # Outside the lock (docs/concepts/controller.md#schedule-aware-eviction).
        policy = self.policy
        if type(policy) is DeterministicTieredLRU:
            return  # it observes nothing
        observe = getattr(policy, "observe", None)
        if callable(observe):
            observe(tuple([requirement.handle for requirement in request.requirements]))

    def record_staged(
        self, request: ResidencyRequest, used: frozenset[ResidencyHandle[Any]]
    ) -> None:
        """`record_checked` for a pipeline's staged step once it entered (``used``: its
        request's handles): where its entry recorded the epochs natively
        (``epoch_keys``, a built-in policy, whose epochs are read only there), what is
        left is the schedule-aware policy's observation."""
        if self.epoch_keys is None:
            # A Python policy reads the epochs by handle (`_order`).
            self.record_checked(request)
            return
        policy = self.policy
        if type(policy) is not DeterministicTieredLRU:
            # The schedule-aware policy (`record_checked`): its own `observe`, of the
            # set made once per request, unless its class's was replaced.
            if ScheduleAwarePolicy.observe is _OBSERVE:
                observed(policy, used)  # type: ignore[arg-type]
            else:
                policy.observe(  # type: ignore[attr-defined]
                    tuple([requirement.handle for requirement in request.requirements])
                )

    # ------------------------------------------------------------------ decide

    def decide(self, request: ResidencyRequest, position: int | None = None) -> LazyDecision:
        """`ResidencyController.decide` for a checked request, with a schedule-aware
        policy standing at step ``position`` when one is given (a prefetch decides for
        a later step)."""
        source, state_version, explored = self.decide_found(request, position)
        engine = self.engine
        manager_id = engine.manager_id
        policy = self.policy
        identity = self.identity
        if not source[1].empty:
            return decided(
                manager_id, state_version, explored, request, policy, source, None, identity
            )
        # A satisfied request (a staged step at its entry): its empty plan is the
        # same record every time, a request being immutable, so it is built once
        # per request object.
        with self.lock:
            empty = self._empty_plans.get(id(request))
            if empty is not None and empty[0] is request:
                return decided(
                    manager_id, state_version, explored, request, policy, source, empty[1], identity
                )
            decision = decided(
                manager_id, state_version, explored, request, policy, source, None, identity
            )
            if len(self._empty_plans) >= _LOWERED_REQUESTS:
                self._empty_plans.clear()
            self._empty_plans[id(request)] = (request, decision.plan)
            return decision

    def decide_found(
        self, request: ResidencyRequest, position: int | None = None
    ) -> tuple[tuple[Any, Any], int, int]:
        """What `decide` builds its decision from: the search's result as a decision's
        source (`_decided.decided`), the state version it was decided at and the states
        it explored. A pipeline's staging runs the plan without the decision record."""
        engine = self.engine
        # A forked child is refused before the lock (docs/concepts/lifetimes.md#fork).
        engine.check_process()
        policy = self.policy
        if isinstance(policy, ScheduleAwarePolicy):
            # A one-pass schedule that has run out says so, once, before anything is
            # decided (docs/concepts/controller.md#schedule-aware-eviction).
            deciding_at(policy, policy.position if position is None else position)
        with self.lock:
            # One core call holds the gate from the state read to the explanation: no
            # other thread can change what was planned on in between. A completed event
            # reaped afterwards makes the decision stale at scope entry, never here (see
            # docs/concepts/controller.md#decide).
            # The request (and the schedule) as resolved before, unchecked: the core
            # refuses a resolution older than its last discard.
            found = self._decide_request(request, position, False)
            while found is None:
                # None: a value was discarded after the request was resolved; resolve
                # it again.
                found = self._decide_request(request, position, True)
        if not found.feasible:
            raise ResidencyPlanError(found.reason or "the decided plan is infeasible")
        # The core's decision, read when a record built from it is first read.
        return (engine.handle_at, found), found.state_version, found.explored

    def rerun_arguments(self, request: ResidencyRequest, discards: int) -> tuple[Any, ...] | None:
        """What `restage`'s native call takes from this decider for ``request``, when it
        would make that call itself: ``(lowering, search limit, CUDA count, native
        configuration, schedule index or None)``, all lowered while the manager had
        discarded ``discards`` values; None otherwise. A pipeline keeps them for the
        staging of ``request`` in a cyclic schedule's steady state and makes the call
        under `lock` (`_restaging.restage_first`): once a value is discarded,
        the core refuses the lowering (and the schedule) as stale, and the staging is
        decided afresh."""
        policy = self.policy
        native = self._native
        cached = self._lowered_requests.get(id(request))
        if (
            native is None
            or native[0] is not policy
            or cached is None
            or cached[0] is not request
            or cached[1] != discards
        ):
            return None
        schedule = None
        if type(policy) is ScheduleAwarePolicy:
            kept = self._schedule_cache
            if kept is None or kept[0] is not policy or kept[1].discards != discards:
                return None
            schedule = kept[1]
        elif type(policy) is not DeterministicTieredLRU:
            return None
        return (cached[2], self.limit, self.engine.cuda_count or -1, native[1], schedule)

    def restage(
        self,
        request: ResidencyRequest,
        position: int | None,
        rerun: tuple[Any, ...],
        reclaim: bool,
        blocking: bool | None,
    ) -> tuple[tuple[tuple[Any, Any], int, int], bool] | None:
        """`decide_found` for a pipeline's staging of ``request`` whose last staging of it
        ran ``rerun``: `(that decision, a new plan run, the plan's IR, handles and
        actions, transfer streams, (hold groups, held tokens))`. With a built-in
        policy, when the search decides what that decision decided (evicting nothing
        unless ``reclaim``), its plan runs again in the same hold of the manager, its
        values held (`_core.CoreManager.stage_request`: at the very state it was
        decided on, so never stale). The search's result, and whether the plan ran;
        None when ``blocking`` is given (whether reads from disk are deferred) and
        the step's copies would block the host, checked first."""
        engine = self.engine
        # A forked child is refused before the lock (docs/concepts/lifetimes.md#fork).
        engine.check_process()
        policy = self.policy
        schedule: tuple[Any, int] | None = None
        if isinstance(policy, ScheduleAwarePolicy):
            # A one-pass schedule that has run out says so (`decide_found`).
            position = policy.position if position is None else position
            deciding_at(policy, position)
            kept = self._schedule_cache
            if kept is not None and kept[0] is policy:
                schedule = (kept[1], position)
        with self.lock:
            # `_decide_request`'s native call, inline where the request's lowering and
            # the policy's native configuration (and its schedule) are kept already: a
            # staging in a pipeline's steady state.
            cached = self._lowered_requests.get(id(request))
            native = self._native
            if (
                cached is not None
                and cached[0] is request
                and native is not None
                and native[0] is policy
                and (schedule is not None or type(policy) is DeterministicTieredLRU)
            ):
                again = engine.stage_request(
                    cached[2],
                    self.limit,
                    engine.cuda_count or -1,
                    *rerun,
                    native[1],
                    schedule,
                    None,
                    reclaim,
                    blocking,
                )
            else:
                again = self._decide_request(request, position, False, (rerun, reclaim, blocking))
            if again is None:
                return None
            found, ran = again
            if found is None:
                # A value was discarded since: decided afresh, nothing ran.
                ran = False
                found = self._decide_request(request, position, True)
                while found is None:
                    found = self._decide_request(request, position, True)
        if not found.feasible:
            raise ResidencyPlanError(found.reason or "the decided plan is infeasible")
        return ((engine.handle_at, found), found.state_version, found.explored), ran

    def _lowered(self, request: ResidencyRequest) -> LoweredRequest:
        """The request validated and lowered for the core (`_requirement_rows`, then its
        name and reservations), kept per request object while no value is discarded: a
        request is immutable, and a handle's index changes only when a value is
        discarded (the core refuses a lowering older than its last discard)."""
        discards = self.engine.discard_count()
        cached = self._lowered_requests.get(id(request))
        if cached is not None and cached[0] is request and cached[1] == discards:
            return cached[2]
        rows = self._requirement_rows(request)
        # Converted once into the core's form, kept with the request.
        lowered = _lowering.LoweredRequest(
            discards,
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
        engine = self.engine
        manager_id = engine.manager_id
        resolve = engine.resolve
        rows: list[tuple[int, int]] = []
        locations: dict[int, set[ResidencyLocation]] = {}
        for requirement in request.requirements:
            handle = requirement.handle
            index = resolve(handle) if handle.manager_id == manager_id else None
            if index is None:
                # Another manager's, a discarded value's, or one never issued.
                engine.handle_error(handle)
            rows.append((index, _lowering.location_code(requirement.location)))
            locations.setdefault(index, set()).add(requirement.location)
        for index, places in locations.items():
            spec = engine.spec_at(index)
            if spec.replica_mode is ReplicaMode.EXCLUSIVE and len(places) > 1:
                raise ResidencyOwnershipError(
                    f"EXCLUSIVE value {engine.handle_at(index).handle_id!r} is required at "
                    f"{len(places)} locations at once"
                )
        return rows

    def _decide_request(
        self,
        request: ResidencyRequest,
        position: int | None,
        current: bool,
        rerun: tuple[Any, ...] | None = None,
    ) -> Any:
        """The core's decision for ``request`` in one call (`_core.Decided`: its plan IR,
        simulation and evictions), or None when a value was discarded since the request
        (or the schedule) was resolved. The core raises each search failure as its
        error. With ``current``, a resolution is reused only if no value was discarded
        since; without, the core's own refusal of a stale one (None) says so. With
        ``rerun`` (see `restage`): the decision (or None) and whether the plan ran."""
        engine = self.engine
        # `_checked`, for a request lowered before (since the last discard, if
        # ``current``): the cached lowering.
        cached = self._lowered_requests.get(id(request))
        if (
            cached is not None
            and cached[0] is request
            and (not current or cached[1] == engine.discard_count())
        ):
            lowered = cached[2]
        else:
            lowered = self._checked(request)
        arguments = (lowered, self.limit, engine.cuda_count or -1)
        policy = self.policy
        tiered: DeterministicTieredLRU | None = None
        schedule: tuple[Any, int] | None = None
        if type(policy) is DeterministicTieredLRU:
            tiered = policy
        elif type(policy) is ScheduleAwarePolicy:
            tiered = tiered_of(policy)
            # The same order, natively: the schedule as handle indices (one pass or
            # repeating), resolved once per policy until a value is discarded, and the
            # policy's position (docs/concepts/controller.md#schedule-aware-eviction).
            schedule = (
                self._schedule_index(policy, current),
                policy.position if position is None else position,
            )
        if tiered is not None:
            tiers = self._native_tiers
            if tiers is None or tiers[0] is not tiered:
                # The policy's tiers (an immutable table, the same object for the
                # policy's life: converted once per policy), with the keys.
                table = tier_table(tiered)
                tiers = self._native_tiers = (
                    tiered,
                    (
                        self._native_keys,
                        _lowering.TierTable(
                            [
                                (
                                    _lowering.location_code(source),
                                    [_lowering.location_code(target) for target in targets],
                                )
                                for source, targets in table
                            ]
                        ),
                    ),
                )
            # For `restage`: the native configuration of this very policy.
            self._native = (policy, tiers[1])
            if rerun is None:
                return engine.decide_request(*arguments, native=tiers[1], schedule=schedule)
            again, reclaim, blocking = rerun
            return engine.stage_request(
                *arguments, *again, tiers[1], schedule, None, reclaim, blocking
            )
        # Any other policy is consulted as the search reaches it: one ordering per list
        # of candidates, one list of tiers per location
        # (docs/concepts/controller.md#candidates).
        standing: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if position is not None and isinstance(policy, ScheduleAwarePolicy):
            # A Python schedule-aware policy reads its own position: it stands at the
            # step decided for, and back where it was afterwards.
            standing = standing_at(policy, position)
        with standing:
            decided = engine.decide_request(*arguments, python=(self._order, self._fallbacks))
        return decided if rerun is None else (decided, False)

    def _checked(self, request: ResidencyRequest) -> LoweredRequest:
        """`_lowered`, whose refusals come after the core's own: a closed manager, a call
        from inside a transition, a failed reap (docs/concepts/controller.md#decide)."""
        try:
            return self._lowered(request)
        except Exception as error:  # re-raised below, as it was raised
            failure = error
        # The gate's checks and the reap, as the decide itself would take them first;
        # outside the handler, so a refusal there is not chained to the request's.
        _ = self.engine.state_version
        raise failure

    def _schedule_index(self, policy: ScheduleAwarePolicy, current: bool) -> Any:
        """The policy's schedule as handle indices, resolved once and kept (with
        ``current``, only while no value was discarded since)."""
        engine = self.engine
        cached = self._schedule_cache
        if (
            cached is not None
            and cached[0] is policy
            and (not current or cached[1].discards == engine.discard_count())
        ):
            return cached[1]
        index = engine.schedule_index(
            [list(step) for step in policy.schedule], cyclic=policy.cyclic
        )
        self._schedule_cache = (policy, index)
        return index

    def _order(self, rows: list[tuple[int, int, int]]) -> list[int]:
        """A Python policy's ordering, as positions into `rows`
        (docs/concepts/controller.md#candidates)."""
        handle_of = self.engine.handle_at
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
        ordered = tuple(self.policy.order_candidates(tuple(candidates)))
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
                f"policy {self.policy.name!r} must return each of its {len(candidates)} "
                "candidates exactly once from order_candidates"
            )
        return result

    def _fallbacks(self, code: int) -> list[int]:
        return [
            _lowering.location_code(location)
            for location in self.policy.fallback_locations(location_of(code))
        ]


class ControllerBase:
    """The base of `ResidencyController`: the decider it keeps everything in."""

    __slots__ = ()

    _decider: Decider


def decider_of(controller: object) -> Any:
    """What a use or a pipeline works with: a `ResidencyController`'s decider, or any
    other object that serves as one (the `Controller` protocol of `_use`) as it is."""
    if isinstance(controller, ControllerBase):
        return controller._decider
    return controller
