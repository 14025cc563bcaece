"""The bounded transition trace (docs/concepts/transitions.md#trace)."""

from __future__ import annotations

from typing import Any

import pytest

from fhelium.errors import ResidencyOwnershipError
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.plan import DiscardValue, DropResident, EnsureResident, MoveResident
from helpers.manager import (
    CUDA0,
    REPLICABLE,
    Source,
    fresh,
    has_reserve,
    sim_fixture,  # noqa: F401
    spec,
    tensor_value,
)


def test_every_primitive_report_is_traced_oldest_first(sim: Any) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    reports = [
        manager.ensure(handle, CUDA0),
        manager.copy(handle, PINNED_HOST),
        manager.ensure(handle, CUDA0),  # no-op
        manager.move(handle, CUDA0),
        manager.drop(handle, PINNED_HOST),
        manager.drop(handle, PINNED_HOST),  # no-op
        manager.discard(handle),
    ]
    trace = manager.trace()
    assert isinstance(trace, tuple)
    assert trace == tuple(reports)
    assert [type(r.action) for r in trace] == [
        EnsureResident,
        EnsureResident,
        EnsureResident,
        MoveResident,
        DropResident,
        DropResident,
        DiscardValue,
    ]
    assert [r.no_op for r in trace] == [False, False, True, False, False, True, False]
    completed = [r.completed_at_ns for r in trace]
    assert completed == sorted(completed)


def test_adopt_register_and_reservations_are_not_traced() -> None:
    manager = ResidencyManager()
    manager.adopt(tensor_value())
    manager.register_source(spec(), Source(fresh()))
    if has_reserve(manager):
        manager.reserve(PAGEABLE_HOST, 4, label="r").release()
    manager.snapshot()
    assert manager.trace() == ()


def test_failed_actions_are_not_traced() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    with pytest.raises(ResidencyOwnershipError):
        manager.drop(handle, PAGEABLE_HOST)
    with pytest.raises(ResidencyOwnershipError):
        manager.ensure(handle, PINNED_HOST)  # EXCLUSIVE, already materialised
    assert manager.trace() == ()


def test_capacity_keeps_the_last_reports() -> None:
    manager = ResidencyManager(trace_capacity=3)
    handle = manager.adopt(tensor_value())
    reports = [manager.ensure(handle, PAGEABLE_HOST) for _ in range(7)]
    trace = manager.trace()
    assert len(trace) == 3
    assert trace == tuple(reports[-3:])


def test_capacity_zero_disables_the_trace() -> None:
    manager = ResidencyManager(trace_capacity=0)
    handle = manager.adopt(tensor_value())
    report = manager.ensure(handle, PAGEABLE_HOST)
    assert report.no_op is True  # reports are still returned
    assert manager.trace() == ()


def test_default_capacity_is_4096() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    for _ in range(4100):
        manager.ensure(handle, PAGEABLE_HOST)
    trace = manager.trace()
    assert len(trace) == 4096


def test_clear_trace_empties_without_a_version_step() -> None:
    manager = ResidencyManager(trace_capacity=5)
    handle = manager.adopt(tensor_value())
    manager.ensure(handle, PAGEABLE_HOST)
    version = manager.state_version
    assert manager.clear_trace() is None
    assert manager.trace() == ()
    assert manager.state_version == version
    later = manager.ensure(handle, PAGEABLE_HOST)
    assert manager.trace() == (later,)


def test_trace_returns_a_copy() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    manager.ensure(handle, PAGEABLE_HOST)
    first = manager.trace()
    manager.ensure(handle, PAGEABLE_HOST)
    assert len(first) == 1
    assert len(manager.trace()) == 2


def test_trace_survives_close_and_can_be_cleared_after_close() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    report = manager.ensure(handle, PAGEABLE_HOST)
    manager.close()
    assert manager.trace() == (report,)
    manager.clear_trace()
    assert manager.trace() == ()
