"""A slow, literal Python transcription of the controller's `decide` search.

Written straight from the documented algorithm (docs/concepts/controller.md, "Decide" steps
3-6, "Request simulation", "Search", "Decisions and evictions"; docs/concepts/values.md,
"Source order"), independently of the implementation, for differential tests
against `ResidencyController.decide`. Nothing here is optimised: states are cloned
wholesale, the signature is rebuilt on every use, and `reclaim_states` / `capacity_states`
are lazy generators exactly as the docs describe them (laziness is observable through
`explored_states`: a successful drop trial stops the generator before its move options count).

Input: `PlanningInput`, a tensor-free description of what `decide` reads from
`manager.snapshot()` plus the controller's metadata, epochs, policy, request and limit.
`planning_input(manager, ...)` builds one from a live `ResidencyManager`.

Output: `reference_decide(planning)` returns a `RefOutcome`:

* `kind == "ok"`: `reclaim`, `enter`, `evictions` (tuples
  `(action, rank, released_location, released_nbytes, reason)`) and `explored_states`;
* `kind == "limit"`: the search-state limit was reached (`explored_states == limit`), or
  the depth bound (`MAX_SEARCH_DEPTH` states open on the path, `bound == "depth"`);
* `kind == "infeasible"`: the search was exhausted;
* `kind == "handle"` / `kind == "ownership"`: request validation failed
  (controller.md#decide, step 3).

A policy whose ordering is not a permutation raises `RuntimeError`, as `decide` does.
The manager-side `explain` (controller.md#decide, step 7) is not modelled: a caller that needs
it explains `ref_plan(planning, outcome)` on the live manager. Nor is the memo's memory bound
(controller.md#search-bounds), which counts the core's own byte sizes: the searches compared
here stay far below it.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, ResidencyLocation
from fhelium.residency.model import ReplicaMode, ResidencyHandle
from fhelium.residency.plan import DropResident, EnsureResident, MoveResident, ResidencyPlan
from fhelium.residency.policy import ResidencyEvictionCandidate, ResidencyPolicyMetadata
from fhelium.residency.request import ResidencyRequest

__all__ = [
    "DROP_REPLICATED",
    "DROP_SOURCE",
    "RefLocation",
    "RefMaterialization",
    "RefOutcome",
    "RefValue",
    "PlanningInput",
    "canonical_key",
    "move_reason",
    "planning_input",
    "reference_decide",
    "ref_plan",
]

# The three reason templates (docs/concepts/controller.md#reclaim-options), verbatim.
DROP_REPLICATED = "another materialization preserves the logical value"
DROP_SOURCE = "registered source can reconstruct the logical value"


def move_reason(destination: ResidencyLocation) -> str:
    return (
        f"sole materialization moved to requested destination {destination} "
        "instead of reconstructing it later"
    )


def canonical_key(location: ResidencyLocation) -> tuple[int, int]:
    """Pageable host, pinned host, then CUDA by ascending index (values.md#source-order)."""
    if location == PAGEABLE_HOST:
        return (0, -1)
    if location == PINNED_HOST:
        return (1, -1)
    index = location.device.index
    assert index is not None
    return (2, index)


# --------------------------------------------------------------------------------------------
# Input description
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RefMaterialization:
    location: ResidencyLocation
    charged_nbytes: int
    use_count: int = 0
    hold_count: int = 0
    pending_event_count: int = 0

    @property
    def protected(self) -> bool:
        return bool(self.use_count or self.hold_count or self.pending_event_count)


@dataclass(frozen=True)
class RefValue:
    handle: ResidencyHandle[Any]
    replica_mode: ReplicaMode
    storage_nbytes: int
    has_source: bool
    source_location: ResidencyLocation | None
    discarded: bool
    materializations: tuple[RefMaterialization, ...]


@dataclass(frozen=True)
class RefLocation:
    location: ResidencyLocation
    budget_bytes: int | None
    used_bytes: int
    reserved_bytes: int


@dataclass(frozen=True)
class PlanningInput:
    manager_id: str
    state_version: int
    values: tuple[RefValue, ...]  # issue order, including discarded values
    locations: tuple[RefLocation, ...]  # registered locations
    metadata: Mapping[ResidencyHandle[Any], ResidencyPolicyMetadata]
    epochs: Mapping[ResidencyHandle[Any], int]
    policy: Any
    request: ResidencyRequest
    search_state_limit: int


@dataclass(frozen=True)
class RefOutcome:
    kind: str  # "ok" | "limit" | "infeasible" | "handle" | "ownership"
    reclaim: tuple[Any, ...] = ()
    enter: tuple[Any, ...] = ()
    evictions: tuple[tuple[Any, int, ResidencyLocation, int, str], ...] = ()
    explored_states: int | None = None
    detail: str = ""


def planning_input(
    manager: Any,
    request: ResidencyRequest,
    *,
    policy: Any,
    metadata: Mapping[ResidencyHandle[Any], ResidencyPolicyMetadata] | None = None,
    epochs: Mapping[ResidencyHandle[Any], int] | None = None,
    search_state_limit: int = 100_000,
    snapshot: Any = None,
) -> PlanningInput:
    """The planning input `decide` would build from `manager.snapshot()`
    (controller.md#decide, step 4).

    `metadata` and `epochs` are the caller's mirror of the controller's maps
    (controller.md#policy-metadata, #access-epochs).
    """
    snap = manager.snapshot() if snapshot is None else snapshot
    values = tuple(
        RefValue(
            handle=v.handle,
            replica_mode=v.spec.replica_mode,
            storage_nbytes=v.spec.storage_nbytes,
            has_source=v.has_source,
            source_location=v.source_location,
            discarded=v.discarded,
            materializations=tuple(
                RefMaterialization(
                    m.location,
                    m.charged_nbytes,
                    m.use_count,
                    m.hold_count,
                    m.pending_event_count,
                )
                for m in v.materializations
            ),
        )
        for v in snap.values
    )
    locations = tuple(
        RefLocation(e.location, e.budget_bytes, e.used_bytes, e.reserved_bytes)
        for e in snap.locations
    )
    return PlanningInput(
        manager_id=snap.manager_id,
        state_version=snap.state_version,
        values=values,
        locations=locations,
        metadata=dict(metadata or {}),
        epochs=dict(epochs or {}),
        policy=policy,
        request=request,
        search_state_limit=search_state_limit,
    )


def ref_plan(planning: PlanningInput, outcome: RefOutcome) -> ResidencyPlan:
    """The plan `decide` builds from a successful search (controller.md#decide, step 6)."""
    assert outcome.kind == "ok"
    return ResidencyPlan(
        planning.request.name,
        reclaim=outcome.reclaim,
        enter=outcome.enter,
        reservations=planning.request.reservations,
    )


# --------------------------------------------------------------------------------------------
# Planning state
# --------------------------------------------------------------------------------------------


@dataclass
class _Value:
    handle: ResidencyHandle[Any]
    registration_index: int
    replica_mode: ReplicaMode
    charge: int
    has_source: bool
    source_location: ResidencyLocation | None
    # location -> materialisation snapshot (install order; canonical order is computed)
    mats: dict[ResidencyLocation, RefMaterialization]

    def clone(self) -> _Value:
        return _Value(
            self.handle,
            self.registration_index,
            self.replica_mode,
            self.charge,
            self.has_source,
            self.source_location,
            dict(self.mats),
        )

    def canonical_locations(self) -> list[ResidencyLocation]:
        return sorted(self.mats, key=canonical_key)


@dataclass
class _State:
    values: dict[ResidencyHandle[Any], _Value]  # registration order, non-discarded only
    used: dict[ResidencyLocation, int]
    reserved: dict[ResidencyLocation, int]
    reclaim: list[Any] = field(default_factory=list)
    evictions: list[tuple[Any, int, ResidencyLocation, int, str]] = field(default_factory=list)

    def clone(self) -> _State:
        return _State(
            {h: v.clone() for h, v in self.values.items()},
            dict(self.used),
            dict(self.reserved),
            list(self.reclaim),
            list(self.evictions),
        )


class _Capacity(Exception):
    def __init__(self, location: ResidencyLocation, nbytes: int, stage: str) -> None:
        super().__init__(f"{stage}: {nbytes} bytes do not fit at {location}")
        self.location = location
        self.nbytes = nbytes
        self.stage = stage


class _Unavailable(Exception):
    pass


class _Fail(Exception):
    pass


class _Limit(Exception):
    def __init__(self, message: str, bound: str) -> None:
        super().__init__(message)
        self.bound = bound


# controller.md#search-bounds: the deepest the search goes, in counted states open on its path.
MAX_SEARCH_DEPTH = 131_072


class _Search:
    def __init__(self, planning: PlanningInput) -> None:
        self.policy = planning.policy
        self.request = planning.request
        self.metadata = planning.metadata
        self.epochs = planning.epochs
        self.limit = planning.search_state_limit
        self.budgets = {e.location: e.budget_bytes for e in planning.locations}
        self.required = {(r.handle, r.location) for r in planning.request.requirements}
        self.explored = 0
        self.depth = 0
        self.failed_requests: set[Any] = set()
        self.failed_capacities: set[Any] = set()

    # --- helpers -------------------------------------------------------------------------
    def fits(self, state: _State, location: ResidencyLocation, nbytes: int) -> bool:
        budget = self.budgets.get(location)
        if budget is None:
            return True
        return state.used.get(location, 0) + state.reserved.get(location, 0) + nbytes <= budget

    def signature(self, state: _State) -> Any:
        values = tuple(
            (v.registration_index, tuple(loc.name for loc in v.canonical_locations()))
            for v in state.values.values()
        )
        keys = sorted(set(state.used) | set(state.reserved), key=canonical_key)
        locations = tuple(
            (loc.name, state.used.get(loc, 0), state.reserved.get(loc, 0)) for loc in keys
        )
        return (values, locations)

    def count(self) -> None:
        if self.explored >= self.limit:
            raise _Limit(f"search state limit {self.limit} reached", "states")
        if self.depth >= MAX_SEARCH_DEPTH:
            raise _Limit(f"search depth bound {MAX_SEARCH_DEPTH} reached", "depth")
        self.explored += 1

    # --- request simulation --------------------------------------------------------------------
    def simulate(self, state: _State) -> list[Any]:
        sim = state.clone()
        for reservation in self.request.reservations:
            if not self.fits(sim, reservation.location, reservation.nbytes):
                raise _Capacity(reservation.location, reservation.nbytes, "reservation")
            sim.reserved[reservation.location] = (
                sim.reserved.get(reservation.location, 0) + reservation.nbytes
            )
        actions: list[Any] = []
        for requirement in self.request.requirements:
            value = sim.values[requirement.handle]
            dest = requirement.location
            if dest in value.mats:
                continue
            charge = value.charge
            ordered = value.canonical_locations()
            temporary = not ordered
            if temporary:
                if not value.has_source:
                    raise _Unavailable(f"{requirement.handle} has no materialization or source")
                src = value.source_location
                assert src is not None
                if not self.fits(sim, src, charge):
                    raise _Capacity(src, charge, "source reconstruction")
                sim.reserved[src] = sim.reserved.get(src, 0) + charge
                if src == dest:
                    sim.reserved[src] -= charge
            else:
                src = ordered[0]
            if not self.fits(sim, dest, charge):
                raise _Capacity(dest, charge, "materialization")
            sim.used[dest] = sim.used.get(dest, 0) + charge
            if temporary:
                value.mats[dest] = RefMaterialization(dest, charge)
            else:
                source_snap = value.mats[src]
                value.mats[dest] = RefMaterialization(
                    dest,
                    source_snap.charged_nbytes,
                    source_snap.use_count,
                    source_snap.hold_count,
                    source_snap.pending_event_count,
                )
            if temporary and src != dest:
                sim.reserved[src] -= charge
            if value.replica_mode is ReplicaMode.EXCLUSIVE:
                actions.append(
                    MoveResident(requirement.handle, dest, from_location=None if temporary else src)
                )
                if not temporary:
                    del value.mats[src]
                    sim.used[src] -= charge
            else:
                actions.append(EnsureResident(requirement.handle, dest))
        return actions

    # --- candidates and ordering ---------------------------------------------------------
    def candidates(
        self, state: _State, location: ResidencyLocation, blocked: frozenset[Any]
    ) -> list[ResidencyEvictionCandidate]:
        result = []
        for handle, value in state.values.items():
            if handle in blocked:
                continue
            mat = value.mats.get(location)
            if mat is None or mat.protected:
                continue
            result.append(
                ResidencyEvictionCandidate(
                    handle,
                    location,
                    mat.charged_nbytes,
                    value.registration_index,
                    self.epochs.get(handle),
                    self.metadata.get(handle, ResidencyPolicyMetadata()),
                )
            )
        return result

    def ordered(
        self, state: _State, location: ResidencyLocation, blocked: frozenset[Any]
    ) -> list[ResidencyEvictionCandidate]:
        listed = self.candidates(state, location, blocked)
        ordinary = [c for c in listed if (c.handle, location) not in self.required]
        endpoints = [c for c in listed if (c.handle, location) in self.required]
        combined = list(self.policy.order_candidates(tuple(ordinary))) + list(
            self.policy.order_candidates(tuple(endpoints))
        )
        if len(combined) != len(listed) or collections.Counter(combined) != collections.Counter(
            listed
        ):
            raise RuntimeError("policy did not return every candidate exactly once")
        return combined

    # --- search_request --------------------------------------------------------------
    def search_request(self, state: _State) -> tuple[_State, list[Any]]:
        key = ("request", self.signature(state))
        if key in self.failed_requests:
            raise _Fail("the equivalent state is already exhausted")
        self.count()
        self.depth += 1
        try:
            return self.search_request_open(state, key)
        finally:
            self.depth -= 1

    def search_request_open(self, state: _State, key: Any) -> tuple[_State, list[Any]]:
        try:
            enter = self.simulate(state)
        except _Capacity as failure:
            capacity = failure
        else:
            return state, enter
        location = capacity.location
        notes: list[str] = []
        for rank, candidate in enumerate(self.ordered(state, location, frozenset())):
            for trial in self.reclaim_states(state, candidate, rank, frozenset(), frozenset()):
                try:
                    return self.search_request(trial)
                except _Fail as inner:
                    notes.append(f"{candidate.handle.handle_id}@{location}: {inner}")
        self.failed_requests.add(key)
        raise _Fail(
            f"{capacity} (budget={self.budgets.get(location)}, "
            f"used={state.used.get(location, 0)}, reserved={state.reserved.get(location, 0)}); "
            + "; ".join(notes)
        )

    # --- reclaim_states --------------------------------------------------------------
    def reclaim_states(
        self,
        state: _State,
        candidate: ResidencyEvictionCandidate,
        rank: int,
        blocked: frozenset[Any],
        active: frozenset[Any],
    ) -> Iterator[_State]:
        handle = candidate.handle
        location = candidate.location
        pair = (handle, location)
        if pair in active:
            return
        value = state.values[handle]
        alternatives = [loc for loc in value.mats if loc != location]
        if alternatives or value.has_source:
            trial = state.clone()
            action = DropResident(handle, location)
            trial.reclaim.append(action)
            reason = DROP_REPLICATED if alternatives else DROP_SOURCE
            trial.evictions.append((action, rank, location, candidate.charged_nbytes, reason))
            del trial.values[handle].mats[location]
            trial.used[location] -= value.charge
            yield trial
            if alternatives:
                return
        charge = value.charge
        destinations: list[ResidencyLocation] = []
        endpoints = sorted(
            {r.location for r in self.request.requirements if r.handle == handle} - {location},
            key=canonical_key,
        )
        for destination in [*endpoints, *self.policy.fallback_locations(location)]:
            if destination not in destinations:
                destinations.append(destination)
        for destination in destinations:
            additional = 0 if destination in value.mats else charge
            for reached in self.capacity_states(
                state.clone(), destination, additional, blocked | {handle}, active | {pair}
            ):
                trial = reached.clone()
                moved = trial.values[handle]
                if location not in moved.mats:
                    continue
                if destination not in moved.mats:
                    source_snap = moved.mats[location]
                    moved.mats[destination] = RefMaterialization(
                        destination,
                        source_snap.charged_nbytes,
                        source_snap.use_count,
                        source_snap.hold_count,
                        source_snap.pending_event_count,
                    )
                    trial.used[destination] = trial.used.get(destination, 0) + charge
                action = MoveResident(handle, destination, from_location=location)
                trial.reclaim.append(action)
                trial.evictions.append(
                    (action, rank, location, candidate.charged_nbytes, move_reason(destination))
                )
                del moved.mats[location]
                trial.used[location] -= charge
                yield trial

    # --- capacity_states -------------------------------------------------------------
    def capacity_states(
        self,
        state: _State,
        destination: ResidencyLocation,
        additional: int,
        blocked: frozenset[Any],
        active: frozenset[Any],
    ) -> Iterator[_State]:
        if self.fits(state, destination, additional):
            yield state
            return
        registration = {h: v.registration_index for h, v in state.values.items()}
        key = (
            self.signature(state),
            destination.name,
            additional,
            tuple(sorted(registration[h] for h in blocked)),
            tuple(sorted((registration[h], loc.name) for h, loc in active)),
        )
        if key in self.failed_capacities:
            return
        self.count()
        self.depth += 1
        yielded = False
        try:
            for rank, candidate in enumerate(self.ordered(state, destination, blocked)):
                if (candidate.handle, destination) in active:
                    continue
                for reclaimed in self.reclaim_states(state, candidate, rank, blocked, active):
                    for reached in self.capacity_states(
                        reclaimed, destination, additional, blocked, active
                    ):
                        yielded = True
                        yield reached
        finally:
            self.depth -= 1
        if not yielded:
            self.failed_capacities.add(key)


# --------------------------------------------------------------------------------------------
# decide (controller.md#decide, steps 3-6)
# --------------------------------------------------------------------------------------------


def reference_decide(planning: PlanningInput) -> RefOutcome:
    request = planning.request
    by_handle = {v.handle: v for v in planning.values}
    # Step 3: request validation, per requirement in order.
    for requirement in request.requirements:
        handle = requirement.handle
        if handle.manager_id != planning.manager_id:
            return RefOutcome("handle", detail=f"foreign handle {handle}")
        if handle not in by_handle:
            return RefOutcome("handle", detail=f"unknown handle {handle}")
        if by_handle[handle].discarded:
            return RefOutcome("handle", detail=f"discarded handle {handle}")
    required_at: dict[ResidencyHandle[Any], set[ResidencyLocation]] = {}
    for requirement in request.requirements:
        required_at.setdefault(requirement.handle, set()).add(requirement.location)
    for handle, locations in required_at.items():
        if by_handle[handle].replica_mode is ReplicaMode.EXCLUSIVE and len(locations) > 1:
            return RefOutcome("ownership", detail=f"EXCLUSIVE {handle} at {len(locations)}")
    # Step 4: the planning state.
    values: dict[ResidencyHandle[Any], _Value] = {}
    for index, value in enumerate(planning.values):
        if value.discarded:
            continue
        values[value.handle] = _Value(
            value.handle,
            index,
            value.replica_mode,
            value.storage_nbytes,
            value.has_source,
            value.source_location,
            {m.location: m for m in value.materializations},
        )
    state = _State(
        values,
        {e.location: e.used_bytes for e in planning.locations},
        {e.location: e.reserved_bytes for e in planning.locations},
    )
    # Step 5: the search. It recurses once per explored state (a cycle of moves between two
    # tiers only ends at the limit), so the recursion limit is raised for the duration; keep
    # `search_state_limit` small (hundreds) when calling the reference.
    search = _Search(planning)
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(max(previous, 20 * planning.search_state_limit + 2000))
    try:
        final, enter = search.search_request(state)
    except _Limit as limit:
        if limit.bound == "states":
            assert search.explored == planning.search_state_limit
        return RefOutcome("limit", explored_states=search.explored, detail=str(limit))
    except _Fail as failure:
        return RefOutcome("infeasible", explored_states=search.explored, detail=str(failure))
    finally:
        sys.setrecursionlimit(previous)
    return RefOutcome(
        "ok",
        reclaim=tuple(final.reclaim),
        enter=tuple(enter),
        evictions=tuple(final.evictions),
        explored_states=search.explored,
    )
