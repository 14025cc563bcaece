"""Protected removals (docs/concepts/lifetimes.md#protection).

A materialisation with use, hold or pending tokens cannot be removed by `drop`, by the source
side of `move` or by `discard`; the `ResidencyInUseError` names the handle id, the location and
the counts. The tokens come from `hold()`/`acquire()` (lifetimes.md#leases, #holds): the tests
skip without them.
"""

from __future__ import annotations

from typing import Any

import pytest

from fhelium.errors import ResidencyInUseError
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST
from fhelium.residency.manager import ResidencyManager
from helpers.manager import (
    CUDA0,
    CUDA1,
    REPLICABLE,
    Source,
    fresh,
    loc_snap,
    mat_locs,
    on,
    sim_fixture,  # noqa: F401
    spec,
    state_key,
    stream,
    tensor_value,
    val_snap,
)


def _hold(manager: ResidencyManager, handles: list[Any], at: Any) -> Any:
    if not callable(getattr(manager, "hold", None)):
        pytest.skip("ResidencyManager.hold is not implemented yet")
    try:
        return manager.hold(handles, at=at)
    except NotImplementedError:
        pytest.skip("ResidencyManager.hold is not implemented yet")


def _acquire(manager: ResidencyManager, handles: list[Any], at: Any, **kwargs: Any) -> Any:
    if not callable(getattr(manager, "acquire", None)):
        pytest.skip("ResidencyManager.acquire is not implemented yet")
    try:
        return manager.acquire(handles, at=at, **kwargs)
    except NotImplementedError:
        pytest.skip("ResidencyManager.acquire is not implemented yet")


def _assert_in_use(
    exc: ResidencyInUseError,
    handle: Any,
    location: Any,
    *,
    reads: int,
    holds: int,
    pending: int,
) -> None:
    message = str(exc)
    assert handle.handle_id in message
    assert location.name in message
    assert f"active_reads={reads}" in message
    assert f"holds={holds}" in message
    assert f"pending_events={pending}" in message
    # The optional structured attributes, when supplied, agree with the message.
    for attribute, expected in (
        ("handle_id", handle.handle_id),
        ("location", location.name),
        ("active_reads", reads),
        ("holds", holds),
        ("pending_events", pending),
    ):
        value = getattr(exc, attribute, None)
        assert value is None or value == expected, (attribute, value)


def test_held_materialisation_cannot_be_dropped_and_protection_precedes_last_copy_rule() -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())  # the only copy of a MUST_PRESERVE value
    hold = _hold(manager, [handle], PAGEABLE_HOST)
    try:
        before = state_key(manager.snapshot())
        with pytest.raises(ResidencyInUseError) as info:
            manager.drop(handle, PAGEABLE_HOST)
        _assert_in_use(info.value, handle, PAGEABLE_HOST, reads=0, holds=1, pending=0)
        assert state_key(manager.snapshot()) == before
        mat = val_snap(manager.snapshot(), handle).materializations[0]
        assert (mat.use_count, mat.hold_count, mat.pending_event_count) == (0, 1, 0)
        assert loc_snap(manager.snapshot(), PAGEABLE_HOST).hold_count == 1
    finally:
        hold.release()


def test_two_holds_are_counted(sim: Any) -> None:
    manager = ResidencyManager()
    handle = manager.register_source(spec(), Source(fresh()))
    manager.ensure(handle, PAGEABLE_HOST)
    first = _hold(manager, [handle], PAGEABLE_HOST)
    second = _hold(manager, [handle], PAGEABLE_HOST)
    try:
        with pytest.raises(ResidencyInUseError) as info:
            manager.drop(handle, PAGEABLE_HOST)
        _assert_in_use(info.value, handle, PAGEABLE_HOST, reads=0, holds=2, pending=0)
    finally:
        first.release()
        second.release()
    manager.drop(handle, PAGEABLE_HOST)
    assert mat_locs(manager.snapshot(), handle) == ()


def test_move_source_must_be_removable_before_any_copy(sim: Any) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value())
    hold = _hold(manager, [handle], PAGEABLE_HOST)
    try:
        before = state_key(manager.snapshot())
        with pytest.raises(ResidencyInUseError):
            manager.move(handle, CUDA0)
        assert sim.calls["copy_to_cuda"] == 0
        assert state_key(manager.snapshot()) == before
        assert manager.trace() == ()
    finally:
        hold.release()
    manager.move(handle, CUDA0)
    assert mat_locs(manager.snapshot(), handle) == (CUDA0,)


def test_move_case_a_protected_source(sim: Any) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    manager.ensure(handle, CUDA1)
    hold = _hold(manager, [handle], PAGEABLE_HOST)
    try:
        with pytest.raises(ResidencyInUseError):
            manager.move(handle, CUDA1)
        # Protection never blocks adding replicas, nor removing an unprotected one.
        manager.ensure(handle, PINNED_HOST)
        manager.move(handle, CUDA1, from_location=PINNED_HOST)
        assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST, CUDA1)
    finally:
        hold.release()


def test_discard_with_any_protected_materialisation_changes_nothing(sim: Any) -> None:
    manager = ResidencyManager()
    handle = manager.register_source(spec(), Source(fresh()))
    manager.ensure(handle, PAGEABLE_HOST)
    manager.ensure(handle, CUDA0)
    hold = _hold(manager, [handle], CUDA0)
    try:
        before = state_key(manager.snapshot())
        with pytest.raises(ResidencyInUseError) as info:
            manager.discard(handle)
        _assert_in_use(info.value, handle, CUDA0, reads=0, holds=1, pending=0)
        after = manager.snapshot()
        assert state_key(after) == before
        assert mat_locs(after, handle) == (PAGEABLE_HOST, CUDA0)  # pageable not removed
        assert val_snap(after, handle).has_source is True
    finally:
        hold.release()
    manager.discard(handle)
    assert val_snap(manager.snapshot(), handle).discarded is True


def test_active_cpu_lease_protects(sim: Any) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(), replica_mode=REPLICABLE)
    manager.ensure(handle, PINNED_HOST)
    lease = _acquire(manager, [handle], PINNED_HOST)
    try:
        with pytest.raises(ResidencyInUseError) as info:
            manager.drop(handle, PINNED_HOST)
        _assert_in_use(info.value, handle, PINNED_HOST, reads=1, holds=0, pending=0)
    finally:
        lease.release()
    manager.drop(handle, PINNED_HOST)


def test_pending_cuda_lease_protects_until_its_event_completes(sim: Any) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(on(sim, CUDA0, tensor_value()), replica_mode=REPLICABLE)
    manager.ensure(handle, PAGEABLE_HOST)
    lease = _acquire(manager, [handle], CUDA0, consumer_stream=stream(sim, 0))
    lease.release(wait=False)
    with pytest.raises(ResidencyInUseError) as info:
        manager.drop(handle, CUDA0)
    _assert_in_use(info.value, handle, CUDA0, reads=0, holds=0, pending=1)
    sim.complete_events()
    manager.drop(handle, CUDA0)  # reaped, then removable
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST,)
