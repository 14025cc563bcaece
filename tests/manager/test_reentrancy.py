"""Re-entrancy and the source-callback gate (docs/concepts/lifetimes.md#re-entrancy-and-threads).

While a source callback runs, every other gated public operation, from any thread (the
callback's own included), fails fast with `ResidencyReentrancyError`; threads already waiting
for the lock fail too. A thread re-entering the manager from inside its own transition fails
the same way. Every potentially blocking call runs under a timeout so a bug cannot hang the
suite.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from fhelium.errors import ResidencyReentrancyError
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST
from fhelium.residency.manager import ResidencyManager
from fhelium.values import ResidentTensor
from helpers.manager import (
    CUDA0,
    REPLICABLE,
    Source,
    capture,
    fresh,
    has_reserve,
    mat_locs,
    run_with_timeout,
    simulated,
    spec,
    tensor_value,
    val_snap,
)

FAST = 2.0  # seconds; "fails fast" with generous slack for a loaded CI machine


def _gated_calls(manager: ResidencyManager, other: Any) -> dict[str, Callable[[], Any]]:
    """Every gated public operation, with valid arguments."""
    calls: dict[str, Callable[[], Any]] = {
        "snapshot": manager.snapshot,
        "state_version": lambda: manager.state_version,
        "locations": lambda: manager.locations,
        "trace": manager.trace,
        "clear_trace": manager.clear_trace,
        "adopt": lambda: manager.adopt(tensor_value(3)),
        "register_source": lambda: manager.register_source(spec(), Source(fresh())),
        "ensure": lambda: manager.ensure(other, PAGEABLE_HOST),
        "copy": lambda: manager.copy(other, PAGEABLE_HOST),
        "move": lambda: manager.move(other, PAGEABLE_HOST),
        "drop": lambda: manager.drop(other, PINNED_HOST),
        "discard": lambda: manager.discard(other),
        "close": manager.close,
        "enter": manager.__enter__,
    }
    if has_reserve(manager):  # reserve() may not exist yet
        calls["reserve"] = lambda: manager.reserve(PAGEABLE_HOST, 1, label="inside")
    return calls


def test_every_gated_operation_fails_inside_the_callback() -> None:
    manager = ResidencyManager()
    other = manager.adopt(tensor_value(2), replica_mode=REPLICABLE)
    manager.ensure(other, PAGEABLE_HOST)  # one trace entry
    outcomes: dict[str, BaseException | None] = {}
    timings: dict[str, float] = {}
    manager_ids: list[str] = []

    def inside() -> None:
        manager_ids.append(manager.manager_id)  # ungated: always readable
        for name, call in _gated_calls(manager, other).items():
            start = time.monotonic()
            outcomes[name] = capture(call)
            timings[name] = time.monotonic() - start

    handle = manager.register_source(spec(), Source(fresh(), before_load=inside))
    version = manager.state_version
    report = run_with_timeout(lambda: manager.ensure(handle, PAGEABLE_HOST))
    assert report.no_op is False
    for name, exc in outcomes.items():
        assert isinstance(exc, ResidencyReentrancyError), f"{name}: {exc!r}"
        assert timings[name] < FAST, f"{name} took {timings[name]:.2f} s"
    assert set(outcomes) == set(_gated_calls(manager, other))
    assert manager_ids == [manager.manager_id]
    # None of the rejected calls changed anything: one install, the trace kept its entry.
    assert manager.state_version == version + 1
    snap = manager.snapshot()
    assert len(snap.values) == 2
    assert snap.reservations == ()
    assert mat_locs(snap, handle) == (PAGEABLE_HOST,)
    assert len(manager.trace()) == 2
    # And the manager is open and usable.
    manager.ensure(other, PAGEABLE_HOST)


def test_argument_errors_still_come_first_inside_the_callback() -> None:
    manager = ResidencyManager()
    seen: list[BaseException | None] = []

    def inside() -> None:
        seen.append(capture(lambda: manager.ensure("handle", PAGEABLE_HOST)))  # type: ignore[arg-type]
        seen.append(capture(lambda: manager.adopt(torch.zeros(2))))  # type: ignore[arg-type]
        seen.append(capture(lambda: manager.register_source(spec(), object())))
        if has_reserve(manager):
            seen.append(capture(lambda: manager.reserve(PAGEABLE_HOST, -1, label="x")))

    handle = manager.register_source(spec(), Source(fresh(), before_load=inside))
    run_with_timeout(lambda: manager.ensure(handle, PAGEABLE_HOST))
    expected = [TypeError, TypeError, TypeError] + ([ValueError] if has_reserve(manager) else [])
    assert [type(e) for e in seen] == expected


def test_reentrancy_error_escaping_load_propagates_and_changes_nothing() -> None:
    manager = ResidencyManager()
    handle = manager.register_source(spec(), Source(fresh(), before_load=manager.snapshot))
    before = manager.snapshot()
    with pytest.raises(ResidencyReentrancyError):
        run_with_timeout(lambda: manager.ensure(handle, PAGEABLE_HOST))
    after = manager.snapshot()  # the callback flag was cleared
    assert after.state_version == before.state_version
    assert val_snap(after, handle).materializations == ()
    assert manager.trace() == ()


def test_callback_flag_is_cleared_after_a_failing_load() -> None:
    manager = ResidencyManager()

    def explode() -> None:
        raise LookupError("missing")

    handle = manager.register_source(spec(), Source(fresh(), before_load=explode))
    with pytest.raises(LookupError):
        run_with_timeout(lambda: manager.ensure(handle, PAGEABLE_HOST))
    # Every operation works again, from this thread and another.
    assert manager.snapshot().state_version == manager.state_version
    run_with_timeout(lambda: manager.adopt(tensor_value()))
    assert len(manager.snapshot().values) == 2


def test_recursive_ensure_of_the_same_handle_fails_instead_of_recursing() -> None:
    manager = ResidencyManager()
    inner: list[BaseException | None] = []
    holder: dict[str, Any] = {}

    def inside() -> None:
        inner.append(capture(lambda: manager.ensure(holder["handle"], PAGEABLE_HOST)))

    source = Source(fresh(), before_load=inside)
    holder["handle"] = manager.register_source(spec(), source)
    run_with_timeout(lambda: manager.ensure(holder["handle"], PAGEABLE_HOST))
    assert source.calls == 1
    assert len(inner) == 1
    assert isinstance(inner[0], ResidencyReentrancyError)


def test_other_threads_fail_fast_while_a_callback_runs() -> None:
    manager = ResidencyManager()
    other = manager.adopt(tensor_value(2), replica_mode=REPLICABLE)
    results: dict[str, BaseException | None] = {}
    durations: dict[str, float] = {}

    def from_other_thread() -> None:
        for name, call in _gated_calls(manager, other).items():
            start = time.monotonic()
            results[name] = capture(call)
            durations[name] = time.monotonic() - start

    def inside() -> None:
        worker = threading.Thread(target=from_other_thread, daemon=True)
        worker.start()
        worker.join(10)
        assert not worker.is_alive(), "another thread blocked while the callback ran"

    handle = manager.register_source(spec(), Source(fresh(), before_load=inside))
    run_with_timeout(lambda: manager.ensure(handle, PAGEABLE_HOST), timeout=20)
    assert set(results) == set(_gated_calls(manager, other))
    for name, exc in results.items():
        assert isinstance(exc, ResidencyReentrancyError), f"{name}: {exc!r}"
        assert durations[name] < FAST, f"{name} took {durations[name]:.2f} s"
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST,)
    assert len(manager.snapshot().values) == 2


def test_threads_already_waiting_for_the_lock_fail_when_a_callback_starts() -> None:
    """Thread A holds the lock (blocked in its allocator sample, before the load); B and C
    wait for the lock; then A's callback starts. B and C must fail, not wait it out."""
    with simulated() as runtime:
        in_sample = threading.Event()
        release_sample = threading.Event()
        load_started = threading.Event()
        release_load = threading.Event()
        armed = [True]
        originals = {name: getattr(runtime, name) for name in ("memory_sample",)}

        def make_hook(name: str) -> Callable[..., Any]:
            def hook(*args: Any, **kwargs: Any) -> Any:
                if armed[0] and threading.current_thread().name == "owner":
                    armed[0] = False
                    in_sample.set()
                    release_sample.wait(10)
                return originals[name](*args, **kwargs)

            return hook

        for name in originals:
            setattr(runtime, name, make_hook(name))

        def slow_load() -> None:
            load_started.set()
            release_load.wait(10)

        manager = ResidencyManager()
        other = manager.adopt(tensor_value(2), replica_mode=REPLICABLE)
        handle = manager.register_source(spec(), Source(fresh(), before_load=slow_load))
        outcome: dict[str, Any] = {}

        def run(name: str, call: Callable[[], Any]) -> threading.Thread:
            def target() -> None:
                try:
                    outcome[name] = call()
                except BaseException as exc:
                    outcome[name] = exc
                outcome[name + "-at"] = time.monotonic()

            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            return thread

        owner = run("owner", lambda: manager.ensure(handle, CUDA0))
        try:
            assert in_sample.wait(10), "the transition never sampled the allocator"
            assert not load_started.is_set(), "the before-sample must precede the load"
            waiters = [
                run("adopt", lambda: manager.adopt(tensor_value(3))),
                run("ensure", lambda: manager.ensure(other, PAGEABLE_HOST)),
            ]
            time.sleep(0.3)
            assert all(w.is_alive() for w in waiters), "waiters did not wait for the lock"
            release_sample.set()
            assert load_started.wait(10)
            started = time.monotonic()
            for waiter in waiters:
                waiter.join(FAST + 1)
            assert not any(w.is_alive() for w in waiters), "a waiting thread kept waiting"
            assert owner.is_alive()  # the callback is still running
            for name in ("adopt", "ensure"):
                assert isinstance(outcome[name], ResidencyReentrancyError), outcome[name]
                assert outcome[name + "-at"] - started < FAST
        finally:
            release_sample.set()
            release_load.set()
            owner.join(10)
        assert not owner.is_alive()
        report = outcome["owner"]
        assert not isinstance(report, BaseException), report
        assert report.destination == CUDA0
        snap = manager.snapshot()
        assert len(snap.values) == 2  # the waiting adopt did not happen
        assert mat_locs(snap, handle) == (CUDA0,)


class Probe(ResidentTensor):
    """A value that calls back into the manager whenever the manager reads its tensors."""

    __slots__ = ("_probe",)

    _probe: Callable[[], None] | None

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(tensor)
        self._probe = None

    @property
    def _resident_tensors(self) -> tuple[torch.Tensor, ...]:
        probe = self._probe
        if probe is not None:
            probe()
        return (self._tensor,)


def test_same_thread_reentry_from_inside_a_transition_fails() -> None:
    manager = ResidencyManager()
    value = Probe(torch.arange(4, dtype=torch.float32))
    inner: list[BaseException | None] = []

    def probe() -> None:
        inner.append(capture(manager.snapshot))
        inner.append(capture(lambda: manager.adopt(tensor_value(1))))

    object.__setattr__(value, "_probe", probe)
    handle = run_with_timeout(lambda: manager.adopt(value))
    object.__setattr__(value, "_probe", None)
    assert inner, "adopt never read the value's tensors"
    assert all(isinstance(exc, ResidencyReentrancyError) for exc in inner), inner
    snap = manager.snapshot()
    assert [v.handle for v in snap.values] == [handle]


def test_same_thread_reentry_during_a_copy_fails() -> None:
    with simulated() as runtime:
        manager = ResidencyManager()
        value = Probe(torch.arange(4, dtype=torch.float32))
        handle = manager.adopt(value, replica_mode=REPLICABLE)
        inner: list[BaseException | None] = []
        object.__setattr__(value, "_probe", lambda: inner.append(capture(manager.snapshot)))
        try:
            run_with_timeout(lambda: manager.ensure(handle, CUDA0))
        finally:
            object.__setattr__(value, "_probe", None)
        assert inner, "the copy never read the value's tensors"
        assert all(isinstance(exc, ResidencyReentrancyError) for exc in inner), inner
        assert runtime.calls["copy_to_cuda"] == 1
        assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST, CUDA0)


def test_the_callback_gate_is_per_manager() -> None:
    manager = ResidencyManager()
    neighbour = ResidencyManager()
    seen: list[Any] = []

    def inside() -> None:
        seen.append(neighbour.adopt(tensor_value()))
        seen.append(neighbour.snapshot())

    handle = manager.register_source(spec(), Source(fresh(), before_load=inside))
    run_with_timeout(lambda: manager.ensure(handle, PAGEABLE_HOST))
    assert len(seen) == 2
    assert len(seen[1].values) == 1


def test_concurrent_transitions_on_one_manager_do_not_deadlock() -> None:
    manager = ResidencyManager()
    handles = [manager.register_source(spec(), Source(fresh())) for _ in range(4)]
    errors: list[BaseException] = []
    done = [0]

    def worker(handle: Any) -> None:
        # An operation that meets another thread's load() is rejected by design
        # (ResidencyReentrancyError): a rejected ensure is skipped, a rejected drop is
        # retried, so every value ends dropped.
        for _ in range(30):
            try:
                manager.ensure(handle, PAGEABLE_HOST)
            except ResidencyReentrancyError:
                continue
            except BaseException as exc:
                errors.append(exc)
                return
            while True:
                try:
                    manager.drop(handle, PAGEABLE_HOST)
                    break
                except ResidencyReentrancyError:
                    time.sleep(0)
                except BaseException as exc:
                    errors.append(exc)
                    return
            done[0] += 1

    threads = [threading.Thread(target=worker, args=(h,), daemon=True) for h in handles]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert errors == []
    assert done[0] > 0
    snap = manager.snapshot()
    assert all(v.materializations == () for v in snap.values)
    assert snap.locations[0].used_bytes == 0
