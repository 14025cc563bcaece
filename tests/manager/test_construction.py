"""`ResidencyManager` construction, identity, `locations` and the context-manager protocol.

Construction order, guards (docs/concepts/transitions.md#guards), location validation and
registration (docs/concepts/locations-and-budgets.md), observations, only the minimal
close/context-manager behaviour (docs/concepts/lifetimes.md#close), and machines without CUDA.
"""

# Exception types are fixed; ValueError wording is not (docs/concepts/conventions.md#check-order).
# ruff: noqa: PT011

from __future__ import annotations

import re
import uuid
from collections import OrderedDict
from types import MappingProxyType

import numpy as np
import pytest
import torch

from fhelium.errors import ResidencyClosedError
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, ResidencyLocation, cuda_location
from fhelium.residency.manager import ResidencyManager
from helpers.manager import (
    CUDA0,
    CUDA1,
    REPLICABLE,
    Source,
    assert_balanced,
    fresh,
    loc_snap,
    sim_fixture,  # noqa: F401
    spec,
    tensor_value,
)

UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


# --------------------------------------------------------------------------------------------
# Defaults and identity
# --------------------------------------------------------------------------------------------


def test_default_manager_starts_empty_at_version_zero() -> None:
    manager = ResidencyManager()
    assert manager.state_version == 0
    assert type(manager.state_version) is int
    assert manager.locations == ()
    assert isinstance(manager.locations, tuple)
    snap = manager.snapshot()
    assert snap.values == ()
    assert snap.locations == ()
    assert snap.reservations == ()
    assert snap.state_version == 0
    assert snap.manager_id == manager.manager_id
    assert manager.trace() == ()


def test_manager_id_is_a_process_unique_uuid4_string() -> None:
    managers = [ResidencyManager() for _ in range(20)]
    ids = [m.manager_id for m in managers]
    assert all(type(i) is str for i in ids)
    assert all(UUID_RE.match(i) for i in ids), ids
    assert all(str(uuid.UUID(i)) == i for i in ids)
    assert len(set(ids)) == len(ids)


def test_manager_id_is_stable_and_read_only() -> None:
    manager = ResidencyManager()
    first = manager.manager_id
    manager.adopt(tensor_value())
    assert manager.manager_id == first
    with pytest.raises(AttributeError):
        manager.manager_id = "other"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        manager.state_version = 5  # type: ignore[misc]
    with pytest.raises(AttributeError):
        manager.locations = ()  # type: ignore[misc]
    assert manager.manager_id == first


# --------------------------------------------------------------------------------------------
# budgets
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "budgets",
    [[(PAGEABLE_HOST, 10)], ((PAGEABLE_HOST, 10),), 5, "pageable-host", {PAGEABLE_HOST}],
    ids=["list", "tuple", "int", "str", "set"],
)
def test_non_mapping_budgets_raise_type_error(budgets: object) -> None:
    with pytest.raises(TypeError):
        ResidencyManager(budgets)  # type: ignore[arg-type]


def test_any_mapping_is_accepted_and_budgets_register_in_mapping_order() -> None:
    budgets = OrderedDict([(PINNED_HOST, 7), (PAGEABLE_HOST, 5)])
    manager = ResidencyManager(MappingProxyType(budgets))
    # Budgeted locations are registered immediately, in mapping order, without a version bump.
    assert manager.locations == (PINNED_HOST, PAGEABLE_HOST)
    assert manager.state_version == 0
    snap = manager.snapshot()
    assert [e.location for e in snap.locations] == [PINNED_HOST, PAGEABLE_HOST]
    pinned, pageable = snap.locations
    assert (pinned.budget_bytes, pinned.remaining_budget_bytes) == (7, 7)
    assert (pageable.budget_bytes, pageable.remaining_budget_bytes) == (5, 5)
    for entry in snap.locations:
        assert entry.used_bytes == entry.reserved_bytes == entry.value_count == 0
        assert entry.peak_used_bytes == entry.peak_charged_bytes == 0
        assert entry.reservation_count == 0
        assert entry.allocator_allocated_bytes is None
        assert entry.allocator_reserved_bytes is None


def test_empty_budget_mapping_is_the_unbudgeted_manager() -> None:
    manager = ResidencyManager({})
    assert manager.locations == ()
    assert manager.state_version == 0


@pytest.mark.parametrize("key", ["pageable-host", None, 0, torch.device("cpu")])
def test_non_location_budget_key_raises_type_error(key: object) -> None:
    with pytest.raises(TypeError):
        ResidencyManager({key: 10})  # type: ignore[dict-item]


@pytest.mark.parametrize("budget", [True, False, 1.5, "10", None], ids=repr)
def test_budget_value_of_wrong_kind_raises_type_error(budget: object) -> None:
    with pytest.raises(TypeError):
        ResidencyManager({PAGEABLE_HOST: budget})  # type: ignore[dict-item]


def test_negative_budget_raises_value_error() -> None:
    with pytest.raises(ValueError):
        ResidencyManager({PAGEABLE_HOST: -1})


def test_budget_values_are_index_ints_normalised_to_int() -> None:
    manager = ResidencyManager({PAGEABLE_HOST: np.int64(12), PINNED_HOST: 0})
    entry = loc_snap(manager.snapshot(), PAGEABLE_HOST)
    assert entry.budget_bytes == 12
    assert type(entry.budget_bytes) is int
    assert type(entry.remaining_budget_bytes) is int
    assert loc_snap(manager.snapshot(), PINNED_HOST).budget_bytes == 0


def test_cuda_budget_without_cuda_raises_value_error() -> None:
    # This process has no usable CUDA runtime; constructing the location works
    # (locations-and-budgets.md#without-cuda).
    with pytest.raises(ValueError):
        ResidencyManager({cuda_location("cuda:0"): 10})


def test_budget_entries_are_checked_in_mapping_order() -> None:
    # The bad *value* of the first entry is found before the bad *key* of the second.
    with pytest.raises(ValueError):
        ResidencyManager({PAGEABLE_HOST: -1, "bad": 10})  # type: ignore[dict-item]
    # ...and a bad key of the first entry before the bad value of the second.
    with pytest.raises(TypeError):
        ResidencyManager({"bad": 10, PAGEABLE_HOST: -1})  # type: ignore[dict-item]
    # Within an entry, the location is checked before its budget.
    with pytest.raises(TypeError):
        ResidencyManager({"bad": -1})  # type: ignore[dict-item]


# --------------------------------------------------------------------------------------------
# trace_capacity
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [True, False, 2.0, "3", None], ids=repr)
def test_trace_capacity_of_wrong_kind_raises_type_error(capacity: object) -> None:
    with pytest.raises(TypeError):
        ResidencyManager(trace_capacity=capacity)  # type: ignore[arg-type]


def test_negative_trace_capacity_raises_value_error() -> None:
    with pytest.raises(ValueError):
        ResidencyManager(trace_capacity=-1)


def test_trace_capacity_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        ResidencyManager(None, 5)  # type: ignore[misc]


def test_trace_capacity_accepts_index_ints() -> None:
    manager = ResidencyManager(trace_capacity=np.int32(1))
    handle = manager.adopt(tensor_value())
    manager.ensure(handle, PAGEABLE_HOST)
    manager.ensure(handle, PAGEABLE_HOST)
    assert len(manager.trace()) == 1


def test_trace_capacity_has_no_upper_bound() -> None:
    # An index int >= 0 keeps the last N reports (transitions.md#trace); 2**63 does not fit a
    # C ssize_t.
    manager = ResidencyManager(trace_capacity=2**63)
    handle = manager.adopt(tensor_value())
    manager.ensure(handle, PAGEABLE_HOST)
    assert len(manager.trace()) == 1


def test_construction_check_order() -> None:
    # 1. budgets kind, before trace_capacity.
    with pytest.raises(TypeError):
        ResidencyManager([1], trace_capacity=-1)  # type: ignore[arg-type]
    # 3. trace_capacity, before the budget entries (4.).
    with pytest.raises(ValueError):
        ResidencyManager({"bad": 1}, trace_capacity=-1)  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        ResidencyManager({PAGEABLE_HOST: -1}, trace_capacity=True)


# --------------------------------------------------------------------------------------------
# Simulated CUDA budgets
# --------------------------------------------------------------------------------------------


def test_cuda_budgets_with_simulated_runtime(sim: object) -> None:
    manager = ResidencyManager({CUDA1: 100, PAGEABLE_HOST: 50, CUDA0: 20})
    assert manager.locations == (CUDA1, PAGEABLE_HOST, CUDA0)
    assert manager.state_version == 0
    snap = manager.snapshot()
    assert [e.budget_bytes for e in snap.locations] == [100, 50, 20]
    assert_balanced(snap)


@pytest.mark.usefixtures("sim")
def test_cuda_budget_index_out_of_range_raises_value_error() -> None:
    with pytest.raises(ValueError):
        ResidencyManager({cuda_location("cuda:2"): 10})
    with pytest.raises(ValueError):
        ResidencyManager({CUDA0: 10, cuda_location("cuda:127"): 10})


# --------------------------------------------------------------------------------------------
# locations: registration order
# --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("sim")
def test_locations_lists_budgeted_first_then_first_registration_order() -> None:
    manager = ResidencyManager({CUDA1: 1000})
    source_handle = manager.register_source(spec(), Source(fresh()), source_location=PINNED_HOST)
    assert manager.locations == (CUDA1, PINNED_HOST)
    adopted = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    assert manager.locations == (CUDA1, PINNED_HOST, PAGEABLE_HOST)
    manager.ensure(adopted, CUDA0)
    manager.ensure(adopted, CUDA1)
    assert manager.locations == (CUDA1, PINNED_HOST, PAGEABLE_HOST, CUDA0)
    manager.ensure(adopted, cuda_location(torch.device("cuda", 0)))  # known: no new entry
    assert manager.locations == (CUDA1, PINNED_HOST, PAGEABLE_HOST, CUDA0)
    assert [e.location for e in manager.snapshot().locations] == list(manager.locations)
    assert source_handle.manager_id == manager.manager_id


def test_failed_operations_register_no_location() -> None:
    manager = ResidencyManager()
    value = tensor_value()
    from fhelium.errors import ResidencyMaterializationError

    with pytest.raises(ResidencyMaterializationError):
        manager.adopt(value, at=PINNED_HOST)  # a pageable value is not pinned
    assert manager.locations == ()
    assert manager.state_version == 0


# --------------------------------------------------------------------------------------------
# Context manager and minimal close behaviour
# --------------------------------------------------------------------------------------------


def test_context_manager_returns_self_and_closes_on_exit() -> None:
    manager = ResidencyManager()
    with manager as entered:
        assert entered is manager
        handle = manager.adopt(tensor_value())
        manager.ensure(handle, PAGEABLE_HOST)
    with pytest.raises(ResidencyClosedError):
        manager.snapshot()
    with pytest.raises(ResidencyClosedError):
        _ = manager.state_version
    with pytest.raises(ResidencyClosedError):
        manager.ensure(handle, PAGEABLE_HOST)
    with pytest.raises(ResidencyClosedError):
        manager.adopt(tensor_value())
    with pytest.raises(ResidencyClosedError):
        manager.register_source(spec(), Source(fresh()))
    with pytest.raises(ResidencyClosedError):
        manager.drop(handle, PAGEABLE_HOST)
    with pytest.raises(ResidencyClosedError):
        manager.discard(handle)
    with pytest.raises(ResidencyClosedError):
        manager.move(handle, PAGEABLE_HOST)
    with pytest.raises(ResidencyClosedError):
        manager.copy(handle, PAGEABLE_HOST)
    with pytest.raises(ResidencyClosedError), manager:
        pass
    # These keep working after close (lifetimes.md#close).
    assert manager.locations == (PAGEABLE_HOST,)
    assert len(manager.trace()) == 1
    assert UUID_RE.match(manager.manager_id)
    manager.clear_trace()
    assert manager.trace() == ()
    # close() on a closed manager returns silently.
    manager.close()
    manager.close(force=True)


def test_context_manager_exit_does_not_suppress_body_exception() -> None:
    manager = ResidencyManager()
    with pytest.raises(KeyError), manager:
        raise KeyError("body")
    with pytest.raises(ResidencyClosedError):
        manager.snapshot()


def test_argument_type_checks_run_before_the_closed_check() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    manager.close()
    with pytest.raises(TypeError):
        manager.adopt(torch.zeros(3))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        manager.register_source("spec", Source(fresh()))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        manager.register_source(spec(), object())
    with pytest.raises(TypeError):
        manager.ensure("handle", PAGEABLE_HOST)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        manager.ensure(handle, "pageable-host")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        manager.move(handle, PAGEABLE_HOST, from_location="pinned-host")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        manager.drop(handle, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        manager.discard(None)  # type: ignore[arg-type]


def test_locations_are_location_records() -> None:
    manager = ResidencyManager({PAGEABLE_HOST: 1})
    assert all(isinstance(loc, ResidencyLocation) for loc in manager.locations)
