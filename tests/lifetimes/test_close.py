"""`close(*, wait=True, force=False)`, the manager context manager and forced close
(docs/concepts/lifetimes.md#close, #forced-close).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from fhelium.errors import (
    ResidencyClosedError,
    ResidencyInUseError,
    ResidencyUnavailableError,
)
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.plan import EnsureResident, ResidencyPlan
from helpers.lifetimes import (
    PLAN_METHODS,
    LoggingRuntime,
    cuda_stream,
    mat,
    replicated,
    rt_fixture,  # noqa: F401
)
from helpers.manager import (
    CUDA0,
    CUDA1,
    Source,
    capture,
    fresh,
    loc_snap,
    spec,
    tensor_value,
)


def _counts(message: str) -> dict[str, int]:
    found = {
        key: int(value)
        for key, value in re.findall(
            r"(active_leases|pending_leases|holds|reservations)=(\d+)", message
        )
    }
    assert set(found) == {"active_leases", "pending_leases", "holds", "reservations"}, message
    return found


def test_close_refuses_live_lifetimes_and_stays_open(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    a = replicated(manager, CUDA0)
    s0 = cuda_stream(rt)
    leases = [
        manager.acquire([a], at=PAGEABLE_HOST),
        manager.acquire([a], at=CUDA0, consumer_stream=s0),
    ]
    holds = [manager.hold([a], at=PAGEABLE_HOST)]
    reservations = [manager.reserve(PAGEABLE_HOST, n, label=f"r{n}") for n in (1, 2, 3)]
    version = manager.state_version
    with pytest.raises(ResidencyInUseError) as info:
        manager.close()
    assert _counts(str(info.value)) == {
        "active_leases": 2,
        "pending_leases": 0,
        "holds": 1,
        "reservations": 3,
    }
    # still open and unchanged
    assert manager.state_version == version
    snap = manager.snapshot()
    assert mat(snap, a, PAGEABLE_HOST).use_count == 1
    assert mat(snap, a, CUDA0).use_count == 1
    assert loc_snap(snap, PAGEABLE_HOST).reservation_count == 3
    assert all(lifetime.active for lifetime in (*leases, *holds, *reservations))
    manager.adopt(tensor_value(2))
    leases[0].release()
    holds[0].release()
    with pytest.raises(ResidencyInUseError) as info:
        manager.close(wait=False)
    assert _counts(str(info.value)) == {
        "active_leases": 1,
        "pending_leases": 0,
        "holds": 0,
        "reservations": 3,
    }
    for reservation in reservations:
        reservation.release()
    leases[1].release(wait=True)
    manager.close()
    with pytest.raises(ResidencyClosedError):
        manager.snapshot()


def test_close_wait_true_synchronises_pending_leases(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    a = replicated(manager, CUDA0, CUDA1)
    s0, s1 = cuda_stream(rt, 0), cuda_stream(rt, 1)
    manager.acquire([a], at=CUDA0, consumer_stream=s0).release()
    manager.acquire([a], at=CUDA1, consumer_stream=s1).release()
    assert rt.pending_event_count() == 2
    calls = rt.calls.copy()
    manager.close()
    assert rt.calls["synchronize_event"] - calls["synchronize_event"] == 2
    assert rt.calls["synchronize_device"] == calls["synchronize_device"]
    assert rt.pending_event_count() == 0
    with pytest.raises(ResidencyClosedError):
        manager.state_version  # noqa: B018


def test_close_wait_false_leaves_incomplete_pending_leases_in_use(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    a = replicated(manager, CUDA0)
    manager.acquire([a], at=CUDA0, consumer_stream=cuda_stream(rt)).release()
    version = manager.state_version
    calls = rt.calls.copy()
    with pytest.raises(ResidencyInUseError) as info:
        manager.close(wait=False)
    assert _counts(str(info.value)) == {
        "active_leases": 0,
        "pending_leases": 1,
        "holds": 0,
        "reservations": 0,
    }
    assert rt.calls["synchronize_event"] == calls["synchronize_event"]
    assert rt.pending_event_count() == 1
    assert manager.state_version == version
    assert mat(manager.snapshot(), a, CUDA0).pending_event_count == 1
    rt.complete_events()
    manager.close(wait=False)
    with pytest.raises(ResidencyClosedError):
        manager.snapshot()


def test_versions_advanced_by_close_synchronisation_stay_advanced(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    a = replicated(manager, CUDA0)
    manager.acquire([a], at=CUDA0, consumer_stream=cuda_stream(rt)).release()
    hold = manager.hold([a], at=CUDA0)
    version = manager.state_version
    with pytest.raises(ResidencyInUseError) as info:
        manager.close()
    assert _counts(str(info.value)) == {
        "active_leases": 0,
        "pending_leases": 0,
        "holds": 1,
        "reservations": 0,
    }
    assert rt.pending_event_count() == 0
    assert manager.state_version == version + 1
    snap = manager.snapshot()
    assert mat(snap, a, CUDA0).pending_event_count == 0
    assert mat(snap, a, CUDA0).hold_count == 1
    hold.release()
    manager.close()


def test_forced_close_clears_everything_and_makes_lifetimes_inert(rt: LoggingRuntime) -> None:
    manager = ResidencyManager({CUDA1: 1 << 20})  # CUDA1: registered but unused
    a = replicated(manager, CUDA0)
    b = replicated(manager, PINNED_HOST)
    s0 = cuda_stream(rt)
    cpu_lease = manager.acquire([a, b], at=PAGEABLE_HOST)
    gpu_lease = manager.acquire([a], at=CUDA0, consumer_stream=s0)
    manager.acquire([a], at=CUDA0, consumer_stream=s0).release()  # pending, incomplete
    values = cpu_lease.values
    gpu_values = gpu_lease.values
    hold = manager.hold([b], at=PINNED_HOST)
    reservation = manager.reserve(CUDA1, 128, label="scratch")
    calls = rt.calls.copy()
    manager.close(wait=False, force=True)
    # every registered CUDA location's device is synchronised
    assert rt.calls["synchronize_device"] - calls["synchronize_device"] == 2
    assert rt.pending_event_count() == 0
    with pytest.raises(ResidencyClosedError):
        manager.snapshot()
    # borrowed lookups are stale
    with pytest.raises(ResidencyUnavailableError):
        values[a]
    with pytest.raises(ResidencyUnavailableError):
        gpu_values[a]
    # releases are silent, and idempotent
    for _ in range(2):
        assert cpu_lease.release() is None
        assert gpu_lease.release(wait=True) is None
        assert hold.release() is None
        assert reservation.release() is None
    for lifetime in (cpu_lease, gpu_lease, hold, reservation):
        assert lifetime.active is False
    # locations survive close
    assert manager.locations == (CUDA1, PAGEABLE_HOST, CUDA0, PINNED_HOST)


def test_forced_close_with_wait_synchronises_pending_events_first(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    a = replicated(manager, CUDA0)
    s0 = cuda_stream(rt)
    lease = manager.acquire([a], at=CUDA0, consumer_stream=s0)
    manager.acquire([a], at=CUDA0, consumer_stream=s0).release()
    calls = rt.calls.copy()
    manager.close(force=True)
    assert rt.calls["synchronize_event"] - calls["synchronize_event"] == 1
    assert rt.calls["synchronize_device"] - calls["synchronize_device"] == 1
    assert rt.pending_event_count() == 0
    lease.release()  # silent
    assert lease.active is False


def _closed_calls(manager: ResidencyManager, handle: Any) -> dict[str, Callable[[], Any]]:
    return {
        "state_version": lambda: manager.state_version,
        "snapshot": manager.snapshot,
        "adopt": lambda: manager.adopt(tensor_value(2)),
        "register_source": lambda: manager.register_source(spec(), Source(fresh())),
        "ensure": lambda: manager.ensure(handle, PINNED_HOST),
        "copy": lambda: manager.copy(handle, PINNED_HOST),
        "move": lambda: manager.move(handle, PINNED_HOST),
        "drop": lambda: manager.drop(handle, PAGEABLE_HOST),
        "discard": lambda: manager.discard(handle),
        "execute_actions": lambda: manager.execute_actions([EnsureResident(handle, PINNED_HOST)]),
        "explain": lambda: manager.explain(ResidencyPlan("p")),
        "scope": lambda: manager.scope(ResidencyPlan("p")).__enter__(),
        "acquire": lambda: manager.acquire([handle], at=PAGEABLE_HOST),
        "acquire_cuda": lambda: manager.acquire([handle], at=CUDA0),
        "hold": lambda: manager.hold([handle], at=PAGEABLE_HOST),
        "reserve": lambda: manager.reserve(PAGEABLE_HOST, 8, label="x"),
        "enter": manager.__enter__,
    }


@pytest.mark.parametrize("force", [False, True])
def test_after_close_gated_operations_raise_closed(rt: LoggingRuntime, force: bool) -> None:
    manager = ResidencyManager()
    handle = replicated(manager)
    manager.ensure(handle, PAGEABLE_HOST)  # one trace entry
    lease = manager.acquire([handle], at=PAGEABLE_HOST)
    if force:
        manager.close(force=True)
    else:
        lease.release()
        manager.close()
    for name, call in _closed_calls(manager, handle).items():
        if name in PLAN_METHODS and not callable(getattr(manager, name, None)):
            continue  # plans may not exist yet
        error = capture(call)
        assert isinstance(error, ResidencyClosedError), f"{name}: {error!r}"
    # what still works after close
    assert manager.locations == (PAGEABLE_HOST,)
    assert len(manager.trace()) == 1
    manager.clear_trace()
    assert manager.trace() == ()
    assert isinstance(manager.manager_id, str)
    if callable(getattr(manager, "scope", None)):
        manager.scope(ResidencyPlan("constructed"))  # construction touches nothing
    # closing again is silent, whatever the flags
    manager.close()
    manager.close(force=True)
    manager.close(wait=False)
    lease.release()


def test_manager_exit_closes(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    with manager as entered:
        assert entered is manager
        handle = replicated(manager, CUDA0)
        lease = manager.acquire([handle], at=CUDA0, consumer_stream=cuda_stream(rt))
        lease.release()  # pending: close (wait=True) synchronises it
    assert rt.pending_event_count() == 0
    with pytest.raises(ResidencyClosedError):
        manager.snapshot()
    with pytest.raises(ResidencyClosedError), manager:
        pass


def test_manager_exit_error_replaces_the_body_exception(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager)
    holds: list[Any] = []
    try:
        with pytest.raises(ResidencyInUseError) as info, manager:  # noqa: PT012
            holds.append(manager.hold([handle], at=PAGEABLE_HOST))
            raise LookupError("body")
        assert "holds=1" in str(info.value)
        # the manager stayed open
        assert mat(manager.snapshot(), handle, PAGEABLE_HOST).hold_count == 1
        # "replaces a body exception, with the normal __context__ chaining" (lifetimes.md#close)
        assert isinstance(info.value.__context__, LookupError)
    finally:
        for hold in holds:
            hold.release()
    with manager:
        pass
    with pytest.raises(ResidencyClosedError):
        manager.snapshot()


def test_manager_exit_with_live_lifetime_and_no_body_error(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    with pytest.raises(ResidencyInUseError, match="reservations=1"), manager:
        reservation = manager.reserve(PAGEABLE_HOST, 4, label="left open")
    reservation.release()
    manager.close()
