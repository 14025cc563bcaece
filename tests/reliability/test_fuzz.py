"""Reliability: bad-input fuzzing of every public entry point.

Written from the documented behaviour (docs/concepts/), not from the implementation.

Every public constructor and method is called with Hypothesis-drawn arguments mixing arbitrary
objects (None, bools, huge and negative ints, NaN/inf floats, strings with lone surrogates,
bytes, containers, tensors, torch devices of the wrong kind, streams of the wrong device or of
another runtime, handles of other managers, ...) with plausible values (so the deeper checks are
reached too). The only acceptable outcomes are:

* success;
* `TypeError` or `ValueError` (docs/concepts/conventions.md#check-order and the per-record
  rules);
* `KeyError` where documented (`BorrowedValues.__getitem__`, lifetimes.md#borrowed-values);
* a documented `fhelium.errors.ResidencyError` subclass (docs/concepts/errors.md);
* a plain `RuntimeError` only where one is documented (a policy whose `order_candidates`
  does not return each candidate exactly once, controller.md#candidates).

Anything else -- `pyo3_runtime.PanicException`, `SystemError`, `OverflowError`,
`AttributeError`, `IndexError`, a torch `RuntimeError`, a warning turned into an error -- fails.
A hang is caught by `faulthandler.dump_traceback_later` (the process exits with all stacks).

Each test uses a bounded number of examples; the last test prints how many inputs were tried.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import inspect
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fhelium.residency as R
from fhelium.errors import ResidencyError
from fhelium.residency._runtime import SimulatedRuntime, SimulatedStream, use_runtime
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST
from fhelium.values import ResidentTensor, TensorBundle
from helpers.manager import (
    CUDA0,
    CUDA1,
    EXCLUSIVE,
    MUST_PRESERVE,
    RECONSTRUCTIBLE,
    REPLICABLE,
    NoTensors,
    Other,
    spec,
    tensor_value,
)

EXAMPLES = 80  # per entry point
MANAGER_EXAMPLES = 200
HANG_TIMEOUT_S = 300

COUNTS: collections.Counter[str] = collections.Counter()
OUTCOMES: collections.Counter[str] = collections.Counter()

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
    ],
    derandomize=True,
    database=None,
)

# --------------------------------------------------------------------------------------------
# Outcome checking
# --------------------------------------------------------------------------------------------

FORBIDDEN = (
    SystemError,
    OverflowError,
    AttributeError,
    IndexError,
    MemoryError,
    RecursionError,
    AssertionError,
)


def call(
    entry: str, fn: Callable[[], Any], *, key_error: bool = False, plain_runtime_error: bool = False
) -> Any:
    """Call `fn()`; return its result, or None when it raised an acceptable exception."""
    COUNTS[entry] += 1
    try:
        result = fn()
    except BaseException as exc:  # classify everything, including panics
        if type(exc).__module__.startswith("hypothesis"):
            # a draw inside `fn` ran out of data (StopTest etc.): Hypothesis' own control flow
            COUNTS[entry] -= 1
            raise
        name = type(exc).__name__
        acceptable = (
            isinstance(exc, ResidencyError)
            or (isinstance(exc, (TypeError, ValueError)) and not isinstance(exc, FORBIDDEN))
            or (key_error and type(exc) is KeyError)
            or (plain_runtime_error and type(exc) is RuntimeError)
        )
        if isinstance(exc, FORBIDDEN) or not acceptable or name == "PanicException":
            raise AssertionError(
                f"{entry}: unacceptable {type(exc).__module__}.{name}: {exc!r}"
            ) from exc
        OUTCOMES[f"{entry}:{name}"] += 1
        return None
    OUTCOMES[f"{entry}:ok"] += 1
    return result


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------

RUNTIME = SimulatedRuntime(device_count=2, auto_complete=True)
OTHER_RUNTIME = SimulatedRuntime(device_count=2, auto_complete=True)
NB = 16  # bytes of a 4-float value
U64_MAX = 2**64 - 1


class _Weird:
    """An object whose every dunder is the default: not iterable, not a mapping, not an int."""

    def __repr__(self) -> str:
        return "Weird()"


class _RaisingIter:
    def __iter__(self) -> Iterator[Any]:
        raise ValueError("iteration refused")


class _BadIndex:
    def __index__(self) -> int:
        return 2**200


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]


surrogates = st.text(
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3
)
scalar_junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([-1, -(2**63), 2**63, 2**64, 2**200, -(2**200), 127, 128, 0]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1.5]),
    st.text(max_size=8),
    surrogates,
    st.sampled_from(
        [
            "",
            " ",
            "\t",
            "cuda",
            "cuda:0",
            "cuda:01",
            "cuda:128",
            "cpu",
            "meta",
            "pageable-host",
            "pinned-host",
            "cuda:0 ",
            "\x00",
            "exclusive",
        ]
    ),
    st.binary(max_size=8),
    st.sampled_from(
        [
            torch.device("cpu"),
            torch.device("meta"),
            torch.device("cuda"),
            torch.device("cuda", 0),
            torch.device("cuda", 1),
            torch.device("cuda", 7),
            torch.device("cuda", 127),
            torch.zeros(3),
            torch.zeros(0),
            torch.tensor(2**40),
            torch.tensor(1.5),
            torch.tensor([True]),
            torch.zeros(2, 2, dtype=torch.int64)[:, 0],
            object(),
            _Weird(),
            _RaisingIter(),
            _BadIndex(),
            _Unhashable(),
            int,
            str,
            type,
            ResidentTensor,
            TensorBundle,
            Exception("x"),
            ...,
            NotImplemented,
            1j,
            SimulatedStream(RUNTIME, torch.device("cuda", 0)),
            SimulatedStream(RUNTIME, torch.device("cuda", 1)),
            SimulatedStream(OTHER_RUNTIME, torch.device("cuda", 0)),
            R.ReplicaMode.EXCLUSIVE,
            R.ReplicaMode.REPLICABLE,
            R.Recoverability.MUST_PRESERVE,
            R.Recoverability.RECONSTRUCTIBLE,
        ]
    ),
)
junk = st.recursive(
    scalar_junk,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(
            st.one_of(st.none(), st.integers(), st.text(max_size=3)), inner, max_size=3
        ),
        st.frozensets(st.integers(), max_size=3),
    ),
    max_leaves=6,
)

# Plausible, valid values (shared, tensor-free where possible)
H = R.ResidencyHandle("fuzz-manager", "h1", ResidentTensor)
H2 = R.ResidencyHandle("fuzz-manager", "h2", ResidentTensor)
SPEC = spec(4)
LOCS = [PAGEABLE_HOST, PINNED_HOST, CUDA0, CUDA1, R.cuda_location("cuda:127")]
ACTIONS = [
    R.EnsureResident(H, CUDA0),
    R.MoveResident(H, CUDA1, PAGEABLE_HOST),
    R.DropResident(H2, PINNED_HOST),
    R.DiscardValue(H),
]
RES = R.MemoryReservation(CUDA0, 8, "r")
REQ = R.ResidencyRequest("req", [R.ResidencyRequirement(H, CUDA0)])
META = R.ResidencyPolicyMetadata(1, "k")
CAND = R.ResidencyEvictionCandidate(H, CUDA0, 16, 0, None, META)
MAT = R.MaterializationSnapshot(CUDA0, 16, 16, 16, 0, 0, 0)
VAL = R.ResidencyValueSnapshot(H, SPEC, (MAT,), False, None, False)
LOCSNAP = R.ResidencyLocationSnapshot(CUDA0, None, 16, 0, None, 16, 16, 1, 0, 0, 0, 0, None, None)
RSNAP = R.ResidencyReservationSnapshot(CUDA0, 8, "r")
TR = R.ResidencyTransitionReport(ACTIONS[0], False, PAGEABLE_HOST, CUDA0, 16, 16, 1, 2)
AEXPL = R.ResidencyActionExplanation(ACTIONS[0], True, False, PAGEABLE_HOST, CUDA0, 16, 16)
PEXPL = R.ResidencyPlanExplanation("req", (AEXPL,), (RES,), ((CUDA0, 16),), True)
PLAN = R.ResidencyPlan("req", enter=[ACTIONS[0]], reservations=[RES])
EVICT = R.ResidencyEviction(R.DropResident(H2, CUDA0), 0, CUDA0, 16, "because")
PLAUSIBLE_VALUES = [
    H,
    H2,
    SPEC,
    *LOCS,
    *ACTIONS,
    RES,
    REQ,
    META,
    CAND,
    MAT,
    VAL,
    LOCSNAP,
    RSNAP,
    TR,
    AEXPL,
    PEXPL,
    PLAN,
    EVICT,
    (ACTIONS[0],),
    (MAT,),
    (VAL,),
    (LOCSNAP,),
    (RSNAP,),
    (TR,),
    (AEXPL,),
    (RES,),
    (EVICT,),
    ((CUDA0, 16),),
    (("a", 1),),
    [R.ResidencyRequirement(H, CUDA0)],
    ResidentTensor,
    TensorBundle,
    Other,
    "a",
    "name",
    "fuzz-manager",
    0,
    1,
    2,
    16,
    32,
    True,
    False,
    None,
    (),
    R.ReplicaMode.EXCLUSIVE,
    R.Recoverability.RECONSTRUCTIBLE,
    {PAGEABLE_HOST: [PINNED_HOST]},
    {CUDA0: (PINNED_HOST, PAGEABLE_HOST)},
    tensor_value(4),
]
plausible = st.sampled_from(PLAUSIBLE_VALUES)
anything = st.one_of(junk, plausible, plausible)


def draw_args(data: Any, fn: Callable[..., Any]) -> tuple[list[Any], dict[str, Any]]:
    """Arguments for every parameter of `fn` (optional ones are sometimes left out)."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    positional_ok = True
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is not p.empty and data.draw(st.booleans()):
            positional_ok = False
            continue
        value = data.draw(anything)
        if p.kind == p.KEYWORD_ONLY or not positional_ok or data.draw(st.booleans()):
            kwargs[p.name] = value
            positional_ok = False
        else:
            args.append(value)
    return args, kwargs


def _is_hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def exercise(entry: str, obj: Any) -> None:
    """repr / hash / == on a successfully built record must not fail unexpectedly."""
    call(f"{entry}.repr", lambda: repr(obj))
    call(f"{entry}.hash", lambda: hash(obj))  # TypeError is fine for unhashable fields
    same = obj
    call(f"{entry}.eq", lambda: obj == same and obj != object())


@pytest.fixture(autouse=True, scope="module")
def _runtime_and_watchdog() -> Iterator[None]:
    faulthandler.dump_traceback_later(HANG_TIMEOUT_S, exit=True)
    try:
        with use_runtime(RUNTIME):
            yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# --------------------------------------------------------------------------------------------
# Records and free functions
# --------------------------------------------------------------------------------------------

RECORDS = [
    R.ResidencyLocation,
    R.ResidencyHandle,
    R.ResidencyValueSpec,
    R.EnsureResident,
    R.MoveResident,
    R.DropResident,
    R.DiscardValue,
    R.MemoryReservation,
    R.ResidencyPlan,
    R.ResidencyRequirement,
    R.ResidencyRequest,
    R.ResidencyPolicyMetadata,
    R.ResidencyEvictionCandidate,
    R.MaterializationSnapshot,
    R.ResidencyValueSnapshot,
    R.ResidencyReservationSnapshot,
    R.ResidencyLocationSnapshot,
    R.ResidencySnapshot,
    R.ResidencyTransitionReport,
    R.ResidencyActionExplanation,
    R.ResidencyPlanExplanation,
    R.ResidencyPlanReport,
    R.ResidencyEviction,
    R.ResidencyDecision,
    R.DeterministicTieredLRU,
]


# A valid positional argument list per record: the fuzzer corrupts some of its fields, so the
# later checks in each constructor's documented order are reached too.
VALID_ARGS: dict[type, tuple[Any, ...]] = {
    R.ResidencyLocation: ("cuda", "cuda:3"),
    R.ResidencyHandle: ("m", "h", ResidentTensor),
    R.ResidencyValueSpec: (ResidentTensor, 16, 32, REPLICABLE, MUST_PRESERVE),
    R.EnsureResident: (H, CUDA0),
    R.MoveResident: (H, CUDA0, PINNED_HOST),
    R.DropResident: (H, CUDA0),
    R.DiscardValue: (H,),
    R.MemoryReservation: (CUDA0, 8, "r"),
    R.ResidencyPlan: ("p", [ACTIONS[0]], (ACTIONS[2],), [RES], [ACTIONS[1]]),
    R.ResidencyRequirement: (H, CUDA0),
    R.ResidencyRequest: ("req", [R.ResidencyRequirement(H, CUDA0)], [RES]),
    R.ResidencyPolicyMetadata: (-5, "key"),
    R.ResidencyEvictionCandidate: (H, CUDA0, 16, 0, 3, META),
    R.MaterializationSnapshot: (CUDA0, 16, 16, 32, 0, 1, 2),
    R.ResidencyValueSnapshot: (H, SPEC, (MAT,), True, PAGEABLE_HOST, False),
    R.ResidencyReservationSnapshot: (CUDA0, 8, "r"),
    R.ResidencyLocationSnapshot: (CUDA0, 64, 16, 8, 40, 16, 24, 1, 1, 0, 0, 0, 5, 6),
    R.ResidencySnapshot: ("m", 3, (VAL,), (LOCSNAP,), (RSNAP,), 10),
    R.ResidencyTransitionReport: (
        ACTIONS[0],
        False,
        PAGEABLE_HOST,
        CUDA0,
        16,
        16,
        1,
        2,
        "cuda:0",
        1,
        2,
        3,
        4,
        "why",
    ),
    R.ResidencyActionExplanation: (ACTIONS[0], True, False, PAGEABLE_HOST, CUDA0, 16, 16, "r"),
    R.ResidencyPlanExplanation: ("req", (AEXPL,), (RES,), ((CUDA0, 16),), True, None),
    R.ResidencyPlanReport: ("p", (TR,), 1, 2),
    R.ResidencyEviction: (R.DropResident(H2, CUDA0), 0, CUDA0, 16, "because"),
    R.ResidencyDecision: ("m", 0, 1, REQ, PLAN, "pol", (("a", 1),), (EVICT,), PEXPL),
    R.DeterministicTieredLRU: ({CUDA0: [PINNED_HOST, PAGEABLE_HOST]},),
}


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
@FUZZ
@given(data=st.data())
def test_record_constructors_reject_bad_input_cleanly(cls: type, data: Any) -> None:
    if data.draw(st.integers(0, 3)) == 0:
        args, kwargs = draw_args(data, cls)  # every field arbitrary
    else:
        valid = VALID_ARGS[cls]
        rate = data.draw(st.sampled_from([0.0, 0.2, 0.5]))
        args = [data.draw(anything) if data.draw(st.floats(0, 1)) < rate else v for v in valid]
        kwargs = {}
        if data.draw(st.booleans()):  # the same, passed by keyword
            names = list(inspect.signature(cls).parameters)
            kwargs = dict(zip(names, args, strict=False))
            args = []
    obj = call(cls.__name__, lambda: cls(*args, **kwargs))
    if obj is not None:
        exercise(cls.__name__, obj)


@FUZZ
@given(device=anything)
def test_cuda_location_rejects_bad_input_cleanly(device: Any) -> None:
    call("cuda_location", lambda: R.cuda_location(device))


@FUZZ
@given(
    kind=st.one_of(st.sampled_from(["pageable-host", "pinned-host", "cuda"]), anything),
    device=anything,
)
def test_location_kinds_with_bad_devices(kind: Any, device: Any) -> None:
    call("ResidencyLocation(kind)", lambda: R.ResidencyLocation(kind, device))


@FUZZ
@given(
    tiers=st.one_of(
        anything,
        st.dictionaries(
            st.one_of(st.sampled_from(LOCS), scalar_junk.filter(_is_hashable)),
            st.one_of(st.lists(st.one_of(st.sampled_from(LOCS), anything), max_size=3), anything),
            max_size=3,
        ),
    ),
    location=anything,
    candidates=st.one_of(anything, st.lists(st.one_of(st.just(CAND), anything), max_size=3)),
)
def test_deterministic_tiered_lru(tiers: Any, location: Any, candidates: Any) -> None:
    policy = call("DeterministicTieredLRU", lambda: R.DeterministicTieredLRU(tiers))
    if policy is None:
        policy = R.DeterministicTieredLRU()
    call("DeterministicTieredLRU.name", lambda: policy.name)
    call("DeterministicTieredLRU.config_identity", lambda: policy.config_identity)
    call("DeterministicTieredLRU.fallback_locations", lambda: policy.fallback_locations(location))
    call("DeterministicTieredLRU.order_candidates", lambda: policy.order_candidates(candidates))


# --------------------------------------------------------------------------------------------
# The manager
# --------------------------------------------------------------------------------------------


class JunkSource:
    """A source whose `load()` returns an arbitrary object."""

    def __init__(self, result: Any) -> None:
        self.result = result

    def load(self) -> Any:
        return self.result


class World:
    """A fresh manager with a few values, plus foreign things to pass it."""

    def __init__(self) -> None:
        self.manager = R.ResidencyManager({CUDA0: 2 * NB, PAGEABLE_HOST: 64 * NB})
        m = self.manager
        self.must = m.adopt(tensor_value(4), replica_mode=REPLICABLE)
        self.excl = m.adopt(tensor_value(4), replica_mode=EXCLUSIVE)
        self.src = m.register_source(spec(4, recoverability=RECONSTRUCTIBLE), JunkSource(None))
        self.good_src = m.register_source(spec(4, recoverability=RECONSTRUCTIBLE), _FreshSource())
        m.ensure(self.must, CUDA0)
        m.ensure(self.good_src, CUDA0)
        self.other = R.ResidencyManager()
        self.foreign = self.other.adopt(tensor_value(4))
        self.lifetimes: list[Any] = []

    def handles(self) -> st.SearchStrategy[Any]:
        return st.sampled_from(
            [
                self.must,
                self.excl,
                self.src,
                self.good_src,
                self.foreign,
                H,
                R.ResidencyHandle(self.manager.manager_id, "unknown", ResidentTensor),
                R.ResidencyHandle(self.manager.manager_id, self.must.handle_id, TensorBundle),
            ]
        )

    def handle_ish(self) -> st.SearchStrategy[Any]:
        return st.one_of(self.handles(), self.handles(), anything)

    def many(self) -> st.SearchStrategy[Any]:
        resident = st.lists(st.sampled_from([self.must, self.good_src]), min_size=1, max_size=2)
        return st.one_of(
            resident,
            resident,
            st.lists(self.handle_ish(), max_size=3),
            st.lists(self.handles(), min_size=1, max_size=3),
            anything,
        )

    def actions(self) -> st.SearchStrategy[Any]:
        h, loc = self.handles(), loc_ish
        return st.one_of(
            st.builds(R.EnsureResident, h, loc_valid),
            st.builds(R.MoveResident, h, loc_valid),
            st.builds(R.DropResident, h, loc_valid),
            st.builds(R.DiscardValue, h),
            loc.map(lambda x: x),
        )

    def keep(self, obj: Any) -> Any:
        if obj is not None:
            self.lifetimes.append(obj)
        return obj

    def finish(self) -> None:
        for lifetime in self.lifetimes:
            call("release", lambda lifetime=lifetime: lifetime.release())
        for manager in (self.manager, self.other):
            with contextlib.suppress(ResidencyError):
                manager.close(force=True)


class _FreshSource:
    def load(self) -> Any:
        return tensor_value(4)


loc_valid = st.sampled_from([PAGEABLE_HOST, PINNED_HOST, CUDA0, CUDA1])
loc_ish = st.one_of(
    loc_valid, st.sampled_from([R.cuda_location("cuda:5"), R.cuda_location("cuda:127")]), anything
)
stream_ish = st.one_of(
    st.none(),
    st.sampled_from(
        [
            SimulatedStream(RUNTIME, torch.device("cuda", 0)),
            SimulatedStream(RUNTIME, torch.device("cuda", 1)),
            SimulatedStream(OTHER_RUNTIME, torch.device("cuda", 0)),
        ]
    ),
    anything,
)


def streams_map() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.dictionaries(
            st.one_of(loc_valid, st.integers(), st.text(max_size=3)), stream_ish, max_size=2
        ),
        anything,
    )


value_ish = st.one_of(
    st.builds(lambda: tensor_value(4)),
    st.builds(lambda: ResidentTensor(torch.zeros(64)[:4])),
    st.builds(lambda: RUNTIME.to_device(tensor_value(4), "cuda:0")),
    st.builds(lambda: RUNTIME.to_device(tensor_value(4), "cuda:1")),
    st.builds(lambda: RUNTIME.pin(tensor_value(4))),
    st.builds(lambda: TensorBundle(a=torch.ones(2))),
    st.builds(lambda: Other(torch.ones(2))),
    st.builds(NoTensors),
    st.builds(lambda: ResidentTensor(torch.zeros(2, device="meta"))),
    anything,
)
spec_ish = st.one_of(
    st.builds(
        lambda n, r, c: spec(n, replica=r, recoverability=c),
        st.integers(0, 8),
        st.sampled_from([REPLICABLE, EXCLUSIVE]),
        st.sampled_from([RECONSTRUCTIBLE, MUST_PRESERVE]),
    ),
    st.just(spec(4, value_type=Other)),
    anything,
)
source_ish = st.one_of(st.builds(JunkSource, value_ish), st.just(_FreshSource()), anything)


def manager_ops(world: World, data: Any) -> None:
    m = world.manager
    d = data.draw
    op = d(
        st.sampled_from(
            [
                "adopt",
                "register_source",
                "ensure",
                "copy",
                "move",
                "drop",
                "discard",
                "execute_actions",
                "explain",
                "scope",
                "acquire",
                "hold",
                "reserve",
                "snapshot",
                "trace",
                "close",
            ]
        )
    )
    if op == "adopt":
        kwargs = {}
        if d(st.booleans()):
            kwargs["at"] = d(loc_ish)
        if d(st.booleans()):
            kwargs["replica_mode"] = d(anything)
        value = d(value_ish)
        # values.md#adopt, step 5: `value.device` raises a plain RuntimeError for a tensor-less
        # value and adopt lets it propagate unchanged
        call(
            "adopt",
            lambda: m.adopt(value, **kwargs),
            plain_runtime_error=isinstance(value, NoTensors),
        )
    elif op == "register_source":
        kwargs = {"source_location": d(loc_ish)} if d(st.booleans()) else {}
        h = call("register_source", lambda: m.register_source(d(spec_ish), d(source_ish), **kwargs))
        if h is not None:
            call("ensure(registered)", lambda: m.ensure(h, d(loc_ish), stream=d(stream_ish)))
            call("move(registered)", lambda: m.move(h, d(loc_ish)))
    elif op in ("ensure", "copy"):
        fn = getattr(m, op)
        call(op, lambda: fn(d(world.handle_ish()), d(loc_ish), stream=d(stream_ish)))
    elif op == "move":
        call(
            "move",
            lambda: m.move(
                d(world.handle_ish()),
                d(loc_ish),
                from_location=d(st.one_of(st.none(), loc_ish)),
                stream=d(stream_ish),
            ),
        )
    elif op == "drop":
        call("drop", lambda: m.drop(d(world.handle_ish()), d(loc_ish)))
    elif op == "discard":
        call("discard", lambda: m.discard(d(world.handle_ish())))
    elif op == "execute_actions":
        actions = d(st.one_of(st.lists(world.actions(), max_size=3), anything))
        call(
            "execute_actions",
            lambda: m.execute_actions(
                actions,
                name=d(st.one_of(st.just("n"), anything)),
                transfer_streams=d(streams_map()),
                expected_state_version=d(st.one_of(st.none(), st.integers(-2, 5), anything)),
            ),
        )
    elif op in ("explain", "scope"):
        plan = d(
            st.one_of(
                st.builds(
                    lambda e, x, r: R.ResidencyPlan("p", enter=e, exit=x, reservations=r),
                    st.lists(
                        world.actions().filter(
                            lambda a: isinstance(
                                a,
                                (R.EnsureResident, R.MoveResident, R.DropResident, R.DiscardValue),
                            )
                        ),
                        max_size=2,
                    ),
                    st.lists(
                        world.actions().filter(
                            lambda a: isinstance(a, (R.EnsureResident, R.DropResident))
                        ),
                        max_size=2,
                    ),
                    st.lists(
                        st.builds(
                            R.MemoryReservation, loc_valid, st.integers(0, 2**70), st.just("r")
                        ),
                        max_size=2,
                    ),
                ),
                anything,
            )
        )
        version = d(st.one_of(st.none(), st.integers(-2, 5), anything))
        if op == "explain":
            call("explain", lambda: m.explain(plan, expected_state_version=version))
        else:
            scope = call(
                "scope",
                lambda: m.scope(
                    plan, transfer_streams=d(streams_map()), expected_state_version=version
                ),
            )
            if scope is not None:
                entered = call("scope.__enter__", scope.__enter__)
                if entered is not None:
                    call("scope.__exit__", lambda: scope.__exit__(None, None, None))
                call("scope.close", scope.close)
    elif op == "acquire":
        handles = d(world.many())
        at = d(st.one_of(st.sampled_from([PAGEABLE_HOST, CUDA0]), loc_ish))
        matching = SimulatedStream(RUNTIME, torch.device("cuda", 0)) if at == CUDA0 else None
        stream = d(st.one_of(st.just(matching), stream_ish))
        lease = world.keep(
            call("acquire", lambda: m.acquire(handles, at=at, consumer_stream=stream))
        )
        if lease is not None:
            values = call("lease.values", lambda: lease.values)
            if values is not None:
                call("BorrowedValues[]", lambda: values[d(world.handle_ish())], key_error=True)
                call("BorrowedValues.len", lambda: len(values))
            call("lease.add_consumer_stream", lambda: lease.add_consumer_stream(d(stream_ish)))
            call("lease.release", lambda: lease.release(wait=d(st.booleans())))
    elif op == "hold":
        at = d(st.one_of(st.sampled_from([PAGEABLE_HOST, CUDA0]), loc_ish))
        hold = world.keep(call("hold", lambda: m.hold(d(world.many()), at=at)))
        if hold is not None:
            call("hold.release", hold.release)
    elif op == "reserve":
        nbytes = d(st.one_of(st.integers(-2, 2**70), anything))
        label = d(st.one_of(st.just("lbl"), anything))
        reservation = world.keep(
            call("reserve", lambda: m.reserve(d(loc_ish), nbytes, label=label))
        )
        if reservation is not None:
            call("reservation.release", reservation.release)
    elif op == "snapshot":
        call("snapshot", m.snapshot)
    elif op == "trace":
        call("trace", m.trace)
        call("clear_trace", m.clear_trace)
    elif op == "close":
        call("close", lambda: m.close(wait=d(anything), force=d(anything)))


@settings(FUZZ, max_examples=MANAGER_EXAMPLES)
@given(
    budgets=st.one_of(
        anything,
        st.dictionaries(
            st.one_of(loc_ish.filter(_is_hashable)),
            st.one_of(st.integers(-2, 2**70), anything),
            max_size=3,
        ),
    ),
    capacity=st.one_of(st.integers(-2, 2**70), anything),
    with_capacity=st.booleans(),
)
def test_manager_constructor_rejects_bad_input_cleanly(
    budgets: Any, capacity: Any, with_capacity: bool
) -> None:
    kwargs = {"trace_capacity": capacity} if with_capacity else {}
    manager = call("ResidencyManager", lambda: R.ResidencyManager(budgets, **kwargs))
    if manager is not None:
        call("ResidencyManager.snapshot", manager.snapshot)
        call("ResidencyManager.close", manager.close)


@settings(FUZZ, max_examples=MANAGER_EXAMPLES)
@given(data=st.data())
def test_manager_methods_reject_bad_input_cleanly(data: Any) -> None:
    world = World()
    try:
        for _ in range(data.draw(st.integers(1, 6))):
            manager_ops(world, data)
    finally:
        world.finish()


# --------------------------------------------------------------------------------------------
# The controller
# --------------------------------------------------------------------------------------------


class JunkPolicy:
    """Structurally a `ResidencyPolicy`, with arbitrary answers."""

    def __init__(self, name: Any, identity: Any, fallback: Any, order: Any) -> None:
        self._name, self._identity, self._fallback, self._order = name, identity, fallback, order

    @property
    def name(self) -> Any:
        return self._name

    @property
    def config_identity(self) -> Any:
        return self._identity

    def fallback_locations(self, location: Any) -> Any:
        return self._fallback

    def order_candidates(self, candidates: Any) -> Any:
        return candidates if self._order is None else self._order


@settings(FUZZ, max_examples=MANAGER_EXAMPLES)
@given(data=st.data())
def test_controller_rejects_bad_input_cleanly(data: Any) -> None:
    d = data.draw
    world = World()
    try:
        policy = d(
            st.one_of(
                st.none(),
                st.builds(
                    JunkPolicy,
                    st.one_of(st.just("junk"), anything),
                    st.one_of(st.just(()), anything),
                    st.one_of(st.just(()), st.just((PAGEABLE_HOST,)), anything),
                    st.one_of(st.none(), anything),
                ),
                anything,
            )
        )
        kwargs: dict[str, Any] = {}
        if policy is not None or d(st.booleans()):
            kwargs["policy"] = policy
        if d(st.booleans()):
            kwargs["search_state_limit"] = d(st.one_of(st.integers(-2, 2**70), anything))
        manager = d(st.one_of(st.just(world.manager), st.just(world.other), anything))
        controller = call("ResidencyController", lambda: R.ResidencyController(manager, **kwargs))
        if controller is None:
            controller = R.ResidencyController(world.manager)
        # a junk policy that reorders candidates wrongly may raise the documented plain
        # RuntimeError (controller.md#candidates)
        junk_policy = isinstance(controller.policy, JunkPolicy)
        request_ish = st.one_of(
            st.builds(
                lambda pairs, res: R.ResidencyRequest(
                    "req", [R.ResidencyRequirement(h, loc) for h, loc in dict(pairs).items()], res
                ),
                st.lists(st.tuples(world.handles(), loc_valid), min_size=1, max_size=3),
                # NARROWED: nbytes >= 2**64 makes decide() raise OverflowError (see
                # test_decide_with_a_reservation_of_2_pow_64_bytes_is_refused_cleanly below)
                st.lists(
                    st.builds(
                        R.MemoryReservation, loc_valid, st.integers(0, U64_MAX), st.just("r")
                    ),
                    max_size=2,
                ),
            ),
            anything,
        )
        for _ in range(d(st.integers(1, 3))):
            op = d(st.sampled_from(["meta", "decide", "scope", "use"]))
            if op == "meta":
                call(
                    "set_policy_metadata",
                    lambda: controller.set_policy_metadata(
                        d(world.handle_ish()),
                        priority=d(st.one_of(st.integers(), anything)),
                        stable_key=d(st.one_of(st.none(), st.just("k"), anything)),
                    ),
                )
            elif op == "decide":
                call(
                    "decide",
                    lambda: controller.decide(d(request_ish)),
                    plain_runtime_error=junk_policy,
                )
            elif op == "scope":
                decision = call(
                    "decide(for scope)",
                    lambda: controller.decide(d(request_ish)),
                    plain_runtime_error=junk_policy,
                )
                target = d(st.one_of(st.just(decision), anything))
                streams = d(streams_map())
                scope = call(
                    "controller.scope",
                    lambda t=target, s=streams: controller.scope(t, transfer_streams=s),
                )
                if (
                    scope is not None
                    and call("controller.scope.__enter__", scope.__enter__) is not None
                ):
                    call("controller.scope.__exit__", lambda s=scope: s.__exit__(None, None, None))
            else:
                use = call(
                    "controller.use",
                    lambda: controller.use(
                        d(request_ish),
                        consumer_streams=d(streams_map()),
                        transfer_streams=d(streams_map()),
                    ),
                    plain_runtime_error=junk_policy,
                )
                if use is not None:
                    entered = call("use.__enter__", use.__enter__, plain_runtime_error=junk_policy)
                    if entered is not None:
                        # Exited even when Hypothesis stops drawing mid-example: an
                        # abandoned use would warn wherever the collector meets it.
                        try:
                            handle, at = d(world.handle_ish()), d(loc_ish)
                            call(
                                "use.value",
                                lambda u=use, h=handle, a=at: u.value(h, at=a),
                                key_error=True,
                            )
                        finally:
                            call("use.__exit__", lambda u=use: u.__exit__(None, None, None))
    finally:
        world.finish()


# --------------------------------------------------------------------------------------------
# Regressions: implementation bugs this module found (both fixed)
# --------------------------------------------------------------------------------------------


def test_decide_with_a_reservation_of_2_pow_64_bytes_is_refused_cleanly() -> None:
    """A request reservation of >= 2**64 bytes (conventions.md#byte-counts-and-timestamps)
    must give a `ResidencyPlanError` (budgeted: capacity failure) or a clean `ValueError`
    (like `reserve`, which refuses nbytes > 2**64 - 1 with `ValueError`), never `OverflowError`."""
    manager = R.ResidencyManager({PAGEABLE_HOST: 64})
    try:
        handle = manager.adopt(tensor_value(4))
        controller = R.ResidencyController(manager)
        request = R.ResidencyRequest(
            "req",
            [R.ResidencyRequirement(handle, PAGEABLE_HOST)],
            [R.MemoryReservation(PAGEABLE_HOST, 2**64, "r")],
        )
        call("decide(2**64 reservation)", lambda: controller.decide(request))
    finally:
        manager.close(force=True)


def test_reserved_bytes_never_saturate_on_an_unbudgeted_location() -> None:
    """`reserved_bytes` is the sum of the listed reservations (snapshots.md#location-snapshots).

    Two reservations of 2**64 - 1 bytes at an unbudgeted location are both accepted, but
    `reserved_bytes` stays at 2**64 - 1 (saturated), and after releasing one of them it is 0
    while the other (2**64 - 1 bytes) is still listed. Either the sum must be exact or the
    second `reserve` must be refused (e.g. `ValueError`, as for nbytes > 2**64 - 1)."""
    manager = R.ResidencyManager()
    lifetimes = [manager.reserve(PAGEABLE_HOST, U64_MAX, label="a")]
    try:
        try:
            lifetimes.append(manager.reserve(PAGEABLE_HOST, U64_MAX, label="b"))
        except (ValueError, ResidencyError):
            return  # refusing the second reservation is a fine fix
        snap = manager.snapshot()
        listed = sum(r.nbytes for r in snap.reservations)
        entry = next(e for e in snap.locations if e.location == PAGEABLE_HOST)
        assert entry.reserved_bytes == listed, (entry.reserved_bytes, listed)
        lifetimes[1].release()
        snap = manager.snapshot()
        entry = next(e for e in snap.locations if e.location == PAGEABLE_HOST)
        assert entry.reserved_bytes == U64_MAX, entry.reserved_bytes
    finally:
        for lifetime in lifetimes:
            lifetime.release()
        manager.close(force=True)


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------


def test_zz_summary() -> None:
    """Runs last in this module: prints how many inputs were tried per entry point."""
    total = sum(COUNTS.values())
    entries = len(COUNTS)
    sys.stdout.write(
        f"\n[reliability-fuzz] {total} calls over {entries} entry points; "
        f"outcomes: {sum(v for k, v in OUTCOMES.items() if k.endswith(':ok'))} ok, "
        f"{sum(v for k, v in OUTCOMES.items() if not k.endswith(':ok'))} clean refusals\n"
    )
    sys.stdout.write(f"[reliability-fuzz] per entry: {dict(sorted(COUNTS.items()))}\n")
    if total:
        assert entries > 40
