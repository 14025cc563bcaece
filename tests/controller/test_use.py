"""`ResidencyController.use(...)` and `ResidencyUse` (docs/concepts/controller.md#use).

Construction (the consumer-stream set rule, mapping normalisation and its order), entry
(decide first, the scope, one lease per location in first-appearance order, values keyed by
requirement, epochs), failure unwinding, exit (leases released with `wait=False`, the scope
closed, values cleared but still cached, exceptions never suppressed) and the members'
`RuntimeError`s. CUDA locations and streams come from the simulated runtime.
"""

# ruff: noqa: PT011

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

from fhelium.errors import (
    ResidencyLifetimeClosedError,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
)
from fhelium.residency.controller import ResidencyController, ResidencyDecision, ResidencyUse
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.plan import DropResident, EnsureResident, MemoryReservation
from fhelium.residency.request import ResidencyRequirement
from fhelium.residency.snapshot import ResidencyPlanReport
from fhelium.values import TensorResident
from helpers.controller import RecordingPolicy, cuda_stream, replicated_at, request
from helpers.lifetimes import mat
from helpers.manager import (
    CUDA0,
    CUDA1,
    foreign_handle,
    mat_locs,
    sim_fixture,  # noqa: F401
    state_key,
    tensor_value,
)
from helpers.plans import (
    FaultRuntime,
    fault_rt_fixture,  # noqa: F401
)


class Boom(Exception):
    pass


class SpyManager(ResidencyManager):
    """Records every `acquire` call; `fail_at` makes the n-th call (1-based) raise `Boom`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.acquired: list[tuple[tuple[Any, ...], Any, Any]] = []
        self.fail_at: int | None = None

    def acquire(self, handles: Any, *, at: Any, consumer_stream: Any = None) -> Any:
        handles = tuple(handles)
        self.acquired.append((handles, at, consumer_stream))
        if self.fail_at == len(self.acquired):
            raise Boom("acquire failed")
        return super().acquire(handles, at=at, consumer_stream=consumer_stream)


class Setup:
    """cuda:0 budget 32 with replicated `a`, `b` there; `c` pageable only; a recording policy."""

    def __init__(self, runtime: Any) -> None:
        self.sim = runtime
        self.manager = SpyManager({CUDA0: 32})
        self.policy = RecordingPolicy()
        self.controller = ResidencyController(self.manager, policy=self.policy)
        self.a = replicated_at(self.manager, runtime, PAGEABLE_HOST, CUDA0)
        self.b = replicated_at(self.manager, runtime, PAGEABLE_HOST, CUDA0)
        self.c = replicated_at(self.manager, runtime, PAGEABLE_HOST)
        self.s0 = cuda_stream(runtime, 0)
        self.s1 = cuda_stream(runtime, 1)

    def mixed(self) -> Any:
        """c at cuda:0 (evicts a), b at pageable, c at pageable, a at cuda:1; a reservation."""
        return request(
            "mixed",
            (self.c, CUDA0),
            (self.b, PAGEABLE_HOST),
            (self.a, CUDA1),
            (self.c, PAGEABLE_HOST),
            reservations=[MemoryReservation(PINNED_HOST, 8, "ws")],
        )

    def streams(self) -> dict[Any, Any]:
        return {CUDA0: self.s0, CUDA1: self.s1}

    def epochs(self) -> dict[Any, Any]:
        """The candidates' epochs, observed by deciding a fresh value at cuda:0."""
        self.policy.calls.clear()
        self.sim.complete_events()
        d = replicated_at(self.manager, self.sim, PAGEABLE_HOST, n=8)  # all of cuda:0
        self.controller.decide(request("probe", (d, CUDA0)))
        return {c.handle: c.last_access_epoch for c in self.policy.seen()}


@pytest.fixture
def setup(sim: Any) -> Any:
    s = Setup(sim)
    yield s
    s.sim.complete_events()
    s.manager.close()


# --------------------------------------------------------------------------------------------
# Construction
# --------------------------------------------------------------------------------------------


def test_use_returns_a_residency_use(setup: Setup) -> None:
    req = setup.mixed()
    version = setup.manager.state_version
    use = setup.controller.use(req, consumer_streams=setup.streams())
    assert isinstance(use, ResidencyUse)
    assert use.request is req
    assert use.report is None
    assert use.exit_error is None
    with pytest.raises(RuntimeError):
        _ = use.decision
    with pytest.raises(RuntimeError):
        _ = use.values
    with pytest.raises(RuntimeError):
        use.value(setup.c, at=CUDA0)
    assert setup.manager.state_version == version
    assert setup.manager.acquired == []


@pytest.mark.parametrize("bad", [None, "req", ResidencyRequirement(foreign_handle(), CUDA0)])
def test_non_request(setup: Setup, bad: Any) -> None:
    with pytest.raises(TypeError):
        setup.controller.use(bad)


def test_host_only_request_needs_no_streams(setup: Setup) -> None:
    req = request("host", (setup.c, PAGEABLE_HOST))
    setup.controller.use(req)
    setup.controller.use(req, consumer_streams={})
    setup.controller.use(req, consumer_streams=None, transfer_streams={})
    with pytest.raises(ValueError) as info:
        setup.controller.use(req, consumer_streams={CUDA0: setup.s0})
    assert "cuda:0" in str(info.value)


def test_consumer_streams_must_match_the_cuda_locations(setup: Setup) -> None:
    req = setup.mixed()
    with pytest.raises(ValueError) as info:
        setup.controller.use(req)
    assert "cuda:0" in str(info.value)
    assert "cuda:1" in str(info.value)
    with pytest.raises(ValueError) as info:
        setup.controller.use(req, consumer_streams={CUDA0: setup.s0})
    assert "cuda:1" in str(info.value)
    only0 = request("only0", (setup.c, CUDA0))
    with pytest.raises(ValueError) as info:
        setup.controller.use(only0, consumer_streams=setup.streams())
    assert "cuda:1" in str(info.value)  # unexpected
    setup.controller.use(only0, consumer_streams={CUDA0: setup.s0})
    setup.controller.use(req, consumer_streams=setup.streams())


@pytest.mark.parametrize("argument", ["consumer_streams", "transfer_streams"])
def test_mapping_normalisation(setup: Setup, argument: str) -> None:
    req = request("only0", (setup.c, CUDA0))
    base = {"consumer_streams": {CUDA0: setup.s0}, "transfer_streams": None}

    def build(value: Any) -> Any:
        return setup.controller.use(req, **{**base, argument: value})

    with pytest.raises(TypeError):
        build([(CUDA0, setup.s0)])  # not a Mapping
    with pytest.raises(TypeError):
        build({"cuda:0": setup.s0})  # key not a location
    with pytest.raises(TypeError):
        build({CUDA0: "stream"})  # value not a stream
    with pytest.raises(TypeError):
        build({CUDA0: torch.device("cuda", 0)})
    with pytest.raises(ValueError):
        build({CUDA0: setup.s0, PINNED_HOST: setup.s0})  # non-CUDA key
    with pytest.raises(ValueError):
        build({CUDA0: setup.s1})  # stream on the wrong device
    # the value type check precedes the non-CUDA key check
    with pytest.raises(TypeError):
        build({CUDA0: setup.s0, PAGEABLE_HOST: "stream"})


def test_transfer_streams_may_name_unused_cuda_locations(setup: Setup) -> None:
    req = request("only0", (setup.c, CUDA0))
    use = setup.controller.use(
        req, consumer_streams={CUDA0: setup.s0}, transfer_streams=setup.streams()
    )
    with use:
        pass


def test_construction_check_order(setup: Setup) -> None:
    req = request("only0", (setup.c, CUDA0))
    # step 1 before step 2
    with pytest.raises(TypeError):
        setup.controller.use(None, consumer_streams=5)  # type: ignore[arg-type]
    # step 2 (TypeError) before step 3 (missing key, ValueError)
    with pytest.raises(TypeError):
        setup.controller.use(req, consumer_streams=5)  # type: ignore[arg-type]
    # step 3 (ValueError) before step 4 (TypeError)
    with pytest.raises(ValueError):
        setup.controller.use(req, transfer_streams=5)  # type: ignore[arg-type]
    # step 2 (ValueError, host key) before step 4 (TypeError)
    with pytest.raises(ValueError):
        setup.controller.use(
            req,
            consumer_streams={CUDA0: setup.s0, PINNED_HOST: setup.s0},
            transfer_streams=5,  # type: ignore[arg-type]
        )


def test_direct_construction(setup: Setup) -> None:
    req = request("host", (setup.c, PAGEABLE_HOST))
    use = ResidencyUse(
        controller=setup.controller, request=req, consumer_streams=None, transfer_streams=None
    )
    with use as entered:
        assert entered is use
    with pytest.raises(TypeError):
        ResidencyUse(setup.controller, req, None, None)  # type: ignore[misc]
    with pytest.raises(TypeError):
        ResidencyUse(controller=setup.controller, request=req)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        ResidencyUse(
            controller=setup.controller, request=None, consumer_streams=None, transfer_streams=None
        )


# --------------------------------------------------------------------------------------------
# Entry and the active context
# --------------------------------------------------------------------------------------------


def test_entry(setup: Setup) -> None:
    req = setup.mixed()
    expected = setup.controller.decide(req)
    assert expected.plan.reclaim == (DropResident(setup.a, CUDA0),)
    use = setup.controller.use(req, consumer_streams=setup.streams())
    with use as entered:
        assert entered is use
        assert isinstance(use.decision, ResidencyDecision)
        assert use.decision == expected
        # one lease per location, in first-appearance order, handles in requirement order
        assert setup.manager.acquired == [
            ((setup.c,), CUDA0, setup.s0),
            ((setup.b, setup.c), PAGEABLE_HOST, None),
            ((setup.a,), CUDA1, setup.s1),
        ]
        snap = setup.manager.snapshot()
        for requirement in req.requirements:
            assert mat(snap, requirement.handle, requirement.location).use_count == 1
        assert [(r.location, r.nbytes, r.label) for r in snap.reservations] == [
            (PINNED_HOST, 8, "ws")
        ]
        values = use.values
        assert isinstance(values, Mapping)
        assert set(values) == set(req.requirements)
        assert len(values) == 4
        for requirement in req.requirements:
            value = values[requirement]
            assert isinstance(value, TensorResident)
            assert setup.sim.placement(value) == requirement.location
            assert use.value(requirement.handle, at=requirement.location) is value
        assert (
            values[ResidencyRequirement(setup.c, CUDA0)]
            is not values[ResidencyRequirement(setup.c, PAGEABLE_HOST)]
        )
        assert use.report is None
        # the borrowed value is the managed object itself
        with setup.manager.acquire([setup.c], at=CUDA0, consumer_stream=setup.s0) as borrowed:
            assert borrowed[setup.c] is values[ResidencyRequirement(setup.c, CUDA0)]


def test_value_lookup_errors(setup: Setup) -> None:
    req = request("host", (setup.c, PAGEABLE_HOST), (setup.a, PAGEABLE_HOST))
    with setup.controller.use(req) as use:
        with pytest.raises(KeyError):
            use.value(setup.c, at=CUDA0)  # not an endpoint of the request
        with pytest.raises(KeyError):
            use.value(setup.b, at=PAGEABLE_HOST)
        with pytest.raises(KeyError):
            _ = use.values[ResidencyRequirement(setup.b, PAGEABLE_HOST)]
        with pytest.raises(TypeError):
            use.value("handle", at=PAGEABLE_HOST)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            use.value(setup.c, at="pageable-host")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            use.value([setup.c], at=PAGEABLE_HOST)  # type: ignore[arg-type]
        assert torch.equal(use.value(setup.c, at=PAGEABLE_HOST).tensor, tensor_value().tensor)


def test_single_entry(setup: Setup) -> None:
    use = setup.controller.use(request("host", (setup.c, PAGEABLE_HOST)))
    with use, pytest.raises(RuntimeError):
        use.__enter__()
    with pytest.raises(RuntimeError):
        use.__enter__()
    assert len(setup.manager.acquired) == 1


def test_epochs_are_recorded_after_the_leases(setup: Setup) -> None:
    with setup.controller.use(setup.mixed(), consumer_streams=setup.streams()):
        pass
    # a was dropped from cuda:0 and c put there: the cuda:0 candidates are b and c
    assert setup.epochs() == {setup.b: 1, setup.c: 1}


# --------------------------------------------------------------------------------------------
# Exit
# --------------------------------------------------------------------------------------------


def test_exit(setup: Setup) -> None:
    req = setup.mixed()
    use = setup.controller.use(req, consumer_streams=setup.streams())
    with use:
        captured = use.values
        decision = use.decision
    snap = setup.manager.snapshot()
    # values stay cached: no exit eviction
    for requirement in req.requirements:
        entry = mat(snap, requirement.handle, requirement.location)
        assert entry.use_count == 0
    # CUDA leases were released with wait=False: pending until their events are reaped
    assert mat(snap, setup.c, CUDA0).pending_event_count == 1
    assert mat(snap, setup.a, CUDA1).pending_event_count == 1
    assert mat(snap, setup.c, PAGEABLE_HOST).pending_event_count == 0
    setup.sim.complete_events()
    assert mat(setup.manager.snapshot(), setup.c, CUDA0).pending_event_count == 0
    # the scope was closed: reservations released, report kept
    assert setup.manager.snapshot().reservations == ()
    report = use.report
    assert isinstance(report, ResidencyPlanReport)
    assert report.plan_name == "mixed"
    assert [t.action for t in report.transitions] == [
        *decision.plan.reclaim,
        *decision.plan.enter,
    ]
    assert decision.plan.enter == (EnsureResident(setup.c, CUDA0), EnsureResident(setup.a, CUDA1))
    assert use.exit_error is None
    assert use.decision is decision  # still available after exit
    with pytest.raises(RuntimeError):
        _ = use.values
    with pytest.raises(RuntimeError):
        use.value(setup.c, at=CUDA0)
    # a mapping captured inside the context re-validates its leases
    with pytest.raises(ResidencyLifetimeClosedError):
        len(captured)
    with pytest.raises(ResidencyLifetimeClosedError):
        list(captured)
    # a second exit is a no-op returning False
    assert use.__exit__(None, None, None) is False


def test_exit_returns_false_and_never_suppresses(setup: Setup) -> None:
    use = setup.controller.use(
        request("host", (setup.c, PAGEABLE_HOST), (setup.b, CUDA0)),
        consumer_streams={CUDA0: setup.s0},
    )
    with pytest.raises(Boom), use:
        raise Boom("body")
    snap = setup.manager.snapshot()
    assert mat(snap, setup.c, PAGEABLE_HOST).use_count == 0
    assert mat(snap, setup.b, CUDA0).use_count == 0
    assert use.report is not None
    entered = setup.controller.use(request("host", (setup.c, PAGEABLE_HOST)))
    entered.__enter__()
    assert entered.__exit__(None, None, None) is False
    again = setup.controller.use(request("host", (setup.c, PAGEABLE_HOST)))
    again.__enter__()
    error = Boom("x")
    assert again.__exit__(Boom, error, None) is False


def test_exit_without_entry(setup: Setup) -> None:
    use = setup.controller.use(request("host", (setup.c, PAGEABLE_HOST)))
    assert use.__exit__(None, None, None) is False
    assert setup.manager.acquired == []


# --------------------------------------------------------------------------------------------
# Failure unwinding
# --------------------------------------------------------------------------------------------


def test_failed_decide(setup: Setup) -> None:
    big = replicated_at(setup.manager, setup.sim, PAGEABLE_HOST, n=16)
    before = state_key(setup.manager.snapshot())
    use = setup.controller.use(request("big", (big, CUDA0)), consumer_streams={CUDA0: setup.s0})
    with pytest.raises(ResidencyPlanError):
        use.__enter__()
    with pytest.raises(RuntimeError):
        _ = use.decision  # decide never succeeded
    with pytest.raises(RuntimeError):
        use.__enter__()  # closed
    assert use.report is None
    assert state_key(setup.manager.snapshot()) == before
    assert setup.manager.acquired == []


def test_failed_scope_entry(frt: FaultRuntime) -> None:
    setup = Setup(frt)
    with setup.manager:
        req = setup.mixed()
        use = setup.controller.use(req, consumer_streams=setup.streams())
        frt.arm("copy_to_cuda", 1, Boom("copy failed"))
        with pytest.raises(ResidencyPlanExecutionError) as info, use:
            pytest.fail("the body must not run")
        assert info.value.phase == "enter"
        assert isinstance(info.value.__cause__, Boom)
        # the decision was stored before anything failed
        assert isinstance(use.decision, ResidencyDecision)
        assert use.decision.request is req
        # the reclaim stays committed, the reservation was released, no lease was taken
        snap = setup.manager.snapshot()
        assert CUDA0 not in mat_locs(snap, setup.a)
        assert snap.reservations == ()
        assert setup.manager.acquired == []
        assert use.report is None
        with pytest.raises(RuntimeError):
            use.__enter__()
        assert use.__exit__(None, None, None) is False
        assert setup.epochs() == {setup.b: None}  # c never reached cuda:0


def test_failed_acquire_unwinds(setup: Setup) -> None:
    req = setup.mixed()
    use = setup.controller.use(req, consumer_streams=setup.streams())
    setup.manager.fail_at = 3  # the cuda:1 lease
    with pytest.raises(Boom), use:
        pytest.fail("the body must not run")
    assert len(setup.manager.acquired) == 3
    assert isinstance(use.decision, ResidencyDecision)
    snap = setup.manager.snapshot()
    # the two leases taken were released, the scope closed and its reservation released
    for requirement in req.requirements:
        assert mat(snap, requirement.handle, requirement.location).use_count == 0
    assert snap.reservations == ()
    # the enter actions stay committed
    assert CUDA1 in mat_locs(snap, setup.a)
    with pytest.raises(RuntimeError):
        _ = use.values
    with pytest.raises(RuntimeError):
        use.__enter__()
    setup.manager.fail_at = None
    # a failed entry records no access
    assert setup.epochs() == {setup.b: None, setup.c: None}
