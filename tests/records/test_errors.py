"""The residency error hierarchy, attributes, messages, pickling (docs/concepts/errors.md)."""

# Exception types are fixed; ValueError wording is not (docs/concepts/conventions.md#check-order).

from __future__ import annotations

import pickle
import re
import types
from typing import Any

import numpy as np
import pytest

import fhelium
from fhelium import errors
from fhelium.errors import (
    FHEliumError,
    ResidencyBudgetError,
    ResidencyCheckpointError,
    ResidencyClosedError,
    ResidencyCollectiveError,
    ResidencyCommunicationError,
    ResidencyDivergenceError,
    ResidencyError,
    ResidencyForkedError,
    ResidencyHandleError,
    ResidencyIntegrityError,
    ResidencyInUseError,
    ResidencyLifetimeClosedError,
    ResidencyMaterializationError,
    ResidencyOwnershipError,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
    ResidencyReentrancyError,
    ResidencySearchLimitError,
    ResidencyStaleStateError,
    ResidencyUnavailableError,
)

# Each class with its single, exact parent (docs/concepts/errors.md#hierarchy).
PARENT = {
    ResidencyBudgetError: ResidencyError,
    ResidencyHandleError: ResidencyError,
    ResidencyUnavailableError: ResidencyError,
    ResidencyInUseError: ResidencyError,
    ResidencyLifetimeClosedError: ResidencyError,
    ResidencyMaterializationError: ResidencyError,
    ResidencyIntegrityError: ResidencyMaterializationError,
    ResidencyOwnershipError: ResidencyError,
    ResidencyPlanError: ResidencyError,
    ResidencyStaleStateError: ResidencyPlanError,
    ResidencySearchLimitError: ResidencyPlanError,
    ResidencyPlanExecutionError: ResidencyError,
    ResidencyClosedError: ResidencyError,
    ResidencyForkedError: ResidencyClosedError,
    ResidencyReentrancyError: ResidencyError,
    ResidencyDivergenceError: ResidencyError,
    ResidencyCollectiveError: ResidencyError,
    ResidencyCommunicationError: ResidencyCollectiveError,
}
ALL_RESIDENCY = [ResidencyError, *PARENT]
ALL = [FHEliumError, *ALL_RESIDENCY]
# The one residency error that is also a ValueError: a checkpoint that does not fit its
# module is a bad argument's content (docs/concepts/errors.md#hierarchy).
ALSO_VALUE_ERROR = {ResidencyCheckpointError: (ResidencyError, ValueError)}
MESSAGE_ONLY = [
    ResidencyHandleError,
    ResidencyUnavailableError,
    ResidencyInUseError,
    ResidencyLifetimeClosedError,
    ResidencyMaterializationError,
    ResidencyOwnershipError,
    ResidencyPlanError,
    ResidencyClosedError,
    ResidencyReentrancyError,
]


def _id(cls: type) -> str:
    return cls.__name__


# --- module surface ------------------------------------------------------------------------------


def test_errors_module_reachable_from_package() -> None:
    assert fhelium.errors is errors


@pytest.mark.parametrize("cls", [*ALL, *ALSO_VALUE_ERROR], ids=_id)
def test_error_defined_and_exported_by_errors_module(cls: type) -> None:
    assert cls.__module__ == "fhelium.errors"
    assert cls.__name__ in errors.__all__
    assert getattr(errors, cls.__name__) is cls


def test_errors_all_has_no_duplicates() -> None:
    assert len(errors.__all__) == len(set(errors.__all__))
    for name in errors.__all__:
        assert hasattr(errors, name), name


# --- hierarchy -----------------------------------------------------------------------------------


def test_root_classes() -> None:
    assert FHEliumError.__bases__ == (Exception,)
    assert ResidencyError.__bases__ == (FHEliumError, RuntimeError)
    assert issubclass(ResidencyError, RuntimeError)


@pytest.mark.parametrize(("cls", "parent"), list(PARENT.items()), ids=_id)
def test_exact_parent(cls: type, parent: type) -> None:
    assert cls.__bases__ == (parent,)
    assert issubclass(cls, ResidencyError)
    assert issubclass(cls, FHEliumError)
    assert issubclass(cls, RuntimeError)


@pytest.mark.parametrize("cls", ALL, ids=_id)
def test_no_residency_error_is_value_or_type_error(cls: type) -> None:
    assert not issubclass(cls, ValueError)
    assert not issubclass(cls, TypeError)


@pytest.mark.parametrize(("cls", "bases"), list(ALSO_VALUE_ERROR.items()), ids=["checkpoint"])
def test_errors_that_are_also_value_errors(cls: type, bases: tuple[type, ...]) -> None:
    assert cls.__bases__ == bases
    assert issubclass(cls, ResidencyError)
    assert issubclass(cls, ValueError)
    assert not issubclass(cls, TypeError)
    assert set(errors.__all__) == {c.__name__ for c in [*ALL, *ALSO_VALUE_ERROR]} | {
        "ResidencyScheduleExhaustedWarning",
        "ConfigurationError",
        "StateError",
        "ExecutionError",
        "ArtifactError",
    }


def test_plan_execution_error_is_sibling_of_plan_error() -> None:
    assert not issubclass(ResidencyPlanExecutionError, ResidencyPlanError)
    assert not issubclass(ResidencyPlanError, ResidencyPlanExecutionError)
    assert issubclass(ResidencyStaleStateError, ResidencyPlanError)
    assert issubclass(ResidencySearchLimitError, ResidencyPlanError)
    # No other cross-links between the leaves.
    parents = (
        ResidencyPlanError,
        ResidencyCollectiveError,
        ResidencyClosedError,
        ResidencyMaterializationError,
    )
    leaves = [c for c in PARENT if c not in parents]
    for a in leaves:
        for b in leaves:
            if a is not b:
                assert not issubclass(a, b), (a, b)


def test_catching_residency_error_catches_plan_errors() -> None:
    with pytest.raises(ResidencyPlanError):
        raise ResidencyStaleStateError(expected_version=1, actual_version=2)
    with pytest.raises(RuntimeError):
        raise ResidencyHandleError("unknown handle")


# --- message-only classes ------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [FHEliumError, ResidencyError, *MESSAGE_ONLY], ids=_id)
def test_message_only_errors(cls: type[Exception]) -> None:
    err = cls("something went wrong: 42")
    assert str(err) == "something went wrong: 42"
    assert err.args == ("something went wrong: 42",)


@pytest.mark.parametrize("cls", [FHEliumError, ResidencyError, *MESSAGE_ONLY], ids=_id)
def test_message_only_errors_pickle(cls: type[Exception]) -> None:
    err = cls("lost handle 'h-1'")
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is cls
    assert str(clone) == str(err)
    assert clone.args == err.args


# --- ResidencyBudgetError ------------------------------------------------------------------------


def _budget(**kw: Any) -> ResidencyBudgetError:
    fields: dict[str, Any] = {
        "location": "cuda:0",
        "budget_bytes": 1000,
        "used_bytes": 600,
        "reserved_bytes": 200,
        "requested_bytes": 300,
    }
    fields.update(kw)
    return ResidencyBudgetError(**fields)


def _assert_fragments_in_order(message: str, fragments: list[str]) -> None:
    positions = []
    for fragment in fragments:
        match = re.search(r"(?<![A-Za-z0-9_])" + re.escape(fragment) + r"(?![0-9])", message)
        assert match is not None, f"{fragment!r} not in {message!r}"
        positions.append(match.start())
    assert positions == sorted(positions), message


def test_budget_error_attributes_and_message() -> None:
    err = _budget()
    assert err.location == "cuda:0"
    assert (err.budget_bytes, err.used_bytes, err.reserved_bytes, err.requested_bytes) == (
        1000,
        600,
        200,
        300,
    )
    _assert_fragments_in_order(
        str(err),
        [
            repr("cuda:0"),
            "budget_bytes=1000",
            "used_bytes=600",
            "reserved_bytes=200",
            "requested_bytes=300",
        ],
    )


def test_budget_error_coerces_counts_with_int_and_keeps_location() -> None:
    marker = ("pinned-host", 1)
    err = _budget(
        location=marker,
        budget_bytes=np.int64(10),
        used_bytes="4",
        reserved_bytes=3.0,
        requested_bytes=np.uint32(5),
    )
    assert err.location is marker
    for name, value in [
        ("budget_bytes", 10),
        ("used_bytes", 4),
        ("reserved_bytes", 3),
        ("requested_bytes", 5),
    ]:
        assert getattr(err, name) == value
        assert type(getattr(err, name)) is int
    assert repr(marker) in str(err)
    assert "reserved_bytes=3" in str(err)
    assert "reserved_bytes=3.0" not in str(err)


def test_budget_error_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        ResidencyBudgetError("cuda:0", 1, 2, 3, 4)  # type: ignore[misc]


def test_budget_error_pickle_roundtrip() -> None:
    err = _budget(location="pinned-host")
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is ResidencyBudgetError
    assert str(clone) == str(err)
    for name in ("location", "budget_bytes", "used_bytes", "reserved_bytes", "requested_bytes"):
        assert getattr(clone, name) == getattr(err, name)


# --- ResidencyStaleStateError --------------------------------------------------------------------


def test_stale_state_error() -> None:
    err = ResidencyStaleStateError(expected_version=np.int64(7), actual_version="9")
    assert err.expected_version == 7
    assert err.actual_version == 9
    assert type(err.expected_version) is int
    assert type(err.actual_version) is int
    _assert_fragments_in_order(str(err), ["expected_version=7", "actual_version=9"])
    with pytest.raises(TypeError):
        ResidencyStaleStateError(7, 9)  # type: ignore[misc]
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is ResidencyStaleStateError
    assert (clone.expected_version, clone.actual_version) == (7, 9)
    assert str(clone) == str(err)


# --- ResidencySearchLimitError -------------------------------------------------------------------


def test_search_limit_error() -> None:
    err = ResidencySearchLimitError(
        request_name="warmup-step",
        state_limit=np.int32(64),
        explored_states=64.0,
        detail="no eviction set fit within the limit",
    )
    assert err.request_name == "warmup-step"
    assert err.state_limit == 64
    assert err.explored_states == 64
    assert type(err.state_limit) is int
    assert type(err.explored_states) is int
    assert err.detail == "no eviction set fit within the limit"
    _assert_fragments_in_order(
        str(err),
        [
            repr("warmup-step"),
            "state_limit=64",
            "explored_states=64",
            "no eviction set fit within the limit",
        ],
    )
    with pytest.raises(TypeError):
        ResidencySearchLimitError("r", 1, 1, "d")  # type: ignore[misc]


def test_search_limit_error_coerces_with_str() -> None:
    detail = ValueError("inner detail")
    err = ResidencySearchLimitError(
        request_name=42, state_limit=1, explored_states=1, detail=detail
    )
    assert err.request_name == "42"
    assert type(err.request_name) is str
    assert err.detail == "inner detail"
    assert type(err.detail) is str
    assert repr("42") in str(err)


def test_search_limit_error_pickle() -> None:
    err = ResidencySearchLimitError(
        request_name="r", state_limit=10, explored_states=10, detail="d"
    )
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is ResidencySearchLimitError
    assert str(clone) == str(err)
    assert (clone.request_name, clone.state_limit, clone.explored_states, clone.detail) == (
        "r",
        10,
        10,
        "d",
    )
    assert clone.bound == "states"


def test_search_limit_error_names_its_bound() -> None:
    # controller.md#search-bounds: "states" by default, "depth" or "memory" otherwise.
    err = ResidencySearchLimitError(
        request_name="r", state_limit=10**12, explored_states=16384, detail="d", bound="depth"
    )
    assert err.bound == "depth"
    assert "bound=depth" in str(err)
    clone = pickle.loads(pickle.dumps(err))
    assert (clone.bound, clone.explored_states, str(clone)) == ("depth", 16384, str(err))


# --- ResidencyPlanExecutionError -----------------------------------------------------------------


def _exec_error(**kw: Any) -> ResidencyPlanExecutionError:
    fields: dict[str, Any] = {
        "plan_name": "train-step",
        "phase": "enter",
        "partial_report": types.SimpleNamespace(transitions=("t1", "t2", "t3")),
        "failed_action": "the-action",
        "failed_action_index": 3,
        "detail": "copy failed: device lost",
    }
    fields.update(kw)
    return ResidencyPlanExecutionError(**fields)


def test_plan_execution_error_stores_fields_as_given() -> None:
    report = types.SimpleNamespace(transitions=("t1", "t2", "t3"))
    action = object()
    index = np.int64(3)
    err = _exec_error(partial_report=report, failed_action=action, failed_action_index=index)
    assert err.plan_name == "train-step"
    assert err.phase == "enter"
    assert err.partial_report is report
    assert err.failed_action is action
    assert err.failed_action_index is index
    assert err.detail == "copy failed: device lost"
    assert err.failed_reservation is None
    assert err.failed_reservation_index is None
    reservation = object()
    with_res = _exec_error(
        failed_action=None,
        failed_action_index=None,
        failed_reservation=reservation,
        failed_reservation_index=0,
    )
    assert with_res.failed_reservation is reservation
    assert with_res.failed_reservation_index == 0
    assert with_res.failed_action is None


def test_plan_execution_error_message() -> None:
    err = _exec_error(phase="exit", detail="boom: staging buffer")
    message = str(err)
    assert repr("train-step") in message
    assert "exit" in message
    assert re.search(r"(?<![0-9])3(?![0-9])", message.replace("boom: staging buffer", ""))
    assert "boom: staging buffer" in message
    empty = _exec_error(partial_report=types.SimpleNamespace(transitions=()), detail="d")
    assert re.search(r"(?<![0-9])0(?![0-9])", str(empty))


def test_plan_execution_error_with_real_report() -> None:
    from fhelium.residency.snapshot import ResidencyPlanReport

    report = ResidencyPlanReport("train-step", (), 1, 2)
    err = _exec_error(partial_report=report, phase="reclaim")
    assert err.partial_report is report
    assert "reclaim" in str(err)


def test_plan_execution_error_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        ResidencyPlanExecutionError("p", "enter", None, None, None, "d")  # type: ignore[misc]


def test_plan_execution_error_pickle() -> None:
    err = _exec_error(failed_reservation="res", failed_reservation_index=1)
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is ResidencyPlanExecutionError
    assert str(clone) == str(err)
    for name in (
        "plan_name",
        "phase",
        "partial_report",
        "failed_action",
        "failed_action_index",
        "detail",
        "failed_reservation",
        "failed_reservation_index",
    ):
        assert getattr(clone, name) == getattr(err, name), name


def test_structured_errors_pickle_preserves_notes_and_cause_free_state() -> None:
    err = _budget()
    err.add_note("while entering scope 'x'")
    clone = pickle.loads(pickle.dumps(err))
    assert clone.__notes__ == ["while entering scope 'x'"]
    assert clone.requested_bytes == 300


def test_plan_execution_error_pickle_with_real_records() -> None:
    import torch

    from fhelium.residency import (
        PAGEABLE_HOST,
        EnsureResident,
        MemoryReservation,
        MoveResident,
        ResidencyHandle,
        ResidencyPlanReport,
        ResidencyTransitionReport,
        cuda_location,
    )
    from fhelium.values import ResidentTensor

    handle = ResidencyHandle("manager", "handle", ResidentTensor)
    cuda0 = cuda_location("cuda:0")
    transition = ResidencyTransitionReport(
        EnsureResident(handle, cuda0), False, PAGEABLE_HOST, cuda0, 4, 8, 1, 2, "cuda:0", 1, 2, 3, 4
    )
    report = ResidencyPlanReport("p", [transition], 1, 3)
    err = ResidencyPlanExecutionError(
        plan_name="p",
        phase="enter",
        partial_report=report,
        failed_action=MoveResident(handle, PAGEABLE_HOST),
        failed_action_index=1,
        detail="copy failed",
        failed_reservation=MemoryReservation(cuda0, 16, "ws"),
        failed_reservation_index=0,
    )
    clone = pickle.loads(pickle.dumps(err))
    assert clone.partial_report == report
    assert clone.partial_report.transitions[0].allocator_device == torch.device("cuda", 0)
    assert clone.failed_action == MoveResident(handle, PAGEABLE_HOST)
    assert clone.failed_reservation == MemoryReservation(cuda0, 16, "ws")
    assert str(clone) == str(err)
    assert re.search(r"(?<![0-9])1(?![0-9])", str(err))
