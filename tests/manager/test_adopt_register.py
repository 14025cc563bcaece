"""`adopt` and `register_source`, including the storage-alias rule (docs/concepts/values.md)."""

# Exception types are fixed; ValueError wording is not (docs/concepts/conventions.md#check-order).
# ruff: noqa: PT011

from __future__ import annotations

import types
import uuid

import pytest
import torch

from fhelium.errors import (
    ResidencyBudgetError,
    ResidencyError,
    ResidencyMaterializationError,
    ResidencyOwnershipError,
)
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, cuda_location
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.model import ResidencyHandle, ResidencyValueSpec
from fhelium.values import ResidentTensor, TensorBundle, TensorResident
from helpers.manager import (
    CUDA0,
    CUDA1,
    EXCLUSIVE,
    MUST_PRESERVE,
    RECONSTRUCTIBLE,
    REPLICABLE,
    NoTensors,
    Other,
    Source,
    SubTensor,
    assert_balanced,
    fresh,
    loc_snap,
    mat_locs,
    on,
    sim_fixture,  # noqa: F401
    spec,
    state_key,
    tensor_value,
    val_snap,
    view_value,
)

# --------------------------------------------------------------------------------------------
# adopt: handles and specs
# --------------------------------------------------------------------------------------------


def test_adopt_issues_a_handle_bound_to_this_manager() -> None:
    manager = ResidencyManager()
    value = tensor_value(4)
    handle = manager.adopt(value)
    assert isinstance(handle, ResidencyHandle)
    assert handle.manager_id == manager.manager_id
    assert str(uuid.UUID(handle.handle_id)) == handle.handle_id
    assert handle.value_type is ResidentTensor
    other = manager.adopt(tensor_value(4))
    assert other.handle_id != handle.handle_id
    assert other != handle


def test_adopt_uses_the_concrete_class_as_value_type() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(SubTensor(torch.ones(2)))
    assert handle.value_type is SubTensor
    assert val_snap(manager.snapshot(), handle).spec.value_type is SubTensor


def test_adopt_builds_a_must_preserve_exclusive_spec_by_default() -> None:
    manager = ResidencyManager()
    value = tensor_value(5)
    handle = manager.adopt(value)
    entry = val_snap(manager.snapshot(), handle)
    assert entry.spec == ResidencyValueSpec(ResidentTensor, 20, 20, EXCLUSIVE, MUST_PRESERVE)
    assert entry.has_source is False
    assert entry.source_location is None
    assert entry.discarded is False
    (mat,) = entry.materializations
    assert mat.location == PAGEABLE_HOST
    assert (mat.logical_nbytes, mat.storage_nbytes, mat.charged_nbytes) == (20, 20, 20)
    assert (mat.use_count, mat.hold_count, mat.pending_event_count) == (0, 0, 0)


def test_adopt_replica_mode_is_recorded() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    assert val_snap(manager.snapshot(), handle).spec.replica_mode is REPLICABLE
    assert val_snap(manager.snapshot(), handle).spec.recoverability is MUST_PRESERVE


def test_adopt_charges_the_whole_allocation_of_a_view() -> None:
    # storage = max(nbytes, storage_nbytes): a 4-float view into 64 floats is charged 256.
    manager = ResidencyManager()
    value = view_value(4, backing=64)
    handle = manager.adopt(value)
    snap = manager.snapshot()
    entry = val_snap(snap, handle)
    assert (entry.spec.logical_nbytes, entry.spec.storage_nbytes) == (16, 256)
    (mat,) = entry.materializations
    assert (mat.logical_nbytes, mat.storage_nbytes, mat.charged_nbytes) == (16, 256, 256)
    assert loc_snap(snap, PAGEABLE_HOST).used_bytes == 256


def test_adopt_charges_logical_bytes_when_fields_share_storage() -> None:
    # Two fields on one 8-float storage: logical 64, actual storage 32, charge = 64.
    manager = ResidencyManager()
    base = torch.zeros(8, dtype=torch.float32)
    value = TensorBundle(a=base, b=base)
    handle = manager.adopt(value)
    snap = manager.snapshot()
    entry = val_snap(snap, handle)
    assert (entry.spec.logical_nbytes, entry.spec.storage_nbytes) == (64, 64)
    (mat,) = entry.materializations
    assert (mat.storage_nbytes, mat.charged_nbytes) == (32, 64)
    assert loc_snap(snap, PAGEABLE_HOST).used_bytes == 64
    assert_balanced(snap)


# --------------------------------------------------------------------------------------------
# adopt: argument checks
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [torch.zeros(3), None, "value", 3], ids=repr)
def test_adopt_rejects_non_resident_values_with_type_error(value: object) -> None:
    manager = ResidencyManager()
    with pytest.raises(TypeError):
        manager.adopt(value)  # type: ignore[arg-type]
    assert manager.state_version == 0


def test_adopt_accepts_a_virtual_tensor_resident_subclass() -> None:
    # Registered with the abstract base rather than derived from it: `isinstance`
    # says yes, so adopt does too.
    class Registered:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

        @property
        def _resident_tensors(self) -> tuple[torch.Tensor, ...]:
            return (self.tensor,)

    TensorResident.register(Registered)
    manager = ResidencyManager()
    value = Registered(torch.zeros(4))
    handle = manager.adopt(value)  # type: ignore[type-var]
    assert handle.value_type is Registered
    snapshot = manager.snapshot()
    assert mat_locs(snapshot, handle) == (PAGEABLE_HOST,)
    assert val_snap(snapshot, handle).spec.storage_nbytes == 16


@pytest.mark.parametrize("mode", ["exclusive", "replicable", None, 1], ids=repr)
def test_adopt_rejects_non_replica_mode(mode: object) -> None:
    manager = ResidencyManager()
    with pytest.raises(TypeError):
        manager.adopt(tensor_value(), replica_mode=mode)  # type: ignore[arg-type]
    assert manager.snapshot().values == ()
    assert manager.locations == ()
    assert manager.state_version == 0


def test_adopt_location_checks_come_before_the_replica_mode_check() -> None:
    manager = ResidencyManager()
    # An unavailable CUDA location (no CUDA here) is a ValueError before the bad mode.
    with pytest.raises(ValueError):
        manager.adopt(tensor_value(), at=cuda_location("cuda:0"), replica_mode="x")  # type: ignore[arg-type]
    # A pinning mismatch is a materialisation error before the bad mode.
    with pytest.raises(ResidencyMaterializationError):
        manager.adopt(tensor_value(), at=PINNED_HOST, replica_mode="x")  # type: ignore[arg-type]


@pytest.mark.parametrize("at", ["pageable-host", torch.device("cpu"), 0], ids=repr)
def test_adopt_rejects_non_location_at(at: object) -> None:
    manager = ResidencyManager()
    with pytest.raises(TypeError):
        manager.adopt(tensor_value(), at=at)  # type: ignore[arg-type]


def test_adopt_at_cuda_without_cuda_is_value_error() -> None:
    manager = ResidencyManager()
    with pytest.raises(ValueError):
        manager.adopt(tensor_value(), at=cuda_location("cuda:0"))
    assert manager.locations == ()


def test_adopt_pageable_value_at_pinned_host_is_a_materialization_error() -> None:
    manager = ResidencyManager()
    with pytest.raises(ResidencyMaterializationError):
        manager.adopt(tensor_value(), at=PINNED_HOST)
    assert manager.snapshot().values == ()
    assert manager.locations == ()
    assert manager.state_version == 0


def test_adopt_value_without_tensors_propagates_runtime_error_unchanged() -> None:
    manager = ResidencyManager()
    with pytest.raises(RuntimeError) as info:
        manager.adopt(NoTensors())
    assert not isinstance(info.value, ResidencyError)
    assert manager.snapshot().values == ()
    assert manager.state_version == 0


def test_adopt_explicit_pageable_location() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(), at=PAGEABLE_HOST)
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST,)


# --------------------------------------------------------------------------------------------
# adopt: budgets and aliasing
# --------------------------------------------------------------------------------------------


def test_adopt_is_budget_checked_and_a_failure_leaves_no_record() -> None:
    manager = ResidencyManager({PAGEABLE_HOST: 30})
    first = manager.adopt(tensor_value(4))  # 16 bytes
    before = state_key(manager.snapshot())
    with pytest.raises(ResidencyBudgetError) as info:
        manager.adopt(tensor_value(4))  # 16 + 16 > 30
    err = info.value
    assert err.location == "pageable-host"
    assert (err.budget_bytes, err.used_bytes, err.reserved_bytes, err.requested_bytes) == (
        30,
        16,
        0,
        16,
    )
    assert state_key(manager.snapshot()) == before
    # Equality is admitted: 16 + 14 == 30.
    second = manager.adopt(ResidentTensor(torch.zeros(7, dtype=torch.int16)))
    snap = manager.snapshot()
    assert [v.handle for v in snap.values] == [first, second]
    assert loc_snap(snap, PAGEABLE_HOST).used_bytes == 30
    assert loc_snap(snap, PAGEABLE_HOST).remaining_budget_bytes == 0


def test_adopt_zero_byte_value_is_admitted_at_a_zero_budget() -> None:
    manager = ResidencyManager({PAGEABLE_HOST: 0})
    handle = manager.adopt(ResidentTensor(torch.empty(0)))
    snap = manager.snapshot()
    assert mat_locs(snap, handle) == (PAGEABLE_HOST,)
    assert loc_snap(snap, PAGEABLE_HOST).used_bytes == 0


def test_adopting_the_same_object_twice_is_an_ownership_error() -> None:
    manager = ResidencyManager()
    value = tensor_value()
    handle = manager.adopt(value)
    before = state_key(manager.snapshot())
    with pytest.raises(ResidencyOwnershipError):
        manager.adopt(value)
    after = manager.snapshot()
    assert state_key(after) == before
    assert [v.handle for v in after.values] == [handle]


def test_adopting_a_view_of_managed_storage_is_an_ownership_error() -> None:
    manager = ResidencyManager()
    base = torch.arange(16, dtype=torch.float32)
    manager.adopt(ResidentTensor(base))
    with pytest.raises(ResidencyOwnershipError):
        manager.adopt(ResidentTensor(base[4:8]))
    # One field aliasing is enough.
    with pytest.raises(ResidencyOwnershipError):
        manager.adopt(TensorBundle(a=torch.zeros(2), b=base[:1]))
    assert len(manager.snapshot().values) == 1


def test_fields_of_one_value_may_share_storage() -> None:
    manager = ResidencyManager()
    base = torch.arange(8, dtype=torch.float32)
    handle = manager.adopt(TensorBundle(a=base, b=base[2:4]))
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST,)


def test_zero_byte_storages_never_collide() -> None:
    manager = ResidencyManager()
    empty = torch.empty(0)
    value = ResidentTensor(empty)
    first = manager.adopt(value)
    second = manager.adopt(value)
    third = manager.adopt(TensorBundle(a=empty, b=torch.empty(0)))
    assert len({first, second, third}) == 3


def test_alias_rule_applies_across_handles_of_different_types() -> None:
    manager = ResidencyManager()
    base = torch.arange(4, dtype=torch.float32)
    manager.adopt(Other(base))
    with pytest.raises(ResidencyOwnershipError):
        manager.adopt(ResidentTensor(base))


def test_storage_of_a_discarded_value_can_be_adopted_again() -> None:
    manager = ResidencyManager()
    value = tensor_value()
    handle = manager.adopt(value)
    manager.discard(handle)
    again = manager.adopt(value)
    assert again != handle
    assert mat_locs(manager.snapshot(), again) == (PAGEABLE_HOST,)


# --------------------------------------------------------------------------------------------
# adopt: location inference and checks under the simulated runtime
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", [PAGEABLE_HOST, PINNED_HOST, CUDA0, CUDA1], ids=str)
def test_adopt_infers_the_location_from_the_value(sim: object, where: object) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(on(sim, where, tensor_value()))  # type: ignore[arg-type]
    snap = manager.snapshot()
    assert mat_locs(snap, handle) == (where,)
    assert manager.locations == (where,)
    assert loc_snap(snap, where).used_bytes == 16


@pytest.mark.parametrize(
    ("where", "at"),
    [
        (PAGEABLE_HOST, PINNED_HOST),
        (PINNED_HOST, PAGEABLE_HOST),
        (PAGEABLE_HOST, CUDA0),
        (CUDA1, CUDA0),
        (CUDA0, PAGEABLE_HOST),
        (CUDA0, PINNED_HOST),
    ],
    ids=str,
)
def test_adopt_rejects_a_value_that_is_not_at_the_given_location(
    sim: object, where: object, at: object
) -> None:
    manager = ResidencyManager()
    value = on(sim, where, tensor_value())  # type: ignore[arg-type]
    with pytest.raises(ResidencyMaterializationError):
        manager.adopt(value, at=at)  # type: ignore[arg-type]
    assert manager.snapshot().values == ()
    assert manager.locations == ()
    assert manager.state_version == 0


def test_adopt_rejects_mixed_pinning(sim: object) -> None:
    manager = ResidencyManager()
    pinned = on(sim, PINNED_HOST, tensor_value())  # type: ignore[arg-type]
    mixed = TensorBundle(a=pinned.tensor, b=torch.zeros(3))  # type: ignore[attr-defined]
    with pytest.raises(ResidencyMaterializationError):
        manager.adopt(mixed)
    with pytest.raises(ResidencyMaterializationError):
        manager.adopt(mixed, at=PAGEABLE_HOST)
    with pytest.raises(ResidencyMaterializationError):
        manager.adopt(mixed, at=PINNED_HOST)
    assert manager.snapshot().values == ()


@pytest.mark.usefixtures("sim")
def test_adopt_out_of_range_cuda_is_value_error() -> None:
    manager = ResidencyManager()
    with pytest.raises(ValueError):
        manager.adopt(tensor_value(), at=cuda_location("cuda:2"))


# --------------------------------------------------------------------------------------------
# register_source
# --------------------------------------------------------------------------------------------


def test_register_source_records_a_source_only_value_without_loading() -> None:
    manager = ResidencyManager({PAGEABLE_HOST: 0})  # never budget-checked
    source = Source(fresh(8))
    value_spec = spec(8, storage=100, replica=EXCLUSIVE)
    handle = manager.register_source(value_spec, source)
    assert source.calls == 0
    assert handle.manager_id == manager.manager_id
    assert handle.value_type is ResidentTensor
    assert str(uuid.UUID(handle.handle_id)) == handle.handle_id
    snap = manager.snapshot()
    entry = val_snap(snap, handle)
    assert entry.spec == value_spec
    assert entry.materializations == ()
    assert entry.has_source is True
    assert entry.source_location == PAGEABLE_HOST
    assert entry.discarded is False
    assert loc_snap(snap, PAGEABLE_HOST).used_bytes == 0
    assert loc_snap(snap, PAGEABLE_HOST).peak_charged_bytes == 0


def test_register_source_handle_uses_the_spec_value_type() -> None:
    manager = ResidencyManager()
    handle = manager.register_source(spec(value_type=SubTensor), Source(fresh()))
    assert handle.value_type is SubTensor


def test_register_source_accepts_any_object_with_a_callable_load() -> None:
    manager = ResidencyManager()
    calls: list[int] = []
    source = types.SimpleNamespace(load=lambda: calls.append(1) or tensor_value())
    handle = manager.register_source(spec(), source)
    assert calls == []
    manager.ensure(handle, PAGEABLE_HOST)
    assert calls == [1]


@pytest.mark.parametrize(
    "source",
    [object(), types.SimpleNamespace(load=None), types.SimpleNamespace(load=3), None],
    ids=["no-load", "load-None", "load-int", "None"],
)
def test_register_source_rejects_a_source_without_callable_load(source: object) -> None:
    manager = ResidencyManager()
    with pytest.raises(TypeError):
        manager.register_source(spec(), source)  # type: ignore[arg-type]
    assert manager.state_version == 0


@pytest.mark.parametrize("bad", [None, "spec", tensor_value()], ids=["None", "str", "value"])
def test_register_source_rejects_a_non_spec(bad: object) -> None:
    manager = ResidencyManager()
    with pytest.raises(TypeError):
        manager.register_source(bad, Source(fresh()))  # type: ignore[arg-type]


def test_register_source_rejects_must_preserve_with_value_error() -> None:
    manager = ResidencyManager()
    with pytest.raises(ValueError):
        manager.register_source(
            spec(recoverability=MUST_PRESERVE), Source(fresh()), source_location=PINNED_HOST
        )
    # Nothing registered: not even the (valid, new) source location.
    assert manager.locations == ()
    assert manager.state_version == 0
    assert manager.snapshot().values == ()


@pytest.mark.parametrize("location", ["pageable-host", None, torch.device("cpu")], ids=repr)
def test_register_source_rejects_a_non_location(location: object) -> None:
    manager = ResidencyManager()
    with pytest.raises(TypeError):
        manager.register_source(spec(), Source(fresh()), source_location=location)  # type: ignore[arg-type]


def test_register_source_location_is_validated_before_recoverability() -> None:
    manager = ResidencyManager()
    with pytest.raises(TypeError):
        manager.register_source(
            spec(recoverability=MUST_PRESERVE),
            Source(fresh()),
            source_location="x",  # type: ignore[arg-type]
        )
    with pytest.raises(ValueError):
        manager.register_source(spec(), Source(fresh()), source_location=cuda_location("cuda:0"))
    assert manager.locations == ()


@pytest.mark.parametrize("mode", [REPLICABLE, EXCLUSIVE])
def test_register_source_accepts_either_replica_mode(mode: object) -> None:
    manager = ResidencyManager()
    handle = manager.register_source(spec(replica=mode), Source(fresh()))  # type: ignore[arg-type]
    assert val_snap(manager.snapshot(), handle).spec.replica_mode is mode
    assert val_snap(manager.snapshot(), handle).spec.recoverability is RECONSTRUCTIBLE


def test_register_source_at_cuda_with_simulated_runtime(sim: object) -> None:
    manager = ResidencyManager()
    handle = manager.register_source(spec(), Source(fresh()), source_location=CUDA1)
    assert manager.locations == (CUDA1,)
    assert val_snap(manager.snapshot(), handle).source_location == CUDA1
    with pytest.raises(ValueError):
        manager.register_source(spec(), Source(fresh()), source_location=cuda_location("cuda:2"))
    assert manager.locations == (CUDA1,)


def test_values_are_listed_in_issue_order() -> None:
    manager = ResidencyManager()
    a = manager.register_source(spec(), Source(fresh()))
    b = manager.adopt(tensor_value())
    c = manager.register_source(spec(2), Source(fresh(2)))
    d = manager.adopt(tensor_value(3))
    assert [v.handle for v in manager.snapshot().values] == [a, b, c, d]
