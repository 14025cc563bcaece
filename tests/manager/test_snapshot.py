"""Snapshots (docs/concepts/snapshots.md) including immutability and concurrent consistency."""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any

import pytest
import torch

from fhelium.errors import ResidencyReentrancyError
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.snapshot import (
    MaterializationSnapshot,
    ResidencyLocationSnapshot,
    ResidencyReservationSnapshot,
    ResidencySnapshot,
    ResidencyValueSnapshot,
)
from helpers.manager import (
    CUDA0,
    CUDA1,
    EXCLUSIVE,
    REPLICABLE,
    Source,
    assert_balanced,
    fresh,
    has_reserve,
    loc_snap,
    mat_locs,
    on,
    reserve,
    sim_fixture,  # noqa: F401
    simulated,
    spec,
    state_key,
    tensor_value,
    val_snap,
    view_value,
)


def test_snapshot_record_types_and_basic_fields(sim: Any) -> None:
    manager = ResidencyManager({CUDA1: 500})
    t0 = time.time_ns()
    adopted = manager.adopt(view_value(4, backing=16), replica_mode=REPLICABLE)
    sourced = manager.register_source(spec(2, storage=12), Source(fresh(2)))
    manager.ensure(adopted, CUDA1)
    manager.ensure(sourced, PAGEABLE_HOST)
    snap = manager.snapshot()
    t1 = time.time_ns()
    assert isinstance(snap, ResidencySnapshot)
    assert snap.manager_id == manager.manager_id
    assert snap.state_version == manager.state_version
    assert t0 <= snap.captured_at_ns <= t1
    assert all(isinstance(v, ResidencyValueSnapshot) for v in snap.values)
    assert all(isinstance(e, ResidencyLocationSnapshot) for e in snap.locations)
    assert all(isinstance(r, ResidencyReservationSnapshot) for r in snap.reservations)
    assert isinstance(snap.values, tuple)
    assert isinstance(snap.locations, tuple)
    assert isinstance(snap.reservations, tuple)

    assert [v.handle for v in snap.values] == [adopted, sourced]
    assert [e.location for e in snap.locations] == [CUDA1, PAGEABLE_HOST]
    assert snap.reservations == ()

    a = val_snap(snap, adopted)
    assert a.has_source is False
    assert a.source_location is None
    assert a.discarded is False
    pageable_mat, cuda_mat = a.materializations
    assert all(isinstance(m, MaterializationSnapshot) for m in a.materializations)
    assert (pageable_mat.location, pageable_mat.storage_nbytes) == (PAGEABLE_HOST, 64)
    assert (cuda_mat.location, cuda_mat.charged_nbytes, cuda_mat.logical_nbytes) == (
        CUDA1,
        64,
        16,
    )
    s = val_snap(snap, sourced)
    assert s.has_source is True
    assert s.source_location == PAGEABLE_HOST
    (mat,) = s.materializations
    assert (mat.logical_nbytes, mat.storage_nbytes, mat.charged_nbytes) == (8, 8, 12)

    cuda1 = loc_snap(snap, CUDA1)
    assert (cuda1.budget_bytes, cuda1.used_bytes, cuda1.remaining_budget_bytes) == (
        500,
        64,
        436,
    )
    assert cuda1.value_count == 1
    pageable = loc_snap(snap, PAGEABLE_HOST)
    assert (pageable.used_bytes, pageable.value_count) == (76, 2)
    for entry in snap.locations:
        assert (entry.use_count, entry.hold_count, entry.pending_event_count) == (0, 0, 0)
    assert_balanced(snap)


def test_reservations_are_listed_in_creation_order() -> None:
    manager = ResidencyManager()
    first = reserve(manager, PINNED_HOST, 1, "first")
    second = reserve(manager, PAGEABLE_HOST, 2, "second")
    third = reserve(manager, PINNED_HOST, 3, "third")
    try:
        snap = manager.snapshot()
        res = snap.reservations[0]
        assert (res.location, res.nbytes, res.label) == (PINNED_HOST, 1, "first")
        pinned = loc_snap(snap, PINNED_HOST)
        assert (pinned.used_bytes, pinned.reserved_bytes, pinned.reservation_count) == (0, 4, 2)
        assert pinned.peak_charged_bytes == 4
        assert_balanced(snap)
        labels = [r.label for r in manager.snapshot().reservations]
        assert labels == ["first", "second", "third"]
        second.release()
        labels = [r.label for r in manager.snapshot().reservations]
        assert labels == ["first", "third"]
    finally:
        first.release()
        third.release()


def test_materialisations_are_listed_in_install_order(sim: Any) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(on(sim, CUDA1, tensor_value()), replica_mode=REPLICABLE)
    manager.ensure(handle, PAGEABLE_HOST)
    manager.ensure(handle, CUDA0)
    assert mat_locs(manager.snapshot(), handle) == (CUDA1, PAGEABLE_HOST, CUDA0)
    manager.drop(handle, CUDA1)
    manager.ensure(handle, CUDA1)  # a re-install appears at the end
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST, CUDA0, CUDA1)


def test_discarded_values_remain_listed() -> None:
    manager = ResidencyManager()
    a = manager.adopt(tensor_value())
    b = manager.adopt(tensor_value())
    manager.discard(a)
    snap = manager.snapshot()
    assert [v.handle for v in snap.values] == [a, b]
    entry = val_snap(snap, a)
    assert entry.discarded is True
    assert entry.materializations == ()
    assert entry.has_source is False
    assert entry.source_location is None
    assert entry.spec.recoverability.value == "must-preserve"


def test_budgeted_locations_appear_even_when_unused() -> None:
    manager = ResidencyManager({PINNED_HOST: 3})
    manager.adopt(tensor_value())
    snap = manager.snapshot()
    assert [e.location for e in snap.locations] == [PINNED_HOST, PAGEABLE_HOST]
    pinned = loc_snap(snap, PINNED_HOST)
    assert (pinned.budget_bytes, pinned.used_bytes, pinned.remaining_budget_bytes) == (3, 0, 3)


def test_a_snapshot_is_not_affected_by_later_mutations(sim: Any) -> None:
    manager = ResidencyManager({CUDA0: 100})
    a = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    b = manager.register_source(spec(2), Source(fresh(2)))
    early = manager.snapshot()  # entries not looked at yet
    manager.ensure(a, CUDA0)
    manager.ensure(b, CUDA1)
    manager.drop(a, PAGEABLE_HOST)
    manager.discard(b)
    c = manager.adopt(tensor_value(3))
    if has_reserve(manager):
        manager.reserve(CUDA0, 5, label="late").release()
    # Only now are the early snapshot's entries read.
    assert early.state_version == 3
    assert [v.handle for v in early.values] == [a, b]
    assert mat_locs(early, a) == (PAGEABLE_HOST,)
    assert val_snap(early, b).discarded is False
    assert val_snap(early, b).has_source is True
    assert [e.location for e in early.locations] == [CUDA0, PAGEABLE_HOST]
    assert loc_snap(early, CUDA0).used_bytes == 0
    assert loc_snap(early, CUDA0).peak_used_bytes == 0
    assert loc_snap(early, PAGEABLE_HOST).used_bytes == 16
    assert early.reservations == ()
    assert_balanced(early)
    late = manager.snapshot()
    assert c in [v.handle for v in late.values]
    assert state_key(late) != state_key(early)


def test_a_read_snapshot_stays_equal_to_itself_after_mutations() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    snap = manager.snapshot()
    key = state_key(snap)
    manager.discard(handle)
    manager.adopt(tensor_value())
    assert state_key(snap) == key


def test_two_snapshots_without_mutation_describe_the_same_state(sim: Any) -> None:
    manager = ResidencyManager({PINNED_HOST: 50})
    handle = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    manager.ensure(handle, CUDA0)
    first = manager.snapshot()
    second = manager.snapshot()
    assert state_key(first) == state_key(second)
    assert second.captured_at_ns >= first.captured_at_ns


def test_snapshot_equality_and_hash_follow_the_record_rules() -> None:
    manager = ResidencyManager()
    manager.adopt(tensor_value())
    snap = manager.snapshot()
    plain = ResidencySnapshot(
        snap.manager_id,
        snap.state_version,
        snap.values,
        snap.locations,
        snap.reservations,
        snap.captured_at_ns,
    )
    assert snap == plain
    assert plain == snap
    assert hash(snap) == hash(plain)
    assert pickle.loads(pickle.dumps(snap)) == plain


def test_snapshot_is_a_constructible_frozen_record() -> None:
    """Section 0: fields are set at construction, positionally or by keyword, so the
    dataclass tools that rebuild a record work on the snapshot `snapshot()` returns."""
    import dataclasses

    manager = ResidencyManager()
    manager.adopt(tensor_value())
    snap = manager.snapshot()
    fields = (
        snap.manager_id,
        snap.state_version,
        snap.values,
        snap.locations,
        snap.reservations,
        snap.captured_at_ns,
    )
    names = [f.name for f in dataclasses.fields(snap)]
    assert names == [
        "manager_id",
        "state_version",
        "values",
        "locations",
        "reservations",
        "captured_at_ns",
    ]
    assert type(snap)(*fields) == snap
    assert type(snap)(**dict(zip(names, fields, strict=True))) == snap
    replaced = dataclasses.replace(snap, captured_at_ns=0)
    assert replaced.captured_at_ns == 0
    assert replaced.values == snap.values
    assert isinstance(replaced, ResidencySnapshot)


def test_snapshot_is_frozen() -> None:
    import dataclasses

    manager = ResidencyManager()
    manager.adopt(tensor_value())
    snap = manager.snapshot()
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.state_version = 99  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.values = ()  # type: ignore[misc]
    assert len(snap.values) == 1


def test_default_runtime_allocator_fields_are_none() -> None:
    manager = ResidencyManager({PAGEABLE_HOST: 10})
    for entry in manager.snapshot().locations:
        assert entry.allocator_allocated_bytes is None
        assert entry.allocator_reserved_bytes is None


# --------------------------------------------------------------------------------------------
# Concurrency: balanced books under concurrent mutation
# --------------------------------------------------------------------------------------------


def test_concurrent_snapshots_always_see_balanced_books() -> None:
    with simulated() as runtime:
        manager = ResidencyManager({CUDA0: 10_000})
        replicated = [manager.adopt(tensor_value(4 + i), replica_mode=REPLICABLE) for i in range(3)]
        exclusive = manager.adopt(tensor_value(6))
        sourced = manager.register_source(spec(5, replica=EXCLUSIVE), Source(fresh(5)))
        stop = threading.Event()
        errors: list[BaseException] = []
        snapshots: list[Any] = []
        mutations = [0]

        def mutate_replicas() -> None:
            locations = (CUDA0, CUDA1, PINNED_HOST)
            i = 0
            while not stop.is_set():
                handle = replicated[i % len(replicated)]
                loc = locations[i % len(locations)]
                try:
                    manager.ensure(handle, loc)
                    manager.drop(handle, loc)
                    mutations[0] += 2
                except ResidencyReentrancyError:
                    pass
                except BaseException as exc:
                    errors.append(exc)
                    return
                i += 1

        def mutate_moves() -> None:
            locations = (CUDA1, PAGEABLE_HOST, CUDA0, PINNED_HOST)
            i = 0
            while not stop.is_set():
                try:
                    manager.move(exclusive, locations[i % len(locations)])
                    manager.move(sourced, locations[(i + 1) % len(locations)])
                    if i % 3 == 0:
                        manager.drop(sourced, locations[(i + 1) % len(locations)])
                    mutations[0] += 2
                except ResidencyReentrancyError:
                    pass
                except BaseException as exc:
                    errors.append(exc)
                    return
                i += 1

        def observe() -> None:
            last_version = -1
            while not stop.is_set():
                try:
                    snap = manager.snapshot()
                except ResidencyReentrancyError:
                    continue
                try:
                    assert snap.state_version >= last_version
                    last_version = snap.state_version
                    assert_balanced(snap)
                    for value in snap.values:
                        if value.spec.replica_mode is EXCLUSIVE:
                            assert len(value.materializations) <= 1
                except BaseException as exc:
                    errors.append(exc)
                    return
                snapshots.append(snap)

        threads = [
            threading.Thread(target=mutate_replicas, daemon=True),
            threading.Thread(target=mutate_moves, daemon=True),
            threading.Thread(target=observe, daemon=True),
            threading.Thread(target=observe, daemon=True),
        ]
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        stop.set()
        for thread in threads:
            thread.join(10)
        assert not any(t.is_alive() for t in threads), "a thread hung"
        if errors:
            raise errors[0]
        assert mutations[0] > 20
        assert len(snapshots) > 20
        # The books also balance at rest.
        final = manager.snapshot()
        assert_balanced(final)
        # Snapshots taken during the run are still internally consistent when read late.
        for snap in snapshots[:: max(1, len(snapshots) // 50)]:
            assert_balanced(snap)
        assert runtime.calls["synchronize_device"] == 0


def test_allocator_readings_are_taken_at_capture_time() -> None:
    with simulated() as runtime:
        manager = ResidencyManager({CUDA0: 1_000})
        handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
        early = manager.snapshot()  # entries not looked at yet
        manager.ensure(handle, CUDA0)
        assert runtime.memory_allocated(torch.device("cuda", 0)) == 16
        late = manager.snapshot()
        assert loc_snap(early, CUDA0).allocator_allocated_bytes == 0
        assert loc_snap(early, CUDA0).allocator_reserved_bytes == 0
        assert loc_snap(late, CUDA0).allocator_allocated_bytes == 16


def test_snapshot_capture_cost_does_not_grow_with_the_entries() -> None:
    """Capture is O(1); the entries are built when first read (docs/architecture.md, "State,
    versions and snapshots"). Compared relatively, so a slow machine does not matter."""
    manager = ResidencyManager()
    for _ in range(3_000):
        manager.register_source(spec(), Source(fresh()))

    def best(fn: Any) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    capture_time = best(manager.snapshot)
    full_time = best(lambda: (manager.snapshot().values, manager.snapshot().locations))
    assert capture_time * 5 < full_time, (capture_time, full_time)
    assert len(manager.snapshot().values) == 3_000


def test_a_snapshot_can_be_read_after_close_and_after_the_manager_is_gone() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4))
    early = manager.snapshot()
    kept = manager.snapshot()
    _ = kept.values  # built before close
    manager.close()
    assert mat_locs(early, handle) == (PAGEABLE_HOST,)
    assert loc_snap(early, PAGEABLE_HOST).used_bytes == 16
    assert state_key(early) == state_key(kept)
    orphan = ResidencyManager()
    other = orphan.adopt(tensor_value(2))
    snap = orphan.snapshot()
    del orphan
    assert mat_locs(snap, other) == (PAGEABLE_HOST,)
