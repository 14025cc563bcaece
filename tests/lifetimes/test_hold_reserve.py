"""Holds, reservations and what lifetimes protect (docs/concepts/lifetimes.md)."""

# ruff: noqa: PT011

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fhelium.errors import (
    ResidencyBudgetError,
    ResidencyClosedError,
    ResidencyInUseError,
    ResidencyLifetimeClosedError,
    ResidencyOwnershipError,
)
from fhelium.residency.lease import ResidencyHold, ResidencyReservation
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, cuda_location
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.snapshot import ResidencyReservationSnapshot
from helpers.lifetimes import (
    LoggingRuntime,
    cuda_stream,
    mat,
    replicated,
    rt_fixture,  # noqa: F401
)
from helpers.manager import (
    CUDA0,
    CUDA1,
    EXCLUSIVE,
    assert_balanced,
    loc_snap,
    mat_locs,
    state_key,
    tensor_value,
    val_snap,
)

# --------------------------------------------------------------------------------------------
# Holds
# --------------------------------------------------------------------------------------------


def test_hold_properties_tokens_versions_and_idempotent_release(rt: Any) -> None:
    manager = ResidencyManager()
    a, b = replicated(manager), replicated(manager)
    version = manager.state_version
    hold = manager.hold([a, b], at=PAGEABLE_HOST)
    assert isinstance(hold, ResidencyHold)
    assert hold.active is True
    assert hold.handles == (a, b)
    assert hold.location == PAGEABLE_HOST
    assert manager.state_version == version + 1
    snap = manager.snapshot()
    assert mat(snap, a, PAGEABLE_HOST).hold_count == 1
    assert mat(snap, a, PAGEABLE_HOST).use_count == 0
    assert loc_snap(snap, PAGEABLE_HOST).hold_count == 2
    assert hold.release() is None
    assert hold.active is False
    assert manager.state_version == version + 2
    hold.release()
    hold.close()
    assert manager.state_version == version + 2
    snap = manager.snapshot()
    assert loc_snap(snap, PAGEABLE_HOST).hold_count == 0


def test_hold_context_manager_returns_the_hold(rt: Any) -> None:
    manager = ResidencyManager()
    handle = replicated(manager)
    hold = manager.hold([handle], at=PAGEABLE_HOST)
    version = manager.state_version
    with pytest.raises(LookupError), hold as entered:  # noqa: PT012
        assert entered is hold
        with pytest.raises(RuntimeError) as info:
            hold.__enter__()
        assert not isinstance(info.value, ResidencyLifetimeClosedError)
        assert hold.active
        raise LookupError("body")
    assert hold.active is False
    assert manager.state_version == version + 1
    assert mat(manager.snapshot(), handle, PAGEABLE_HOST).hold_count == 0
    with pytest.raises(ResidencyLifetimeClosedError):
        hold.__enter__()


def test_released_hold_cannot_be_entered(rt: Any) -> None:
    manager = ResidencyManager()
    hold = manager.hold([replicated(manager)], at=PAGEABLE_HOST)
    hold.release()
    with pytest.raises(ResidencyLifetimeClosedError):
        hold.__enter__()


def test_with_hold_directly(rt: Any) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    with manager.hold([handle], at=CUDA0) as hold:
        assert isinstance(hold, ResidencyHold)
        with pytest.raises(ResidencyInUseError):
            manager.drop(handle, CUDA0)
    manager.drop(handle, CUDA0)


# --------------------------------------------------------------------------------------------
# Protection (lifetimes.md#protection)
# --------------------------------------------------------------------------------------------


def test_protected_drop_names_handle_location_and_counts(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    s0 = cuda_stream(rt)
    leases = [manager.acquire([handle], at=CUDA0, consumer_stream=s0) for _ in range(3)]
    leases[0].release()  # pending
    hold = manager.hold([handle], at=CUDA0)
    before = state_key(manager.snapshot())
    with pytest.raises(ResidencyInUseError) as info:
        manager.drop(handle, CUDA0)
    message = str(info.value)
    assert handle.handle_id in message
    assert "cuda:0" in message
    assert "active_reads=2" in message
    assert "holds=1" in message
    assert "pending_events=1" in message
    assert state_key(manager.snapshot()) == before
    for lifetime in (*leases[1:], hold):
        lifetime.release()
    with pytest.raises(ResidencyInUseError, match="pending_events="):
        manager.drop(handle, CUDA0)
    rt.complete_events()
    manager.drop(handle, CUDA0)
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST,)


@pytest.mark.parametrize("kind", ["lease", "hold"])
def test_protection_blocks_every_removal(rt: Any, kind: str) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, PINNED_HOST, CUDA0)
    lifetime = (
        manager.acquire([handle], at=PAGEABLE_HOST)
        if kind == "lease"
        else manager.hold([handle], at=PAGEABLE_HOST)
    )
    before = state_key(manager.snapshot())
    copies = len(rt.copies)
    with pytest.raises(ResidencyInUseError):
        manager.drop(handle, PAGEABLE_HOST)
    with pytest.raises(ResidencyInUseError):
        manager.move(handle, CUDA1, from_location=PAGEABLE_HOST)
    with pytest.raises(ResidencyInUseError):
        manager.move(handle, CUDA1)  # the canonical source is the protected pageable copy
    with pytest.raises(ResidencyInUseError):
        manager.move(handle, CUDA0)  # case A: removes the (protected) selected source
    with pytest.raises(ResidencyInUseError):
        manager.discard(handle)
    assert len(rt.copies) == copies  # protection is checked before any copy
    assert state_key(manager.snapshot()) == before
    # Unprotected replicas of the same value can still be removed and added.
    manager.drop(handle, PINNED_HOST)
    manager.ensure(handle, CUDA1)
    manager.move(handle, PINNED_HOST, from_location=CUDA1)
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST, CUDA0, PINNED_HOST)
    lifetime.release()
    manager.discard(handle)
    assert val_snap(manager.snapshot(), handle).discarded


def test_protection_of_an_exclusive_value_blocks_its_move(rt: Any) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(), replica_mode=EXCLUSIVE)
    lease = manager.acquire([handle], at=PAGEABLE_HOST)
    copies = len(rt.copies)
    with pytest.raises(ResidencyInUseError):
        manager.move(handle, CUDA0)
    assert len(rt.copies) == copies
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST,)
    assert CUDA0 not in manager.locations
    lease.release()
    manager.move(handle, CUDA0)
    assert mat_locs(manager.snapshot(), handle) == (CUDA0,)


def test_protection_is_checked_before_the_last_copy_rule(rt: Any) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    hold = manager.hold([handle], at=PAGEABLE_HOST)
    with pytest.raises(ResidencyInUseError):
        manager.drop(handle, PAGEABLE_HOST)
    hold.release()
    with pytest.raises(ResidencyOwnershipError):
        manager.drop(handle, PAGEABLE_HOST)


def test_protection_does_not_block_ensure_or_other_handles(rt: Any) -> None:
    manager = ResidencyManager()
    a, b = replicated(manager), replicated(manager, CUDA0)
    lease = manager.acquire([a], at=PAGEABLE_HOST)
    hold = manager.hold([a], at=PAGEABLE_HOST)
    # adding replicas of the protected value
    manager.ensure(a, CUDA0)
    manager.copy(a, PINNED_HOST)
    # the same value can be acquired and held again
    again = manager.acquire([a], at=PAGEABLE_HOST)
    held = manager.hold([a, b], at=PAGEABLE_HOST)
    other = manager.acquire([b], at=CUDA0, consumer_stream=cuda_stream(rt))
    snap = manager.snapshot()
    assert mat(snap, a, PAGEABLE_HOST).use_count == 2
    assert mat(snap, a, PAGEABLE_HOST).hold_count == 2
    assert mat(snap, b, CUDA0).use_count == 1
    # replicas without tokens are removable
    manager.drop(a, CUDA0)
    manager.drop(a, PINNED_HOST)
    for lifetime in (lease, hold, again, held):
        lifetime.release()
    other.release(wait=True)
    manager.discard(a)
    manager.discard(b)
    assert_balanced(manager.snapshot())


# --------------------------------------------------------------------------------------------
# Reservations
# --------------------------------------------------------------------------------------------


def test_reservation_attributes_and_accounting(rt: Any) -> None:
    manager = ResidencyManager({PAGEABLE_HOST: 1000})
    replicated(manager)  # 16 bytes used
    version = manager.state_version
    reservation = manager.reserve(PAGEABLE_HOST, np.int64(100), label="workspace")
    assert isinstance(reservation, ResidencyReservation)
    assert reservation.location == PAGEABLE_HOST
    assert reservation.nbytes == 100
    assert type(reservation.nbytes) is int
    assert reservation.label == "workspace"
    assert reservation.active is True
    assert manager.state_version == version + 1
    snap = manager.snapshot()
    entry = loc_snap(snap, PAGEABLE_HOST)
    assert entry.reserved_bytes == 100
    assert entry.reservation_count == 1
    assert entry.used_bytes == 16
    assert entry.remaining_budget_bytes == 1000 - 16 - 100
    assert entry.peak_charged_bytes == 116
    assert snap.reservations == (ResidencyReservationSnapshot(PAGEABLE_HOST, 100, "workspace"),)
    assert_balanced(snap)
    assert reservation.release() is None
    assert reservation.active is False
    assert manager.state_version == version + 2
    reservation.release()
    reservation.close()
    assert manager.state_version == version + 2
    snap = manager.snapshot()
    entry = loc_snap(snap, PAGEABLE_HOST)
    assert (entry.reserved_bytes, entry.reservation_count) == (0, 0)
    assert entry.remaining_budget_bytes == 1000 - 16
    assert entry.peak_charged_bytes == 116  # peaks are never lowered
    assert snap.reservations == ()


class Index:
    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_reserve_nbytes_is_an_index_int(rt: Any) -> None:
    manager = ResidencyManager()
    reservation = manager.reserve(PAGEABLE_HOST, Index(12), label="index")
    assert reservation.nbytes == 12
    assert type(reservation.nbytes) is int
    reservation.release()


@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
def test_reserve_argument_checks_come_before_the_gate(rt: Any, closed: bool) -> None:
    manager = ResidencyManager()
    if closed:
        manager.close()
    for bad in (True, False, 1.0, "8", None, [8]):
        with pytest.raises(TypeError):
            manager.reserve(PAGEABLE_HOST, bad, label="x")
    with pytest.raises(ValueError):
        manager.reserve(PAGEABLE_HOST, -1, label="x")
    with pytest.raises(ValueError):
        manager.reserve(PAGEABLE_HOST, np.int64(-5), label="x")
    for bad_label in (None, 5, b"x", ["x"]):
        with pytest.raises(TypeError):
            manager.reserve(PAGEABLE_HOST, 8, label=bad_label)
    for blank in ("", "  ", "\t\n"):
        with pytest.raises(ValueError):
            manager.reserve(PAGEABLE_HOST, 8, label=blank)
    # nbytes is checked before the label
    with pytest.raises(ValueError):
        manager.reserve(PAGEABLE_HOST, -1, label=5)
    with pytest.raises(TypeError):
        manager.reserve(PAGEABLE_HOST, "x", label="")
    # the label is keyword-only
    with pytest.raises(TypeError):
        manager.reserve(PAGEABLE_HOST, 8, "x")  # type: ignore[misc]
    if closed:
        with pytest.raises(ResidencyClosedError):
            manager.reserve(PAGEABLE_HOST, 8, label="x")
        # the location is validated after the gate
        with pytest.raises(ResidencyClosedError):
            manager.reserve("nowhere", 8, label="x")
    else:
        assert manager.snapshot().reservations == ()


def test_reserve_validates_the_location(rt: Any) -> None:
    manager = ResidencyManager()
    version = manager.state_version
    with pytest.raises(TypeError):
        manager.reserve("pageable-host", 8, label="x")
    with pytest.raises(ValueError):
        manager.reserve(cuda_location("cuda:7"), 8, label="x")
    assert manager.state_version == version
    assert manager.locations == ()


def test_reserve_registers_a_new_location(rt: Any) -> None:
    manager = ResidencyManager()
    replicated(manager)
    version = manager.state_version
    reservation = manager.reserve(CUDA1, 64, label="gpu scratch")
    assert manager.state_version == version + 2  # new location +1, reservation +1
    assert manager.locations == (PAGEABLE_HOST, CUDA1)
    entry = loc_snap(manager.snapshot(), CUDA1)
    assert (entry.reserved_bytes, entry.reservation_count, entry.used_bytes) == (64, 1, 0)
    reservation.release()
    assert manager.state_version == version + 3
    assert manager.locations == (PAGEABLE_HOST, CUDA1)  # locations are kept


def test_reserve_budget_error(rt: Any) -> None:
    manager = ResidencyManager({CUDA0: 100})
    handle = replicated(manager, CUDA0)  # 16 bytes at cuda:0
    first = manager.reserve(CUDA0, 80, label="a")
    version = manager.state_version
    before = state_key(manager.snapshot())
    with pytest.raises(ResidencyBudgetError) as info:
        manager.reserve(CUDA0, 5, label="b")
    error = info.value
    assert error.location == "cuda:0"
    assert error.budget_bytes == 100
    assert error.used_bytes == 16
    assert error.reserved_bytes == 80
    assert error.requested_bytes == 5
    assert state_key(manager.snapshot()) == before
    assert manager.state_version == version
    # equality is admitted, and 0 bytes always are
    exact = manager.reserve(CUDA0, 4, label="exact")
    zero = manager.reserve(CUDA0, 0, label="zero")
    entry = loc_snap(manager.snapshot(), CUDA0)
    assert entry.remaining_budget_bytes == 0
    assert entry.peak_charged_bytes == 100
    # reservations take headroom from direct operations
    other = replicated(manager)
    with pytest.raises(ResidencyBudgetError) as info:
        manager.ensure(other, CUDA0)
    assert info.value.reserved_bytes == 84
    exact.release()
    with pytest.raises(ResidencyBudgetError):
        manager.ensure(other, CUDA0)
    first.release()
    manager.ensure(other, CUDA0)
    zero.release()
    snap = manager.snapshot()
    assert loc_snap(snap, CUDA0).used_bytes == 32
    assert loc_snap(snap, CUDA0).reserved_bytes == 0
    assert mat_locs(snap, handle) == (PAGEABLE_HOST, CUDA0)
    assert_balanced(snap)


def test_zero_byte_reservations_are_counted_and_listed(rt: Any) -> None:
    manager = ResidencyManager({PINNED_HOST: 0})
    version = manager.state_version
    zero = manager.reserve(PINNED_HOST, 0, label="zero")
    assert zero.nbytes == 0
    assert manager.state_version == version + 1
    snap = manager.snapshot()
    entry = loc_snap(snap, PINNED_HOST)
    assert (entry.reserved_bytes, entry.reservation_count, entry.remaining_budget_bytes) == (
        0,
        1,
        0,
    )
    assert snap.reservations == (ResidencyReservationSnapshot(PINNED_HOST, 0, "zero"),)
    zero.release()
    assert manager.state_version == version + 2
    assert loc_snap(manager.snapshot(), PINNED_HOST).reservation_count == 0


def test_snapshot_lists_reservations_in_creation_order(rt: Any) -> None:
    manager = ResidencyManager()
    first = manager.reserve(CUDA0, 10, label="first")
    second = manager.reserve(PAGEABLE_HOST, 20, label="second")
    third = manager.reserve(CUDA0, 30, label="third")
    fourth = manager.reserve(PAGEABLE_HOST, 40, label="fourth")
    snap = manager.snapshot()
    assert [(r.location, r.nbytes, r.label) for r in snap.reservations] == [
        (CUDA0, 10, "first"),
        (PAGEABLE_HOST, 20, "second"),
        (CUDA0, 30, "third"),
        (PAGEABLE_HOST, 40, "fourth"),
    ]
    assert loc_snap(snap, CUDA0).reserved_bytes == 40
    assert loc_snap(snap, CUDA0).reservation_count == 2
    assert loc_snap(snap, CUDA0).peak_charged_bytes == 40
    assert loc_snap(snap, PAGEABLE_HOST).reservation_count == 2
    assert_balanced(snap)
    second.release()
    fifth = manager.reserve(PAGEABLE_HOST, 50, label="fifth")
    assert [r.label for r in manager.snapshot().reservations] == [
        "first",
        "third",
        "fourth",
        "fifth",
    ]
    # duplicate labels are separate records
    dup = manager.reserve(CUDA0, 1, label="first")
    assert [r.label for r in manager.snapshot().reservations].count("first") == 2
    for reservation in (first, third, fourth, fifth, dup):
        reservation.release()
    snap = manager.snapshot()
    assert snap.reservations == ()
    assert loc_snap(snap, CUDA0).peak_charged_bytes == 41
    assert loc_snap(snap, PAGEABLE_HOST).peak_charged_bytes == 90


def test_reservation_context_manager_returns_itself(rt: Any) -> None:
    manager = ResidencyManager()
    reservation = manager.reserve(PAGEABLE_HOST, 32, label="ctx")
    with reservation as entered:
        assert entered is reservation
        with pytest.raises(RuntimeError) as info:
            reservation.__enter__()
        assert not isinstance(info.value, ResidencyLifetimeClosedError)
        assert loc_snap(manager.snapshot(), PAGEABLE_HOST).reserved_bytes == 32
    assert reservation.active is False
    assert loc_snap(manager.snapshot(), PAGEABLE_HOST).reserved_bytes == 0
    with pytest.raises(ResidencyLifetimeClosedError):
        reservation.__enter__()
    with manager.reserve(PAGEABLE_HOST, 8, label="direct") as direct:
        assert isinstance(direct, ResidencyReservation)
        assert direct.active
    assert not direct.active
    assert manager.snapshot().reservations == ()
