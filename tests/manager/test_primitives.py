"""The direct primitives `ensure`/`copy`, `move`, `drop` and `discard`
(docs/concepts/transitions.md).

Every numbered rule, the three no-op reasons and the report's source/destination table
(docs/concepts/transitions.md#reports). Multi-location cases run under the simulated
runtime, which provides pinned host memory and two CUDA devices backed by CPU tensors.
"""

# Exception types are fixed; ValueError wording is not (docs/concepts/conventions.md#check-order).
# ruff: noqa: PT011

from __future__ import annotations

import copy
import time
import uuid

import pytest
import torch

from fhelium.errors import (
    ResidencyHandleError,
    ResidencyOwnershipError,
    ResidencyUnavailableError,
)
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, cuda_location
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.model import ResidencyHandle
from fhelium.residency.plan import DiscardValue, DropResident, EnsureResident, MoveResident
from fhelium.residency.snapshot import ResidencyTransitionReport
from fhelium.values import ResidentTensor
from helpers.manager import (
    CUDA0,
    CUDA1,
    DROP_NOOP,
    ENSURE_NOOP,
    EXCLUSIVE,
    MOVE_NOOP,
    REPLICABLE,
    Other,
    Source,
    assert_balanced,
    foreign_handle,
    fresh,
    loc_snap,
    mat_locs,
    on,
    sim_factory,
    sim_fixture,  # noqa: F401
    spec,
    state_key,
    tensor_value,
    used,
    val_snap,
)

# --------------------------------------------------------------------------------------------
# Handle lookup and argument kinds (transitions.md#common-steps, #exception-selection)
# --------------------------------------------------------------------------------------------


def _primitive_calls(handle: object, location: object) -> list[object]:
    return [
        lambda m: m.ensure(handle, location),
        lambda m: m.copy(handle, location),
        lambda m: m.move(handle, location),
        lambda m: m.drop(handle, location),
        lambda m: m.discard(handle),
    ]


@pytest.mark.parametrize("which", range(5), ids=["ensure", "copy", "move", "drop", "discard"])
def test_non_handle_raises_type_error(which: int) -> None:
    manager = ResidencyManager()
    call = _primitive_calls("not-a-handle", PAGEABLE_HOST)[which]
    with pytest.raises(TypeError):
        call(manager)  # type: ignore[operator]


@pytest.mark.parametrize("which", range(4), ids=["ensure", "copy", "move", "drop"])
def test_non_location_raises_type_error(which: int) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    call = _primitive_calls(handle, "pageable-host")[which]
    with pytest.raises(TypeError):
        call(manager)  # type: ignore[operator]
    assert manager.trace() == ()


@pytest.mark.parametrize("which", range(5), ids=["ensure", "copy", "move", "drop", "discard"])
def test_foreign_handle_raises_handle_error(which: int) -> None:
    manager = ResidencyManager()
    manager.adopt(tensor_value())
    before = state_key(manager.snapshot())
    call = _primitive_calls(foreign_handle(), PAGEABLE_HOST)[which]
    with pytest.raises(ResidencyHandleError):
        call(manager)  # type: ignore[operator]
    assert state_key(manager.snapshot()) == before
    assert manager.trace() == ()


@pytest.mark.parametrize("which", range(5), ids=["ensure", "copy", "move", "drop", "discard"])
def test_unknown_handle_of_this_manager_raises_handle_error(which: int) -> None:
    manager = ResidencyManager()
    manager.adopt(tensor_value())
    unknown = ResidencyHandle(manager.manager_id, str(uuid.uuid4()), ResidentTensor)
    call = _primitive_calls(unknown, PAGEABLE_HOST)[which]
    with pytest.raises(ResidencyHandleError):
        call(manager)  # type: ignore[operator]


@pytest.mark.parametrize("which", range(5), ids=["ensure", "copy", "move", "drop", "discard"])
def test_handle_with_the_wrong_value_type_is_not_the_managed_handle(which: int) -> None:
    # Handles compare all three fields (values.md#handles): same ids, another value_type ->
    # not issued here.
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    impostor = ResidencyHandle(handle.manager_id, handle.handle_id, Other)
    call = _primitive_calls(impostor, PAGEABLE_HOST)[which]
    with pytest.raises(ResidencyHandleError):
        call(manager)  # type: ignore[operator]
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST,)


def test_handles_from_another_manager_are_foreign() -> None:
    first = ResidencyManager()
    second = ResidencyManager()
    handle = first.adopt(tensor_value())
    with pytest.raises(ResidencyHandleError):
        second.ensure(handle, PAGEABLE_HOST)
    with pytest.raises(ResidencyHandleError):
        second.discard(handle)


@pytest.mark.parametrize("which", range(5), ids=["ensure", "copy", "move", "drop", "discard"])
def test_discarded_handle_raises_handle_error_on_every_primitive(which: int) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    manager.discard(handle)
    version = manager.state_version
    trace_len = len(manager.trace())
    call = _primitive_calls(handle, PAGEABLE_HOST)[which]
    with pytest.raises(ResidencyHandleError):
        call(manager)  # type: ignore[operator]
    assert manager.state_version == version
    assert len(manager.trace()) == trace_len


def test_handle_lookup_precedes_location_validation() -> None:
    manager = ResidencyManager()
    with pytest.raises(ResidencyHandleError):
        manager.ensure(foreign_handle(), cuda_location("cuda:0"))


def test_cuda_location_without_cuda_is_value_error_for_every_primitive() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    cuda = cuda_location("cuda:0")
    before = state_key(manager.snapshot())
    for call in (
        lambda: manager.ensure(handle, cuda),
        lambda: manager.copy(handle, cuda),
        lambda: manager.move(handle, cuda),
        lambda: manager.move(handle, PAGEABLE_HOST, from_location=cuda),
        lambda: manager.drop(handle, cuda),
    ):
        with pytest.raises(ValueError):
            call()
    assert state_key(manager.snapshot()) == before
    assert manager.trace() == ()


def test_stream_of_wrong_kind_is_type_error_even_for_a_no_op() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    with pytest.raises(TypeError):
        manager.ensure(handle, PAGEABLE_HOST, stream=object())
    with pytest.raises(TypeError):
        manager.move(handle, PAGEABLE_HOST, stream="stream")
    assert manager.trace() == ()


def test_drop_and_discard_take_no_stream() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    with pytest.raises(TypeError):
        manager.drop(handle, PAGEABLE_HOST, stream=None)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        manager.discard(handle, stream=None)  # type: ignore[call-arg]


# --------------------------------------------------------------------------------------------
# ensure / copy (transitions.md#ensure-and-copy)
# --------------------------------------------------------------------------------------------


def test_ensure_at_current_location_is_a_no_op_even_for_exclusive() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4))  # EXCLUSIVE, MUST_PRESERVE
    before = state_key(manager.snapshot())
    t0 = time.time_ns()
    report = manager.ensure(handle, PAGEABLE_HOST)
    t1 = time.time_ns()
    assert type(report) is ResidencyTransitionReport
    assert report.action == EnsureResident(handle, PAGEABLE_HOST)
    assert report.no_op is True
    assert report.reason == ENSURE_NOOP
    assert report.source is None
    assert report.destination == PAGEABLE_HOST
    assert (report.logical_nbytes, report.storage_nbytes) == (16, 16)
    assert t0 <= report.started_at_ns <= report.completed_at_ns <= t1
    assert report.allocator_device is None
    assert report.allocator_allocated_bytes_before is None
    assert report.allocator_reserved_bytes_before is None
    assert report.allocator_allocated_bytes_after is None
    assert report.allocator_reserved_bytes_after is None
    assert state_key(manager.snapshot()) == before
    assert manager.trace() == (report,)


def test_copy_is_ensure_under_another_parameter_name() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    report = manager.copy(handle, to=PAGEABLE_HOST)
    assert report.action == EnsureResident(handle, PAGEABLE_HOST)
    assert isinstance(report.action, EnsureResident)
    assert report.no_op is True
    assert report.reason == ENSURE_NOOP
    with pytest.raises(TypeError):
        manager.copy(handle, at=PAGEABLE_HOST)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        manager.ensure(handle, to=PAGEABLE_HOST)  # type: ignore[call-arg]


def test_repeated_calls_report_the_arguments_they_were_given(sim: object) -> None:
    # Action records of repeated calls may be shared, but each report names exactly
    # the objects its call passed: an equal copy of the handle, or another location
    # or source, is never reported as a record built for an earlier call.
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    twin = copy.copy(handle)
    assert twin == handle
    assert twin is not handle
    first = manager.ensure(handle, CUDA0)
    again = manager.drop(handle, CUDA0)
    by_twin = manager.ensure(twin, CUDA0)
    assert first.action.handle is handle
    assert again.action == DropResident(handle, CUDA0)
    assert by_twin.action.handle is twin
    assert manager.drop(twin, CUDA0).action.handle is twin
    moved = manager.move(handle, CUDA0, from_location=PAGEABLE_HOST)
    assert moved.action == MoveResident(handle, CUDA0, PAGEABLE_HOST)
    moved_back = manager.move(handle, PAGEABLE_HOST)
    assert moved_back.action == MoveResident(handle, PAGEABLE_HOST, None)
    assert moved_back.action.from_location is None
    for _ in range(3):
        report = manager.ensure(handle, CUDA0)
        assert report.action == EnsureResident(handle, CUDA0)
        assert manager.drop(handle, CUDA0).action == DropResident(handle, CUDA0)
    assert_balanced(manager.snapshot())


def test_ensure_reports_contain_spec_bytes_not_actual_storage() -> None:
    manager = ResidencyManager()
    handle = manager.register_source(spec(4, storage=100), Source(fresh(4)))
    report = manager.ensure(handle, PAGEABLE_HOST)
    assert (report.logical_nbytes, report.storage_nbytes) == (16, 100)
    (mat,) = val_snap(manager.snapshot(), handle).materializations
    assert (mat.storage_nbytes, mat.charged_nbytes) == (16, 100)


def test_ensure_reconstructs_a_source_only_value_at_its_source_location() -> None:
    manager = ResidencyManager()
    source = Source(fresh(4))
    handle = manager.register_source(spec(4, replica=EXCLUSIVE), source)
    report = manager.ensure(handle, PAGEABLE_HOST)
    assert source.calls == 1
    assert report.no_op is False
    assert report.reason is None
    assert report.source == PAGEABLE_HOST
    assert report.destination == PAGEABLE_HOST
    snap = manager.snapshot()
    assert mat_locs(snap, handle) == (PAGEABLE_HOST,)
    assert val_snap(snap, handle).has_source is True
    assert used(snap, PAGEABLE_HOST) == 16
    # Second ensure is a no-op and does not load again.
    again = manager.ensure(handle, PAGEABLE_HOST)
    assert again.no_op is True
    assert source.calls == 1


def test_ensure_of_exclusive_value_elsewhere_is_ownership_error(sim: object) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())  # EXCLUSIVE at pageable
    before = state_key(manager.snapshot())
    for call in (
        lambda: manager.ensure(handle, CUDA0),
        lambda: manager.copy(handle, PINNED_HOST),
    ):
        with pytest.raises(ResidencyOwnershipError):
            call()
    assert state_key(manager.snapshot()) == before
    assert sim.calls["copy_to_cuda"] == 0  # type: ignore[attr-defined]
    assert sim.calls["copy_to_pinned"] == 0  # type: ignore[attr-defined]
    assert manager.trace() == ()


def test_ensure_of_exclusive_reconstructible_value_elsewhere_is_ownership_error(
    sim: object,
) -> None:
    manager = ResidencyManager()
    source = Source(fresh())
    handle = manager.register_source(spec(replica=EXCLUSIVE), source)
    manager.ensure(handle, PAGEABLE_HOST)
    with pytest.raises(ResidencyOwnershipError):
        manager.ensure(handle, CUDA1)
    assert source.calls == 1
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST,)


def test_ensure_replicable_keeps_existing_replicas(sim: object) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    report = manager.ensure(handle, CUDA0)
    assert report.no_op is False
    assert report.reason is None
    assert report.source == PAGEABLE_HOST
    assert report.destination == CUDA0
    assert report.action == EnsureResident(handle, CUDA0)
    report = manager.copy(handle, PINNED_HOST)
    assert report.source == PAGEABLE_HOST
    assert report.destination == PINNED_HOST
    snap = manager.snapshot()
    assert mat_locs(snap, handle) == (PAGEABLE_HOST, CUDA0, PINNED_HOST)
    for loc in (PAGEABLE_HOST, CUDA0, PINNED_HOST):
        assert used(snap, loc) == 16
    assert_balanced(snap)


def test_ensure_to_pinned_host_without_pinned_memory_propagates_runtime_error() -> None:
    # Default torch runtime on a machine without a pinned allocator
    # (transitions.md#copies-and-streams).
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    before = state_key(manager.snapshot())
    with pytest.raises(RuntimeError):
        manager.ensure(handle, PINNED_HOST)
    after = manager.snapshot()
    assert state_key(after) == before
    assert loc_snap(after, PINNED_HOST) is None
    assert manager.locations == (PAGEABLE_HOST,)
    assert manager.trace() == ()


# --------------------------------------------------------------------------------------------
# Deterministic source order (values.md#source-order)
# --------------------------------------------------------------------------------------------


def _replicas(manager: ResidencyManager, runtime: object, locations: tuple[object, ...]) -> object:
    """A REPLICABLE adopted value with replicas at `locations` (adopted at the first)."""
    first, *rest = locations
    handle = manager.adopt(on(runtime, first, tensor_value()), replica_mode=REPLICABLE)  # type: ignore[arg-type]
    for loc in rest:
        manager.ensure(handle, loc)  # type: ignore[arg-type]
    return handle


@pytest.mark.parametrize(
    ("present", "target", "expected"),
    [
        ((CUDA1, PINNED_HOST, PAGEABLE_HOST), CUDA0, PAGEABLE_HOST),
        ((CUDA1, PINNED_HOST), CUDA0, PINNED_HOST),
        ((CUDA1, CUDA0), PINNED_HOST, CUDA0),
        ((CUDA1,), PAGEABLE_HOST, CUDA1),
        ((PINNED_HOST, CUDA0), CUDA1, PINNED_HOST),
    ],
    ids=["pageable-first", "pinned-before-cuda", "cuda0-before-cuda1", "only-cuda1", "pinned"],
)
def test_ensure_picks_the_canonical_source(
    sim: object, present: tuple[object, ...], target: object, expected: object
) -> None:
    manager = ResidencyManager()
    handle = _replicas(manager, sim, present)
    report = manager.ensure(handle, target)  # type: ignore[arg-type]
    assert report.source == expected
    snap = manager.snapshot()
    assert set(mat_locs(snap, handle)) == {*present, target}


def test_move_without_from_location_picks_the_canonical_source_excluding_to(sim: object) -> None:
    manager = ResidencyManager()
    handle = _replicas(manager, sim, (CUDA1, PINNED_HOST, CUDA0))
    # `to` = pinned is resident; the best other replica is cuda:0 (pageable absent).
    report = manager.move(handle, PINNED_HOST)
    assert report.no_op is False
    assert report.source == CUDA0
    assert report.destination == PINNED_HOST
    assert mat_locs(manager.snapshot(), handle) == (CUDA1, PINNED_HOST)


# --------------------------------------------------------------------------------------------
# move (transitions.md#move)
# --------------------------------------------------------------------------------------------


def test_move_exclusive_value_to_a_new_location(sim: object) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4))
    report = manager.move(handle, CUDA0)
    assert report.action == MoveResident(handle, CUDA0)
    assert report.no_op is False
    assert report.reason is None
    assert report.source == PAGEABLE_HOST
    assert report.destination == CUDA0
    assert (report.logical_nbytes, report.storage_nbytes) == (16, 16)
    snap = manager.snapshot()
    assert mat_locs(snap, handle) == (CUDA0,)
    assert used(snap, PAGEABLE_HOST) == 0
    assert used(snap, CUDA0) == 16
    assert loc_snap(snap, PAGEABLE_HOST).peak_used_bytes == 16
    assert_balanced(snap)
    # And back, from CUDA to the host.
    report = manager.move(handle, PAGEABLE_HOST)
    assert (report.source, report.destination) == (CUDA0, PAGEABLE_HOST)
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST,)


def test_move_to_the_only_location_is_a_no_op() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    before = state_key(manager.snapshot())
    report = manager.move(handle, PAGEABLE_HOST)
    assert report.no_op is True
    assert report.reason == MOVE_NOOP
    assert report.source is None
    assert report.destination == PAGEABLE_HOST
    assert report.action == MoveResident(handle, PAGEABLE_HOST)
    assert state_key(manager.snapshot()) == before
    assert manager.trace() == (report,)


def test_move_with_from_location_equal_to_to_is_a_no_op_reporting_to(sim: object) -> None:
    manager = ResidencyManager()
    handle = _replicas(manager, sim, (PAGEABLE_HOST, CUDA0))
    before = state_key(manager.snapshot())
    report = manager.move(handle, CUDA0, from_location=CUDA0)
    assert report.no_op is True
    assert report.reason == MOVE_NOOP
    assert report.source == CUDA0
    assert report.destination == CUDA0
    assert report.action == MoveResident(handle, CUDA0, CUDA0)
    assert state_key(manager.snapshot()) == before


def test_move_to_resident_location_removes_the_selected_other_replica(sim: object) -> None:
    manager = ResidencyManager()
    handle = _replicas(manager, sim, (PAGEABLE_HOST, CUDA0))
    version = manager.state_version
    report = manager.move(handle, CUDA0)
    assert report.no_op is False
    assert report.reason is None
    assert report.source == PAGEABLE_HOST
    assert report.destination == CUDA0
    assert manager.state_version == version + 1  # one removal, no copy
    snap = manager.snapshot()
    assert mat_locs(snap, handle) == (CUDA0,)
    assert used(snap, PAGEABLE_HOST) == 0
    assert sim.calls["copy_to_cuda"] == 1  # type: ignore[attr-defined]  # only the setup copy


def test_move_to_resident_location_with_explicit_other_source(sim: object) -> None:
    manager = ResidencyManager()
    handle = _replicas(manager, sim, (PAGEABLE_HOST, CUDA0, CUDA1))
    report = manager.move(handle, CUDA0, from_location=CUDA1)
    assert (report.no_op, report.source, report.destination) == (False, CUDA1, CUDA0)
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST, CUDA0)


def test_move_removes_only_the_selected_replica(sim: object) -> None:
    manager = ResidencyManager()
    handle = _replicas(manager, sim, (PINNED_HOST, PAGEABLE_HOST, CUDA0))
    report = manager.move(handle, CUDA1)
    assert report.source == PAGEABLE_HOST
    assert mat_locs(manager.snapshot(), handle) == (PINNED_HOST, CUDA0, CUDA1)


def test_move_with_explicit_source(sim: object) -> None:
    manager = ResidencyManager()
    handle = _replicas(manager, sim, (PAGEABLE_HOST, CUDA0))
    report = manager.move(handle, CUDA1, from_location=CUDA0)
    assert report.action == MoveResident(handle, CUDA1, CUDA0)
    assert (report.source, report.destination) == (CUDA0, CUDA1)
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST, CUDA1)
    assert sim.copies[-1].destination == CUDA1  # type: ignore[attr-defined]
    assert sim.copies[-1].non_blocking is True  # type: ignore[attr-defined]  # CUDA source


def test_move_from_a_non_resident_location_is_unavailable(sim: object) -> None:
    manager = ResidencyManager()
    handle = _replicas(manager, sim, (PAGEABLE_HOST, CUDA0))
    before = state_key(manager.snapshot())
    with pytest.raises(ResidencyUnavailableError):
        manager.move(handle, CUDA0, from_location=CUDA1)
    with pytest.raises(ResidencyUnavailableError):
        manager.move(handle, PINNED_HOST, from_location=CUDA1)
    with pytest.raises(ResidencyUnavailableError):
        manager.move(handle, CUDA1, from_location=CUDA1)
    assert state_key(manager.snapshot()) == before
    assert manager.trace()[-1].action == EnsureResident(handle, CUDA0)


def test_move_exclusive_with_explicit_other_source_when_to_is_resident(sim: object) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(on(sim, CUDA0, tensor_value()))  # type: ignore[arg-type]
    with pytest.raises(ResidencyUnavailableError):
        manager.move(handle, CUDA0, from_location=PAGEABLE_HOST)


def test_move_of_source_only_value_reconstructs_and_removes_nothing(sim: object) -> None:
    manager = ResidencyManager()
    source = Source(fresh())
    handle = manager.register_source(spec(replica=EXCLUSIVE), source)
    report = manager.move(handle, CUDA1)
    assert source.calls == 1
    assert (report.no_op, report.source, report.destination) == (False, PAGEABLE_HOST, CUDA1)
    snap = manager.snapshot()
    assert mat_locs(snap, handle) == (CUDA1,)
    assert used(snap, PAGEABLE_HOST) == 0
    assert val_snap(snap, handle).has_source is True


def test_move_of_source_only_value_to_its_source_location(sim: object) -> None:
    manager = ResidencyManager()
    source = Source(sim_factory(sim, PINNED_HOST))
    handle = manager.register_source(spec(), source, source_location=PINNED_HOST)
    report = manager.move(handle, PINNED_HOST)
    assert (report.no_op, report.source, report.destination) == (False, PINNED_HOST, PINNED_HOST)
    assert mat_locs(manager.snapshot(), handle) == (PINNED_HOST,)
    assert sim.copies == []  # type: ignore[attr-defined]  # installed directly, no copy


# --------------------------------------------------------------------------------------------
# Reconstruction to another destination (values.md#reconstruction, step 6)
# --------------------------------------------------------------------------------------------


def test_reconstruction_for_another_destination_materialises_only_there(sim: object) -> None:
    manager = ResidencyManager()
    source = Source(fresh(4))
    handle = manager.register_source(spec(4), source)
    report = manager.ensure(handle, CUDA0)
    assert report.source == PAGEABLE_HOST  # the registered source_location
    assert report.destination == CUDA0
    snap = manager.snapshot()
    assert mat_locs(snap, handle) == (CUDA0,)
    assert used(snap, PAGEABLE_HOST) == 0
    assert used(snap, CUDA0) == 16
    assert_balanced(snap)
    assert sim.copies[-1].destination == CUDA0  # type: ignore[attr-defined]
    assert sim.copies[-1].non_blocking is False  # type: ignore[attr-defined]  # pageable source


def test_reconstruction_from_a_pinned_source_location_copies_non_blocking(sim: object) -> None:
    manager = ResidencyManager()
    handle = manager.register_source(
        spec(4), Source(sim_factory(sim, PINNED_HOST)), source_location=PINNED_HOST
    )
    report = manager.ensure(handle, CUDA1)
    assert report.source == PINNED_HOST
    assert mat_locs(manager.snapshot(), handle) == (CUDA1,)
    assert used(manager.snapshot(), PINNED_HOST) == 0
    assert sim.copies[-1].non_blocking is True  # type: ignore[attr-defined]


def test_reconstruction_from_cuda_to_host(sim: object) -> None:
    manager = ResidencyManager()
    handle = manager.register_source(
        spec(4), Source(sim_factory(sim, CUDA1)), source_location=CUDA1
    )
    report = manager.ensure(handle, PAGEABLE_HOST)
    assert report.source == CUDA1
    snap = manager.snapshot()
    assert mat_locs(snap, handle) == (PAGEABLE_HOST,)
    assert used(snap, CUDA1) == 0
    assert sim.calls["copy_to_pageable"] == 1  # type: ignore[attr-defined]


def test_replicable_reconstructible_value_reloads_after_dropping_its_last_copy() -> None:
    manager = ResidencyManager()
    source = Source(fresh())
    handle = manager.register_source(spec(), source)
    manager.ensure(handle, PAGEABLE_HOST)
    manager.drop(handle, PAGEABLE_HOST)
    assert mat_locs(manager.snapshot(), handle) == ()
    manager.ensure(handle, PAGEABLE_HOST)
    assert source.calls == 2
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST,)


def test_existing_materialisation_is_preferred_over_reconstruction(sim: object) -> None:
    manager = ResidencyManager()
    source = Source(fresh())
    handle = manager.register_source(spec(), source)
    manager.ensure(handle, CUDA1)
    assert source.calls == 1
    report = manager.ensure(handle, CUDA0)
    assert source.calls == 1
    assert report.source == CUDA1
    assert mat_locs(manager.snapshot(), handle) == (CUDA1, CUDA0)


# --------------------------------------------------------------------------------------------
# drop (transitions.md#drop)
# --------------------------------------------------------------------------------------------


def test_drop_of_absent_materialisation_is_a_no_op(sim: object) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    before = state_key(manager.snapshot())
    report = manager.drop(handle, CUDA1)
    assert report.action == DropResident(handle, CUDA1)
    assert report.no_op is True
    assert report.reason == DROP_NOOP
    assert report.source == CUDA1
    assert report.destination is None
    assert (report.logical_nbytes, report.storage_nbytes) == (16, 16)
    assert state_key(manager.snapshot()) == before
    # The absent location is not registered by a no-op.
    assert manager.locations == (PAGEABLE_HOST,)
    assert manager.trace() == (report,)


def test_drop_of_the_last_copy_of_an_adopted_value_is_ownership_error() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    before = state_key(manager.snapshot())
    with pytest.raises(ResidencyOwnershipError):
        manager.drop(handle, PAGEABLE_HOST)
    assert state_key(manager.snapshot()) == before
    assert manager.trace() == ()


def test_drop_of_a_replica_of_an_adopted_value(sim: object) -> None:
    manager = ResidencyManager()
    handle = _replicas(manager, sim, (PAGEABLE_HOST, CUDA0))
    report = manager.drop(handle, PAGEABLE_HOST)
    assert (report.no_op, report.reason, report.source, report.destination) == (
        False,
        None,
        PAGEABLE_HOST,
        None,
    )
    snap = manager.snapshot()
    assert mat_locs(snap, handle) == (CUDA0,)
    assert used(snap, PAGEABLE_HOST) == 0
    assert loc_snap(snap, PAGEABLE_HOST).peak_used_bytes == 16
    with pytest.raises(ResidencyOwnershipError):
        manager.drop(handle, CUDA0)


def test_drop_of_the_last_copy_of_a_reconstructible_value() -> None:
    manager = ResidencyManager()
    handle = manager.register_source(spec(replica=EXCLUSIVE), Source(fresh()))
    manager.ensure(handle, PAGEABLE_HOST)
    report = manager.drop(handle, PAGEABLE_HOST)
    assert report.no_op is False
    snap = manager.snapshot()
    assert mat_locs(snap, handle) == ()
    assert used(snap, PAGEABLE_HOST) == 0
    assert val_snap(snap, handle).has_source is True


def test_dropped_storage_is_released_from_the_alias_index(sim: object) -> None:
    manager = ResidencyManager()
    value = tensor_value()
    handle = manager.adopt(value, replica_mode=REPLICABLE)
    manager.ensure(handle, CUDA0)
    manager.drop(handle, PAGEABLE_HOST)
    again = manager.adopt(value)  # the same storage is unmanaged again
    assert mat_locs(manager.snapshot(), again) == (PAGEABLE_HOST,)


def test_moved_away_storage_is_released_from_the_alias_index(sim: object) -> None:
    manager = ResidencyManager()
    value = tensor_value()
    handle = manager.adopt(value)
    manager.move(handle, CUDA1)
    again = manager.adopt(value)
    assert mat_locs(manager.snapshot(), again) == (PAGEABLE_HOST,)
    assert mat_locs(manager.snapshot(), handle) == (CUDA1,)


# --------------------------------------------------------------------------------------------
# discard (transitions.md#discard)
# --------------------------------------------------------------------------------------------


def test_discard_removes_everything_and_keeps_the_record(sim: object) -> None:
    manager = ResidencyManager()
    handle = manager.register_source(spec(4, storage=40), Source(fresh(4)))
    manager.ensure(handle, PAGEABLE_HOST)
    manager.ensure(handle, CUDA0)
    version = manager.state_version
    report = manager.discard(handle)
    assert report.action == DiscardValue(handle)
    assert (report.no_op, report.reason, report.source, report.destination) == (
        False,
        None,
        None,
        None,
    )
    assert (report.logical_nbytes, report.storage_nbytes) == (16, 40)
    assert manager.state_version == version + 3  # two removals + the final mark
    snap = manager.snapshot()
    entry = val_snap(snap, handle)
    assert entry.discarded is True
    assert entry.materializations == ()
    assert entry.has_source is False
    assert entry.source_location is None
    assert entry.spec == spec(4, storage=40)
    assert used(snap, PAGEABLE_HOST) == used(snap, CUDA0) == 0
    assert loc_snap(snap, CUDA0).peak_used_bytes == 40
    assert_balanced(snap)


def test_discard_of_source_only_value() -> None:
    manager = ResidencyManager()
    source = Source(fresh())
    handle = manager.register_source(spec(), source)
    version = manager.state_version
    report = manager.discard(handle)
    assert report.no_op is False
    assert manager.state_version == version + 1
    assert val_snap(manager.snapshot(), handle).discarded is True
    assert source.calls == 0


def test_second_discard_is_a_handle_error_not_a_no_op() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    manager.discard(handle)
    with pytest.raises(ResidencyHandleError):
        manager.discard(handle)
    assert len(manager.trace()) == 1


def test_discarded_values_stay_in_issue_order() -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value())
    b = manager.register_source(spec(), Source(fresh()))
    c = manager.adopt(tensor_value())
    manager.discard(b)
    manager.discard(a)
    snap = manager.snapshot()
    assert [v.handle for v in snap.values] == [a, b, c]
    assert [v.discarded for v in snap.values] == [True, True, False]


def test_reports_are_new_objects_each_time() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    first = manager.ensure(handle, PAGEABLE_HOST)
    second = manager.ensure(handle, PAGEABLE_HOST)
    assert first is not second
    assert second.started_at_ns >= first.completed_at_ns
    assert manager.trace() == (first, second)


def test_bundles_move_all_fields_together(sim: object) -> None:
    from fhelium.values import TensorBundle

    manager = ResidencyManager()
    bundle = TensorBundle(a=torch.ones(3), b=torch.zeros(2, dtype=torch.int64))
    handle = manager.adopt(bundle)
    report = manager.move(handle, CUDA1)
    assert (report.logical_nbytes, report.storage_nbytes) == (28, 28)
    snap = manager.snapshot()
    assert mat_locs(snap, handle) == (CUDA1,)
    assert used(snap, CUDA1) == 28
