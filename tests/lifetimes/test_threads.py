"""Lifetimes and threads (docs/concepts/lifetimes.md#re-entrancy-and-threads, #deferred-releases).

* From inside a source callback's own thread, a release raises `ResidencyReentrancyError` and
  the lifetime stays active.
* From another thread while a callback runs, a release is accepted (returns without error, the
  lifetime becomes inactive) and its effect is applied once the callback ends.
* Stress: several threads acquire/release, hold, reserve concurrently for a bounded number of
  iterations; afterwards nothing is in use and `close()` succeeds.

Every wait is bounded so that a bug fails the test instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from fhelium.errors import (
    ResidencyClosedError,
    ResidencyInUseError,
    ResidencyReentrancyError,
    ResidencyUnavailableError,
)
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST
from fhelium.residency.manager import ResidencyManager
from helpers.lifetimes import (
    LoggingRuntime,
    cuda_stream,
    mat,
    recorded_warnings,
    replicated,
    root_lists_holding,
    rt_fixture,  # noqa: F401
)
from helpers.manager import (
    CUDA0,
    CUDA1,
    Source,
    assert_balanced,
    capture,
    fresh,
    loc_snap,
    mat_locs,
    run_with_timeout,
    spec,
)

WAIT = 10.0  # seconds; every wait in this module is bounded by this


def _start(target: Callable[[], None], errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _join(*threads: threading.Thread, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            pytest.fail("a worker thread did not finish in time (deadlock?)")


# --------------------------------------------------------------------------------------------
# Release from inside the callback's own thread
# --------------------------------------------------------------------------------------------


def test_release_inside_the_callback_thread_is_a_reentrancy_error(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    handle = replicated(manager, CUDA0)
    cpu = manager.acquire([handle], at=PAGEABLE_HOST)
    gpu = manager.acquire([handle], at=CUDA0, consumer_stream=cuda_stream(rt))
    hold = manager.hold([handle], at=PAGEABLE_HOST)
    reservation = manager.reserve(PAGEABLE_HOST, 8, label="inside")
    outcomes: dict[str, Any] = {}

    def inside() -> None:
        outcomes["cpu"] = capture(cpu.release)
        outcomes["gpu"] = capture(lambda: gpu.release(wait=True))
        outcomes["gpu_close"] = capture(gpu.close)
        outcomes["hold"] = capture(hold.release)
        outcomes["reservation"] = capture(reservation.release)
        outcomes["lookup"] = capture(lambda: cpu.values[handle])
        outcomes["acquire"] = capture(lambda: manager.acquire([handle], at=PAGEABLE_HOST))
        outcomes["hold_new"] = capture(lambda: manager.hold([handle], at=PAGEABLE_HOST))
        outcomes["reserve"] = capture(lambda: manager.reserve(PAGEABLE_HOST, 1, label="x"))
        outcomes["active"] = [x.active for x in (cpu, gpu, hold, reservation)]

    loaded = manager.register_source(spec(), Source(fresh(), before_load=inside))
    version = manager.state_version
    run_with_timeout(lambda: manager.ensure(loaded, PAGEABLE_HOST))
    active = outcomes.pop("active")
    for name, error in outcomes.items():
        assert isinstance(error, ResidencyReentrancyError), f"{name}: {error!r}"
    assert active == [True, True, True, True]
    assert all(x.active for x in (cpu, gpu, hold, reservation))
    # only the install happened; every lifetime still protects / charges
    assert manager.state_version == version + 1
    snap = manager.snapshot()
    assert mat(snap, handle, PAGEABLE_HOST).use_count == 1
    assert mat(snap, handle, PAGEABLE_HOST).hold_count == 1
    assert mat(snap, handle, CUDA0).use_count == 1
    assert loc_snap(snap, PAGEABLE_HOST).reserved_bytes == 8
    # and they release normally afterwards
    cpu.release()
    gpu.release(wait=True)
    hold.release()
    reservation.release()
    snap = manager.snapshot()
    assert loc_snap(snap, PAGEABLE_HOST).use_count == 0
    assert loc_snap(snap, PAGEABLE_HOST).hold_count == 0
    assert loc_snap(snap, PAGEABLE_HOST).reserved_bytes == 0
    manager.close()


# --------------------------------------------------------------------------------------------
# Release from another thread while a callback runs: deferred, never lost
# --------------------------------------------------------------------------------------------


class HeldCallback:
    """Runs `manager.ensure(handle)` on a worker whose `load()` blocks until `finish()`."""

    def __init__(self, manager: ResidencyManager) -> None:
        self.manager = manager
        self.started = threading.Event()
        self.proceed = threading.Event()
        self.errors: list[BaseException] = []
        self.handle = manager.register_source(spec(), Source(fresh(), before_load=self._load))
        self.thread: threading.Thread | None = None

    def _load(self) -> None:
        self.started.set()
        if not self.proceed.wait(WAIT):
            raise TimeoutError("the test never let the callback finish")

    def start(self) -> None:
        self.thread = _start(lambda: self.manager.ensure(self.handle, PAGEABLE_HOST), self.errors)
        assert self.started.wait(WAIT), "the callback never started"

    def finish(self) -> None:
        self.proceed.set()
        assert self.thread is not None
        _join(self.thread)
        assert self.errors == []


def test_releases_from_another_thread_during_a_callback_are_deferred(
    rt: LoggingRuntime,
) -> None:
    manager = ResidencyManager()
    a = replicated(manager, CUDA0)
    s0 = cuda_stream(rt)
    cpu = manager.acquire([a], at=PAGEABLE_HOST)
    gpu = manager.acquire([a], at=CUDA0, consumer_stream=s0)
    gpu_wait = manager.acquire([a], at=CUDA0, consumer_stream=s0)
    entered = manager.acquire([a], at=PAGEABLE_HOST)
    values = entered.__enter__()
    hold = manager.hold([a], at=CUDA0)
    held_ctx = manager.hold([a], at=PAGEABLE_HOST)
    held_ctx.__enter__()
    reservation = manager.reserve(CUDA0, 100, label="deferred")
    callback = HeldCallback(manager)
    version = manager.state_version
    callback.start()
    try:
        # the callback really is running: gated operations fail fast
        assert isinstance(capture(manager.snapshot), ResidencyReentrancyError)
        assert isinstance(capture(lambda: values[a]), ResidencyReentrancyError)
        assert isinstance(
            capture(lambda: manager.acquire([a], at=PAGEABLE_HOST)), ResidencyReentrancyError
        )
        # releases are accepted, promptly, and the lifetimes become inactive
        run_with_timeout(cpu.release, timeout=5)
        run_with_timeout(gpu.release, timeout=5)
        run_with_timeout(lambda: gpu_wait.release(wait=True), timeout=5)
        run_with_timeout(lambda: entered.__exit__(None, None, None), timeout=5)
        run_with_timeout(hold.release, timeout=5)
        run_with_timeout(lambda: held_ctx.__exit__(None, None, None), timeout=5)
        run_with_timeout(reservation.release, timeout=5)
        for lifetime in (cpu, gpu, gpu_wait, entered, hold, held_ctx, reservation):
            assert lifetime.active is False
        # released twice: still silent
        cpu.release()
        reservation.release()
    finally:
        callback.finish()
    snap = manager.snapshot()
    assert mat_locs(snap, callback.handle) == (PAGEABLE_HOST,)
    assert mat(snap, a, PAGEABLE_HOST).use_count == 0
    assert mat(snap, a, PAGEABLE_HOST).hold_count == 0
    assert mat(snap, a, CUDA0).use_count == 0
    assert mat(snap, a, CUDA0).hold_count == 0
    assert loc_snap(snap, CUDA0).reserved_bytes == 0
    assert loc_snap(snap, CUDA0).reservation_count == 0
    assert snap.reservations == ()
    # the CUDA leases recorded their events on the captured stream; only the one released
    # without waiting is still pending
    assert sum(1 for stream, _ in rt.recorded if stream is s0) == 2
    assert loc_snap(snap, CUDA0).pending_event_count == 1
    rt.complete_events()
    snap = manager.snapshot()
    assert loc_snap(snap, CUDA0).pending_event_count == 0
    # 7 releases: +1 each, +1 more for the CUDA wait=False one when reaped and for the
    # wait=True one; plus the callback's install
    assert snap.state_version == version + 7 + 1 + 1 + 1
    manager.drop(a, CUDA0)
    manager.close()


def test_deferred_release_unblocks_removal_after_the_callback(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    a = replicated(manager, PINNED_HOST)
    hold = manager.hold([a], at=PINNED_HOST)
    lease = manager.acquire([a], at=PINNED_HOST)
    callback = HeldCallback(manager)
    callback.start()
    try:
        run_with_timeout(hold.release, timeout=5)
        run_with_timeout(lease.release, timeout=5)
    finally:
        callback.finish()
    manager.drop(a, PINNED_HOST)  # would raise ResidencyInUseError if a release was lost
    manager.close()


def test_deferred_releases_let_close_succeed(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    a = replicated(manager)
    lifetimes = [
        manager.acquire([a], at=PAGEABLE_HOST),
        manager.hold([a], at=PAGEABLE_HOST),
        manager.reserve(PAGEABLE_HOST, 4, label="r"),
    ]
    callback = HeldCallback(manager)
    callback.start()
    try:
        for lifetime in lifetimes:
            run_with_timeout(lifetime.release, timeout=5)
    finally:
        callback.finish()
    manager.close()  # would raise ResidencyInUseError if a release was lost
    with pytest.raises(ResidencyClosedError):
        manager.snapshot()


def test_abandoned_lifetimes_during_a_callback_on_another_thread_are_released(
    rt: LoggingRuntime,
) -> None:
    manager = ResidencyManager()
    a = replicated(manager, CUDA0)
    s0 = cuda_stream(rt)
    lifetimes = [
        manager.acquire([a], at=PAGEABLE_HOST),
        manager.acquire([a], at=CUDA0, consumer_stream=s0),
        manager.hold([a], at=CUDA0),
        manager.reserve(PAGEABLE_HOST, 16, label="abandoned"),
    ]
    callback = HeldCallback(manager)
    callback.start()
    try:
        with recorded_warnings() as caught:
            del lifetimes[:]
            gc.collect()
    finally:
        callback.finish()
    found = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert len(found) == 4, [str(w.message) for w in caught]
    assert all(manager.manager_id in str(w.message) for w in found)
    snap = manager.snapshot()
    for entry in snap.locations:
        assert (entry.use_count, entry.hold_count, entry.pending_event_count) == (0, 0, 0)
        assert entry.reserved_bytes == 0
    assert root_lists_holding(manager) == []
    manager.close()


# --------------------------------------------------------------------------------------------
# Stress
# --------------------------------------------------------------------------------------------

THREADS = 4
ITERATIONS = 120


def test_stress_acquire_hold_reserve_from_several_threads(rt: LoggingRuntime) -> None:
    manager = ResidencyManager({PINNED_HOST: 1 << 20})
    handles = [replicated(manager, PINNED_HOST, CUDA0, CUDA1) for _ in range(THREADS)]
    shared = replicated(manager, PINNED_HOST, CUDA0)
    version = manager.state_version
    errors: list[BaseException] = []
    barrier = threading.Barrier(THREADS, timeout=WAIT)

    def worker(index: int) -> None:
        own = handles[index]
        device = CUDA0 if index % 2 == 0 else CUDA1
        stream = cuda_stream(rt, device.device.index)
        extra = cuda_stream(rt, device.device.index)
        barrier.wait()
        for i in range(ITERATIONS):
            lease = manager.acquire([own, shared], at=PAGEABLE_HOST)
            assert lease.values[own] is not None
            lease.release()
            with manager.hold([shared, own], at=PINNED_HOST if i % 2 else PAGEABLE_HOST):
                pass
            reservation = manager.reserve(PINNED_HOST, 64 + index, label=f"t{index}-{i}")
            reservation.release()
            gpu = manager.acquire([own], at=device, consumer_stream=stream)
            if i % 3 == 0:
                gpu.add_consumer_stream(extra)
            gpu.release(wait=i % 2 == 0)
            if i % 10 == 0:
                manager.snapshot()
                rt.complete_events()

    threads = [_start(lambda index=index: worker(index), errors) for index in range(THREADS)]
    _join(*threads, timeout=60)
    assert errors == []
    rt.complete_events()
    snap = manager.snapshot()
    for entry in snap.locations:
        assert (entry.use_count, entry.hold_count, entry.pending_event_count) == (0, 0, 0)
        assert entry.reserved_bytes == 0
        assert entry.reservation_count == 0
    assert snap.reservations == ()
    assert_balanced(snap)
    # per iteration: CPU lease 2, hold 2, reservation 2, CUDA lease 3 (1 + 2 once reaped)
    assert snap.state_version == version + THREADS * ITERATIONS * 9
    manager.close()
    with pytest.raises(ResidencyClosedError):
        manager.state_version  # noqa: B018


def test_stress_with_callbacks_and_removals_loses_nothing(rt: LoggingRuntime) -> None:
    """Releases race with source callbacks on another thread (deferred) and with removals."""
    manager = ResidencyManager()
    a = replicated(manager, CUDA0)
    loaded = manager.register_source(spec(), Source(fresh(), before_load=lambda: time.sleep(0)))
    stop = threading.Event()
    errors: list[BaseException] = []
    callbacks = [0]

    def retry(call: Callable[[], Any]) -> Any:
        for _ in range(5000):
            try:
                return call()
            except ResidencyReentrancyError:
                time.sleep(0)
        raise AssertionError("never got past the callback gate")

    def loader() -> None:
        while not stop.is_set():
            retry(lambda: manager.ensure(loaded, PAGEABLE_HOST))
            callbacks[0] += 1
            with contextlib.suppress(ResidencyInUseError):
                retry(lambda: manager.drop(loaded, PAGEABLE_HOST))

    def remover() -> None:
        while not stop.is_set():
            with contextlib.suppress(ResidencyInUseError):
                retry(lambda: manager.drop(a, CUDA1))
            retry(lambda: manager.ensure(a, CUDA1))

    def user(index: int) -> None:
        stream = cuda_stream(rt, 1)
        for i in range(80):
            try:
                lease = retry(lambda: manager.acquire([a, loaded], at=PAGEABLE_HOST))
            except ResidencyUnavailableError:
                lease = retry(lambda: manager.acquire([a], at=PAGEABLE_HOST))
            hold = retry(lambda: manager.hold([a], at=PAGEABLE_HOST))
            reservation = retry(lambda: manager.reserve(PAGEABLE_HOST, 8, label=f"u{index}"))
            try:
                gpu = retry(lambda: manager.acquire([a], at=CUDA1, consumer_stream=stream))
            except ResidencyUnavailableError:
                gpu = None
            if gpu is not None:
                # while the lease is active its value cannot have been removed
                borrowed = gpu.values
                value = retry(functools.partial(borrowed.__getitem__, a))
                assert rt.placement(value) == CUDA1
                gpu.release(wait=i % 2 == 0)
            lease.release()
            hold.release()
            reservation.release()
            if i % 8 == 0:
                rt.complete_events()

    background = [_start(loader, errors), _start(remover, errors)]
    users = [_start(lambda index=index: user(index), errors) for index in range(3)]
    try:
        _join(*users, timeout=60)
    finally:
        stop.set()
        _join(*background)
    assert errors == []
    assert callbacks[0] > 0
    rt.complete_events()
    snap = manager.snapshot()
    for entry in snap.locations:
        assert (entry.use_count, entry.hold_count, entry.pending_event_count) == (0, 0, 0)
        assert entry.reserved_bytes == 0
    assert snap.reservations == ()
    assert_balanced(snap)
    manager.close()


RACE_ITERATIONS = 20_000
RACE_SECONDS = 4.0  # whichever ends first


def test_releases_never_fail_while_callbacks_start_and_end_on_another_thread(
    rt: LoggingRuntime,
) -> None:
    """A release from a thread other than the callback's must be accepted even when a
    callback starts or ends while the release is entering the manager (nothing leaks)."""
    manager = ResidencyManager()
    a = replicated(manager)
    loaded = manager.register_source(spec(), Source(fresh()))
    stop = threading.Event()
    errors: list[BaseException] = []
    refused: list[BaseException] = []
    leaked: list[Any] = []
    attempts: list[int] = []
    callbacks = [0]

    def loader() -> None:
        while not stop.is_set():
            manager.ensure(loaded, PAGEABLE_HOST)  # one short source callback
            manager.drop(loaded, PAGEABLE_HOST)
            callbacks[0] += 1

    def create(i: int) -> Any:
        for _ in range(100_000):
            try:
                if i % 3 == 0:
                    return manager.acquire([a], at=PAGEABLE_HOST)
                if i % 3 == 1:
                    return manager.hold([a], at=PAGEABLE_HOST)
                return manager.reserve(PAGEABLE_HOST, 4, label="race")
            except ResidencyReentrancyError:
                time.sleep(0)
        raise AssertionError("never got past the callback gate")

    deadline = time.monotonic() + RACE_SECONDS

    def user() -> None:
        for i in range(RACE_ITERATIONS):
            if time.monotonic() > deadline:
                break
            lifetime = create(i)
            attempts.append(1)
            try:
                lifetime.release()
            except BaseException as exc:
                refused.append(exc)
            if lifetime.active:
                leaked.append(lifetime)

    background = _start(loader, errors)
    users = [_start(user, errors) for _ in range(3)]
    try:
        _join(*users, timeout=60)
    finally:
        stop.set()
        _join(background)
    for lifetime in leaked:  # no callback runs any more: clean up before asserting
        lifetime.release()
    assert errors == []
    assert callbacks[0] > 0
    assert refused == [], f"{len(refused)} of {len(attempts)} releases refused: {refused[0]!r}"
    entry = loc_snap(manager.snapshot(), PAGEABLE_HOST)
    assert (entry.use_count, entry.hold_count, entry.reserved_bytes) == (0, 0, 0)
    manager.close()


def test_concurrent_double_release_is_idempotent(rt: LoggingRuntime) -> None:
    manager = ResidencyManager()
    a = replicated(manager, CUDA0)
    s0 = cuda_stream(rt)
    makers: list[Callable[[], Any]] = [
        lambda: manager.acquire([a], at=PAGEABLE_HOST),
        lambda: manager.hold([a], at=PAGEABLE_HOST),
        lambda: manager.reserve(PAGEABLE_HOST, 4, label="twice"),
        lambda: manager.acquire([a], at=CUDA0, consumer_stream=s0),
    ]
    rounds = 60
    version = manager.state_version
    errors: list[BaseException] = []
    for i in range(rounds * len(makers)):
        lifetime = makers[i % len(makers)]()
        barrier = threading.Barrier(2, timeout=WAIT)

        def release(lifetime: Any = lifetime, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            lifetime.release()

        _join(*(_start(release, errors) for _ in range(2)))
        assert not lifetime.active
    assert errors == []
    rt.complete_events()
    snap = manager.snapshot()
    for entry in snap.locations:
        assert (entry.use_count, entry.hold_count, entry.pending_event_count) == (0, 0, 0)
        assert entry.reserved_bytes == 0
    # each round: CPU lease 2, hold 2, reservation 2, CUDA lease 3 (+1 when reaped)
    assert snap.state_version == version + rounds * 9
    manager.close()
