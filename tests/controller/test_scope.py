"""`ResidencyController.scope(decision, *, transfer_streams=None)`
(docs/concepts/controller.md#scope-of-a-decision).

The check order (type, manager, policy identity), the scope it builds from the decision, that
it takes no manager state (works during callbacks and after close), and stale decisions
failing at entry before any reclaim or reservation, never silently replanned.
"""

from __future__ import annotations

from typing import Any

import pytest

from fhelium.errors import (
    ResidencyClosedError,
    ResidencyHandleError,
    ResidencyPlanError,
    ResidencyStaleStateError,
)
from fhelium.residency.controller import ResidencyController
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST
from fhelium.residency.manager import ResidencyManager, ResidencyScope
from fhelium.residency.plan import DropResident, EnsureResident, MemoryReservation
from fhelium.residency.policy import DeterministicTieredLRU
from helpers.controller import RecordingPolicy, cuda_stream, replicated_at, request
from helpers.manager import (
    CUDA0,
    Source,
    mat_locs,
    sim_fixture,  # noqa: F401
    spec,
    state_key,
    tensor_value,
)


class Setup:
    def __init__(self, sim: Any, policy: Any = None) -> None:
        self.sim = sim
        self.manager = ResidencyManager({CUDA0: 32})
        kwargs = {} if policy is None else {"policy": policy}
        self.controller = ResidencyController(self.manager, **kwargs)
        self.a = replicated_at(self.manager, sim, PAGEABLE_HOST, CUDA0)
        self.b = replicated_at(self.manager, sim, PAGEABLE_HOST, CUDA0)
        self.c = replicated_at(self.manager, sim, PAGEABLE_HOST)
        self.request = request(
            "need-c", (self.c, CUDA0), reservations=[MemoryReservation(PINNED_HOST, 8, "ws")]
        )
        self.decision = self.controller.decide(self.request)
        assert self.decision.plan.reclaim == (DropResident(self.a, CUDA0),)


@pytest.fixture
def setup(sim: Any) -> Any:
    s = Setup(sim)
    yield s
    s.manager.close()


class ConfigurablePolicy(RecordingPolicy):
    """A Python policy whose name and configuration evidence can change."""

    def __init__(self, name: str = "configurable", config: Any = (("v", 1),)) -> None:
        super().__init__(name=name)
        self.config = config

    @property
    def name(self) -> str:
        return self._name

    @property
    def config_identity(self) -> tuple[tuple[str, object], ...]:
        return self.config


@pytest.mark.parametrize("bad", [None, "decision", object()])
def test_non_decision(setup: Setup, bad: Any) -> None:
    with pytest.raises(TypeError):
        setup.controller.scope(bad)
    with pytest.raises(TypeError):
        setup.controller.scope(setup.decision.plan)  # a plan is not a decision


def test_scope_from_the_decision(setup: Setup) -> None:
    version = setup.manager.state_version
    scope = setup.controller.scope(setup.decision)
    assert isinstance(scope, ResidencyScope)
    assert scope.manager is setup.manager
    assert scope.plan == setup.decision.plan
    assert scope.expected_state_version == setup.decision.expected_state_version
    assert setup.manager.state_version == version  # construction touches nothing
    with scope:
        snap = setup.manager.snapshot()
        assert CUDA0 in mat_locs(snap, setup.c)
        assert CUDA0 not in mat_locs(snap, setup.a)
        assert [(r.location, r.nbytes, r.label) for r in snap.reservations] == [
            (PINNED_HOST, 8, "ws")
        ]
    assert setup.manager.snapshot().reservations == ()
    assert scope.report is not None
    assert [t.action for t in scope.report.transitions] == [
        DropResident(setup.a, CUDA0),
        EnsureResident(setup.c, CUDA0),
    ]


def test_transfer_streams_are_passed_through(setup: Setup) -> None:
    stream = cuda_stream(setup.sim)
    mark = len(setup.sim.copies)
    with setup.controller.scope(setup.decision, transfer_streams={CUDA0: stream}):
        pass
    copies = [c for c in setup.sim.copies[mark:] if c.destination == CUDA0]
    assert copies
    assert all(c.stream is stream for c in copies)


def test_bad_transfer_streams_type(setup: Setup) -> None:
    with pytest.raises(TypeError):
        setup.controller.scope(setup.decision, transfer_streams=[(CUDA0, None)])  # type: ignore[arg-type]


def test_host_transfer_stream_key_fails_at_entry(setup: Setup) -> None:
    scope = setup.controller.scope(
        setup.decision, transfer_streams={PAGEABLE_HOST: cuda_stream(setup.sim)}
    )
    before = state_key(setup.manager.snapshot())
    with pytest.raises(ValueError):  # noqa: PT011
        scope.__enter__()
    assert state_key(setup.manager.snapshot()) == before


def test_decision_from_another_manager(setup: Setup, sim: Any) -> None:
    with ResidencyManager({CUDA0: 32}) as other:
        x = replicated_at(other, sim, PAGEABLE_HOST)
        foreign = ResidencyController(other).decide(request("x", (x, CUDA0)))
        with pytest.raises(ResidencyHandleError):
            setup.controller.scope(foreign)
        # the manager check comes before the policy check
        tiered = ResidencyController(
            other, policy=DeterministicTieredLRU({CUDA0: [PINNED_HOST]})
        ).decide(request("x", (x, CUDA0)))
        with pytest.raises(ResidencyHandleError):
            setup.controller.scope(tiered)


def test_decision_from_another_policy_configuration(setup: Setup) -> None:
    tiered = ResidencyController(
        setup.manager, policy=DeterministicTieredLRU({CUDA0: [PINNED_HOST]})
    )
    with pytest.raises(ResidencyPlanError) as info:
        tiered.scope(setup.decision)
    assert type(info.value) is ResidencyPlanError
    # an equal policy in another controller of the same manager is accepted
    twin = ResidencyController(setup.manager, policy=DeterministicTieredLRU({}))
    with twin.scope(setup.decision):
        pass


def test_decision_from_another_policy_name(setup: Setup) -> None:
    named = ResidencyController(
        setup.manager, policy=ConfigurablePolicy(config=(("fallback_tiers", ()),))
    )
    assert tuple(named.policy.config_identity) == setup.decision.policy_config
    with pytest.raises(ResidencyPlanError):
        named.scope(setup.decision)


def test_policy_whose_identity_changes(sim: Any) -> None:
    policy = ConfigurablePolicy()
    s = Setup(sim, policy=policy)
    with s.manager:
        assert s.decision.policy_name == "configurable"
        assert s.decision.policy_config == (("v", 1),)
        policy.config = (("v", 2),)
        with pytest.raises(ResidencyPlanError):
            s.controller.scope(s.decision)
        policy.config = [("v", 1)]  # equal as a tuple: accepted again
        with s.controller.scope(s.decision):
            pass


def test_stale_decision_fails_at_entry(setup: Setup, sim: Any) -> None:
    scope = setup.controller.scope(setup.decision)
    replicated_at(setup.manager, sim, PAGEABLE_HOST)  # any mutation makes it stale
    late = setup.controller.scope(setup.decision)  # construction still works
    before = state_key(setup.manager.snapshot())
    trace = setup.manager.trace()
    for stale in (scope, late):
        with pytest.raises(ResidencyStaleStateError) as info:
            stale.__enter__()
        assert info.value.expected_version == setup.decision.expected_state_version
        assert info.value.actual_version == setup.manager.state_version
    # nothing was reclaimed, reserved or replanned
    assert state_key(setup.manager.snapshot()) == before
    assert setup.manager.trace() == trace
    assert CUDA0 in mat_locs(setup.manager.snapshot(), setup.a)
    assert setup.manager.snapshot().reservations == ()


def test_scope_during_a_source_callback(setup: Setup) -> None:
    outcome: dict[str, Any] = {}

    def hook() -> None:
        try:
            outcome["scope"] = setup.controller.scope(setup.decision)
        except BaseException as exc:
            outcome["error"] = exc

    handle = setup.manager.register_source(spec(), Source(tensor_value, before_load=hook))
    setup.manager.ensure(handle, PAGEABLE_HOST)
    assert "error" not in outcome, outcome.get("error")
    assert isinstance(outcome["scope"], ResidencyScope)


def test_scope_after_close(setup: Setup) -> None:
    setup.manager.close()
    scope = setup.controller.scope(setup.decision)
    assert isinstance(scope, ResidencyScope)
    with pytest.raises(ResidencyClosedError):
        scope.__enter__()
