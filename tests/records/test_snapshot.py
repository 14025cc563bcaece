"""Construction rules of the snapshot, explanation and report records
(docs/concepts/snapshots.md#record-checks)."""

# Exception types are fixed; ValueError wording is not (docs/concepts/conventions.md#check-order).
# ruff: noqa: PT011

from __future__ import annotations

import typing
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, cuda_location
from fhelium.residency.model import Recoverability, ReplicaMode, ResidencyValueSpec
from fhelium.residency.plan import (
    DiscardValue,
    DropResident,
    EnsureResident,
    MemoryReservation,
    MoveResident,
)
from fhelium.residency.snapshot import (
    MaterializationSnapshot,
    ResidencyActionExplanation,
    ResidencyLocationSnapshot,
    ResidencyPlanExplanation,
    ResidencyPlanReport,
    ResidencyReservationSnapshot,
    ResidencySnapshot,
    ResidencyTransitionReport,
    ResidencyValueSnapshot,
)
from helpers.records import (
    BLANK_STR,
    BLANK_STR_IDS,
    NOT_BOOL,
    NOT_BOOL_IDS,
    NOT_STR,
    NOT_STR_IDS,
    NOT_STRICT_INT,
    NOT_STRICT_INT_IDS,
    NOT_STRICT_INT_NONE_OK,
    NOT_STRICT_INT_NONE_OK_IDS,
    Pair,
    make_handle,
)

H1 = make_handle(handle_id="h1")
H2 = make_handle(handle_id="h2")
CUDA0 = cuda_location("cuda:0")
CUDA1 = cuda_location("cuda:1")
SPEC = ResidencyValueSpec(Pair, 10, 16, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE)
ENSURE = EnsureResident(H1, CUDA0)

# --------------------------------------------------------------------------------------------
# Builders: a valid record, with any fields overridden.
# --------------------------------------------------------------------------------------------

MAT_FIELDS = [
    "location",
    "logical_nbytes",
    "storage_nbytes",
    "charged_nbytes",
    "use_count",
    "hold_count",
    "pending_event_count",
]


def mat(**kw: Any) -> MaterializationSnapshot:
    fields: dict[str, Any] = {
        "location": CUDA0,
        "logical_nbytes": 10,
        "storage_nbytes": 12,
        "charged_nbytes": 16,
        "use_count": 1,
        "hold_count": 2,
        "pending_event_count": 3,
    }
    fields.update(kw)
    return MaterializationSnapshot(**fields)


VALUE_FIELDS = [
    "handle",
    "spec",
    "materializations",
    "has_source",
    "source_location",
    "discarded",
]


def value_snap(**kw: Any) -> ResidencyValueSnapshot[Any]:
    fields: dict[str, Any] = {
        "handle": H1,
        "spec": SPEC,
        "materializations": (mat(location=CUDA0), mat(location=PAGEABLE_HOST)),
        "has_source": True,
        "source_location": PAGEABLE_HOST,
        "discarded": False,
    }
    fields.update(kw)
    return ResidencyValueSnapshot(**fields)


RES_FIELDS = ["location", "nbytes", "label"]


def res_snap(**kw: Any) -> ResidencyReservationSnapshot:
    fields: dict[str, Any] = {"location": CUDA0, "nbytes": 20, "label": "scratch"}
    fields.update(kw)
    return ResidencyReservationSnapshot(**fields)


LOC_FIELDS = [
    "location",
    "budget_bytes",
    "used_bytes",
    "reserved_bytes",
    "remaining_budget_bytes",
    "peak_used_bytes",
    "peak_charged_bytes",
    "value_count",
    "reservation_count",
    "use_count",
    "hold_count",
    "pending_event_count",
    "allocator_allocated_bytes",
    "allocator_reserved_bytes",
]
LOC_COUNT_FIELDS = [
    "used_bytes",
    "reserved_bytes",
    "peak_used_bytes",
    "peak_charged_bytes",
    "value_count",
    "reservation_count",
    "use_count",
    "hold_count",
    "pending_event_count",
]


def loc_snap(**kw: Any) -> ResidencyLocationSnapshot:
    fields: dict[str, Any] = {
        "location": CUDA0,
        "budget_bytes": 100,
        "used_bytes": 30,
        "reserved_bytes": 20,
        "remaining_budget_bytes": 50,
        "peak_used_bytes": 40,
        "peak_charged_bytes": 60,
        "value_count": 2,
        "reservation_count": 1,
        "use_count": 1,
        "hold_count": 0,
        "pending_event_count": 0,
        "allocator_allocated_bytes": None,
        "allocator_reserved_bytes": None,
    }
    fields.update(kw)
    return ResidencyLocationSnapshot(**fields)


SNAP_FIELDS = [
    "manager_id",
    "state_version",
    "values",
    "locations",
    "reservations",
    "captured_at_ns",
]


def snapshot(**kw: Any) -> ResidencySnapshot[Any]:
    fields: dict[str, Any] = {
        "manager_id": "manager-1",
        "state_version": 3,
        "values": (value_snap(handle=H1), value_snap(handle=H2)),
        "locations": (
            loc_snap(location=CUDA0),
            loc_snap(location=PAGEABLE_HOST, budget_bytes=None, remaining_budget_bytes=None),
        ),
        "reservations": (res_snap(),),
        "captured_at_ns": 1_700_000_000_000_000_000,
    }
    fields.update(kw)
    return ResidencySnapshot(**fields)


REPORT_FIELDS = [
    "action",
    "no_op",
    "source",
    "destination",
    "logical_nbytes",
    "storage_nbytes",
    "started_at_ns",
    "completed_at_ns",
    "allocator_device",
    "allocator_allocated_bytes_before",
    "allocator_reserved_bytes_before",
    "allocator_allocated_bytes_after",
    "allocator_reserved_bytes_after",
    "reason",
]
REPORT_INT_FIELDS = ["logical_nbytes", "storage_nbytes", "started_at_ns", "completed_at_ns"]
REPORT_ALLOCATOR_FIELDS = [
    "allocator_allocated_bytes_before",
    "allocator_reserved_bytes_before",
    "allocator_allocated_bytes_after",
    "allocator_reserved_bytes_after",
]


def report(**kw: Any) -> ResidencyTransitionReport:
    fields: dict[str, Any] = {
        "action": ENSURE,
        "no_op": False,
        "source": PAGEABLE_HOST,
        "destination": CUDA0,
        "logical_nbytes": 10,
        "storage_nbytes": 16,
        "started_at_ns": 100,
        "completed_at_ns": 250,
    }
    fields.update(kw)
    return ResidencyTransitionReport(**fields)


ACTION_EXPL_FIELDS = [
    "action",
    "executable",
    "no_op",
    "source",
    "destination",
    "logical_nbytes",
    "storage_nbytes",
    "reason",
]


def action_expl(**kw: Any) -> ResidencyActionExplanation:
    fields: dict[str, Any] = {
        "action": ENSURE,
        "executable": True,
        "no_op": False,
        "source": PAGEABLE_HOST,
        "destination": CUDA0,
        "logical_nbytes": 10,
        "storage_nbytes": 16,
    }
    fields.update(kw)
    return ResidencyActionExplanation(**fields)


PLAN_EXPL_FIELDS = [
    "plan_name",
    "actions",
    "reservations",
    "predicted_peak_bytes",
    "feasible",
    "reason",
]


def plan_expl(**kw: Any) -> ResidencyPlanExplanation:
    fields: dict[str, Any] = {
        "plan_name": "plan",
        "actions": (action_expl(),),
        "reservations": (MemoryReservation(CUDA0, 8, "ws"),),
        "predicted_peak_bytes": ((CUDA0, 24), (PAGEABLE_HOST, 16)),
        "feasible": True,
    }
    fields.update(kw)
    return ResidencyPlanExplanation(**fields)


PLAN_REPORT_FIELDS = ["plan_name", "transitions", "started_at_ns", "completed_at_ns"]


def plan_report(**kw: Any) -> ResidencyPlanReport:
    fields: dict[str, Any] = {
        "plan_name": "plan",
        "transitions": (report(), report(action=DropResident(H1, PAGEABLE_HOST), no_op=True)),
        "started_at_ns": 10,
        "completed_at_ns": 10,
    }
    fields.update(kw)
    return ResidencyPlanReport(**fields)


# --------------------------------------------------------------------------------------------
# The frozen-record convention for every class.
# --------------------------------------------------------------------------------------------

RECORDS = [
    (mat, MAT_FIELDS),
    (value_snap, VALUE_FIELDS),
    (res_snap, RES_FIELDS),
    (loc_snap, LOC_FIELDS),
    (snapshot, SNAP_FIELDS),
    (report, REPORT_FIELDS),
    (action_expl, ACTION_EXPL_FIELDS),
    (plan_expl, PLAN_EXPL_FIELDS),
    (plan_report, PLAN_REPORT_FIELDS),
]


@pytest.mark.parametrize(("build", "fields"), RECORDS, ids=[b.__name__ for b, _ in RECORDS])
def test_records_follow_frozen_record_convention(
    frozen_record, build: Any, fields: list[str]
) -> None:
    frozen_record(build(), fields)


def test_defaulted_fields() -> None:
    r = report()
    assert r.allocator_device is None
    for name in REPORT_ALLOCATOR_FIELDS:
        assert getattr(r, name) is None
    assert r.reason is None
    assert action_expl().reason is None
    assert plan_expl().reason is None


def test_required_fields() -> None:
    with pytest.raises(TypeError):
        MaterializationSnapshot(CUDA0, 1, 1, 1, 0, 0)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        ResidencyTransitionReport(ENSURE, False, None, None, 0, 0, 0)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        ResidencyPlanReport("p", ())  # type: ignore[call-arg]


def test_generic_records_accept_subscripting() -> None:
    assert typing.get_origin(ResidencyValueSnapshot[Pair]) is ResidencyValueSnapshot
    assert typing.get_origin(ResidencySnapshot[Pair]) is ResidencySnapshot


def test_same_fields_different_class_unequal() -> None:
    snap = ResidencyReservationSnapshot(CUDA0, 8, "ws")
    reservation = MemoryReservation(CUDA0, 8, "ws")
    assert snap != reservation
    assert reservation != snap
    assert len({snap, reservation}) == 2


def test_sequence_fields_are_stored_as_tuples() -> None:
    v = value_snap(materializations=[mat(location=CUDA0)])
    assert type(v.materializations) is tuple
    s = snapshot(values=[value_snap()], locations=[loc_snap()], reservations=[res_snap()])
    assert type(s.values) is tuple
    assert type(s.locations) is tuple
    assert type(s.reservations) is tuple
    assert s == snapshot(
        values=(value_snap(),), locations=(loc_snap(),), reservations=(res_snap(),)
    )
    e = plan_expl(actions=[action_expl()], reservations=[], predicted_peak_bytes=[])
    assert type(e.actions) is tuple
    assert type(e.reservations) is tuple
    assert e.predicted_peak_bytes == ()
    p = plan_report(transitions=[report()])
    assert type(p.transitions) is tuple
    assert p == plan_report(transitions=(report(),))


def test_caller_list_mutation_has_no_effect() -> None:
    transitions = [report()]
    p = plan_report(transitions=transitions)
    transitions.append(report())
    assert len(p.transitions) == 1


# --------------------------------------------------------------------------------------------
# MaterializationSnapshot
# --------------------------------------------------------------------------------------------


def test_mat_values() -> None:
    m = mat()
    assert m.location == CUDA0
    assert (m.logical_nbytes, m.storage_nbytes, m.charged_nbytes) == (10, 12, 16)
    assert (m.use_count, m.hold_count, m.pending_event_count) == (1, 2, 3)


@pytest.mark.parametrize("bad", ["cuda:0", None, CUDA0.device], ids=repr)
def test_mat_location_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        mat(location=bad)


@pytest.mark.parametrize("field", MAT_FIELDS[1:])
@pytest.mark.parametrize("bad", NOT_STRICT_INT, ids=NOT_STRICT_INT_IDS)
def test_mat_int_fields_strict(field: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        mat(**{field: bad})


@pytest.mark.parametrize("field", MAT_FIELDS[1:])
def test_mat_int_fields_non_negative(field: str) -> None:
    with pytest.raises(ValueError):
        mat(**{field: -1})


def test_mat_charge_covers_logical_and_storage() -> None:
    with pytest.raises(ValueError):
        mat(logical_nbytes=17, storage_nbytes=12, charged_nbytes=16)
    with pytest.raises(ValueError):
        mat(logical_nbytes=10, storage_nbytes=17, charged_nbytes=16)
    assert mat(logical_nbytes=16, storage_nbytes=16, charged_nbytes=16).charged_nbytes == 16
    # The actual storage may be below the logical bytes (fields sharing storage).
    assert mat(logical_nbytes=16, storage_nbytes=4, charged_nbytes=16).storage_nbytes == 4
    assert mat(logical_nbytes=0, storage_nbytes=0, charged_nbytes=0).charged_nbytes == 0


def test_mat_location_checked_before_ints() -> None:
    with pytest.raises(TypeError):
        mat(location="cuda:0", logical_nbytes=-1)


# --------------------------------------------------------------------------------------------
# ResidencyValueSnapshot
# --------------------------------------------------------------------------------------------


def test_value_snapshot_values() -> None:
    v = value_snap()
    assert v.handle == H1
    assert v.spec == SPEC
    assert v.materializations == (mat(location=CUDA0), mat(location=PAGEABLE_HOST))
    assert v.has_source is True
    assert v.source_location == PAGEABLE_HOST
    assert v.discarded is False


def test_value_snapshot_valid_variants() -> None:
    no_source = value_snap(has_source=False, source_location=None)
    assert no_source.source_location is None
    empty = value_snap(materializations=())
    assert empty.materializations == ()
    discarded = value_snap(
        materializations=(), has_source=False, source_location=None, discarded=True
    )
    assert discarded.discarded is True


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("handle", "h1"),
        ("handle", None),
        ("spec", None),
        ("spec", (Pair, 10, 16)),
        ("materializations", 5),
        ("materializations", [mat(), "m"]),
        ("materializations", [res_snap()]),
        ("source_location", "pageable-host"),
        ("source_location", torch.device("cpu")),
    ],
    ids=repr,
)
def test_value_snapshot_type_errors(field: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        value_snap(**{field: bad})


@pytest.mark.parametrize("field", ["has_source", "discarded"])
@pytest.mark.parametrize("bad", NOT_BOOL, ids=NOT_BOOL_IDS)
def test_value_snapshot_bool_fields(field: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        value_snap(**{field: bad})


def test_value_snapshot_unique_materialization_locations() -> None:
    with pytest.raises(ValueError):
        value_snap(
            materializations=(
                mat(location=CUDA0),
                mat(location=cuda_location("cuda:0"), use_count=0),
            )
        )
    with pytest.raises(ValueError):
        value_snap(materializations=(mat(location=PINNED_HOST), mat(location=PINNED_HOST)))
    assert (
        len(
            value_snap(
                materializations=(mat(location=PINNED_HOST), mat(location=PAGEABLE_HOST))
            ).materializations
        )
        == 2
    )


def test_value_snapshot_source_consistency() -> None:
    with pytest.raises(ValueError):
        value_snap(has_source=True, source_location=None)
    with pytest.raises(ValueError):
        value_snap(has_source=False, source_location=PAGEABLE_HOST)


@pytest.mark.parametrize(
    "overrides",
    [
        {"materializations": (mat(),), "has_source": False, "source_location": None},
        {"materializations": (), "has_source": True, "source_location": PAGEABLE_HOST},
    ],
    ids=["materialized", "with-source"],
)
def test_value_snapshot_discarded_must_be_empty(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        value_snap(discarded=True, **overrides)


# --------------------------------------------------------------------------------------------
# ResidencyReservationSnapshot
# --------------------------------------------------------------------------------------------


def test_reservation_snapshot_checks() -> None:
    r = res_snap()
    assert (r.location, r.nbytes, r.label) == (CUDA0, 20, "scratch")
    assert res_snap(nbytes=0).nbytes == 0
    with pytest.raises(TypeError):
        res_snap(location="cuda:0")
    with pytest.raises(ValueError):
        res_snap(nbytes=-1)


@pytest.mark.parametrize("bad", NOT_STRICT_INT, ids=NOT_STRICT_INT_IDS)
def test_reservation_snapshot_nbytes_strict(bad: Any) -> None:
    with pytest.raises(TypeError):
        res_snap(nbytes=bad)


@pytest.mark.parametrize("bad", NOT_STR, ids=NOT_STR_IDS)
def test_reservation_snapshot_label_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        res_snap(label=bad)


@pytest.mark.parametrize("bad", BLANK_STR, ids=BLANK_STR_IDS)
def test_reservation_snapshot_label_blank(bad: str) -> None:
    with pytest.raises(ValueError):
        res_snap(label=bad)


# --------------------------------------------------------------------------------------------
# ResidencyLocationSnapshot
# --------------------------------------------------------------------------------------------


def test_location_snapshot_valid_variants() -> None:
    s = loc_snap()
    assert (s.budget_bytes, s.used_bytes, s.reserved_bytes, s.remaining_budget_bytes) == (
        100,
        30,
        20,
        50,
    )
    unbudgeted = loc_snap(budget_bytes=None, remaining_budget_bytes=None, peak_charged_bytes=10**12)
    assert unbudgeted.budget_bytes is None
    assert unbudgeted.remaining_budget_bytes is None
    full = loc_snap(
        budget_bytes=50,
        used_bytes=30,
        reserved_bytes=20,
        remaining_budget_bytes=0,
        peak_used_bytes=30,
        peak_charged_bytes=50,
    )
    assert full.remaining_budget_bytes == 0
    zero = loc_snap(
        budget_bytes=0,
        used_bytes=0,
        reserved_bytes=0,
        remaining_budget_bytes=0,
        peak_used_bytes=0,
        peak_charged_bytes=0,
    )
    assert zero.budget_bytes == 0
    sampled = loc_snap(allocator_allocated_bytes=0, allocator_reserved_bytes=2**40)
    assert (sampled.allocator_allocated_bytes, sampled.allocator_reserved_bytes) == (0, 2**40)


@pytest.mark.parametrize("bad", ["cuda:0", None], ids=repr)
def test_location_snapshot_location_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        loc_snap(location=bad)


@pytest.mark.parametrize("field", LOC_COUNT_FIELDS)
@pytest.mark.parametrize("bad", NOT_STRICT_INT, ids=NOT_STRICT_INT_IDS)
def test_location_snapshot_counts_strict(field: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        loc_snap(**{field: bad})


@pytest.mark.parametrize("field", LOC_COUNT_FIELDS)
def test_location_snapshot_counts_non_negative(field: str) -> None:
    with pytest.raises(ValueError):
        loc_snap(**{field: -1})


@pytest.mark.parametrize(
    "field",
    [
        "budget_bytes",
        "remaining_budget_bytes",
        "allocator_allocated_bytes",
        "allocator_reserved_bytes",
    ],
)
@pytest.mark.parametrize("bad", NOT_STRICT_INT_NONE_OK, ids=NOT_STRICT_INT_NONE_OK_IDS)
def test_location_snapshot_optional_ints_strict(field: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        loc_snap(**{field: bad})


@pytest.mark.parametrize(
    "field",
    [
        "budget_bytes",
        "remaining_budget_bytes",
        "allocator_allocated_bytes",
        "allocator_reserved_bytes",
    ],
)
def test_location_snapshot_optional_ints_non_negative(field: str) -> None:
    with pytest.raises(ValueError):
        loc_snap(**{field: -1})


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"peak_used_bytes": 29}, id="peak_used<used"),
        pytest.param({"peak_charged_bytes": 39}, id="peak_charged<peak_used"),
        pytest.param(
            {"peak_used_bytes": 30, "peak_charged_bytes": 49}, id="peak_charged<used+reserved"
        ),
        pytest.param({"remaining_budget_bytes": 49}, id="remaining-wrong"),
        pytest.param({"remaining_budget_bytes": None}, id="remaining-missing"),
        pytest.param({"peak_charged_bytes": 101}, id="peak_charged>budget"),
        pytest.param(
            {"budget_bytes": 40, "remaining_budget_bytes": 0, "peak_charged_bytes": 60},
            id="used+reserved>budget",
        ),
        pytest.param({"budget_bytes": None}, id="remaining-without-budget"),
    ],
)
def test_location_snapshot_cross_field_rules(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        loc_snap(**overrides)


def test_location_snapshot_types_before_cross_rules() -> None:
    # peak_used=True would also violate peak_used >= used; the per-field type check comes first.
    with pytest.raises(TypeError):
        loc_snap(peak_used_bytes=True)
    with pytest.raises(TypeError):
        loc_snap(remaining_budget_bytes=np.int64(50))


_small = st.integers(min_value=0, max_value=5)


@given(
    st.fixed_dictionaries(
        {
            "budget": st.one_of(st.none(), _small),
            "used": _small,
            "reserved": _small,
            "remaining": st.one_of(st.none(), _small),
            "peak_used": _small,
            "peak_charged": st.integers(min_value=0, max_value=10),
        }
    )
)
def test_location_snapshot_accepts_exactly_the_documented_states(state: dict[str, Any]) -> None:
    budget, used, reserved = state["budget"], state["used"], state["reserved"]
    remaining, peak_used, peak_charged = (
        state["remaining"],
        state["peak_used"],
        state["peak_charged"],
    )
    valid = peak_used >= used and peak_charged >= max(peak_used, used + reserved)
    if budget is None:
        valid = valid and remaining is None
    else:
        valid = (
            valid
            and used + reserved <= budget
            and remaining == budget - used - reserved
            and peak_charged <= budget
        )
    kwargs = {
        "budget_bytes": budget,
        "used_bytes": used,
        "reserved_bytes": reserved,
        "remaining_budget_bytes": remaining,
        "peak_used_bytes": peak_used,
        "peak_charged_bytes": peak_charged,
    }
    if valid:
        s = loc_snap(**kwargs)
        assert s == loc_snap(**kwargs)
        assert hash(s) == hash(loc_snap(**kwargs))
    else:
        with pytest.raises(ValueError):
            loc_snap(**kwargs)


# --------------------------------------------------------------------------------------------
# ResidencySnapshot
# --------------------------------------------------------------------------------------------


def test_snapshot_valid_and_empty() -> None:
    s = snapshot()
    assert s.manager_id == "manager-1"
    assert s.state_version == 3
    assert len(s.values) == 2
    empty = snapshot(values=(), locations=(), reservations=(), state_version=0, captured_at_ns=0)
    assert empty.values == ()
    # Reservations are not required to be unique.
    assert len(snapshot(reservations=[res_snap(), res_snap()]).reservations) == 2


@pytest.mark.parametrize("bad", NOT_STR, ids=NOT_STR_IDS)
def test_snapshot_manager_id_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        snapshot(manager_id=bad)


@pytest.mark.parametrize("bad", BLANK_STR, ids=BLANK_STR_IDS)
def test_snapshot_manager_id_blank(bad: str) -> None:
    with pytest.raises(ValueError):
        snapshot(manager_id=bad)


@pytest.mark.parametrize("field", ["state_version", "captured_at_ns"])
@pytest.mark.parametrize("bad", NOT_STRICT_INT, ids=NOT_STRICT_INT_IDS)
def test_snapshot_ints_strict(field: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        snapshot(**{field: bad})


@pytest.mark.parametrize("field", ["state_version", "captured_at_ns"])
def test_snapshot_ints_non_negative(field: str) -> None:
    with pytest.raises(ValueError):
        snapshot(**{field: -1})


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("values", [value_snap(), mat()]),
        ("values", [H1]),
        ("locations", [loc_snap(), CUDA0]),
        ("locations", [res_snap()]),
        ("reservations", [MemoryReservation(CUDA0, 1, "x")]),
        ("reservations", [loc_snap()]),
        ("values", 3),
    ],
    ids=repr,
)
def test_snapshot_element_types(field: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        snapshot(**{field: bad})


def test_snapshot_unique_handles_and_locations() -> None:
    with pytest.raises(ValueError):
        snapshot(values=(value_snap(handle=H1), value_snap(handle=H1, materializations=())))
    with pytest.raises(ValueError):
        snapshot(
            locations=(
                loc_snap(location=CUDA0),
                loc_snap(location=cuda_location("cuda:0"), use_count=0),
            )
        )
    # Different handles with the same ids but another value type are different handles.
    from helpers.records import Single

    other_type = make_handle(handle_id="h1", value_type=Single)
    assert len(snapshot(values=(value_snap(handle=H1), value_snap(handle=other_type))).values) == 2


# --------------------------------------------------------------------------------------------
# ResidencyTransitionReport
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "action",
    [ENSURE, MoveResident(H1, CUDA0, PAGEABLE_HOST), DropResident(H1, CUDA0), DiscardValue(H1)],
    ids=["ensure", "move", "drop", "discard"],
)
def test_report_accepts_every_action(action: Any) -> None:
    assert report(action=action).action == action


@pytest.mark.parametrize(
    "bad",
    ["ensure", None, MemoryReservation(CUDA0, 1, "x"), H1],
    ids=["str", "None", "res", "handle"],
)
def test_report_action_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        report(action=bad)


@pytest.mark.parametrize("bad", NOT_BOOL, ids=NOT_BOOL_IDS)
def test_report_no_op_bool(bad: Any) -> None:
    with pytest.raises(TypeError):
        report(no_op=bad)


@pytest.mark.parametrize("field", REPORT_INT_FIELDS)
@pytest.mark.parametrize("bad", NOT_STRICT_INT, ids=NOT_STRICT_INT_IDS)
def test_report_ints_strict(field: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        report(**{field: bad})


@pytest.mark.parametrize("field", REPORT_INT_FIELDS)
def test_report_ints_non_negative(field: str) -> None:
    with pytest.raises(ValueError):
        report(**{field: -1})


@pytest.mark.parametrize("field", REPORT_ALLOCATOR_FIELDS)
@pytest.mark.parametrize("bad", NOT_STRICT_INT_NONE_OK, ids=NOT_STRICT_INT_NONE_OK_IDS)
def test_report_allocator_bytes_strict(field: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        report(**{field: bad})


@pytest.mark.parametrize("field", REPORT_ALLOCATOR_FIELDS)
def test_report_allocator_bytes_values(field: str) -> None:
    with pytest.raises(ValueError):
        report(**{field: -1})
    assert getattr(report(**{field: 0}), field) == 0
    assert getattr(report(**{field: 7}), field) == 7


def test_report_ordering_rules() -> None:
    with pytest.raises(ValueError):
        report(logical_nbytes=17, storage_nbytes=16)
    with pytest.raises(ValueError):
        report(started_at_ns=251, completed_at_ns=250)
    assert (
        report(logical_nbytes=16, storage_nbytes=16, started_at_ns=5, completed_at_ns=5).no_op
        is False
    )


@pytest.mark.parametrize(
    ("spelling", "index"),
    [("cuda:0", 0), ("cuda:3", 3), (torch.device("cuda", 1), 1), (torch.device("cuda:2"), 2)],
    ids=repr,
)
def test_report_allocator_device_normalised(spelling: Any, index: int) -> None:
    r = report(allocator_device=spelling)
    assert isinstance(r.allocator_device, torch.device)
    assert r.allocator_device == torch.device("cuda", index)
    assert r == report(allocator_device=torch.device("cuda", index))
    assert hash(r) == hash(report(allocator_device=torch.device("cuda", index)))


@pytest.mark.parametrize(
    "bad",
    ["cuda", torch.device("cuda"), "cpu", torch.device("cpu"), "cpu:0", "meta"],
    ids=repr,
)
def test_report_allocator_device_must_be_indexed_cuda(bad: Any) -> None:
    with pytest.raises(ValueError):
        report(allocator_device=bad)


def test_report_reason() -> None:
    assert report(no_op=True, reason="destination already resident").reason == (
        "destination already resident"
    )
    for bad in BLANK_STR:
        with pytest.raises(ValueError):
            report(reason=bad)
    for bad in [5, b"r", ["r"]]:
        with pytest.raises(TypeError):
            report(reason=bad)


def test_report_source_and_destination_not_type_checked() -> None:
    odd = report(source="anything", destination=42)
    assert (odd.source, odd.destination) == ("anything", 42)
    assert report(source=None, destination=None).source is None


def test_report_hash_fails_only_for_unhashable_field() -> None:
    unhashable = report(source=[PAGEABLE_HOST])
    assert unhashable == report(source=[PAGEABLE_HOST])
    with pytest.raises(TypeError):
        hash(unhashable)
    hash(report(source=(PAGEABLE_HOST,)))


# --------------------------------------------------------------------------------------------
# ResidencyActionExplanation
# --------------------------------------------------------------------------------------------


def test_action_explanation_checks() -> None:
    e = action_expl(
        executable=False, no_op=False, reason="budget exceeded", logical_nbytes=0, storage_nbytes=0
    )
    assert (e.executable, e.no_op, e.reason) == (False, False, "budget exceeded")
    with pytest.raises(TypeError):
        action_expl(action=MemoryReservation(CUDA0, 1, "x"))
    with pytest.raises(ValueError):
        action_expl(logical_nbytes=17, storage_nbytes=16)
    odd = action_expl(source=object, destination="x")
    assert (odd.source, odd.destination) == (object, "x")
    with pytest.raises(TypeError):
        hash(action_expl(destination={"unhashable": 1}))


@pytest.mark.parametrize("field", ["executable", "no_op"])
@pytest.mark.parametrize("bad", NOT_BOOL, ids=NOT_BOOL_IDS)
def test_action_explanation_bools(field: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        action_expl(**{field: bad})


@pytest.mark.parametrize("field", ["logical_nbytes", "storage_nbytes"])
@pytest.mark.parametrize("bad", NOT_STRICT_INT, ids=NOT_STRICT_INT_IDS)
def test_action_explanation_ints_strict(field: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        action_expl(**{field: bad})


@pytest.mark.parametrize("field", ["logical_nbytes", "storage_nbytes"])
def test_action_explanation_ints_non_negative(field: str) -> None:
    with pytest.raises(ValueError):
        action_expl(**{field: -1})


@pytest.mark.parametrize(
    ("bad", "exc"), [("", ValueError), ("  ", ValueError), (3, TypeError)], ids=repr
)
def test_action_explanation_reason(bad: Any, exc: type[Exception]) -> None:
    with pytest.raises(exc):
        action_expl(reason=bad)


# --------------------------------------------------------------------------------------------
# ResidencyPlanExplanation
# --------------------------------------------------------------------------------------------


def test_plan_explanation_peak_normalisation() -> None:
    e = plan_expl(predicted_peak_bytes=[[CUDA0, 24], [PINNED_HOST, 0]])
    assert e.predicted_peak_bytes == ((CUDA0, 24), (PINNED_HOST, 0))
    assert type(e.predicted_peak_bytes) is tuple
    assert all(type(pair) is tuple for pair in e.predicted_peak_bytes)
    assert e == plan_expl(predicted_peak_bytes=((CUDA0, 24), (PINNED_HOST, 0)))
    hash(e)


def test_plan_explanation_peak_rules() -> None:
    with pytest.raises(TypeError):
        plan_expl(predicted_peak_bytes=[("cuda:0", 1)])
    with pytest.raises(TypeError):
        plan_expl(predicted_peak_bytes=[(CUDA0, True)])
    with pytest.raises(TypeError):
        plan_expl(predicted_peak_bytes=[(CUDA0, np.int64(3))])
    with pytest.raises(ValueError):
        plan_expl(predicted_peak_bytes=[(CUDA0, -1)])
    with pytest.raises(ValueError):
        plan_expl(predicted_peak_bytes=[(CUDA0, 1), (cuda_location("cuda:0"), 2)])


def test_plan_explanation_checks() -> None:
    infeasible = plan_expl(feasible=False)
    assert infeasible.feasible is False
    assert infeasible.reason is None
    assert plan_expl(feasible=False, reason="over budget").reason == "over budget"
    with pytest.raises(TypeError):
        plan_expl(actions=[ENSURE])
    with pytest.raises(TypeError):
        plan_expl(reservations=[res_snap()])
    for bad in NOT_STR:
        with pytest.raises(TypeError):
            plan_expl(plan_name=bad)
    for bad in BLANK_STR:
        with pytest.raises(ValueError):
            plan_expl(plan_name=bad)
        with pytest.raises(ValueError):
            plan_expl(reason=bad)
    with pytest.raises(TypeError):
        plan_expl(reason=1)


@pytest.mark.parametrize("bad", NOT_BOOL, ids=NOT_BOOL_IDS)
def test_plan_explanation_feasible_bool(bad: Any) -> None:
    with pytest.raises(TypeError):
        plan_expl(feasible=bad)


# --------------------------------------------------------------------------------------------
# ResidencyPlanReport
# --------------------------------------------------------------------------------------------


def test_plan_report_checks() -> None:
    p = plan_report()
    assert p.plan_name == "plan"
    assert len(p.transitions) == 2
    assert plan_report(transitions=()).transitions == ()
    with pytest.raises(TypeError):
        plan_report(transitions=[report(), ENSURE])
    with pytest.raises(TypeError):
        plan_report(transitions=[action_expl()])
    with pytest.raises(ValueError):
        plan_report(started_at_ns=11, completed_at_ns=10)
    for bad in NOT_STR:
        with pytest.raises(TypeError):
            plan_report(plan_name=bad)
    for bad in BLANK_STR:
        with pytest.raises(ValueError):
            plan_report(plan_name=bad)


@pytest.mark.parametrize("field", ["started_at_ns", "completed_at_ns"])
@pytest.mark.parametrize("bad", NOT_STRICT_INT, ids=NOT_STRICT_INT_IDS)
def test_plan_report_timestamps_strict(field: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        plan_report(**{field: bad})


@pytest.mark.parametrize("field", ["started_at_ns", "completed_at_ns"])
def test_plan_report_timestamps_non_negative(field: str) -> None:
    with pytest.raises(ValueError):
        plan_report(**{field: -1})


# --------------------------------------------------------------------------------------------
# eq / hash consistency over random valid records
# --------------------------------------------------------------------------------------------


_mat_fields = st.tuples(
    st.sampled_from([CUDA0, CUDA1, PINNED_HOST]),
    st.integers(min_value=0, max_value=3),
    st.integers(min_value=0, max_value=3),
    st.integers(min_value=0, max_value=3),
    st.integers(min_value=0, max_value=2),
)


@given(_mat_fields, _mat_fields)
def test_materialization_eq_hash_consistency(
    first: tuple[Any, ...], second: tuple[Any, ...]
) -> None:
    def build(loc: Any, a: int, b: int, c: int, u: int) -> MaterializationSnapshot:
        return MaterializationSnapshot(loc, a, b, max(a, b) + c, u, 0, 0)

    x = build(*first)
    y = build(*second)
    assert (x == y) == (first == second)
    if x == y:
        assert hash(x) == hash(y)
    assert hash(x) == hash(build(*first))


@given(
    st.lists(
        st.tuples(
            st.sampled_from([ENSURE, DropResident(H2, CUDA0), DiscardValue(H1)]),
            st.booleans(),
            st.integers(min_value=0, max_value=5),
            st.integers(min_value=0, max_value=5),
        ),
        max_size=3,
    )
)
def test_plan_report_eq_hash_consistency(rows: list[tuple[Any, bool, int, int]]) -> None:
    def build():
        transitions = [
            report(action=a, no_op=n, logical_nbytes=lg, storage_nbytes=lg + extra)
            for a, n, lg, extra in rows
        ]
        return plan_report(transitions=transitions)

    first, second = build(), build()
    assert first == second
    assert hash(first) == hash(second)
    assert (first == plan_report(transitions=())) == (rows == [])
