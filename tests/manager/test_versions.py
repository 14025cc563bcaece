"""Exact `state_version` increments for simple sequences
(docs/concepts/transitions.md#state-version)."""

from __future__ import annotations

from typing import Any

import pytest

from fhelium.errors import (
    ResidencyBudgetError,
    ResidencyHandleError,
    ResidencyMaterializationError,
    ResidencyOwnershipError,
    ResidencyUnavailableError,
)
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST
from fhelium.residency.manager import ResidencyManager
from helpers.manager import (
    CUDA0,
    CUDA1,
    EXCLUSIVE,
    MUST_PRESERVE,
    REPLICABLE,
    Source,
    foreign_handle,
    fresh,
    on,
    reserve,
    sim_fixture,  # noqa: F401
    spec,
    tensor_value,
)


class Versions:
    """Asserts the version step of each operation."""

    def __init__(self, manager: ResidencyManager) -> None:
        self.manager = manager
        self.last = manager.state_version

    def step(self, expected: int) -> None:
        now = self.manager.state_version
        assert now - self.last == expected, f"expected +{expected}, got +{now - self.last}"
        # Reading the version (no CUDA leases) does not advance it.
        assert self.manager.state_version == now
        self.last = now


def test_version_starts_at_zero_and_budgets_do_not_count() -> None:
    assert ResidencyManager().state_version == 0
    assert ResidencyManager({PAGEABLE_HOST: 10, PINNED_HOST: 0}).state_version == 0


def test_adopt_steps() -> None:
    manager = ResidencyManager()
    v = Versions(manager)
    manager.adopt(tensor_value())
    v.step(2)  # new location + install
    manager.adopt(tensor_value())
    v.step(1)  # install only
    budgeted = ResidencyManager({PAGEABLE_HOST: 100})
    bv = Versions(budgeted)
    budgeted.adopt(tensor_value())
    bv.step(1)  # the budgeted location was registered at construction


def test_register_source_steps() -> None:
    manager = ResidencyManager()
    v = Versions(manager)
    manager.register_source(spec(), Source(fresh()))
    v.step(2)  # new location + record
    manager.register_source(spec(), Source(fresh()))
    v.step(1)
    manager.register_source(spec(), Source(fresh()), source_location=PINNED_HOST)
    v.step(2)


def test_ensure_move_drop_discard_steps(sim: Any) -> None:
    manager = ResidencyManager()
    v = Versions(manager)
    handle = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    v.step(2)
    manager.ensure(handle, CUDA0)
    v.step(2)  # cuda:0 registered + install
    manager.ensure(handle, CUDA0)
    v.step(0)  # no-op
    manager.ensure(handle, PINNED_HOST)
    v.step(2)
    manager.drop(handle, PINNED_HOST)
    v.step(1)
    manager.ensure(handle, PINNED_HOST)
    v.step(1)  # location already known
    manager.drop(handle, CUDA1)
    v.step(0)  # no-op; cuda:1 is not registered by it
    manager.move(handle, CUDA1)
    v.step(3)  # cuda:1 registered + install + removal of the source
    manager.move(handle, CUDA1)
    v.step(1)  # case A: removes the selected other replica only
    manager.move(handle, CUDA1, from_location=CUDA1)
    v.step(0)
    manager.discard(handle)
    v.step(3)  # two removals + the final mark


def test_exclusive_move_steps(sim: Any) -> None:
    manager = ResidencyManager()
    v = Versions(manager)
    handle = manager.adopt(on(sim, CUDA1, tensor_value()))
    v.step(2)
    manager.move(handle, CUDA1)
    v.step(0)
    manager.move(handle, PAGEABLE_HOST)
    v.step(3)
    manager.move(handle, CUDA1)
    v.step(2)  # both locations known: install + removal


def test_reconstruction_steps_have_no_temporary_bump(sim: Any) -> None:
    manager = ResidencyManager()
    v = Versions(manager)
    handle = manager.register_source(spec(replica=EXCLUSIVE), Source(fresh()))
    v.step(2)
    manager.ensure(handle, PAGEABLE_HOST)
    v.step(1)  # same location: one install
    manager.drop(handle, PAGEABLE_HOST)
    v.step(1)
    manager.ensure(handle, CUDA0)
    v.step(2)  # new location + install; the loaded temporary is never installed
    manager.discard(handle)
    v.step(2)
    other = manager.register_source(spec(), Source(fresh()))
    v.step(1)
    manager.discard(other)
    v.step(1)  # source-only discard


def test_failures_never_advance_the_version(sim: Any) -> None:
    manager = ResidencyManager({CUDA1: 4})
    adopted = manager.adopt(tensor_value())
    bad_source = manager.register_source(spec(), Source(lambda: tensor_value(9)))
    manager_value = tensor_value()
    manager.adopt(manager_value)
    v = Versions(manager)
    failures: list[tuple[type[BaseException], Any]] = [
        (ResidencyOwnershipError, lambda: manager.ensure(adopted, CUDA0)),
        (ResidencyOwnershipError, lambda: manager.drop(adopted, PAGEABLE_HOST)),
        (ResidencyOwnershipError, lambda: manager.adopt(manager_value)),
        (ResidencyBudgetError, lambda: manager.move(adopted, CUDA1)),
        (ResidencyUnavailableError, lambda: manager.move(adopted, CUDA0, from_location=CUDA0)),
        (ResidencyHandleError, lambda: manager.ensure(foreign_handle(), PAGEABLE_HOST)),
        (ResidencyMaterializationError, lambda: manager.ensure(bad_source, CUDA0)),
        (ResidencyMaterializationError, lambda: manager.adopt(tensor_value(), at=PINNED_HOST)),
        (
            ValueError,
            lambda: manager.register_source(spec(recoverability=MUST_PRESERVE), Source(fresh())),
        ),
        (TypeError, lambda: manager.ensure(adopted, PAGEABLE_HOST, stream=object())),
    ]
    for expected, call in failures:
        with pytest.raises(expected):
            call()
        v.step(0)
    assert manager.locations == (CUDA1, PAGEABLE_HOST)


def test_observations_do_not_advance_the_version() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    v = Versions(manager)
    manager.snapshot()
    _ = manager.locations
    _ = manager.manager_id
    manager.trace()
    manager.clear_trace()
    manager.ensure(handle, PAGEABLE_HOST)  # no-op
    manager.drop(handle, PINNED_HOST)  # no-op
    manager.move(handle, PAGEABLE_HOST)  # no-op
    v.step(0)
    assert manager.snapshot().state_version == manager.state_version


def test_snapshot_version_matches_the_property() -> None:
    manager = ResidencyManager()
    for i in range(3):
        manager.adopt(tensor_value(i + 1))
        assert manager.snapshot().state_version == manager.state_version


def test_reservation_steps() -> None:
    manager = ResidencyManager()
    v = Versions(manager)
    reservation = reserve(manager, PINNED_HOST, 10, "r")
    v.step(2)  # new location + reservation
    reservation.release()
    v.step(1)
    other = reserve(manager, PINNED_HOST, 0, "zero")
    v.step(1)
    other.release()
    v.step(1)
