"""Random sequences of primitives checked against a tiny reference model (hypothesis).

The model follows docs/concepts/values.md, transitions.md and locations-and-budgets.md
literally: per location it tracks
`used`, `peak_used`, `peak_charged` and registration order; per handle its ordered
materialisation locations, its source and whether it was discarded; plus the exact version.
After every step the manager's snapshot, the returned report or the raised exception, and the
version are compared with the model's prediction.
"""

# Exceptions are compared with the model's prediction inside the loop.
# ruff: noqa: PT017

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from fhelium.errors import (
    ResidencyBudgetError,
    ResidencyError,
    ResidencyHandleError,
    ResidencyOwnershipError,
    ResidencyUnavailableError,
)
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, ResidencyLocation
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.plan import DiscardValue, DropResident, EnsureResident, MoveResident
from helpers.manager import (
    ALL_LOCATIONS,
    CUDA0,
    CUDA1,
    DROP_NOOP,
    ENSURE_NOOP,
    EXCLUSIVE,
    MOVE_NOOP,
    REPLICABLE,
    Source,
    assert_balanced,
    canonical_key,
    loc_snap,
    on,
    sim_factory,
    simulated,
    spec,
    tensor_value,
    val_snap,
)


@dataclass
class ModelValue:
    charge: int
    exclusive: bool
    source_location: ResidencyLocation | None
    mats: list[ResidencyLocation] = field(default_factory=list)
    discarded: bool = False


@dataclass
class Outcome:
    error: type[BaseException] | None = None
    error_location: str | None = None
    no_op: bool = False
    source: ResidencyLocation | None = None
    destination: ResidencyLocation | None = None
    reason: str | None = None


class Model:
    def __init__(self, budgets: dict[ResidencyLocation, int]) -> None:
        self.budgets = dict(budgets)
        self.registered: list[ResidencyLocation] = list(budgets)
        self.used = {loc: 0 for loc in ALL_LOCATIONS}
        self.peak_used = {loc: 0 for loc in ALL_LOCATIONS}
        self.peak_charged = {loc: 0 for loc in ALL_LOCATIONS}
        self.version = 0
        self.values: list[ModelValue] = []

    # --- primitives of the model ------------------------------------------------------
    def fits(self, loc: ResidencyLocation, nbytes: int) -> bool:
        budget = self.budgets.get(loc)
        return budget is None or self.used[loc] + nbytes <= budget

    def register(self, loc: ResidencyLocation) -> None:
        if loc not in self.registered:
            self.registered.append(loc)
            self.version += 1

    def install(self, value: ModelValue, loc: ResidencyLocation) -> None:
        self.register(loc)
        value.mats.append(loc)
        self.used[loc] += value.charge
        self.peak_used[loc] = max(self.peak_used[loc], self.used[loc])
        self.peak_charged[loc] = max(self.peak_charged[loc], self.used[loc])
        self.version += 1

    def remove(self, value: ModelValue, loc: ResidencyLocation) -> None:
        value.mats.remove(loc)
        self.used[loc] -= value.charge
        self.version += 1

    def budget_error(self, loc: ResidencyLocation) -> Outcome:
        return Outcome(error=ResidencyBudgetError, error_location=loc.name)

    def reconstruct_into(self, value: ModelValue, at: ResidencyLocation) -> Outcome | None:
        """The reconstruction path (values.md#reconstruction); an error outcome or None."""
        sl = value.source_location
        assert sl is not None
        if not self.fits(sl, value.charge):
            return self.budget_error(sl)
        self.peak_charged[sl] = max(self.peak_charged[sl], self.used[sl] + value.charge)
        if not self.fits(at, value.charge):
            return self.budget_error(at)
        self.install(value, at)
        return None

    # --- public operations ------------------------------------------------------------
    def adopt(self, value: ModelValue, loc: ResidencyLocation) -> bool:
        if not self.fits(loc, value.charge):
            return False
        self.values.append(value)
        self.install(value, loc)
        return True

    def register_source(self, value: ModelValue) -> None:
        assert value.source_location is not None
        self.register(value.source_location)
        self.values.append(value)
        self.version += 1

    def ensure(self, value: ModelValue, at: ResidencyLocation) -> Outcome:
        if value.discarded:
            return Outcome(error=ResidencyHandleError)
        if at in value.mats:
            return Outcome(no_op=True, destination=at, reason=ENSURE_NOOP)
        if value.exclusive and value.mats:
            return Outcome(error=ResidencyOwnershipError)
        if value.mats:
            source = min(value.mats, key=canonical_key)
            if not self.fits(at, value.charge):
                return self.budget_error(at)
            self.install(value, at)
            return Outcome(source=source, destination=at)
        if value.source_location is None:
            return Outcome(error=ResidencyUnavailableError)
        failure = self.reconstruct_into(value, at)
        if failure is not None:
            return failure
        return Outcome(source=value.source_location, destination=at)

    def move(
        self, value: ModelValue, to: ResidencyLocation, from_location: ResidencyLocation | None
    ) -> Outcome:
        if value.discarded:
            return Outcome(error=ResidencyHandleError)
        if from_location is not None and from_location not in value.mats:
            return Outcome(error=ResidencyUnavailableError)
        if from_location is not None:
            selected: ResidencyLocation | None = from_location
        else:
            others = [loc for loc in value.mats if loc != to]
            selected = min(others, key=canonical_key) if others else None
        if to in value.mats:
            if selected is None or selected == to:
                return Outcome(
                    no_op=True,
                    source=to if from_location == to else None,
                    destination=to,
                    reason=MOVE_NOOP,
                )
            self.remove(value, selected)
            return Outcome(source=selected, destination=to)
        if selected is not None:
            if not self.fits(to, value.charge):
                return self.budget_error(to)
            self.install(value, to)
            self.remove(value, selected)
            return Outcome(source=selected, destination=to)
        if value.source_location is None:
            return Outcome(error=ResidencyUnavailableError)
        failure = self.reconstruct_into(value, to)
        if failure is not None:
            return failure
        return Outcome(source=value.source_location, destination=to)

    def drop(self, value: ModelValue, at: ResidencyLocation) -> Outcome:
        if value.discarded:
            return Outcome(error=ResidencyHandleError)
        if at not in value.mats:
            return Outcome(no_op=True, source=at, reason=DROP_NOOP)
        if len(value.mats) == 1 and value.source_location is None:
            return Outcome(error=ResidencyOwnershipError)
        self.remove(value, at)
        return Outcome(source=at)

    def discard(self, value: ModelValue) -> Outcome:
        if value.discarded:
            return Outcome(error=ResidencyHandleError)
        for loc in list(value.mats):
            self.remove(value, loc)
        value.source_location = None
        value.discarded = True
        self.version += 1
        return Outcome()


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------

locations = st.sampled_from(ALL_LOCATIONS)
value_kinds = st.tuples(
    st.sampled_from(["adopt", "source"]),
    st.booleans(),  # exclusive
    st.sampled_from([1, 2, 4]),  # float32 elements
    locations,  # adopt location or source location
)
operations = st.tuples(
    # Weighted: discard ends a handle, so it is rare.
    st.sampled_from(
        ["ensure"] * 3
        + ["copy"] * 2
        + ["move"] * 3
        + ["move-from"] * 2
        + ["move-from-resident"] * 2
        + ["drop"] * 2
        + ["drop-resident"] * 2
        + ["discard"]
    ),
    st.integers(min_value=0, max_value=10),  # handle index (mod count)
    locations,
    locations,
)
budget_maps = st.dictionaries(
    st.sampled_from(ALL_LOCATIONS), st.sampled_from([4, 8, 16, 24, 40]), max_size=3
)


def _check(manager: ResidencyManager, model: Model, handles: list[Any]) -> None:
    snap = manager.snapshot()
    assert snap.state_version == model.version
    assert manager.state_version == model.version
    assert [e.location for e in snap.locations] == model.registered
    assert list(manager.locations) == model.registered
    assert [v.handle for v in snap.values] == handles
    for handle, value in zip(handles, model.values, strict=True):
        entry = val_snap(snap, handle)
        assert [m.location for m in entry.materializations] == value.mats
        assert entry.discarded is value.discarded
        assert entry.source_location == value.source_location
        assert entry.has_source is (value.source_location is not None)
        for mat in entry.materializations:
            assert mat.charged_nbytes == value.charge
    for loc in model.registered:
        entry = loc_snap(snap, loc)
        assert entry.used_bytes == model.used[loc], loc
        assert entry.peak_used_bytes == model.peak_used[loc], loc
        assert entry.peak_charged_bytes == model.peak_charged[loc], loc
        assert entry.reserved_bytes == 0
        assert entry.budget_bytes == model.budgets.get(loc)
    assert_balanced(snap)


def _run(
    manager: ResidencyManager,
    op: str,
    handle: Any,
    loc: ResidencyLocation,
    other: ResidencyLocation,
) -> Any:
    if op == "ensure":
        return manager.ensure(handle, loc)
    if op == "copy":
        return manager.copy(handle, loc)
    if op == "move":
        return manager.move(handle, loc)
    if op == "move-from":
        return manager.move(handle, loc, from_location=other)
    if op == "drop":
        return manager.drop(handle, loc)
    return manager.discard(handle)


@settings(max_examples=300, deadline=None)
@given(
    budgets=budget_maps,
    kinds=st.lists(value_kinds, min_size=1, max_size=4),
    ops=st.lists(operations, min_size=1, max_size=25),
)
def test_random_primitive_sequences_match_the_model(
    budgets: dict[ResidencyLocation, int],
    kinds: list[tuple[str, bool, int, ResidencyLocation]],
    ops: list[tuple[str, int, ResidencyLocation, ResidencyLocation]],
) -> None:
    with simulated() as runtime:
        manager = ResidencyManager(budgets)
        model = Model(budgets)
        handles: list[Any] = []
        for how, exclusive, n, loc in kinds:
            mode = EXCLUSIVE if exclusive else REPLICABLE
            mvalue = ModelValue(4 * n, exclusive, None if how == "adopt" else loc)
            if how == "adopt":
                value = on(runtime, loc, tensor_value(n))
                if model.adopt(mvalue, loc):
                    handles.append(manager.adopt(value, replica_mode=mode))
                else:
                    try:
                        manager.adopt(value, replica_mode=mode)
                    except ResidencyBudgetError as exc:
                        assert exc.location == loc.name
                    else:
                        raise AssertionError("adopt over budget was admitted")
            else:
                source = Source(sim_factory(runtime, loc, n))
                handles.append(
                    manager.register_source(spec(n, replica=mode), source, source_location=loc)
                )
                model.register_source(mvalue)
            _check(manager, model, handles)
        if not handles:
            return

        for raw_op, index, raw_loc, raw_other in ops:
            op, loc, other = raw_op, raw_loc, raw_other
            handle = handles[index % len(handles)]
            value = model.values[index % len(handles)]
            # The "-resident" variants pick one of the value's current locations, if any.
            if op.endswith("-resident"):
                op = op.removesuffix("-resident")
                if value.mats:
                    pick = value.mats[ALL_LOCATIONS.index(other) % len(value.mats)]
                    if op == "drop":
                        loc = pick
                    else:
                        other = pick
            if op in ("ensure", "copy"):
                expected = model.ensure(value, loc)
                action: Any = EnsureResident(handle, loc)
            elif op == "move":
                expected = model.move(value, loc, None)
                action = MoveResident(handle, loc)
            elif op == "move-from":
                expected = model.move(value, loc, other)
                action = MoveResident(handle, loc, other)
            elif op == "drop":
                expected = model.drop(value, loc)
                action = DropResident(handle, loc)
            else:
                expected = model.discard(value)
                action = DiscardValue(handle)

            if expected.error is not None:
                event(f"{op}: {expected.error.__name__}")
            else:
                event(f"{op}: {'no-op' if expected.no_op else 'change'}")
            trace_before = len(manager.trace())
            try:
                report = _run(manager, op, handle, loc, other)
            except Exception as exc:
                assert expected.error is not None, f"{op} raised {exc!r}, model expected success"
                assert type(exc) is expected.error, f"{op}: {exc!r} vs {expected.error}"
                if expected.error_location is not None:
                    assert exc.location == expected.error_location  # type: ignore[attr-defined]
                assert len(manager.trace()) == trace_before
            else:
                assert expected.error is None, f"{op} succeeded, model expected {expected.error}"
                assert report.action == action
                assert report.no_op is expected.no_op
                assert report.source == expected.source
                if op in ("drop", "discard"):
                    assert report.destination is None
                else:
                    assert report.destination == loc
                assert report.reason == expected.reason
                assert report.storage_nbytes == value.charge
                assert manager.trace()[-1] == report
            _check(manager, model, handles)


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["ensure", "drop"]), locations), max_size=20))
def test_host_only_default_runtime_sequences(ops: list[tuple[str, ResidencyLocation]]) -> None:
    """Without the simulated runtime only pageable memory works; CUDA is a ValueError and
    pinning a RuntimeError, neither of which changes anything."""
    manager = ResidencyManager()
    handle = manager.register_source(spec(2), Source(lambda: tensor_value(2)))
    resident = False
    version = manager.state_version
    for op, loc in ops:
        try:
            call = manager.ensure if op == "ensure" else manager.drop
            report = call(handle, loc)
        except ValueError:
            assert loc in (CUDA0, CUDA1)
        except RuntimeError as exc:
            assert not isinstance(exc, ResidencyError), exc
            assert loc == PINNED_HOST
            assert op == "ensure"
        else:
            assert loc in (PAGEABLE_HOST, PINNED_HOST)
            if op == "ensure":
                assert loc == PAGEABLE_HOST
                assert report.no_op is resident
                version += 0 if resident else 1
                resident = True
            else:
                assert report.no_op is not (resident and loc == PAGEABLE_HOST)
                if resident and loc == PAGEABLE_HOST:
                    version += 1
                    resident = False
        assert manager.state_version == version
        snap = manager.snapshot()
        assert [e.location for e in snap.locations] == [PAGEABLE_HOST]
        assert loc_snap(snap, PAGEABLE_HOST).used_bytes == (8 if resident else 0)
