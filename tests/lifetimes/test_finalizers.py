"""Abandoned lifetimes (docs/concepts/lifetimes.md#finalizers).

A lease, hold or reservation that is garbage-collected while active, or still alive at
interpreter exit, is released by its finalizer with a `ResourceWarning` naming the kind, the
manager id and the location. An abandoned CUDA lease records an event on every registered
consumer stream (streams added later included) and synchronises them before its protection
goes. If that release fails, the manager is kept alive by a module-level list in
`fhelium.residency.lease`.
"""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import textwrap
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest

from fhelium.residency._runtime import use_runtime
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, ResidencyLocation
from fhelium.residency.manager import ResidencyManager, engine_of
from helpers.lifetimes import (
    LoggingRuntime,
    cuda_stream,
    mat,
    of_category,
    recorded_warnings,
    replicated,
    root_lists_holding,
    rt_fixture,  # noqa: F401
)
from helpers.limits import capped
from helpers.manager import CUDA0, loc_snap


def _one_resource_warning(caught: list[warnings.WarningMessage]) -> str:
    found = of_category(caught, ResourceWarning)
    assert len(found) == 1, [str(w.message) for w in caught]
    return str(found[0].message)


def _names(message: str, kind: str, manager: ResidencyManager, location: ResidencyLocation) -> None:
    assert kind in message.lower(), message
    assert manager.manager_id in message, message
    assert location.name in message or repr(location) in message, message


def test_abandoned_cpu_lease_is_released_with_a_warning(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager)
    lease = manager.acquire([handle], at=PAGEABLE_HOST)
    version = manager.state_version
    with recorded_warnings() as caught:
        del lease
        gc.collect()
    message = _one_resource_warning(caught)
    _names(message, "lease", manager, PAGEABLE_HOST)
    assert of_category(caught, RuntimeWarning) == []
    assert manager.state_version == version + 1
    assert mat(manager.snapshot(), handle, PAGEABLE_HOST).use_count == 0
    assert root_lists_holding(manager) == []
    manager.close()


def test_abandoned_cuda_lease_synchronises_every_registered_stream(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    s0, s1 = cuda_stream(rt), cuda_stream(rt)
    lease = manager.acquire([handle], at=CUDA0, consumer_stream=s0)
    lease.add_consumer_stream(s1)  # added after creation: the finalizer must honour it
    version = manager.state_version
    calls = rt.calls.copy()
    mark = rt.mark()
    with recorded_warnings() as caught:
        del lease
        gc.collect()
    message = _one_resource_warning(caught)
    _names(message, "lease", manager, CUDA0)
    recorded = rt.since(mark)
    assert {id(s) for s, _ in recorded} == {id(s0), id(s1)}
    assert len(recorded) == 2
    assert all(event.completed for _, event in recorded)
    assert rt.calls["synchronize_event"] - calls["synchronize_event"] == 2
    assert rt.pending_event_count() == 0
    assert manager.state_version == version + 2  # released with wait=True
    m = mat(manager.snapshot(), handle, CUDA0)
    assert (m.use_count, m.pending_event_count) == (0, 0)
    assert root_lists_holding(manager) == []
    manager.drop(handle, CUDA0)
    manager.close()


def test_abandoned_entered_lease_is_released(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager)
    lease = manager.acquire([handle], at=PAGEABLE_HOST)
    values = lease.__enter__()
    with recorded_warnings() as caught:
        del lease, values
        gc.collect()
    _names(_one_resource_warning(caught), "lease", manager, PAGEABLE_HOST)
    assert mat(manager.snapshot(), handle, PAGEABLE_HOST).use_count == 0
    manager.close()


def test_abandoned_hold_is_released_with_a_warning(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, PINNED_HOST)
    hold = manager.hold([handle], at=PINNED_HOST)
    version = manager.state_version
    with recorded_warnings() as caught:
        del hold
        gc.collect()
    _names(_one_resource_warning(caught), "hold", manager, PINNED_HOST)
    assert manager.state_version == version + 1
    assert mat(manager.snapshot(), handle, PINNED_HOST).hold_count == 0
    manager.drop(handle, PINNED_HOST)
    manager.close()


def test_abandoned_reservation_is_released_with_a_warning(rt: LoggingRuntime) -> None:
    manager = ResidencyManager({CUDA0: 100})
    reservation = manager.reserve(CUDA0, 60, label="abandoned")
    version = manager.state_version
    with recorded_warnings() as caught:
        del reservation
        gc.collect()
    _names(_one_resource_warning(caught), "reservation", manager, CUDA0)
    assert manager.state_version == version + 1
    snap = manager.snapshot()
    assert loc_snap(snap, CUDA0).reserved_bytes == 0
    assert snap.reservations == ()
    manager.close()


def test_released_lifetimes_do_not_warn_when_collected(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    lease = manager.acquire([handle], at=CUDA0, consumer_stream=cuda_stream(rt))
    cpu = manager.acquire([handle], at=PAGEABLE_HOST)
    hold = manager.hold([handle], at=PAGEABLE_HOST)
    reservation = manager.reserve(PAGEABLE_HOST, 4, label="r")
    lease.release()
    with cpu:
        pass
    with hold:
        pass
    reservation.close()
    version = manager.state_version
    with recorded_warnings() as caught:
        del lease, cpu, hold, reservation
        gc.collect()
    assert of_category(caught, ResourceWarning) == []
    assert manager.state_version == version
    rt.complete_events()
    manager.close()


def test_lifetimes_are_inert_after_forced_close_and_collection(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    lease = manager.acquire([handle], at=CUDA0, consumer_stream=cuda_stream(rt))
    hold = manager.hold([handle], at=PAGEABLE_HOST)
    manager.close(force=True)
    lease.release()
    hold.release()
    with recorded_warnings() as caught:
        del lease, hold
        gc.collect()
    assert of_category(caught, ResourceWarning) == []
    assert root_lists_holding(manager) == []


FAULTS = {
    "synchronize_event": [("synchronize_event",)],
    "record_and_stream_fallback": [("record_event",), ("synchronize_stream",)],
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_failed_finalizer_release_retains_the_manager(rt: LoggingRuntime, fault: str) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    lease = manager.acquire([handle], at=CUDA0, consumer_stream=cuda_stream(rt))
    with recorded_warnings() as caught:
        safe = manager.acquire([handle], at=PAGEABLE_HOST)
        del safe
        gc.collect()
    safe_message = _one_resource_warning(caught)
    assert root_lists_holding(manager) == []
    for (method,) in FAULTS[fault]:
        rt.fail_next(method, exc=RuntimeError(f"injected {method} failure"))
    try:
        with recorded_warnings() as caught:
            del lease
            gc.collect()
    finally:
        rt.clear_faults()
    message = _one_resource_warning(caught)
    _names(message, "lease", manager, CUDA0)
    assert message != safe_message
    assert re.search(r"retain|kept|keep|alive|leak", message, re.IGNORECASE), message
    holders = root_lists_holding(manager)
    assert len(holders) >= 1
    # a strong root: the manager survives losing every other reference
    holder = holders[0]
    manager_id = manager.manager_id
    del manager
    gc.collect()
    assert any(
        isinstance(item, ResidencyManager) and item.manager_id == manager_id for item in holder
    )


# --------------------------------------------------------------------------------------------
# Interpreter exit, in a subprocess
# --------------------------------------------------------------------------------------------

EXIT_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from fhelium.residency._runtime import SimulatedRuntime, SimulatedStream, use_runtime
    from fhelium.residency import ResidencyManager, ReplicaMode, PAGEABLE_HOST, cuda_location
    from fhelium.values import ResidentTensor

    CUDA0 = cuda_location("cuda:0")
    runtime = SimulatedRuntime(2)
    with use_runtime(runtime):
        manager = ResidencyManager()
    handle = manager.adopt(ResidentTensor(torch.zeros(4)), replica_mode=ReplicaMode.REPLICABLE)
    manager.ensure(handle, CUDA0)
    stream = SimulatedStream(runtime, torch.device("cuda", 0))
    extra = SimulatedStream(runtime, torch.device("cuda", 0))
    cuda_lease = manager.acquire([handle], at=CUDA0, consumer_stream=stream)
    cuda_lease.add_consumer_stream(extra)
    keep = [
        manager.acquire([handle], at=PAGEABLE_HOST),
        cuda_lease,
        manager.hold([handle], at=PAGEABLE_HOST),
        manager.reserve(PAGEABLE_HOST, 16, label="exit"),
    ]
    if sys.argv[1] == "fail":
        runtime.fail_next("synchronize_event", exc=RuntimeError("injected"), count=10)
    print("MANAGER", manager.manager_id, flush=True)
    """
)


@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_interpreter_exit_with_live_lifetimes(mode: str) -> None:
    try:
        result = subprocess.run(
            capped([sys.executable, "-W", "always::ResourceWarning", "-c", EXIT_SCRIPT, mode]),
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"interpreter exit hung: {exc}")
    assert result.returncode == 0, result.stderr
    match = re.search(r"MANAGER (\S+)", result.stdout)
    assert match is not None, result.stdout
    manager_id = match.group(1)
    stderr = result.stderr
    assert stderr.count("ResourceWarning") >= 4, stderr
    assert stderr.count(manager_id) >= 4, stderr
    lowered = stderr.lower()
    for kind in ("lease", "hold", "reservation"):
        assert kind in lowered, stderr
    assert "Traceback" not in stderr, stderr


def test_abandoned_lease_in_a_reference_cycle_is_released_by_the_collector(
    rt: LoggingRuntime,
) -> None:
    # Leases are finalized from the core's weak reference, not their own finalizer:
    # one that only the cyclic collector can free is released all the same.
    manager = ResidencyManager()
    handle = replicated(manager)
    lease = manager.acquire([handle], at=PAGEABLE_HOST)
    cycle: list[object] = [lease]
    cycle.append(cycle)
    with recorded_warnings() as caught:
        del lease, cycle
        gc.collect()
    _names(_one_resource_warning(caught), "lease", manager, PAGEABLE_HOST)
    assert mat(manager.snapshot(), handle, PAGEABLE_HOST).use_count == 0
    manager.close()


def test_a_released_lease_leaves_nothing_behind(rt: LoggingRuntime) -> None:
    # Released in time, a lease warns about nothing when freed, and neither it nor
    # its manager's core keeps the other alive.
    manager = ResidencyManager()
    handle = replicated(manager)
    lease = manager.acquire([handle], at=PAGEABLE_HOST)
    lease.release()
    engine = weakref.ref(engine_of(manager))
    with recorded_warnings() as caught:
        del lease
        gc.collect()
    assert of_category(caught, ResourceWarning) == []
    manager.close()
    del manager
    gc.collect()
    assert engine() is None


class _CollectingRuntime(LoggingRuntime):
    """Runs `during` (once) inside its next `copy_to_pinned`: in the middle of the
    transition that copies, on the transition's own thread."""

    during: Callable[[], object] | None = None

    def copy_to_pinned(self, value: Any) -> Any:
        during, self.during = self.during, None
        if during is not None:
            during()
        return super().copy_to_pinned(value)


def test_abandoned_lease_collected_mid_transition_is_queued() -> None:
    # Its thread cannot enter the manager in the middle of its own transition: the
    # release waits in the queue for the next operation, and the manager is not
    # retained (docs/concepts/lifetimes.md#deferred-releases).
    runtime = _CollectingRuntime(device_count=0)
    with use_runtime(runtime):
        manager = ResidencyManager()
        handle = replicated(manager)
        other = replicated(manager)
        collecting = gc.isenabled()
        gc.disable()
        try:
            lease = manager.acquire([handle], at=PAGEABLE_HOST)
            cycle: list[object] = [lease]
            cycle.append(cycle)
            del lease, cycle
            runtime.during = gc.collect
            with recorded_warnings() as caught:
                manager.ensure(other, PINNED_HOST)
        finally:
            if collecting:
                gc.enable()
        assert runtime.during is None
        message = _one_resource_warning(caught)
        assert "was released" in message, message
        assert mat(manager.snapshot(), handle, PAGEABLE_HOST).use_count == 0
        assert root_lists_holding(manager) == []
        manager.close()
