"""Controller policy metadata and access epochs (docs/concepts/controller.md#policy-metadata,
#access-epochs).

Both maps are controller-local and only observable through the candidates the controller hands
to its policy, so a `RecordingPolicy` captures them: a cuda:0 budget of 32 bytes holds two
16-byte replicated values `a` and `b`, and a request for a third value `c` at cuda:0 makes
both of them eviction candidates.
"""

# ruff: noqa: PT011

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fhelium.errors import (
    ResidencyClosedError,
    ResidencyHandleError,
    ResidencyPlanError,
    ResidencyReentrancyError,
)
from fhelium.residency.controller import ResidencyController
from fhelium.residency.location import PAGEABLE_HOST
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.model import ResidencyHandle
from fhelium.residency.plan import DropResident
from fhelium.residency.policy import ResidencyPolicyMetadata
from helpers.controller import (
    RecordingPolicy,
    check_against_reference,
    cuda_stream,
    replicated_at,
    request,
    sourced,
)
from helpers.lifetimes import assert_not_reaped, assert_reaped
from helpers.manager import (
    CUDA0,
    Source,
    foreign_handle,
    sim_fixture,  # noqa: F401
    spec,
    tensor_value,
)
from helpers.records import BLANK_STR, BLANK_STR_IDS


class Setup:
    def __init__(self, sim: Any) -> None:
        self.manager = ResidencyManager({CUDA0: 32})
        self.policy = RecordingPolicy()
        self.controller = ResidencyController(self.manager, policy=self.policy)
        self.a = replicated_at(self.manager, sim, PAGEABLE_HOST, CUDA0)
        self.b = replicated_at(self.manager, sim, PAGEABLE_HOST, CUDA0)
        self.c = replicated_at(self.manager, sim, PAGEABLE_HOST)

    def candidates(self) -> dict[ResidencyHandle[Any], Any]:
        """Decide `c` at cuda:0 and return the cuda:0 candidates by handle."""
        self.policy.calls.clear()
        self.decision = self.controller.decide(request("need-c", (self.c, CUDA0)))
        seen = [c for c in self.policy.seen() if c.location == CUDA0]
        assert seen, "the controller offered no candidates at cuda:0"
        result = {}
        for candidate in seen:
            result.setdefault(candidate.handle, candidate)
        return result

    def victim(self) -> ResidencyHandle[Any]:
        self.candidates()
        (eviction,) = self.decision.evictions
        assert isinstance(eviction.action, DropResident)
        return eviction.action.handle

    def touch(self, *handles: ResidencyHandle[Any]) -> None:
        with self.controller.use(request("touch", *((h, PAGEABLE_HOST) for h in handles))):
            pass

    def close(self) -> None:
        self.manager.close()


@pytest.fixture
def setup(sim: Any) -> Any:
    s = Setup(sim)
    yield s
    s.close()


# --------------------------------------------------------------------------------------------
# set_policy_metadata
# --------------------------------------------------------------------------------------------


def test_default_metadata_and_candidate_fields(setup: Setup) -> None:
    candidates = setup.candidates()
    assert set(candidates) == {setup.a, setup.b}
    snap = setup.manager.snapshot()
    indices = {v.handle: i for i, v in enumerate(snap.values)}
    for handle, candidate in candidates.items():
        assert candidate.metadata == ResidencyPolicyMetadata()
        assert candidate.last_access_epoch is None
        assert candidate.charged_nbytes == 16
        assert candidate.location == CUDA0
        assert candidate.registration_index == indices[handle]
    # registration order, a before b
    first_call = next(call for call in setup.policy.calls if call)
    assert [c.handle for c in first_call] == [setup.a, setup.b]


def test_metadata_reaches_the_candidates(setup: Setup) -> None:
    version = setup.manager.state_version
    assert setup.controller.set_policy_metadata(setup.a, priority=5, stable_key="alpha") is None
    setup.controller.set_policy_metadata(setup.b, priority=-2)
    assert setup.manager.state_version == version  # metadata never changes the version
    candidates = setup.candidates()
    assert candidates[setup.a].metadata == ResidencyPolicyMetadata(5, "alpha")
    assert candidates[setup.b].metadata == ResidencyPolicyMetadata(-2, None)


def test_metadata_is_replaced_not_merged(setup: Setup) -> None:
    setup.controller.set_policy_metadata(setup.a, priority=5, stable_key="alpha")
    setup.controller.set_policy_metadata(setup.a)
    assert setup.candidates()[setup.a].metadata == ResidencyPolicyMetadata()
    setup.controller.set_policy_metadata(setup.a, stable_key="beta")
    assert setup.candidates()[setup.a].metadata == ResidencyPolicyMetadata(0, "beta")


def test_priority_decides_the_victim(setup: Setup) -> None:
    # default: equal priority, never accessed, no keys -> registration order, a goes first
    assert setup.victim() == setup.a
    setup.controller.set_policy_metadata(setup.a, priority=1)
    assert setup.victim() == setup.b
    setup.controller.set_policy_metadata(setup.b, priority=2)
    assert setup.victim() == setup.a
    check_against_reference(
        setup.controller,
        setup.decision,
        metadata={
            setup.a: ResidencyPolicyMetadata(1),
            setup.b: ResidencyPolicyMetadata(2),
        },
    )


@pytest.mark.parametrize("bad", [True, np.int64(1), 1.0, "1", None])
def test_invalid_priority_before_any_lookup(setup: Setup, bad: Any) -> None:
    with pytest.raises(TypeError):
        setup.controller.set_policy_metadata(setup.a, priority=bad)
    # the metadata is built first: even a non-handle gets the TypeError
    with pytest.raises(TypeError):
        setup.controller.set_policy_metadata("not a handle", priority=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", BLANK_STR, ids=BLANK_STR_IDS)
def test_blank_stable_key(setup: Setup, bad: str) -> None:
    with pytest.raises(ValueError):
        setup.controller.set_policy_metadata(setup.a, stable_key=bad)
    with pytest.raises(ValueError):
        setup.controller.set_policy_metadata(object(), stable_key=bad)  # type: ignore[arg-type]
    assert setup.candidates()[setup.a].metadata == ResidencyPolicyMetadata()


def test_stable_key_type(setup: Setup) -> None:
    with pytest.raises(TypeError):
        setup.controller.set_policy_metadata(setup.a, stable_key=5)  # type: ignore[arg-type]


def test_metadata_arguments_are_keyword_only(setup: Setup) -> None:
    with pytest.raises(TypeError):
        setup.controller.set_policy_metadata(setup.a, 3)  # type: ignore[misc]


@pytest.mark.parametrize("bad", [None, "handle", 3, object()])
def test_non_handle_is_not_found(setup: Setup, bad: Any) -> None:
    with pytest.raises(ResidencyHandleError):
        setup.controller.set_policy_metadata(bad)


def test_foreign_unknown_and_discarded_handles(setup: Setup) -> None:
    with pytest.raises(ResidencyHandleError):
        setup.controller.set_policy_metadata(foreign_handle())
    unknown = ResidencyHandle(setup.manager.manager_id, "no-such-handle", type(tensor_value()))
    with pytest.raises(ResidencyHandleError):
        setup.controller.set_policy_metadata(unknown)
    with ResidencyManager() as other:
        elsewhere = other.adopt(tensor_value())
        with pytest.raises(ResidencyHandleError):
            setup.controller.set_policy_metadata(elsewhere)
        other.discard(elsewhere)
    setup.manager.discard(setup.c)
    with pytest.raises(ResidencyHandleError):
        setup.controller.set_policy_metadata(setup.c, priority=3)


def test_closed_manager(setup: Setup) -> None:
    setup.manager.close()
    with pytest.raises(ResidencyClosedError):
        setup.controller.set_policy_metadata(setup.a)
    # metadata validation still comes first
    with pytest.raises(TypeError):
        setup.controller.set_policy_metadata(setup.a, priority=1.5)  # type: ignore[arg-type]


def test_during_a_source_callback(setup: Setup, sim: Any) -> None:
    outcome: dict[str, Any] = {}

    def hook() -> None:
        try:
            setup.controller.set_policy_metadata(setup.a, priority=9)
        except BaseException as exc:
            outcome["error"] = exc

    source = Source(tensor_value, before_load=hook)
    handle = setup.manager.register_source(spec(), source)
    setup.manager.ensure(handle, PAGEABLE_HOST)
    assert source.calls == 1
    assert isinstance(outcome.get("error"), ResidencyReentrancyError)
    assert setup.candidates()[setup.a].metadata == ResidencyPolicyMetadata()


def test_metadata_reaps_through_its_snapshot(setup: Setup, sim: Any) -> None:
    with setup.manager.acquire([setup.a], at=CUDA0, consumer_stream=cuda_stream(sim)):
        pass
    assert_not_reaped(setup.manager, sim)
    sim.complete_events()
    setup.controller.set_policy_metadata(setup.b, priority=1)
    assert_reaped(setup.manager, sim)


def test_duplicate_stable_key(setup: Setup) -> None:
    setup.controller.set_policy_metadata(setup.a, priority=1, stable_key="k")
    # the same handle may set its own key again
    setup.controller.set_policy_metadata(setup.a, priority=2, stable_key="k")
    with pytest.raises(ValueError):
        setup.controller.set_policy_metadata(setup.b, priority=7, stable_key="k")
    # a failed set stores nothing
    candidates = setup.candidates()
    assert candidates[setup.b].metadata == ResidencyPolicyMetadata()
    assert candidates[setup.a].metadata == ResidencyPolicyMetadata(2, "k")
    # unkeyed metadata never collides
    setup.controller.set_policy_metadata(setup.b, priority=7)
    assert setup.candidates()[setup.b].metadata == ResidencyPolicyMetadata(7)


def test_replaced_key_is_freed(setup: Setup) -> None:
    setup.controller.set_policy_metadata(setup.a, stable_key="k")
    setup.controller.set_policy_metadata(setup.a, stable_key="other")
    setup.controller.set_policy_metadata(setup.b, stable_key="k")
    candidates = setup.candidates()
    assert candidates[setup.b].metadata.stable_key == "k"
    assert candidates[setup.a].metadata.stable_key == "other"
    setup.controller.set_policy_metadata(setup.a)  # no key any more
    setup.controller.set_policy_metadata(setup.c, stable_key="other")


def test_discarded_keys_stay_reserved(setup: Setup, sim: Any) -> None:
    handle, _ = sourced(setup.manager, sim)
    setup.controller.set_policy_metadata(handle, stable_key="kept")
    setup.manager.discard(handle)
    with pytest.raises(ValueError):
        setup.controller.set_policy_metadata(setup.a, stable_key="kept")
    # a discarded handle's metadata can no longer be changed either
    with pytest.raises(ResidencyHandleError):
        setup.controller.set_policy_metadata(handle)


def test_metadata_is_per_controller(setup: Setup) -> None:
    setup.controller.set_policy_metadata(setup.a, priority=4, stable_key="k")
    policy = RecordingPolicy()
    other = ResidencyController(setup.manager, policy=policy)
    other.set_policy_metadata(setup.b, stable_key="k")  # no clash across controllers
    other.decide(request("need-c", (setup.c, CUDA0)))
    seen = {c.handle: c for c in policy.seen()}
    assert seen[setup.a].metadata == ResidencyPolicyMetadata()
    assert seen[setup.b].metadata == ResidencyPolicyMetadata(0, "k")


def test_stable_key_orders_equal_candidates(setup: Setup) -> None:
    # keyed before unkeyed: a keyed b goes before the unkeyed (older-registered) a
    setup.controller.set_policy_metadata(setup.b, stable_key="zz")
    assert setup.victim() == setup.b
    # among keyed candidates the key text decides
    setup.controller.set_policy_metadata(setup.a, stable_key="zzz")
    assert setup.victim() == setup.b
    setup.controller.set_policy_metadata(setup.b, stable_key="zzzz")
    assert setup.victim() == setup.a


# --------------------------------------------------------------------------------------------
# access epochs
# --------------------------------------------------------------------------------------------


def epochs(setup: Setup) -> dict[ResidencyHandle[Any], int | None]:
    return {h: c.last_access_epoch for h, c in setup.candidates().items()}


def test_epochs_start_unset_and_follow_successful_uses(setup: Setup) -> None:
    assert epochs(setup) == {setup.a: None, setup.b: None}
    setup.touch(setup.b, setup.a)
    assert epochs(setup) == {setup.a: 1, setup.b: 1}
    setup.touch(setup.a)
    assert epochs(setup) == {setup.a: 2, setup.b: 1}
    setup.touch(setup.c)
    setup.touch(setup.b)
    assert epochs(setup) == {setup.a: 2, setup.b: 4}


def test_epochs_decide_the_victim(setup: Setup) -> None:
    assert setup.victim() == setup.a  # both never accessed: registration order
    setup.touch(setup.a)
    assert setup.victim() == setup.b  # b is now the least recently used
    setup.touch(setup.b)
    assert setup.victim() == setup.a
    check_against_reference(setup.controller, setup.decision, epochs={setup.a: 1, setup.b: 2})
    # priority still beats recency
    setup.controller.set_policy_metadata(setup.a, priority=1)
    assert setup.victim() == setup.b


def test_one_epoch_per_entry(setup: Setup, sim: Any) -> None:
    setup.touch(setup.b)
    # a handle required at two locations is recorded once, with the entry's single epoch
    use = setup.controller.use(
        request("a-twice", (setup.a, PAGEABLE_HOST), (setup.a, CUDA0)),
        consumer_streams={CUDA0: cuda_stream(sim)},
    )
    with use:
        pass
    sim.complete_events()  # the cuda:0 lease is pending until its event is reaped
    assert epochs(setup) == {setup.a: 2, setup.b: 1}
    setup.touch(setup.b)
    assert epochs(setup) == {setup.a: 2, setup.b: 3}


def test_decide_scope_and_direct_operations_leave_epochs(setup: Setup) -> None:
    setup.touch(setup.a)
    setup.controller.decide(request("need-c", (setup.c, CUDA0)))
    setup.controller.scope(setup.controller.decide(request("need-c", (setup.c, CUDA0))))
    with setup.controller.scope(setup.controller.decide(request("a", (setup.a, PAGEABLE_HOST)))):
        pass
    setup.manager.ensure(setup.b, PAGEABLE_HOST)
    with setup.manager.acquire([setup.b], at=PAGEABLE_HOST):
        pass
    assert epochs(setup) == {setup.a: 1, setup.b: None}
    setup.touch(setup.b)
    assert epochs(setup) == {setup.a: 1, setup.b: 2}


def test_failed_use_entries_do_not_advance(setup: Setup, sim: Any) -> None:
    setup.touch(setup.a)
    # a 64-byte value can never fit in the 32-byte cuda:0 budget: decide fails at entry
    big = replicated_at(setup.manager, sim, PAGEABLE_HOST, n=16)
    failing = setup.controller.use(
        request("fail", (setup.b, PAGEABLE_HOST), (big, CUDA0)),
        consumer_streams={CUDA0: cuda_stream(sim)},
    )
    with pytest.raises(ResidencyPlanError), failing:
        pass
    assert epochs(setup) == {setup.a: 1, setup.b: None}
    setup.touch(setup.b)
    assert epochs(setup) == {setup.a: 1, setup.b: 2}
