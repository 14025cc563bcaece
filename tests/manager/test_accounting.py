"""Accounting: strict budgets, per-replica charges, peaks and the temporary charge
(docs/concepts/locations-and-budgets.md, docs/concepts/values.md#reconstruction).

`reserve()` is used minimally, only where a reserved amount is needed to observe the
admission rule `used + reserved + incoming <= budget`.
"""

from __future__ import annotations

import pytest
import torch

from fhelium.errors import ResidencyBudgetError
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST
from fhelium.residency.manager import ResidencyManager
from fhelium.values import ResidentTensor
from helpers.manager import (
    CUDA0,
    CUDA1,
    EXCLUSIVE,
    REPLICABLE,
    Source,
    assert_balanced,
    fresh,
    loc_snap,
    mat_locs,
    on,
    reserve,
    sim_factory,
    sim_fixture,  # noqa: F401
    spec,
    state_key,
    tensor_value,
    used,
    val_snap,
    view_value,
)

# --------------------------------------------------------------------------------------------
# The admission rule and the budget error
# --------------------------------------------------------------------------------------------


def test_budget_error_carries_the_location_name_and_all_amounts(sim: object) -> None:
    manager = ResidencyManager({CUDA1: 100})
    filler = manager.adopt(on(sim, CUDA1, tensor_value(10)))  # type: ignore[arg-type]  # 40
    handle = manager.adopt(tensor_value(16), replica_mode=REPLICABLE)  # 64 at pageable
    before = state_key(manager.snapshot())
    with pytest.raises(ResidencyBudgetError) as info:
        manager.ensure(handle, CUDA1)  # 40 + 64 > 100
    err = info.value
    assert err.location == "cuda:1"
    assert type(err.location) is str
    assert (err.budget_bytes, err.used_bytes, err.reserved_bytes, err.requested_bytes) == (
        100,
        40,
        0,
        64,
    )
    message = str(err)
    for fragment in ("budget_bytes=100", "used_bytes=40", "reserved_bytes=0", "requested_bytes=64"):
        assert fragment in message
    assert "cuda:1" in message
    assert state_key(manager.snapshot()) == before
    # Checked before copying (transitions.md#ensure-and-copy, step 5).
    assert sim.calls["copy_to_cuda"] == 0  # type: ignore[attr-defined]
    assert manager.trace() == ()
    assert mat_locs(manager.snapshot(), filler) == (CUDA1,)


def test_budget_error_counts_reservations(sim: object) -> None:
    manager = ResidencyManager({CUDA1: 100})
    manager.adopt(on(sim, CUDA1, tensor_value(10)))  # type: ignore[arg-type]  # 40
    reservation = reserve(manager, CUDA1, 30, "headroom")
    try:
        handle = manager.adopt(tensor_value(8), replica_mode=REPLICABLE)  # 32 at pageable
        before = state_key(manager.snapshot())
        with pytest.raises(ResidencyBudgetError) as info:
            manager.ensure(handle, CUDA1)  # 40 + 30 + 32 > 100
        err = info.value
        assert (err.budget_bytes, err.used_bytes, err.reserved_bytes, err.requested_bytes) == (
            100,
            40,
            30,
            32,
        )
        assert "reserved_bytes=30" in str(err)
        assert state_key(manager.snapshot()) == before
    finally:
        reservation.release()
    # With the reservation gone it fits exactly: 40 + 32 <= 100.
    manager.ensure(handle, CUDA1)
    assert used(manager.snapshot(), CUDA1) == 72


def test_admission_admits_equality_and_refuses_one_byte_more() -> None:
    manager = ResidencyManager({PAGEABLE_HOST: 48})
    manager.adopt(tensor_value(4))  # 16
    manager.adopt(tensor_value(4))  # 32
    with pytest.raises(ResidencyBudgetError) as info:
        manager.adopt(ResidentTensor(torch.zeros(17, dtype=torch.uint8)))  # 32 + 17 > 48
    assert (info.value.used_bytes, info.value.requested_bytes) == (32, 17)
    manager.adopt(ResidentTensor(torch.zeros(16, dtype=torch.uint8)))  # 32 + 16 == 48
    snap = manager.snapshot()
    assert loc_snap(snap, PAGEABLE_HOST).used_bytes == 48
    assert loc_snap(snap, PAGEABLE_HOST).remaining_budget_bytes == 0
    # A 0-byte request is always admitted, even with nothing remaining.
    manager.adopt(ResidentTensor(torch.empty(0)))
    assert len(manager.snapshot().values) == 4


def test_unbudgeted_locations_are_never_refused_but_fully_accounted(sim: object) -> None:
    manager = ResidencyManager({PAGEABLE_HOST: 1_000})
    big = manager.adopt(on(sim, CUDA0, tensor_value(10_000)))  # type: ignore[arg-type]
    snap = manager.snapshot()
    entry = loc_snap(snap, CUDA0)
    assert entry.budget_bytes is None
    assert entry.remaining_budget_bytes is None
    assert entry.used_bytes == 40_000
    assert entry.peak_used_bytes == entry.peak_charged_bytes == 40_000
    assert entry.value_count == 1
    assert mat_locs(snap, big) == (CUDA0,)


def test_reservations_reduce_remaining_budget_and_raise_peak_charged() -> None:
    manager = ResidencyManager({PAGEABLE_HOST: 100})
    manager.adopt(tensor_value(5))  # 20
    reservation = reserve(manager, PAGEABLE_HOST, 50, "work")
    try:
        snap = manager.snapshot()
        entry = loc_snap(snap, PAGEABLE_HOST)
        assert (entry.used_bytes, entry.reserved_bytes, entry.remaining_budget_bytes) == (
            20,
            50,
            30,
        )
        assert entry.reservation_count == 1
        assert entry.peak_used_bytes == 20
        assert entry.peak_charged_bytes == 70
        assert_balanced(snap)
        with pytest.raises(ResidencyBudgetError) as info:
            manager.adopt(tensor_value(8))  # 32 > 30
        assert info.value.reserved_bytes == 50
        manager.adopt(ResidentTensor(torch.zeros(30, dtype=torch.uint8)))
    finally:
        reservation.release()
    entry = loc_snap(manager.snapshot(), PAGEABLE_HOST)
    assert (entry.used_bytes, entry.reserved_bytes, entry.remaining_budget_bytes) == (50, 0, 50)
    assert entry.peak_charged_bytes == 100
    assert entry.peak_used_bytes == 50


def test_two_cuda_devices_have_isolated_books(sim: object) -> None:
    manager = ResidencyManager({CUDA0: 64, CUDA1: 64})
    a = manager.adopt(tensor_value(16), replica_mode=REPLICABLE)  # 64
    manager.ensure(a, CUDA0)
    manager.ensure(a, CUDA1)  # cuda:0 is full; cuda:1 is unaffected
    b = manager.adopt(tensor_value(1), replica_mode=REPLICABLE)
    with pytest.raises(ResidencyBudgetError) as info:
        manager.ensure(b, CUDA0)
    assert info.value.location == "cuda:0"
    with pytest.raises(ResidencyBudgetError) as info:
        manager.ensure(b, CUDA1)
    assert info.value.location == "cuda:1"
    manager.drop(a, CUDA0)
    manager.ensure(b, CUDA0)
    snap = manager.snapshot()
    assert used(snap, CUDA0) == 4
    assert used(snap, CUDA1) == 64
    assert loc_snap(snap, CUDA0).peak_used_bytes == 64
    assert loc_snap(snap, CUDA0).remaining_budget_bytes == 60
    assert loc_snap(snap, CUDA1).remaining_budget_bytes == 0
    assert_balanced(snap)


# --------------------------------------------------------------------------------------------
# Per-replica full charges
# --------------------------------------------------------------------------------------------


def test_every_replica_pays_the_full_spec_charge(sim: object) -> None:
    manager = ResidencyManager()
    value = view_value(4, backing=64)  # logical 16, storage 256 -> charge 256
    handle = manager.adopt(value, replica_mode=REPLICABLE)
    manager.ensure(handle, CUDA0)
    manager.ensure(handle, PINNED_HOST)
    snap = manager.snapshot()
    entry = val_snap(snap, handle)
    assert entry.spec.storage_nbytes == 256
    for mat in entry.materializations:
        assert mat.charged_nbytes == 256
        assert mat.logical_nbytes == 16
        assert mat.storage_nbytes <= 256
    pageable = entry.materializations[0]
    assert pageable.storage_nbytes == 256  # the adopted original keeps its whole allocation
    for loc in (PAGEABLE_HOST, CUDA0, PINNED_HOST):
        assert used(snap, loc) == 256
    assert_balanced(snap)


def test_a_copy_of_a_view_keeps_its_whole_storage_and_is_charged_the_spec_storage(
    sim: object,
) -> None:
    # Copies keep the storage layout: the view stays a view of a copy of its whole
    # allocation (docs/concepts/values.md#copies-keep-the-storage-layout).
    manager = ResidencyManager({CUDA0: 256})
    handle = manager.adopt(view_value(4, backing=64), replica_mode=REPLICABLE)
    manager.ensure(handle, CUDA0)
    (_, cuda) = val_snap(manager.snapshot(), handle).materializations
    assert cuda.storage_nbytes == 256  # actual unique storage of the copy
    assert cuda.charged_nbytes == 256
    assert loc_snap(manager.snapshot(), CUDA0).remaining_budget_bytes == 0


def test_source_value_below_the_storage_ceiling_is_charged_the_ceiling() -> None:
    manager = ResidencyManager({PAGEABLE_HOST: 100})
    handle = manager.register_source(spec(4, storage=100), Source(fresh(4)))
    manager.ensure(handle, PAGEABLE_HOST)
    entry = loc_snap(manager.snapshot(), PAGEABLE_HOST)
    assert entry.used_bytes == 100
    assert entry.remaining_budget_bytes == 0


# --------------------------------------------------------------------------------------------
# Peaks
# --------------------------------------------------------------------------------------------


def test_peaks_never_decrease(sim: object) -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    b = manager.adopt(tensor_value(8), replica_mode=REPLICABLE)
    manager.ensure(a, CUDA0)
    manager.ensure(b, CUDA0)
    manager.drop(a, CUDA0)
    manager.drop(b, CUDA0)
    entry = loc_snap(manager.snapshot(), CUDA0)
    assert entry.used_bytes == 0
    assert entry.peak_used_bytes == 48
    assert entry.peak_charged_bytes == 48
    manager.ensure(a, CUDA0)
    entry = loc_snap(manager.snapshot(), CUDA0)
    assert (entry.used_bytes, entry.peak_used_bytes, entry.peak_charged_bytes) == (16, 48, 48)


def test_exclusive_move_peaks_at_the_destination_only(sim: object) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4))
    manager.move(handle, CUDA0)
    manager.move(handle, CUDA1)
    manager.move(handle, CUDA0)
    snap = manager.snapshot()
    for loc in (PAGEABLE_HOST, CUDA0, CUDA1):
        assert loc_snap(snap, loc).peak_used_bytes == 16
    assert used(snap, CUDA0) == 16
    assert used(snap, CUDA1) == used(snap, PAGEABLE_HOST) == 0


# --------------------------------------------------------------------------------------------
# The temporary reconstruction charge (values.md#reconstruction)
# --------------------------------------------------------------------------------------------


def test_temporary_charge_shows_in_peak_charged_only(sim: object) -> None:
    manager = ResidencyManager()
    manager.adopt(tensor_value(2))  # 8 bytes already used at pageable
    handle = manager.register_source(spec(4, storage=24), Source(fresh(4)))
    version = manager.state_version
    manager.ensure(handle, CUDA0)
    assert manager.state_version == version + 2  # cuda:0 registered + install; no temp bump
    snap = manager.snapshot()
    pageable = loc_snap(snap, PAGEABLE_HOST)
    assert pageable.used_bytes == 8
    assert pageable.reserved_bytes == 0
    assert pageable.reservation_count == 0
    assert pageable.peak_used_bytes == 8
    assert pageable.peak_charged_bytes == 32  # 8 used + 24 temporary
    assert snap.reservations == ()
    cuda = loc_snap(snap, CUDA0)
    assert (cuda.used_bytes, cuda.peak_used_bytes, cuda.peak_charged_bytes) == (24, 24, 24)


def test_same_location_reconstruction_shares_one_charge() -> None:
    # Budget exactly one charge: the temporary charge is returned just before the install.
    manager = ResidencyManager({PAGEABLE_HOST: 24})
    handle = manager.register_source(spec(4, storage=24), Source(fresh(4)))
    manager.ensure(handle, PAGEABLE_HOST)
    entry = loc_snap(manager.snapshot(), PAGEABLE_HOST)
    assert (entry.used_bytes, entry.reserved_bytes) == (24, 0)
    assert entry.peak_used_bytes == 24
    assert entry.peak_charged_bytes == 24  # not 48


def test_temporary_charge_is_budget_checked_before_loading(sim: object) -> None:
    manager = ResidencyManager({PAGEABLE_HOST: 30})
    manager.adopt(tensor_value(2))  # 8
    source = Source(fresh(8))
    handle = manager.register_source(spec(8), source)  # 32 > 30 - 8
    before = state_key(manager.snapshot())
    with pytest.raises(ResidencyBudgetError) as info:
        manager.ensure(handle, CUDA0)  # the destination is unbudgeted
    err = info.value
    assert err.location == "pageable-host"
    assert (err.budget_bytes, err.used_bytes, err.reserved_bytes, err.requested_bytes) == (
        30,
        8,
        0,
        32,
    )
    assert source.calls == 0
    assert state_key(manager.snapshot()) == before
    assert loc_snap(manager.snapshot(), CUDA0) is None
    assert sim.calls["copy_to_cuda"] == 0  # type: ignore[attr-defined]


def test_temporary_charge_counts_against_reservations() -> None:
    manager = ResidencyManager({PAGEABLE_HOST: 40})
    source = Source(fresh(4))
    handle = manager.register_source(spec(4), source)  # 16
    reservation = reserve(manager, PAGEABLE_HOST, 25, "r")
    try:
        with pytest.raises(ResidencyBudgetError) as info:
            manager.ensure(handle, PAGEABLE_HOST)
        assert (info.value.reserved_bytes, info.value.requested_bytes) == (25, 16)
        assert source.calls == 0
    finally:
        reservation.release()
    manager.ensure(handle, PAGEABLE_HOST)
    assert source.calls == 1


def test_destination_budget_failure_after_loading_returns_the_temporary_charge(
    sim: object,
) -> None:
    manager = ResidencyManager({CUDA1: 10})
    source = Source(fresh(4))
    handle = manager.register_source(spec(4), source)  # 16 > 10 at cuda:1
    before = manager.snapshot()
    with pytest.raises(ResidencyBudgetError) as info:
        manager.ensure(handle, CUDA1)
    assert info.value.location == "cuda:1"
    assert info.value.requested_bytes == 16
    after = manager.snapshot()
    # The load happened (its charge was admitted at pageable), then the charge was returned.
    assert source.calls == 1
    assert state_key(after, ignore_peak_charged=(PAGEABLE_HOST,)) == state_key(
        before, ignore_peak_charged=(PAGEABLE_HOST,)
    )
    pageable = loc_snap(after, PAGEABLE_HOST)
    assert (pageable.used_bytes, pageable.reserved_bytes) == (0, 0)
    assert pageable.peak_charged_bytes == 16  # the admitted temporary charge
    assert sim.calls["copy_to_cuda"] == 0  # type: ignore[attr-defined]


def test_failed_load_leaves_only_the_raised_charged_peak() -> None:
    manager = ResidencyManager()

    def explode() -> None:
        raise KeyError("no data")

    handle = manager.register_source(spec(4, storage=20), Source(fresh(4), before_load=explode))
    with pytest.raises(KeyError):
        manager.ensure(handle, PAGEABLE_HOST)
    entry = loc_snap(manager.snapshot(), PAGEABLE_HOST)
    assert (entry.used_bytes, entry.reserved_bytes, entry.reservation_count) == (0, 0, 0)
    assert entry.peak_used_bytes == 0
    assert entry.peak_charged_bytes == 20  # the raised peak stays (locations-and-budgets.md#peaks)


def test_remaining_budget_is_none_when_unbudgeted() -> None:
    manager = ResidencyManager()
    manager.adopt(tensor_value())
    entry = loc_snap(manager.snapshot(), PAGEABLE_HOST)
    assert entry.budget_bytes is None
    assert entry.remaining_budget_bytes is None


def test_move_budget_is_checked_at_the_destination_before_copying(sim: object) -> None:
    manager = ResidencyManager({CUDA0: 15})
    handle = manager.adopt(tensor_value(4))
    before = state_key(manager.snapshot())
    with pytest.raises(ResidencyBudgetError) as info:
        manager.move(handle, CUDA0)
    assert info.value.location == "cuda:0"
    assert state_key(manager.snapshot()) == before
    assert sim.calls["copy_to_cuda"] == 0  # type: ignore[attr-defined]


def test_pinned_budget_applies_to_copies_into_pinned_memory(sim: object) -> None:
    manager = ResidencyManager({PINNED_HOST: 20})
    a = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    b = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    manager.ensure(a, PINNED_HOST)
    with pytest.raises(ResidencyBudgetError) as info:
        manager.ensure(b, PINNED_HOST)
    assert info.value.location == "pinned-host"
    assert sim.calls["copy_to_pinned"] == 1  # type: ignore[attr-defined]


def test_source_location_budget_and_destination_budget_both_apply(sim: object) -> None:
    manager = ResidencyManager({PINNED_HOST: 16, CUDA0: 16})
    handle = manager.register_source(
        spec(4, replica=EXCLUSIVE),
        Source(sim_factory(sim, PINNED_HOST, 4)),
        source_location=PINNED_HOST,
    )
    manager.ensure(handle, CUDA0)
    snap = manager.snapshot()
    assert used(snap, PINNED_HOST) == 0
    assert loc_snap(snap, PINNED_HOST).peak_charged_bytes == 16
    assert used(snap, CUDA0) == 16


# --------------------------------------------------------------------------------------------
# Byte counts are Python ints (conventions.md#byte-counts-and-timestamps). The core accounts
# them exactly up to 2**64 - 1 (16 EiB); anything larger is refused with a ValueError, never
# silently saturated.
# --------------------------------------------------------------------------------------------

LARGEST = 2**64 - 1
HUGE = 2**64 + 5


def test_a_budget_beyond_64_bits_is_refused_not_saturated() -> None:
    with pytest.raises(ValueError, match="2\\*\\*64 - 1"):
        ResidencyManager({PAGEABLE_HOST: HUGE})
    manager = ResidencyManager({PAGEABLE_HOST: LARGEST})
    manager.adopt(tensor_value(4))
    entry = loc_snap(manager.snapshot(), PAGEABLE_HOST)
    assert entry.budget_bytes == LARGEST
    assert entry.remaining_budget_bytes == LARGEST - 16


def test_a_charge_beyond_64_bits_is_refused_and_the_largest_is_charged_exactly() -> None:
    manager = ResidencyManager({PINNED_HOST: 10})
    before = manager.state_version
    with pytest.raises(ValueError, match="storage_nbytes"):
        manager.register_source(spec(4, storage=2**65), Source(fresh(4)))
    assert manager.state_version == before, "a refused registration changes nothing"
    refused = manager.register_source(
        spec(4, storage=LARGEST), Source(fresh(4)), source_location=PINNED_HOST
    )
    with pytest.raises(ResidencyBudgetError) as info:
        manager.ensure(refused, PINNED_HOST)
    assert info.value.requested_bytes == LARGEST
    # Unbudgeted: admitted and charged the exact spec storage.
    handle = manager.register_source(spec(4, storage=LARGEST), Source(fresh(4)))
    report = manager.ensure(handle, PAGEABLE_HOST)
    assert report.storage_nbytes == LARGEST
    snap = manager.snapshot()
    (mat,) = val_snap(snap, handle).materializations
    assert mat.charged_nbytes == LARGEST
    assert loc_snap(snap, PAGEABLE_HOST).used_bytes == LARGEST
    assert loc_snap(snap, PAGEABLE_HOST).peak_used_bytes == LARGEST
