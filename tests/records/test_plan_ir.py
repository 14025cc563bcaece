"""The four actions, `MemoryReservation` and `ResidencyPlan` (docs/concepts/transitions.md#actions,
docs/concepts/plans.md#plan-records)."""

# Exception types are fixed; ValueError wording is not (docs/concepts/conventions.md#check-order).
# ruff: noqa: PT011

from __future__ import annotations

import itertools
import typing
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, cuda_location
from fhelium.residency.plan import (
    DiscardValue,
    DropResident,
    EnsureResident,
    MemoryReservation,
    MoveResident,
    ResidencyAction,
    ResidencyPlan,
)
from helpers.records import (
    BLANK_STR,
    BLANK_STR_IDS,
    NOT_STR,
    NOT_STR_IDS,
    NOT_STRICT_INT,
    NOT_STRICT_INT_IDS,
    Boom,
    exploding,
    make_handle,
)

H1 = make_handle(handle_id="h1")
H2 = make_handle(handle_id="h2")
H_OTHER_MANAGER = make_handle(manager_id="manager-2", handle_id="h1")
CUDA0 = cuda_location("cuda:0")

ACTION_CLASSES = (EnsureResident, MoveResident, DropResident, DiscardValue)

# --- actions -------------------------------------------------------------------------------------


def test_action_alias_is_union_of_the_four_classes() -> None:
    # Members may be the bare classes or their generic aliases (e.g. EnsureResident[Any]).
    members = [typing.get_origin(arg) or arg for arg in typing.get_args(ResidencyAction)]
    assert sorted(m.__name__ for m in members) == sorted(c.__name__ for c in ACTION_CLASSES)
    assert set(members) == set(ACTION_CLASSES)


@pytest.mark.parametrize(
    ("action", "fields"),
    [
        (EnsureResident(H1, CUDA0), ["handle", "location"]),
        (MoveResident(H1, CUDA0), ["handle", "to", "from_location"]),
        (MoveResident(H1, CUDA0, PINNED_HOST), ["handle", "to", "from_location"]),
        (DropResident(H1, PAGEABLE_HOST), ["handle", "location"]),
        (DiscardValue(H1), ["handle"]),
    ],
    ids=["ensure", "move", "move-from", "drop", "discard"],
)
def test_actions_are_frozen_records(frozen_record, action: Any, fields: list[str]) -> None:
    frozen_record(action, fields)


def test_action_field_values() -> None:
    ensure = EnsureResident(H1, CUDA0)
    assert (ensure.handle, ensure.location) == (H1, CUDA0)
    move = MoveResident(H1, CUDA0)
    assert (move.handle, move.to, move.from_location) == (H1, CUDA0, None)
    move_from = MoveResident(H1, to=CUDA0, from_location=PINNED_HOST)
    assert move_from.from_location == PINNED_HOST
    assert MoveResident(H1, CUDA0, None) == move
    assert move_from != move
    drop = DropResident(handle=H1, location=PAGEABLE_HOST)
    assert (drop.handle, drop.location) == (H1, PAGEABLE_HOST)
    assert DiscardValue(handle=H1).handle == H1


def test_actions_are_generic() -> None:
    for cls in ACTION_CLASSES:
        assert typing.get_origin(cls[typing.Any]) is cls


def test_actions_with_same_fields_but_different_class_are_unequal() -> None:
    ensure = EnsureResident(H1, CUDA0)
    drop = DropResident(H1, CUDA0)
    assert ensure != drop
    assert drop != ensure
    assert len({ensure, drop}) == 2
    assert EnsureResident(H1, CUDA0) != EnsureResident(H2, CUDA0)
    assert EnsureResident(H1, CUDA0) != EnsureResident(H1, PAGEABLE_HOST)
    assert DiscardValue(H1) != DiscardValue(H2)


def test_actions_do_not_check_manager_or_availability() -> None:
    # A handle from any manager and a CUDA index beyond any real device are accepted.
    assert EnsureResident(H_OTHER_MANAGER, cuda_location("cuda:127")).handle == H_OTHER_MANAGER
    assert MoveResident(H_OTHER_MANAGER, CUDA0, CUDA0).from_location == CUDA0


BAD_HANDLES = ["h1", None, ("manager-1", "h1"), 1]
BAD_LOCATIONS = ["cuda:0", None, "pageable-host", CUDA0.device]


@pytest.mark.parametrize("bad", BAD_HANDLES, ids=repr)
@pytest.mark.parametrize("cls", [EnsureResident, DropResident, MoveResident])
def test_two_field_actions_reject_bad_handle(cls: Any, bad: Any) -> None:
    with pytest.raises(TypeError):
        cls(bad, CUDA0)


@pytest.mark.parametrize("bad", BAD_LOCATIONS, ids=repr)
@pytest.mark.parametrize("cls", [EnsureResident, DropResident, MoveResident])
def test_two_field_actions_reject_bad_location(cls: Any, bad: Any) -> None:
    with pytest.raises(TypeError):
        cls(H1, bad)


@pytest.mark.parametrize("bad", ["cuda:0", "pageable-host", CUDA0.device, 0], ids=repr)
def test_move_rejects_bad_from_location(bad: Any) -> None:
    with pytest.raises(TypeError):
        MoveResident(H1, CUDA0, bad)


@pytest.mark.parametrize("bad", BAD_HANDLES, ids=repr)
def test_discard_rejects_bad_handle(bad: Any) -> None:
    with pytest.raises(TypeError):
        DiscardValue(bad)


def test_actions_missing_arguments() -> None:
    with pytest.raises(TypeError):
        EnsureResident(H1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        MoveResident(H1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        DropResident(H1)  # type: ignore[call-arg]


# --- MemoryReservation ---------------------------------------------------------------------------


def test_reservation_fields_and_record_protocol(frozen_record) -> None:
    res = MemoryReservation(CUDA0, 1024, "workspace")
    assert (res.location, res.nbytes, res.label) == (CUDA0, 1024, "workspace")
    frozen_record(res, ["location", "nbytes", "label"])
    assert MemoryReservation(CUDA0, 1024, label="workspace") == res
    assert MemoryReservation(PAGEABLE_HOST, 0, "zero").nbytes == 0


def test_reservation_label_is_required() -> None:
    with pytest.raises(TypeError):
        MemoryReservation(CUDA0, 1)  # type: ignore[call-arg]


@pytest.mark.parametrize("bad", ["cuda:0", None, CUDA0.device], ids=repr)
def test_reservation_location_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        MemoryReservation(bad, 1, "label")


@pytest.mark.parametrize("bad", NOT_STRICT_INT, ids=NOT_STRICT_INT_IDS)
def test_reservation_nbytes_is_strict_int(bad: Any) -> None:
    with pytest.raises(TypeError):
        MemoryReservation(CUDA0, bad, "label")


def test_reservation_nbytes_negative() -> None:
    with pytest.raises(ValueError):
        MemoryReservation(CUDA0, -1, "label")


@pytest.mark.parametrize("bad", NOT_STR, ids=NOT_STR_IDS)
def test_reservation_label_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        MemoryReservation(CUDA0, 1, bad)


@pytest.mark.parametrize("bad", BLANK_STR, ids=BLANK_STR_IDS)
def test_reservation_label_blank(bad: str) -> None:
    with pytest.raises(ValueError):
        MemoryReservation(CUDA0, 1, bad)


def test_reservation_check_order() -> None:
    with pytest.raises(TypeError):
        MemoryReservation("cuda:0", -1, "")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        MemoryReservation(CUDA0, -1, 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        MemoryReservation(CUDA0, np.int64(1), "")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        MemoryReservation(CUDA0, True, "")  # type: ignore[arg-type]


_locations = st.sampled_from([PAGEABLE_HOST, PINNED_HOST, CUDA0, cuda_location("cuda:1")])


@given(
    st.tuples(
        _locations,
        st.integers(min_value=0, max_value=2**48),
        st.text(min_size=1, max_size=5).filter(str.strip),
    ),
    st.tuples(_locations, st.integers(min_value=0, max_value=3), st.sampled_from(["a", "b"])),
)
def test_reservation_eq_hash_consistency(
    first: tuple[Any, int, str], second: tuple[Any, int, str]
) -> None:
    a = MemoryReservation(*first)
    b = MemoryReservation(*second)
    assert (a == b) == (first == second)
    if a == b:
        assert hash(a) == hash(b)
    assert hash(a) == hash(MemoryReservation(*first))


# --- ResidencyPlan -------------------------------------------------------------------------------

PLAN_FIELDS = ["name", "enter", "exit", "reservations", "reclaim"]


def _full_plan_inputs() -> dict[str, list[Any]]:
    return {
        "enter": [EnsureResident(H1, CUDA0), MoveResident(H2, CUDA0)],
        "exit": [DropResident(H1, CUDA0)],
        "reservations": [MemoryReservation(CUDA0, 64, "scratch")],
        "reclaim": [DiscardValue(H2), MoveResident(H1, PAGEABLE_HOST, CUDA0)],
    }


def test_plan_defaults() -> None:
    plan = ResidencyPlan("p")
    assert plan.name == "p"
    assert plan.enter == ()
    assert plan.exit == ()
    assert plan.reservations == ()
    assert plan.reclaim == ()
    assert plan == ResidencyPlan("p", (), (), (), ())


def test_plan_field_order_is_name_enter_exit_reservations_reclaim(frozen_record) -> None:
    inputs = _full_plan_inputs()
    plan = ResidencyPlan(
        "p", inputs["enter"], inputs["exit"], inputs["reservations"], inputs["reclaim"]
    )
    assert plan.enter == tuple(inputs["enter"])
    assert plan.exit == tuple(inputs["exit"])
    assert plan.reservations == tuple(inputs["reservations"])
    assert plan.reclaim == tuple(inputs["reclaim"])
    assert plan == ResidencyPlan("p", **inputs)
    frozen_record(plan, PLAN_FIELDS)
    assert repr(plan).startswith("ResidencyPlan(name='p', enter=(")
    assert repr(plan).index("reservations=") < repr(plan).index("reclaim=")


def test_plan_stores_tuples_and_equals_plan_from_tuples() -> None:
    inputs = _full_plan_inputs()
    from_lists = ResidencyPlan("p", **inputs)
    from_tuples = ResidencyPlan("p", **{k: tuple(v) for k, v in inputs.items()})
    from_generators = ResidencyPlan("p", **{k: (x for x in v) for k, v in inputs.items()})
    assert from_lists == from_tuples == from_generators
    assert hash(from_lists) == hash(from_tuples) == hash(from_generators)
    for name in ("enter", "exit", "reservations", "reclaim"):
        assert type(getattr(from_lists, name)) is tuple
        assert type(getattr(from_generators, name)) is tuple


def test_plan_is_isolated_from_caller_list_mutation() -> None:
    inputs = _full_plan_inputs()
    plan = ResidencyPlan("p", **inputs)
    snapshot = {k: tuple(v) for k, v in inputs.items()}
    for value in inputs.values():
        value.append(DiscardValue(H1))
        value.clear()
    for name, expected in snapshot.items():
        assert getattr(plan, name) == expected


def test_plan_allows_cross_field_oddities() -> None:
    # Duplicates, handles from different managers, any reservation location: all accepted.
    dup = EnsureResident(H1, CUDA0)
    plan = ResidencyPlan(
        "odd",
        enter=[dup, dup, EnsureResident(H_OTHER_MANAGER, CUDA0)],
        exit=[DiscardValue(H1), DiscardValue(H1)],
        reservations=[
            MemoryReservation(PINNED_HOST, 1, "x"),
            MemoryReservation(PINNED_HOST, 1, "x"),
        ],
        reclaim=[dup],
    )
    assert plan.enter == (dup, dup, EnsureResident(H_OTHER_MANAGER, CUDA0))
    assert len(plan.reservations) == 2


def test_plan_accepts_every_action_class_in_every_phase() -> None:
    actions = [
        EnsureResident(H1, CUDA0),
        MoveResident(H1, PAGEABLE_HOST),
        DropResident(H1, CUDA0),
        DiscardValue(H1),
    ]
    plan = ResidencyPlan("all", enter=actions, exit=actions, reclaim=actions)
    assert plan.enter == plan.exit == plan.reclaim == tuple(actions)


def test_plan_unequal_when_any_field_differs() -> None:
    inputs = _full_plan_inputs()
    base = ResidencyPlan("p", **inputs)
    assert base != ResidencyPlan("q", **inputs)
    for name in ("enter", "exit", "reservations", "reclaim"):
        changed = dict(inputs)
        changed[name] = inputs[name][:-1]
        assert base != ResidencyPlan("p", **changed)
    # Swapping enter and reclaim changes the plan.
    swapped = dict(inputs, enter=inputs["reclaim"], reclaim=inputs["enter"])
    assert base != ResidencyPlan("p", **swapped)


@pytest.mark.parametrize("bad", NOT_STR, ids=NOT_STR_IDS)
def test_plan_name_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyPlan(bad)


@pytest.mark.parametrize("bad", BLANK_STR, ids=BLANK_STR_IDS)
def test_plan_name_blank(bad: str) -> None:
    with pytest.raises(ValueError):
        ResidencyPlan(bad)


@pytest.mark.parametrize("phase", ["enter", "exit", "reservations", "reclaim"])
@pytest.mark.parametrize("bad", [5, None, object()], ids=["int", "None", "object"])
def test_plan_non_iterable_phase(phase: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyPlan("p", **{phase: bad})


@pytest.mark.parametrize("phase", ["enter", "exit", "reclaim"])
@pytest.mark.parametrize(
    "bad",
    ["ensure", None, MemoryReservation(CUDA0, 1, "r"), H1, CUDA0],
    ids=["str", "None", "reservation", "handle", "location"],
)
def test_plan_action_phases_reject_non_actions(phase: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyPlan("p", **{phase: [EnsureResident(H1, CUDA0), bad]})


def test_plan_string_phase_is_iterated_and_rejected() -> None:
    with pytest.raises(TypeError):
        ResidencyPlan("p", enter="ab")


@pytest.mark.parametrize(
    "bad", [EnsureResident(H1, CUDA0), "r", None, 64], ids=["action", "str", "None", "int"]
)
def test_plan_reservations_reject_non_reservations(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyPlan("p", reservations=[MemoryReservation(CUDA0, 1, "ok"), bad])


def test_plan_check_order_name_first() -> None:
    with pytest.raises(ValueError):
        ResidencyPlan("", enter=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ResidencyPlan(" ", reclaim=exploding())
    with pytest.raises(TypeError):
        ResidencyPlan(None, enter=exploding())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("exploding_phase", "bad_phase"),
    list(itertools.permutations(["enter", "exit", "reservations", "reclaim"], 2)),
)
def test_plan_converts_every_phase_before_checking_elements(
    exploding_phase: str, bad_phase: str
) -> None:
    # Step 2 (tuple conversion of all four) precedes steps 3 and 4 (element checks).
    kwargs: dict[str, Any] = {bad_phase: ["not-an-element"], exploding_phase: exploding()}
    with pytest.raises(Boom):
        ResidencyPlan("p", **kwargs)


def test_plan_element_errors_are_type_errors_whatever_the_phase_mix() -> None:
    with pytest.raises(TypeError):
        ResidencyPlan(
            "p",
            enter=["x"],
            exit=["y"],
            reservations=[EnsureResident(H1, CUDA0)],
            reclaim=[MemoryReservation(CUDA0, 1, "r")],
        )


def test_plan_is_hashable_and_usable_as_key() -> None:
    plan = ResidencyPlan("p", **_full_plan_inputs())
    assert {plan: "v"}[ResidencyPlan("p", **_full_plan_inputs())] == "v"


# --- plans accept every value their records accept ----------------------------------------------

# Includes lone surrogates (category Cs): still a Python str, so a valid non-empty str.
ANY_TEXT = st.text(alphabet=st.characters(exclude_categories=()), max_size=6)


@given(ANY_TEXT)
def test_reservation_label_non_empty_str_rule(label: str) -> None:
    if label.strip():
        assert MemoryReservation(CUDA0, 1, label).label == label
    else:
        with pytest.raises(ValueError):
            MemoryReservation(CUDA0, 1, label)


@given(ANY_TEXT)
def test_plan_name_accepts_exactly_non_blank_strings(name: str) -> None:
    if name.strip():
        plan = ResidencyPlan(name, enter=[EnsureResident(H1, CUDA0)])
        assert plan.name == name
        assert plan == ResidencyPlan(name, enter=(EnsureResident(H1, CUDA0),))
    else:
        with pytest.raises(ValueError):
            ResidencyPlan(name)


@pytest.mark.parametrize(
    "text",
    ["\ud800", "lone \udcff surrogate", "nul\x00inside", "\u00a0nbsp", "x" * 10_000],
    ids=["surrogate", "surrogate-mid", "nul", "nbsp", "long"],
)
def test_plan_accepts_any_non_blank_str_everywhere(text: str) -> None:
    # Only the record rules apply (plans.md#plan-records): a plan of valid records is valid.
    handle = make_handle(manager_id=text, handle_id=text)
    reservation = MemoryReservation(CUDA0, 1, text)
    plan = ResidencyPlan(
        text,
        enter=[EnsureResident(handle, CUDA0)],
        exit=[DiscardValue(handle)],
        reservations=[reservation],
        reclaim=[MoveResident(handle, PAGEABLE_HOST)],
    )
    assert plan.name == text
    assert plan.enter[0].handle.handle_id == text
    assert plan.reservations == (reservation,)


@pytest.mark.parametrize("nbytes", [2**63, 2**64 - 1, 2**64, 2**80], ids=repr)
def test_plan_accepts_reservations_of_any_size(nbytes: int) -> None:
    # MemoryReservation.nbytes is a strict int >= 0 with no upper bound, and plan
    # construction checks nothing across fields; the budget rule decides at execution.
    reservation = MemoryReservation(CUDA0, nbytes, "huge")
    plan = ResidencyPlan("p", reservations=[reservation, reservation])
    assert plan.reservations == (reservation, reservation)
    assert plan.reservations[0].nbytes == nbytes


def test_plan_with_full_cuda_index_range() -> None:
    actions = [EnsureResident(H1, cuda_location(f"cuda:{i}")) for i in range(128)]
    plan = ResidencyPlan("wide", enter=actions, exit=[DropResident(H1, cuda_location("cuda:127"))])
    assert len(plan.enter) == 128
