"""Stateful reliability test: random interleavings of the public residency API (hypothesis).

A `RuleBasedStateMachine` drives one `ResidencyManager` (and a `ResidencyController` over it) on
the two-device `SimulatedRuntime` with pageable, pinned, `cuda:0` and `cuda:1` locations, some
of them budgeted. A small pure-Python model tracks, per value, its materialisation locations,
source and discarded flag, per materialisation its use / hold / pending tokens, and per location
the used and reserved bytes (docs/concepts/transitions.md, lifetimes.md, plans.md,
controller.md).

Every direct primitive's outcome (success, no-op or the exception type) is predicted by the
model. Plans (`execute_actions`, `scope`) are predicted by running the model over the whole
plan on a copy (the preflight, docs/concepts/plans.md#preflight, is the sequential semantics
of the actions), so an
infeasible plan must raise `ResidencyPlanError` and change nothing. Controller decisions are
not re-derived; a successful decision's plan must be feasible in the model and a refused one
must be a documented residency error that left the state unchanged.

Invariants after every step (checked against `snapshot()`):
* per location `used_bytes` equals the model and the sum of the materialisation charges;
* `reserved_bytes` equals the model; `used + reserved <= budget` at budgeted locations;
* each value's materialisation set, discarded flag and source equal the model;
* use / hold / pending counts per materialisation and per location equal the model;
* no MUST_PRESERVE (adopted) live value is ever without a materialisation;
* `state_version` never decreases.
Teardown releases every lifetime and `close()` must succeed.
"""

# Exceptions are compared with the model's prediction inside the rules.
# ruff: noqa: PT017

from __future__ import annotations

import copy
import tempfile
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from fhelium.errors import (
    ResidencyBudgetError,
    ResidencyError,
    ResidencyHandleError,
    ResidencyInUseError,
    ResidencyOwnershipError,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
    ResidencySearchLimitError,
    ResidencyUnavailableError,
)
from fhelium.residency import (
    DiscardValue,
    DropResident,
    EnsureResident,
    MemoryReservation,
    MoveResident,
    ResidencyController,
    ResidencyManager,
    ResidencyPlan,
    ResidencyRequest,
    ResidencyRequirement,
)
from fhelium.residency.disk import disk_location
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, ResidencyLocation
from helpers.manager import (
    ALL_LOCATIONS,
    CUDA0,
    CUDA1,
    EXCLUSIVE,
    REPLICABLE,
    Source,
    canonical_key,
    on,
    sim_factory,
    spec,
    tensor_value,
)

Loc = ResidencyLocation

# One disk directory for the whole module: every manager makes a directory of its own
# inside it and removes it at close.
DISK = disk_location(tempfile.mkdtemp(prefix="residency-stateful-"))
MACHINE_LOCATIONS = (*ALL_LOCATIONS, DISK)

BUDGET_CONFIGS: tuple[dict[Loc, int], ...] = (
    {CUDA0: 24, PINNED_HOST: 32, DISK: 24},
    {CUDA0: 16, CUDA1: 40},
    {PINNED_HOST: 16, CUDA1: 24, PAGEABLE_HOST: 64, DISK: 48},
    {CUDA0: 32, CUDA1: 16, PINNED_HOST: 24},
)

MAX_LIVE = 5
MAX_VALUES = 10


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


@dataclass
class MValue:
    handle: Any
    charge: int
    exclusive: bool
    source_location: Loc | None
    must_preserve: bool
    mats: set[Loc] = field(default_factory=set)
    discarded: bool = False
    uses: Counter[Loc] = field(default_factory=Counter)
    holds: Counter[Loc] = field(default_factory=Counter)
    pending: Counter[Loc] = field(default_factory=Counter)

    def protected(self, loc: Loc) -> bool:
        return self.uses[loc] + self.holds[loc] + self.pending[loc] > 0


class Failure(Exception):
    """A model-predicted failure: `allowed` are the acceptable exception types."""

    def __init__(
        self,
        *allowed: type[BaseException],
        location: Loc | None = None,
        budget: tuple[int, int, int, int] | None = None,
    ) -> None:
        super().__init__(allowed)
        self.allowed = allowed
        self.location = location
        # (budget_bytes, used_bytes, reserved_bytes, requested_bytes) of a budget refusal
        self.budget = budget


class Model:
    def __init__(self, budgets: dict[Loc, int]) -> None:
        self.budgets = dict(budgets)
        self.used: Counter[Loc] = Counter()
        self.reserved: Counter[Loc] = Counter()
        self.values: list[MValue] = []

    def clone(self) -> Model:
        return copy.deepcopy(self)

    # --- accounting ------------------------------------------------------------------
    def check_fits(self, loc: Loc, nbytes: int) -> None:
        budget = self.budgets.get(loc)
        if budget is not None and self.used[loc] + self.reserved[loc] + nbytes > budget:
            numbers = (budget, self.used[loc], self.reserved[loc], nbytes)
            raise Failure(ResidencyBudgetError, location=loc, budget=numbers)

    def install(self, v: MValue, loc: Loc) -> None:
        self.check_fits(loc, v.charge)
        v.mats.add(loc)
        self.used[loc] += v.charge

    def remove(self, v: MValue, loc: Loc) -> None:
        v.mats.remove(loc)
        self.used[loc] -= v.charge

    def reconstruct_into(self, v: MValue, at: Loc) -> None:
        if v.source_location is None:
            raise Failure(ResidencyUnavailableError)
        # the temporary charge (docs/concepts/values.md#reconstruction)
        self.check_fits(v.source_location, v.charge)
        if v.source_location != at:
            self.check_fits(at, v.charge)
        self.install(v, at)

    # --- actions (each either raises Failure with no change, or applies fully) --------
    def ensure(self, v: MValue, at: Loc) -> bool:
        """Returns True for a no-op."""
        if v.discarded:
            raise Failure(ResidencyHandleError)
        if at in v.mats:
            return True
        if v.exclusive and v.mats:
            raise Failure(ResidencyOwnershipError)
        if v.mats:
            self.install(v, at)
        else:
            self.reconstruct_into(v, at)
        return False

    def move(self, v: MValue, to: Loc, from_location: Loc | None) -> bool:
        if v.discarded:
            raise Failure(ResidencyHandleError)
        if from_location is not None and from_location not in v.mats:
            raise Failure(ResidencyUnavailableError)
        if from_location is not None:
            selected: Loc | None = from_location
        else:
            others = [loc for loc in v.mats if loc != to]
            selected = min(others, key=canonical_key) if others else None
        if to in v.mats:
            if selected is None or selected == to:
                return True
            if v.protected(selected):
                raise Failure(ResidencyInUseError)
            self.remove(v, selected)
            return False
        if selected is not None:
            protected = v.protected(selected)
            budget = self.budgets.get(to)
            over = budget is not None and self.used[to] + self.reserved[to] + v.charge > budget
            if protected and over:
                raise Failure(ResidencyInUseError, ResidencyBudgetError)
            if protected:
                raise Failure(ResidencyInUseError)
            self.install(v, to)
            self.remove(v, selected)
            return False
        self.reconstruct_into(v, to)
        return False

    def drop(self, v: MValue, at: Loc) -> bool:
        if v.discarded:
            raise Failure(ResidencyHandleError)
        if at not in v.mats:
            return True
        if v.protected(at):
            raise Failure(ResidencyInUseError)
        if len(v.mats) == 1 and v.source_location is None:
            raise Failure(ResidencyOwnershipError)
        self.remove(v, at)
        return False

    def discard(self, v: MValue) -> bool:
        if v.discarded:
            raise Failure(ResidencyHandleError)
        if any(v.protected(loc) for loc in v.mats):
            raise Failure(ResidencyInUseError)
        for loc in list(v.mats):
            self.remove(v, loc)
        v.source_location = None
        v.discarded = True
        return False

    def apply(self, action: Any) -> bool:
        v = self.value_of(action.handle)
        if isinstance(action, EnsureResident):
            return self.ensure(v, action.location)
        if isinstance(action, MoveResident):
            return self.move(v, action.to, action.from_location)
        if isinstance(action, DropResident):
            return self.drop(v, action.location)
        return self.discard(v)

    def reserve(self, loc: Loc, nbytes: int) -> None:
        self.check_fits(loc, nbytes)
        self.reserved[loc] += nbytes

    def value_of(self, handle: Any) -> MValue:
        for v in self.values:
            if v.handle == handle:
                return v
        raise AssertionError(f"unknown handle {handle}")

    def run_plan(self, reservations: Any, actions: Any) -> None:
        """Sequential semantics of a whole plan on this model (mutates; raises Failure)."""
        for res in reservations:
            self.reserve(res.location, res.nbytes)
        for action in actions:
            self.apply(action)


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------

locations = st.sampled_from(MACHINE_LOCATIONS)
maybe_location = st.one_of(st.none(), locations)
indices = st.integers(min_value=0, max_value=31)
action_specs = st.tuples(
    st.sampled_from(["ensure"] * 3 + ["move"] * 2 + ["move-from", "drop", "drop", "discard"]),
    indices,
    locations,
    locations,
)
small_reservations = st.lists(st.tuples(locations, st.sampled_from([0, 4, 8, 16])), max_size=2)


def expect(failure: Failure | None, exc: BaseException | None, what: str) -> None:
    if failure is None:
        assert exc is None, f"{what}: raised {exc!r}, the model expected success"
        return
    assert exc is not None, f"{what}: succeeded, the model expected {failure.allowed}"
    assert isinstance(exc, failure.allowed), f"{what}: {exc!r}, expected {failure.allowed}"
    if failure.location is not None and isinstance(exc, ResidencyBudgetError):
        assert exc.location == failure.location.name, (exc.location, failure.location)
    if failure.budget is not None and isinstance(exc, ResidencyBudgetError):
        actual = (exc.budget_bytes, exc.used_bytes, exc.reserved_bytes, exc.requested_bytes)
        assert actual == failure.budget, (what, actual, failure.budget)


class ResidencyMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        from fhelium.residency._runtime import SimulatedRuntime, use_runtime

        self.stack = ExitStack()
        self.runtime = SimulatedRuntime(device_count=2)
        self.stack.enter_context(use_runtime(self.runtime))
        self.streams = {
            CUDA0: self._stream(0),
            CUDA1: self._stream(1),
        }
        self.manager: ResidencyManager | None = None
        self.model: Model | None = None
        self.version = 0
        self.leases: list[tuple[Any, list[Any], Loc]] = []
        self.holds: list[tuple[Any, list[Any], Loc]] = []
        self.reservations: list[tuple[Any, Loc, int]] = []
        self.scopes: list[tuple[Any, Any, list[tuple[Loc, int]]]] = []

    def _stream(self, index: int) -> Any:
        from fhelium.residency._runtime.simulated import SimulatedStream

        return SimulatedStream(self.runtime, torch.device("cuda", index))

    # --- helpers -------------------------------------------------------------------------
    @property
    def m(self) -> ResidencyManager:
        assert self.manager is not None
        return self.manager

    @property
    def md(self) -> Model:
        assert self.model is not None
        return self.model

    def pick(self, index: int) -> MValue:
        return self.md.values[index % len(self.md.values)]

    def live(self) -> list[MValue]:
        return [v for v in self.md.values if not v.discarded]

    def attempt(self, failure: Failure | None, what: str, fn: Any) -> Any:
        kind = what.split("(", maxsplit=1)[0].split(" ", maxsplit=1)[0]
        # No lease is reapable between steps (events complete only in `complete_events`,
        # which reaps at once), so a refused operation must not advance the version.
        before = self.m.state_version
        try:
            result = fn()
        except ResidencyError as exc:
            event(f"{kind}: {type(exc).__name__}")
            expect(failure, exc, what)
            assert self.m.state_version == before, f"{what}: refused, but the version advanced"
            return None
        event(f"{kind}: ok")
        expect(failure, None, what)
        return result

    def build_actions(self, specs: list[tuple[str, int, Loc, Loc]]) -> list[Any]:
        actions: list[Any] = []
        for kind, index, loc, other in specs:
            handle = self.pick(index).handle
            if kind == "ensure":
                actions.append(EnsureResident(handle, loc))
            elif kind == "move":
                actions.append(MoveResident(handle, loc))
            elif kind == "move-from":
                v = self.pick(index)
                source = sorted(v.mats, key=canonical_key)[0] if v.mats else other
                actions.append(MoveResident(handle, loc, source))
            elif kind == "drop":
                actions.append(DropResident(handle, loc))
            else:
                actions.append(DiscardValue(handle))
        return actions

    # --- setup -----------------------------------------------------------------------------
    @initialize(config=st.integers(min_value=0, max_value=len(BUDGET_CONFIGS) - 1))
    def setup(self, config: int) -> None:
        budgets = BUDGET_CONFIGS[config]
        self.manager = ResidencyManager(budgets, trace_capacity=16)
        self.model = Model(budgets)
        self.controller = ResidencyController(self.manager, search_state_limit=500)
        # Start with one adopted and one source-backed value so every rule has a target.
        self.adopt(PAGEABLE_HOST, 1, exclusive=False)
        self.register_source(CUDA0, 2, exclusive=True)

    # --- values ----------------------------------------------------------------------------
    @precondition(lambda self: len(self.live()) < MAX_LIVE and len(self.md.values) < MAX_VALUES)
    @rule(loc=locations, n=st.sampled_from([1, 2, 4, 8]), exclusive=st.booleans())
    def adopt(self, loc: Loc, n: int, exclusive: bool) -> None:
        loc = PAGEABLE_HOST if loc == DISK else loc  # a value is never adopted on disk
        mode = EXCLUSIVE if exclusive else REPLICABLE
        value = on(self.runtime, loc, tensor_value(n))
        trial = self.md.clone()
        mv = MValue(None, 4 * n, exclusive, None, True)
        failure: Failure | None = None
        try:
            trial.install(mv, loc)
        except Failure as f:
            failure = f
        handle = self.attempt(
            failure, f"adopt at {loc}", lambda: self.m.adopt(value, replica_mode=mode)
        )
        if handle is not None:
            mv.handle = handle
            trial.values.append(mv)
            self.model = trial

    @precondition(lambda self: len(self.live()) < MAX_LIVE and len(self.md.values) < MAX_VALUES)
    @rule(loc=locations, n=st.sampled_from([1, 2, 4, 8]), exclusive=st.booleans())
    def register_source(self, loc: Loc, n: int, exclusive: bool) -> None:
        loc = PAGEABLE_HOST if loc == DISK else loc  # a source never loads onto disk
        mode = EXCLUSIVE if exclusive else REPLICABLE
        source = Source(sim_factory(self.runtime, loc, n))
        handle = self.m.register_source(spec(n, replica=mode), source, source_location=loc)
        self.md.values.append(MValue(handle, 4 * n, exclusive, loc, False))

    # --- direct primitives -----------------------------------------------------------------
    @rule(
        op=st.sampled_from(
            ["ensure"] * 3
            + ["copy"]
            + ["move"] * 2
            + ["move-from"] * 2
            + ["drop"] * 2
            + ["discard"]
        ),
        index=indices,
        loc=locations,
        other=locations,
    )
    def primitive(self, op: str, index: int, loc: Loc, other: Loc) -> None:
        v = self.pick(index)
        if op == "move-from" and v.mats:
            other = sorted(v.mats, key=canonical_key)[index % len(v.mats)]
        trial = self.md.clone()
        tv = trial.value_of(v.handle)
        failure: Failure | None = None
        no_op = False
        try:
            if op in ("ensure", "copy"):
                no_op = trial.ensure(tv, loc)
            elif op == "move":
                no_op = trial.move(tv, loc, None)
            elif op == "move-from":
                no_op = trial.move(tv, loc, other)
            elif op == "drop":
                no_op = trial.drop(tv, loc)
            else:
                no_op = trial.discard(tv)
        except Failure as f:
            failure = f

        def call() -> Any:
            if op == "ensure":
                return self.m.ensure(v.handle, loc)
            if op == "copy":
                return self.m.copy(v.handle, loc)
            if op == "move":
                return self.m.move(v.handle, loc)
            if op == "move-from":
                return self.m.move(v.handle, loc, from_location=other)
            if op == "drop":
                return self.m.drop(v.handle, loc)
            return self.m.discard(v.handle)

        report = self.attempt(failure, f"{op}({v.handle.handle_id}, {loc}, {other})", call)
        if failure is None:
            assert report.no_op is no_op, (op, report)
            self.model = trial

    # --- plans -----------------------------------------------------------------------------
    @rule(specs=st.lists(action_specs, max_size=4))
    def execute_actions(self, specs: list[tuple[str, int, Loc, Loc]]) -> None:
        actions = self.build_actions(specs)
        trial = self.md.clone()
        failure: Failure | None = None
        try:
            trial.run_plan((), actions)
        except Failure:
            failure = Failure(ResidencyPlanError)
        report = self.attempt(
            failure,
            f"execute_actions({actions})",
            lambda: self.m.execute_actions(actions, name="random"),
        )
        if failure is None:
            assert len(report.transitions) == len(actions)
            self.model = trial

    @precondition(lambda self: len(self.scopes) < 3)
    @rule(
        enter=st.lists(action_specs, max_size=3),
        exit_=st.lists(action_specs, max_size=2),
        reservations=small_reservations,
    )
    def scope_enter(
        self,
        enter: list[tuple[str, int, Loc, Loc]],
        exit_: list[tuple[str, int, Loc, Loc]],
        reservations: list[tuple[Loc, int]],
    ) -> None:
        plan = ResidencyPlan(
            "scope",
            enter=self.build_actions(enter),
            exit=self.build_actions(exit_),
            reservations=[
                MemoryReservation(loc, n, f"r{i}") for i, (loc, n) in enumerate(reservations)
            ],
        )
        failure: Failure | None = None
        try:
            self.md.clone().run_plan(plan.reservations, plan.enter + plan.exit)
        except Failure:
            failure = Failure(ResidencyPlanError)
        scope = self.m.scope(plan)
        entered = self.attempt(failure, f"scope enter {plan}", scope.__enter__)
        if failure is None:
            assert entered is scope
            self.md.run_plan(plan.reservations, plan.enter)
            self.scopes.append((scope, plan, reservations))

    def _close_scope(self, i: int) -> None:
        scope, plan, reservations = self.scopes.pop(i)
        trial = self.md.clone()
        failed_index: int | None = None
        for index, action in enumerate(plan.exit):
            try:
                trial.apply(action)
            except Failure:
                failed_index = index
                break
        for loc, n in reservations:
            trial.reserved[loc] -= n
        try:
            scope.close()
        except ResidencyPlanExecutionError as exc:
            assert failed_index is not None, f"scope exit raised {exc!r}, model expected success"
            assert exc.phase == "exit"
            assert exc.failed_action_index == failed_index
            assert scope.exit_error is exc
            event("scope exit: ResidencyPlanExecutionError")
        else:
            assert failed_index is None, f"scope exit succeeded, model failed at {failed_index}"
            assert scope.report is not None
            event("scope exit: ok")
        self.model = trial

    @rule(index=indices)
    def scope_exit(self, index: int) -> None:
        if not self.scopes:
            return
        self._close_scope(index % len(self.scopes))

    # --- lifetimes ---------------------------------------------------------------------------
    @rule(picks=st.lists(indices, min_size=1, max_size=2), loc=locations, resident=st.booleans())
    def acquire(self, picks: list[int], loc: Loc, resident: bool) -> None:
        chosen = self.choose(picks)
        if resident and chosen[0].mats:  # aim at a location the first value occupies
            loc = sorted(chosen[0].mats, key=canonical_key)[picks[0] % len(chosen[0].mats)]
        if loc == DISK:
            before = self.m.state_version
            with pytest.raises(ValueError, match="cannot be borrowed"):
                self.m.acquire([v.handle for v in chosen], at=loc)
            assert self.m.state_version == before
            return
        failure = self._lifetime_failure(chosen, loc)
        stream = self.streams.get(loc)
        lease = self.attempt(
            failure,
            f"acquire at {loc}",
            lambda: self.m.acquire([v.handle for v in chosen], at=loc, consumer_stream=stream),
        )
        if lease is not None:
            assert lease.active
            values = lease.values
            assert all(values[v.handle] is not None for v in chosen)
            for v in chosen:
                v.uses[loc] += 1
            self.leases.append((lease, [v.handle for v in chosen], loc))

    def choose(self, picks: list[int]) -> list[MValue]:
        chosen: list[MValue] = []
        for index in picks:
            v = self.pick(index)
            if all(v is not c for c in chosen):
                chosen.append(v)
        return chosen

    @staticmethod
    def _lifetime_failure(chosen: list[MValue], loc: Loc) -> Failure | None:
        """Handles are checked in order: discarded, then not resident (lifetimes.md#leases)."""
        for v in chosen:
            if v.discarded:
                return Failure(ResidencyHandleError)
            if loc not in v.mats:
                return Failure(ResidencyUnavailableError)
        return None

    def _release_lease(self, i: int, wait: bool) -> None:
        lease, chosen, loc = self.leases.pop(i)
        lease.release(wait=wait)
        assert not lease.active
        for handle in chosen:
            v = self.md.value_of(handle)
            v.uses[loc] -= 1
            if loc.device.type == "cuda" and not wait:
                v.pending[loc] += 1

    @rule(index=indices, wait=st.booleans())
    def release_lease(self, index: int, wait: bool) -> None:
        if not self.leases:
            return
        self._release_lease(index % len(self.leases), wait)

    @rule()
    def complete_events(self) -> None:
        self.runtime.complete_events()
        self.m.snapshot()  # reaps
        for v in self.md.values:
            v.pending.clear()

    @rule(picks=st.lists(indices, min_size=1, max_size=2), loc=locations, resident=st.booleans())
    def hold(self, picks: list[int], loc: Loc, resident: bool) -> None:
        chosen = self.choose(picks)
        if resident and chosen[0].mats:  # aim at a location the first value occupies
            loc = sorted(chosen[0].mats, key=canonical_key)[picks[0] % len(chosen[0].mats)]
        failure = self._lifetime_failure(chosen, loc)
        held = self.attempt(
            failure, f"hold at {loc}", lambda: self.m.hold([v.handle for v in chosen], at=loc)
        )
        if held is not None:
            for v in chosen:
                v.holds[loc] += 1
            self.holds.append((held, [v.handle for v in chosen], loc))

    @rule(index=indices)
    def release_hold(self, index: int) -> None:
        if not self.holds:
            return
        held, chosen, loc = self.holds.pop(index % len(self.holds))
        held.release()
        assert not held.active
        for handle in chosen:
            self.md.value_of(handle).holds[loc] -= 1

    @rule(loc=locations, nbytes=st.sampled_from([0, 4, 8, 16, 32]))
    def reserve(self, loc: Loc, nbytes: int) -> None:
        failure: Failure | None = None
        try:
            self.md.clone().reserve(loc, nbytes)
        except Failure as f:
            failure = f
        res = self.attempt(
            failure, f"reserve {nbytes} at {loc}", lambda: self.m.reserve(loc, nbytes, label="r")
        )
        if res is not None:
            self.md.reserve(loc, nbytes)
            self.reservations.append((res, loc, nbytes))

    @rule(index=indices)
    def release_reservation(self, index: int) -> None:
        if not self.reservations:
            return
        res, loc, nbytes = self.reservations.pop(index % len(self.reservations))
        res.release()
        assert not res.active
        self.md.reserved[loc] -= nbytes

    # --- controller --------------------------------------------------------------------------
    def _request(
        self,
        picks: list[tuple[int, Loc]],
        reservations: list[tuple[Loc, int]],
        *,
        borrowed: bool = False,
    ) -> tuple[ResidencyRequest, Failure | None]:
        requirements: list[ResidencyRequirement] = []
        for index, pick in picks:
            # A use borrows every requirement, and a disk location cannot be borrowed.
            loc = PAGEABLE_HOST if borrowed and pick == DISK else pick
            req = ResidencyRequirement(self.pick(index).handle, loc)
            if req not in requirements:
                requirements.append(req)
        request = ResidencyRequest(
            "request",
            requirements,
            [MemoryReservation(loc, n, f"q{i}") for i, (loc, n) in enumerate(reservations)],
        )
        failure: Failure | None = None
        values = [self.md.value_of(r.handle) for r in requirements]
        if any(v.discarded for v in values):
            failure = Failure(ResidencyHandleError)
        elif any(
            v.exclusive and len({r.location for r in requirements if r.handle == v.handle}) > 1
            for v in values
        ):
            failure = Failure(ResidencyOwnershipError)
        return request, failure

    def _check_decision(self, decision: Any) -> Model:
        """A feasible decision's plan must be feasible in the model; returns the model after
        reclaim + reservations + enter."""
        plan = decision.plan
        assert plan.exit == ()
        trial = self.md.clone()
        try:
            trial.run_plan((), plan.reclaim)
            trial.run_plan(plan.reservations, plan.enter)
        except Failure as f:
            raise AssertionError(f"decided plan {plan} is infeasible in the model: {f}") from f
        for req in decision.request.requirements:
            assert req.location in trial.value_of(req.handle).mats, (req, plan)
        return trial

    @rule(
        picks=st.lists(st.tuples(indices, locations), min_size=1, max_size=3),
        reservations=small_reservations,
    )
    def controller_decide(
        self, picks: list[tuple[int, Loc]], reservations: list[tuple[Loc, int]]
    ) -> None:
        request, failure = self._request(picks, reservations)
        before = self.m.state_version
        try:
            decision = self.controller.decide(request)
        except (ResidencyPlanError, ResidencySearchLimitError) as exc:
            # Infeasible (or too large a search): allowed unless the model predicted another
            # specific refusal.
            assert failure is None, (exc, failure)
            event(f"decide: {type(exc).__name__}")
            return
        except ResidencyError as exc:
            event(f"decide: {type(exc).__name__}")
            expect(failure, exc, "decide")
            return
        finally:
            assert self.m.state_version == before, "decide advanced the version"
        expect(failure, None, "decide")
        event(f"decide: ok ({len(decision.plan.reclaim)} reclaim)")
        self._check_decision(decision)

    @rule(
        picks=st.lists(st.tuples(indices, locations), min_size=1, max_size=3),
        reservations=small_reservations,
    )
    def controller_use(
        self, picks: list[tuple[int, Loc]], reservations: list[tuple[Loc, int]]
    ) -> None:
        request, failure = self._request(picks, reservations, borrowed=True)
        cuda_locs = {r.location for r in request.requirements if r.location.device.type == "cuda"}
        consumer = {loc: self.streams[loc] for loc in cuda_locs}
        use = self.controller.use(request, consumer_streams=consumer)
        before = self.m.state_version
        try:
            use.__enter__()
        except (ResidencyPlanError, ResidencySearchLimitError) as exc:
            assert failure is None, (exc, failure)
            event(f"use: {type(exc).__name__}")
            with pytest.raises(RuntimeError):
                _ = use.decision  # entry failed in decide: nothing happened
            assert self.m.state_version == before
            return
        except ResidencyError as exc:
            event(f"use: {type(exc).__name__}")
            expect(failure, exc, "use")
            with pytest.raises(RuntimeError):
                _ = use.decision
            assert self.m.state_version == before
            return
        expect(failure, None, "use")
        event(f"use: ok ({len(use.decision.plan.reclaim)} reclaim)")
        trial = self._check_decision(use.decision)
        for req in request.requirements:
            trial.value_of(req.handle).uses[req.location] += 1
        self.model = trial
        self.check_state()
        first = request.requirements[0]
        assert use.value(first.handle, at=first.location) is not None
        assert use.__exit__(None, None, None) is False
        for res in request.reservations:
            self.md.reserved[res.location] -= res.nbytes
        for req in request.requirements:
            v = self.md.value_of(req.handle)
            v.uses[req.location] -= 1
            if req.location.device.type == "cuda":
                v.pending[req.location] += 1

    @rule(
        steps=st.lists(
            st.lists(st.tuples(indices, locations), min_size=1, max_size=2), min_size=1, max_size=4
        ),
        reservations=small_reservations,
        prefetch=st.integers(min_value=0, max_value=2),
        stop=st.integers(min_value=1, max_value=5),
    )
    def controller_pipeline(
        self,
        steps: list[list[tuple[int, Loc]]],
        reservations: list[tuple[Loc, int]],
        prefetch: int,
        stop: int,
    ) -> None:
        """A pipeline over up to four requests, broken off after `stop` steps: each step
        sees its values, budgets hold throughout, and afterwards nothing of it remains
        but the materialisations it installed and its steps' pending lease events."""
        requests = []
        for position, picks in enumerate(steps):
            request, failure = self._request(
                picks, reservations if position == 1 else [], borrowed=True
            )
            if failure is not None:
                return  # refusals of single requests are use's rules
            requests.append(request)
        pipeline = self.controller.run(requests, prefetch=prefetch, consumer_streams=self.streams)
        try:
            with pipeline:
                self._drive(pipeline, stop)
        except (ResidencyPlanError, ResidencyBudgetError) as exc:
            event(f"pipeline: {type(exc).__name__}")
        else:
            event(f"pipeline: ok (prefetch {prefetch})")
        assert self.m._engine.core.transfer_count() == 0
        self._resync()

    def _drive(self, pipeline: Any, stop: int) -> None:
        for count, step in enumerate(pipeline, start=1):
            for requirement in step.request.requirements:
                assert step.value(requirement.handle, at=requirement.location) is not None
            snap = self.m.snapshot()
            for entry in snap.locations:
                if entry.budget_bytes is not None:
                    assert entry.used_bytes + entry.reserved_bytes <= entry.budget_bytes, entry
            if count % 2:
                self.runtime.complete_events()
            if count >= stop:
                break

    def _resync(self) -> None:
        """Checks that only the machine's own protections and reservations remain, then
        takes materialisations, charges and pending events from a snapshot."""
        snap = self.m.snapshot()
        assert sum(r.nbytes for r in snap.reservations) == sum(self.md.reserved.values())
        used: Counter[Loc] = Counter()
        for entry, v in zip(snap.values, self.md.values, strict=True):
            mats = {m.location: m for m in entry.materializations}
            if v.must_preserve and not v.discarded:
                assert mats, f"MUST_PRESERVE value {v.handle.handle_id} lost its last copy"
            for loc, mat in mats.items():
                assert (mat.use_count, mat.hold_count) == (v.uses[loc], v.holds[loc]), (
                    v.handle.handle_id,
                    loc,
                )
                used[loc] += mat.charged_nbytes
            v.mats = set(mats)
            v.pending = Counter({loc: mat.pending_event_count for loc, mat in mats.items()})
        self.md.used = used

    # --- invariants --------------------------------------------------------------------------
    @invariant()
    def check_state(self) -> None:
        if self.manager is None:
            return
        snap = self.m.snapshot()
        assert snap.state_version >= self.version, "state_version decreased"
        self.version = snap.state_version
        model = self.md
        assert [v.handle for v in snap.values] == [v.handle for v in model.values]
        charges: Counter[Loc] = Counter()
        tokens: dict[Loc, list[int]] = {}
        for entry, v in zip(snap.values, model.values, strict=True):
            assert entry.discarded is v.discarded, v.handle
            assert entry.has_source is (v.source_location is not None), v.handle
            assert entry.source_location == v.source_location, v.handle
            mats = {m.location: m for m in entry.materializations}
            assert len(mats) == len(entry.materializations)
            assert set(mats) == v.mats, (v.handle.handle_id, set(mats), v.mats)
            if v.must_preserve and not v.discarded:
                assert mats, f"MUST_PRESERVE value {v.handle.handle_id} lost its last copy"
            for loc, mat in mats.items():
                assert mat.charged_nbytes == v.charge
                charges[loc] += mat.charged_nbytes
                counts = (mat.use_count, mat.hold_count, mat.pending_event_count)
                assert counts == (v.uses[loc], v.holds[loc], v.pending[loc]), (
                    v.handle.handle_id,
                    loc,
                    counts,
                    v.uses[loc],
                    v.holds[loc],
                    v.pending[loc],
                )
                total = tokens.setdefault(loc, [0, 0, 0])
                for k in range(3):
                    total[k] += counts[k]
        registered = {e.location for e in snap.locations}
        for loc in MACHINE_LOCATIONS:
            if model.used[loc] or model.reserved[loc]:
                assert loc in registered, loc
        for e in snap.locations:
            loc = e.location
            assert e.used_bytes == model.used[loc] == charges[loc], (loc, e, model.used[loc])
            assert e.reserved_bytes == model.reserved[loc], (loc, e, model.reserved[loc])
            assert e.budget_bytes == model.budgets.get(loc)
            if e.budget_bytes is not None:
                assert e.used_bytes + e.reserved_bytes <= e.budget_bytes, e
            assert [e.use_count, e.hold_count, e.pending_event_count] == tokens.get(
                loc, [0, 0, 0]
            ), e
        assert sum(r.nbytes for r in snap.reservations) == sum(model.reserved.values())

    # --- teardown ----------------------------------------------------------------------------
    def teardown(self) -> None:
        try:
            if self.manager is not None:
                while self.scopes:
                    self._close_scope(len(self.scopes) - 1)
                while self.leases:
                    self._release_lease(len(self.leases) - 1, wait=True)
                for held, _, _ in self.holds:
                    held.release()
                for res, _, _ in self.reservations:
                    res.release()
                self.holds.clear()
                self.reservations.clear()
                self.runtime.complete_events()
                self.manager.close()
        finally:
            self.stack.close()


ResidencyMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestResidencyReliability = ResidencyMachine.TestCase
