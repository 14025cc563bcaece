"""Construction of `ResidencyController`, `ResidencyEviction` and `ResidencyDecision`
(docs/concepts/controller.md#construction, #decisions-and-evictions).

Every check is exercised on its own, and adjacent checks are paired with inputs that fail with
different exception types, so the order of the checks is pinned down too.
"""

# ruff: noqa: PT011

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fhelium.residency.controller import ResidencyController, ResidencyDecision, ResidencyEviction
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.plan import (
    DiscardValue,
    DropResident,
    EnsureResident,
    MemoryReservation,
    MoveResident,
    ResidencyPlan,
)
from fhelium.residency.policy import DeterministicTieredLRU, ResidencyPolicy
from fhelium.residency.request import ResidencyRequest, ResidencyRequirement
from fhelium.residency.snapshot import ResidencyPlanExplanation
from helpers.controller import DECISION_FIELDS
from helpers.records import (
    BLANK_STR,
    BLANK_STR_IDS,
    NOT_STR,
    NOT_STR_IDS,
    NOT_STRICT_INT,
    NOT_STRICT_INT_IDS,
    check_frozen_record,
    make_handle,
)

# --------------------------------------------------------------------------------------------
# ResidencyController construction (controller.md#construction)
# --------------------------------------------------------------------------------------------


class NamedPolicy:
    """A structurally complete policy with a configurable `name`."""

    def __init__(self, name: Any = "named") -> None:
        self._name = name

    @property
    def name(self) -> Any:
        return self._name

    @property
    def config_identity(self) -> tuple[tuple[str, object], ...]:
        return (("named", 1),)

    def fallback_locations(self, location: Any) -> tuple[Any, ...]:
        return ()

    def order_candidates(self, candidates: Any) -> tuple[Any, ...]:
        return tuple(candidates)


class MissingOrder:
    name = "missing-order"
    config_identity = ()

    def fallback_locations(self, location: Any) -> tuple[Any, ...]:
        return ()


class MissingFallback:
    name = "missing-fallback"
    config_identity = ()

    def order_candidates(self, candidates: Any) -> tuple[Any, ...]:
        return tuple(candidates)


class MissingName:
    config_identity = ()

    def fallback_locations(self, location: Any) -> tuple[Any, ...]:
        return ()

    def order_candidates(self, candidates: Any) -> tuple[Any, ...]:
        return tuple(candidates)


@pytest.fixture
def manager() -> Any:
    with ResidencyManager() as mgr:
        yield mgr


def test_controller_defaults(manager: ResidencyManager) -> None:
    controller = ResidencyController(manager)
    assert controller.manager is manager
    policy = controller.policy
    assert type(policy) is DeterministicTieredLRU
    assert policy.config_identity == (("fallback_tiers", ()),)
    assert policy.name == "deterministic-tiered-lru"


def test_controller_keeps_the_given_policy(manager: ResidencyManager) -> None:
    policy = DeterministicTieredLRU({PINNED_HOST: [PAGEABLE_HOST]})
    controller = ResidencyController(manager, policy=policy, search_state_limit=1)
    assert controller.policy is policy
    custom = NamedPolicy()
    assert isinstance(custom, ResidencyPolicy)
    assert ResidencyController(manager, policy=custom).policy is custom


def test_controller_arguments_are_keyword_only(manager: ResidencyManager) -> None:
    with pytest.raises(TypeError):
        ResidencyController(manager, DeterministicTieredLRU())  # type: ignore[misc]


@pytest.mark.parametrize("bad", [None, object(), "manager", 1])
def test_controller_manager_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyController(bad)


@pytest.mark.parametrize(
    "bad", [object(), MissingOrder(), MissingFallback(), MissingName(), "policy"]
)
def test_controller_policy_protocol(manager: ResidencyManager, bad: Any) -> None:
    assert not isinstance(bad, ResidencyPolicy)
    with pytest.raises(TypeError):
        ResidencyController(manager, policy=bad)


@pytest.mark.parametrize("bad", NOT_STR, ids=NOT_STR_IDS)
def test_controller_policy_name_type(manager: ResidencyManager, bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyController(manager, policy=NamedPolicy(bad))


@pytest.mark.parametrize("bad", BLANK_STR, ids=BLANK_STR_IDS)
def test_controller_policy_name_blank(manager: ResidencyManager, bad: str) -> None:
    with pytest.raises(ValueError):
        ResidencyController(manager, policy=NamedPolicy(bad))


@pytest.mark.parametrize("bad", NOT_STRICT_INT, ids=NOT_STRICT_INT_IDS)
def test_controller_search_state_limit_type(manager: ResidencyManager, bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyController(manager, search_state_limit=bad)


@pytest.mark.parametrize("bad", [0, -1, -100_000])
def test_controller_search_state_limit_positive(manager: ResidencyManager, bad: int) -> None:
    with pytest.raises(ValueError):
        ResidencyController(manager, search_state_limit=bad)


def test_controller_check_order(manager: ResidencyManager) -> None:
    # 1 before 3: a bad manager wins over a blank policy name.
    with pytest.raises(TypeError):
        ResidencyController(None, policy=NamedPolicy(" "))  # type: ignore[arg-type]
    # 1 before 4: a bad manager wins over a zero limit.
    with pytest.raises(TypeError):
        ResidencyController(object(), search_state_limit=0)  # type: ignore[arg-type]
    # 2 before 4: a non-policy wins over a zero limit.
    with pytest.raises(TypeError):
        ResidencyController(manager, policy=object(), search_state_limit=0)  # type: ignore[arg-type]
    # 3 before 4: a blank name (ValueError) wins over a bool limit (TypeError)...
    with pytest.raises(ValueError):
        ResidencyController(manager, policy=NamedPolicy(""), search_state_limit=True)
    # ... and a non-str name (TypeError) wins over a zero limit (ValueError).
    with pytest.raises(TypeError):
        ResidencyController(manager, policy=NamedPolicy(3), search_state_limit=0)


def test_controller_does_not_touch_the_manager(manager: ResidencyManager) -> None:
    version = manager.state_version
    ResidencyController(manager)
    assert manager.state_version == version


def test_controller_manager_and_policy_are_read_only(manager: ResidencyManager) -> None:
    controller = ResidencyController(manager)
    with pytest.raises(AttributeError):
        controller.manager = manager  # type: ignore[misc]
    with pytest.raises(AttributeError):
        controller.policy = DeterministicTieredLRU()  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# ResidencyEviction (controller.md#decisions-and-evictions)
# --------------------------------------------------------------------------------------------

EVICTION_FIELDS = ("action", "rank", "released_location", "released_nbytes", "reason")


def eviction_args(**overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "action": DropResident(make_handle(), PINNED_HOST),
        "rank": 0,
        "released_location": PINNED_HOST,
        "released_nbytes": 16,
        "reason": "another materialization preserves the logical value",
    }
    args.update(overrides)
    return args


def test_eviction_record() -> None:
    eviction = ResidencyEviction(**eviction_args())
    check_frozen_record(eviction, EVICTION_FIELDS)
    move = MoveResident(make_handle(), PAGEABLE_HOST, from_location=PINNED_HOST)
    moved = ResidencyEviction(move, 3, PINNED_HOST, 0, "moved")
    check_frozen_record(moved, EVICTION_FIELDS)
    assert moved.action is move
    assert moved.rank == 3
    assert moved.released_nbytes == 0
    assert moved != ResidencyEviction(move, 2, PINNED_HOST, 0, "moved")
    assert moved != ResidencyEviction(move, 3, PINNED_HOST, 0, "moved!")


@pytest.mark.parametrize(
    "bad",
    [
        EnsureResident(make_handle(), PINNED_HOST),
        DiscardValue(make_handle()),
        None,
        ("drop", PINNED_HOST),
    ],
    ids=["ensure", "discard", "None", "tuple"],
)
def test_eviction_action_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyEviction(**eviction_args(action=bad))


@pytest.mark.parametrize("field", ["rank", "released_nbytes"])
@pytest.mark.parametrize("bad", NOT_STRICT_INT, ids=NOT_STRICT_INT_IDS)
def test_eviction_counts_type(field: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyEviction(**eviction_args(**{field: bad}))


@pytest.mark.parametrize("field", ["rank", "released_nbytes"])
def test_eviction_counts_range(field: str) -> None:
    with pytest.raises(ValueError):
        ResidencyEviction(**eviction_args(**{field: -1}))


@pytest.mark.parametrize("bad", [None, "pinned-host", PINNED_HOST.device])
def test_eviction_location_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyEviction(**eviction_args(released_location=bad))


@pytest.mark.parametrize("bad", NOT_STR, ids=NOT_STR_IDS)
def test_eviction_reason_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyEviction(**eviction_args(reason=bad))


@pytest.mark.parametrize("bad", BLANK_STR, ids=BLANK_STR_IDS)
def test_eviction_reason_blank(bad: str) -> None:
    with pytest.raises(ValueError):
        ResidencyEviction(**eviction_args(reason=bad))


def test_eviction_check_order() -> None:
    ensure = EnsureResident(make_handle(), PINNED_HOST)
    with pytest.raises(TypeError):  # action before rank
        ResidencyEviction(**eviction_args(action=ensure, rank=-1))
    with pytest.raises(ValueError):  # rank before location
        ResidencyEviction(**eviction_args(rank=-1, released_location="x"))
    with pytest.raises(TypeError):  # location before nbytes
        ResidencyEviction(**eviction_args(released_location="x", released_nbytes=-1))
    with pytest.raises(ValueError):  # nbytes before reason
        ResidencyEviction(**eviction_args(released_nbytes=-1, reason=5))


# --------------------------------------------------------------------------------------------
# ResidencyDecision (controller.md#decisions-and-evictions)
# --------------------------------------------------------------------------------------------


def decision_args(**overrides: Any) -> dict[str, Any]:
    handle = make_handle()
    req = ResidencyRequest(
        "r",
        [ResidencyRequirement(handle, PAGEABLE_HOST)],
        [MemoryReservation(PINNED_HOST, 4, "ws")],
    )
    drop = DropResident(make_handle(handle_id="h2"), PINNED_HOST)
    plan = ResidencyPlan(
        "r",
        enter=[EnsureResident(handle, PAGEABLE_HOST)],
        reservations=req.reservations,
        reclaim=[drop],
    )
    args: dict[str, Any] = {
        "manager_id": "manager-1",
        "expected_state_version": 7,
        "explored_states": 2,
        "request": req,
        "plan": plan,
        "policy_name": "deterministic-tiered-lru",
        "policy_config": (("fallback_tiers", ()),),
        "evictions": (ResidencyEviction(drop, 0, PINNED_HOST, 16, "reason"),),
        "explanation": ResidencyPlanExplanation("r", (), req.reservations, (), True),
    }
    args.update(overrides)
    return args


def test_decision_record() -> None:
    decision = ResidencyDecision(**decision_args())
    check_frozen_record(decision, DECISION_FIELDS)
    assert decision.expected_state_version == 7
    assert decision.explored_states == 2
    assert decision != ResidencyDecision(**decision_args(explored_states=3))
    assert decision != ResidencyDecision(**decision_args(manager_id="manager-2"))


def test_decision_normalises_sequences() -> None:
    args = decision_args()
    evictions = list(args["evictions"])
    config = [("fallback_tiers", ())]
    decision = ResidencyDecision(
        **decision_args(policy_config=config, evictions=(e for e in evictions))
    )
    assert decision.policy_config == (("fallback_tiers", ()),)
    assert type(decision.policy_config) is tuple
    assert decision.evictions == tuple(evictions)
    assert type(decision.evictions) is tuple
    config.append(("late", 1))
    assert decision.policy_config == (("fallback_tiers", ()),)
    assert decision == ResidencyDecision(**decision_args())
    assert hash(decision) == hash(ResidencyDecision(**decision_args()))
    empty = ResidencyDecision(**decision_args(policy_config=[], evictions=[]))
    assert empty.policy_config == ()
    assert empty.evictions == ()


@pytest.mark.parametrize("bad", NOT_STR, ids=NOT_STR_IDS)
def test_decision_manager_id_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyDecision(**decision_args(manager_id=bad))


@pytest.mark.parametrize("bad", BLANK_STR, ids=BLANK_STR_IDS)
def test_decision_manager_id_blank(bad: str) -> None:
    with pytest.raises(ValueError):
        ResidencyDecision(**decision_args(manager_id=bad))


@pytest.mark.parametrize("bad", NOT_STRICT_INT, ids=NOT_STRICT_INT_IDS)
def test_decision_version_type(bad: Any) -> None:
    # strict (conventions.md#integer-arguments): numpy integers are rejected too
    with pytest.raises(TypeError):
        ResidencyDecision(**decision_args(expected_state_version=bad))


def test_decision_version_range() -> None:
    with pytest.raises(ValueError):
        ResidencyDecision(**decision_args(expected_state_version=-1))
    assert ResidencyDecision(**decision_args(expected_state_version=0)).expected_state_version == 0


@pytest.mark.parametrize("bad", NOT_STRICT_INT, ids=NOT_STRICT_INT_IDS)
def test_decision_explored_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyDecision(**decision_args(explored_states=bad))


@pytest.mark.parametrize("bad", [0, -1])
def test_decision_explored_positive(bad: int) -> None:
    with pytest.raises(ValueError):
        ResidencyDecision(**decision_args(explored_states=bad))


@pytest.mark.parametrize("field", ["request", "plan", "explanation"])
@pytest.mark.parametrize("bad", [None, object(), "x"])
def test_decision_record_types(field: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyDecision(**decision_args(**{field: bad}))


def test_decision_plan_and_request_types_are_distinct() -> None:
    args = decision_args()
    with pytest.raises(TypeError):
        ResidencyDecision(**decision_args(request=args["plan"]))
    with pytest.raises(TypeError):
        ResidencyDecision(**decision_args(plan=args["request"]))


@pytest.mark.parametrize("bad", NOT_STR, ids=NOT_STR_IDS)
def test_decision_policy_name_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyDecision(**decision_args(policy_name=bad))


@pytest.mark.parametrize("bad", BLANK_STR, ids=BLANK_STR_IDS)
def test_decision_policy_name_blank(bad: str) -> None:
    with pytest.raises(ValueError):
        ResidencyDecision(**decision_args(policy_name=bad))


@pytest.mark.parametrize(
    "bad",
    [
        5,  # not iterable: tuple() raises TypeError
        [("a", 1, 2)],  # not a 2-tuple
        [("a",)],
        ["ab"],  # a 2-char string is not a 2-tuple
        [None],
        [(5, 1)],  # first element not a str
        [(None, 1)],
    ],
    ids=["non-iterable", "3-tuple", "1-tuple", "str", "None", "int-key", "None-key"],
)
def test_decision_policy_config_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyDecision(**decision_args(policy_config=bad))


@pytest.mark.parametrize("blank", BLANK_STR, ids=BLANK_STR_IDS)
def test_decision_policy_config_blank_key(blank: str) -> None:
    with pytest.raises(ValueError):
        ResidencyDecision(**decision_args(policy_config=[("ok", 1), (blank, 2)]))


@pytest.mark.parametrize(
    "bad",
    [5, [None], [DropResident(make_handle(), PINNED_HOST)], [("action", 0)]],
    ids=["non-iterable", "None", "action", "tuple"],
)
def test_decision_evictions_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyDecision(**decision_args(evictions=bad))


def test_decision_plan_name_must_match_request() -> None:
    args = decision_args()
    plan = ResidencyPlan("other", reservations=args["request"].reservations)
    explanation = ResidencyPlanExplanation("other", (), (), (), True)
    with pytest.raises(ValueError):
        ResidencyDecision(**decision_args(plan=plan, explanation=explanation))


def test_decision_explanation_name_must_match_plan() -> None:
    explanation = ResidencyPlanExplanation("other", (), (), (), True)
    with pytest.raises(ValueError):
        ResidencyDecision(**decision_args(explanation=explanation))


def test_decision_explanation_must_be_feasible() -> None:
    explanation = ResidencyPlanExplanation("r", (), (), (), False, "nope")
    with pytest.raises(ValueError):
        ResidencyDecision(**decision_args(explanation=explanation))
    without_reason = ResidencyPlanExplanation("r", (), (), (), False)
    with pytest.raises(ValueError):
        ResidencyDecision(**decision_args(explanation=without_reason))


def test_decision_check_order() -> None:
    args = decision_args()
    # 1 (blank id, ValueError) before 2 (bool version, TypeError)
    with pytest.raises(ValueError):
        ResidencyDecision(**decision_args(manager_id=" ", expected_state_version=True))
    # 2 (negative, ValueError) before 3 (bool, TypeError)
    with pytest.raises(ValueError):
        ResidencyDecision(**decision_args(expected_state_version=-1, explored_states=True))
    # 2 (np.int64, TypeError) before 3 (0, ValueError)
    with pytest.raises(TypeError):
        ResidencyDecision(**decision_args(expected_state_version=np.int64(1), explored_states=0))
    # 3 (0, ValueError) before 4 (TypeError)
    with pytest.raises(ValueError):
        ResidencyDecision(**decision_args(explored_states=0, request=None))
    # 5 (TypeError) before 6 (blank, ValueError)
    with pytest.raises(TypeError):
        ResidencyDecision(**decision_args(plan=None, policy_name=""))
    # 6 (blank, ValueError) before 7 (non-iterable config, TypeError)
    with pytest.raises(ValueError):
        ResidencyDecision(**decision_args(policy_name="", policy_config=5))
    # 7 (blank key, ValueError) before 8 (bad eviction, TypeError)
    with pytest.raises(ValueError):
        ResidencyDecision(**decision_args(policy_config=[("", 1)], evictions=[None]))
    # 8 (TypeError) before 10 (name mismatch, ValueError)
    plan = ResidencyPlan("other")
    with pytest.raises(TypeError):
        ResidencyDecision(**decision_args(evictions=[None], plan=plan))
    # 9 (TypeError) before 10 (ValueError)
    with pytest.raises(TypeError):
        ResidencyDecision(**decision_args(explanation=None, plan=plan))
    # 4 (TypeError) before 10-12 (ValueError)
    infeasible = ResidencyPlanExplanation("x", (), (), (), False)
    with pytest.raises(TypeError):
        ResidencyDecision(**decision_args(request=None, plan=plan, explanation=infeasible))
    # the unmodified arguments are valid
    assert ResidencyDecision(**args).plan is args["plan"]
