"""Pooled cuda-python release events, against a fake `cuda.bindings.runtime` (no GPU needed).

`cuda_bindings_available()` must probe the driver once, lazily, and answer False on any
failure (cuda-bindings 13 on a CUDA 12 driver answers every call with
`cudaErrorInsufficientDriver`); the pool must survive an event finalized (by the garbage
collector) in the middle of one of its own operations on the same thread.
"""

from __future__ import annotations

import enum
import gc
import itertools
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, ClassVar

import pytest
import torch

from fhelium.residency._runtime import cuda_events
from fhelium.residency._runtime.cuda_events import CudaEvent, CudaEventPool, cuda_bindings_available
from helpers.limits import capped

DEADLOCK_TIMEOUT_S = 10.0


class CudaError(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInsufficientDriver = 35
    cudaErrorNotReady = 600


# Handles are unique across fakes: an event a failed test left alive may be finalized
# during a later test, through whichever fake is installed then.
_HANDLES = itertools.count(1)
STEPS = ("cudaEventCreateWithFlags", "cudaEventRecord", "cudaEventQuery", "cudaEventDestroy")


class FakeCudart:
    """The slice of `cuda.bindings.runtime` the events use, with the same tuple returns.

    `errors[name]` makes that call answer an error code, `raises[name]` makes it raise;
    every call is logged, and created handles are tracked until destroyed."""

    cudaError_t = CudaError
    cudaEventDisableTiming = 2

    def __init__(
        self,
        *,
        errors: dict[str, CudaError] | None = None,
        raises: dict[str, BaseException] | None = None,
        query_answer: CudaError = CudaError.cudaSuccess,
        create_delay_s: float = 0.0,
    ) -> None:
        self.errors = errors or {}
        self.raises = raises or {}
        self.query_answer = query_answer
        self.create_delay_s = create_delay_s
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.live: set[int] = set()
        self.destroyed: list[int] = []
        self.foreign: list[int] = []
        self._lock = threading.Lock()

    def _enter(self, name: str, *args: Any) -> CudaError:
        with self._lock:
            self.calls.append((name, args))
        if name in self.raises:
            raise self.raises[name]
        return self.errors.get(name, CudaError.cudaSuccess)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def cudaEventCreateWithFlags(self, flags: int) -> tuple[CudaError, int | None]:
        error = self._enter("cudaEventCreateWithFlags", flags)
        if self.create_delay_s:
            time.sleep(self.create_delay_s)
        if error != CudaError.cudaSuccess:
            return error, None
        handle = next(_HANDLES)
        with self._lock:
            self.live.add(handle)
        return error, handle

    def cudaEventRecord(self, handle: int, stream: int) -> tuple[CudaError]:
        return (self._enter("cudaEventRecord", handle, stream),)

    def cudaEventQuery(self, handle: int) -> tuple[CudaError]:
        error = self._enter("cudaEventQuery", handle)
        return (self.query_answer if error == CudaError.cudaSuccess else error,)

    def cudaEventSynchronize(self, handle: int) -> tuple[CudaError]:
        return (self._enter("cudaEventSynchronize", handle),)

    def cudaEventDestroy(self, handle: int) -> tuple[CudaError]:
        error = self._enter("cudaEventDestroy", handle)
        with self._lock:
            if handle in self.live:
                self.live.discard(handle)
                self.destroyed.append(handle)
            else:  # twice, or another fake's
                self.foreign.append(handle)
        return (error,)


class FakeDeviceGuard:
    """Stands in for `torch.cuda.device` and logs the device it is entered with."""

    entered: ClassVar[list[int]] = []

    def __init__(self, index: int) -> None:
        self.index = index

    def __enter__(self) -> None:
        FakeDeviceGuard.entered.append(self.index)

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.fixture
def fake_torch_cuda(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """torch sees one usable device, current index 1; returns the devices the probe entered."""
    FakeDeviceGuard.entered = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device", FakeDeviceGuard)
    return FakeDeviceGuard.entered


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[FakeCudart | None], None]]:
    """Puts a fake `cudart` in the module with a fresh probe; the real answer is re-probed
    afterwards (the reset runs before monkeypatch restores the real module)."""

    def put(fake: FakeCudart | None) -> None:
        monkeypatch.setattr(cuda_events, "_cudart", fake)
        cuda_events._reset_probe()

    yield put
    cuda_events._reset_probe()


# --------------------------------------------------------------------------------------------
# (7) The availability probe.


def test_probe_creates_records_queries_and_destroys_one_event(
    install: Callable[[FakeCudart | None], None], fake_torch_cuda: list[int]
) -> None:
    fake = FakeCudart()
    install(fake)
    assert fake.calls == []  # nothing until asked
    assert cuda_bindings_available() is True
    handle = fake.calls[1][1][0]
    assert fake.calls == [
        ("cudaEventCreateWithFlags", (FakeCudart.cudaEventDisableTiming,)),
        ("cudaEventRecord", (handle, 0)),  # the legacy default stream
        ("cudaEventQuery", (handle,)),
        ("cudaEventDestroy", (handle,)),
    ]
    assert fake_torch_cuda == [1]  # on the device torch reports current
    assert fake.live == set()
    # Cached: asking again touches neither the driver nor torch.
    assert cuda_bindings_available() is True
    assert len(fake.calls) == 4
    assert fake_torch_cuda == [1]


def test_probe_accepts_a_probe_event_not_yet_complete(
    install: Callable[[FakeCudart | None], None], fake_torch_cuda: list[int]
) -> None:
    # Work queued on the legacy default stream can keep the event pending; the driver works.
    fake = FakeCudart(query_answer=CudaError.cudaErrorNotReady)
    install(fake)
    assert cuda_bindings_available() is True
    assert fake.live == set()


@pytest.mark.parametrize("failing", STEPS)
def test_insufficient_driver_answers_false_once_without_leaking(
    install: Callable[[FakeCudart | None], None], fake_torch_cuda: list[int], failing: str
) -> None:
    # cuda-bindings 13 on a CUDA 12 driver: the calls answer cudaErrorInsufficientDriver.
    fake = FakeCudart(errors={failing: CudaError.cudaErrorInsufficientDriver})
    install(fake)
    assert cuda_bindings_available() is False
    probed = list(fake.calls)
    assert probed[0][0] == "cudaEventCreateWithFlags"
    for _ in range(3):
        assert cuda_bindings_available() is False
    assert fake.calls == probed  # probed once per process
    if failing == "cudaEventCreateWithFlags":
        assert fake.names() == ["cudaEventCreateWithFlags"]
    else:  # the probe event was created, so it is destroyed whatever failed after
        assert fake.names()[-1] == "cudaEventDestroy"
        assert fake.live == set()
        assert len(fake.destroyed) == 1


@pytest.mark.parametrize("failing", STEPS)
def test_an_exception_from_the_bindings_answers_false(
    install: Callable[[FakeCudart | None], None], fake_torch_cuda: list[int], failing: str
) -> None:
    fake = FakeCudart(raises={failing: RuntimeError(f"{failing}: cuGetProcAddress not found")})
    install(fake)
    assert cuda_bindings_available() is False
    if failing != "cudaEventCreateWithFlags":
        assert "cudaEventDestroy" in fake.names()
        if failing != "cudaEventDestroy":
            assert fake.live == set()
    assert cuda_bindings_available() is False
    assert fake.names().count("cudaEventCreateWithFlags") == 1


def test_an_exception_from_torch_answers_false(
    install: Callable[[FakeCudart | None], None],
    fake_torch_cuda: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_driver() -> int:
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(torch.cuda, "current_device", no_driver)
    fake = FakeCudart()
    install(fake)
    assert cuda_bindings_available() is False
    assert fake.calls == []


def test_no_cuda_in_torch_answers_false_without_touching_the_bindings(
    install: Callable[[FakeCudart | None], None],
    fake_torch_cuda: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fake = FakeCudart()
    install(fake)
    assert cuda_bindings_available() is False
    assert fake.calls == []
    assert fake_torch_cuda == []


def test_failed_import_answers_false(
    install: Callable[[FakeCudart | None], None], fake_torch_cuda: list[int]
) -> None:
    install(None)
    assert cuda_bindings_available() is False
    assert fake_torch_cuda == []


def test_concurrent_first_calls_probe_once(
    install: Callable[[FakeCudart | None], None], fake_torch_cuda: list[int]
) -> None:
    fake = FakeCudart(create_delay_s=0.05)
    install(fake)
    start = threading.Barrier(8)
    answers: list[bool] = []

    def ask() -> None:
        start.wait()
        answers.append(cuda_bindings_available())

    threads = [threading.Thread(target=ask, daemon=True) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLOCK_TIMEOUT_S)
    assert answers == [True] * 8
    assert fake.names().count("cudaEventCreateWithFlags") == 1


def test_the_probe_is_reset_for_tests(
    install: Callable[[FakeCudart | None], None], fake_torch_cuda: list[int]
) -> None:
    install(FakeCudart(errors={"cudaEventRecord": CudaError.cudaErrorInsufficientDriver}))
    assert cuda_bindings_available() is False
    install(FakeCudart())
    assert cuda_bindings_available() is True


def test_importing_touches_neither_cuda_nor_the_bindings() -> None:
    # In a fresh interpreter, every entry point that would initialise CUDA raises.
    script = textwrap.dedent(
        """
        import torch
        from cuda.bindings import runtime

        def trap(*args, **kwargs):
            raise AssertionError("CUDA touched at import")

        for name in ("is_available", "current_device", "init", "_lazy_init", "device_count"):
            setattr(torch.cuda, name, trap)
        for name in ("cudaEventCreateWithFlags", "cudaEventRecord", "cudaEventQuery",
                     "cudaGetDevice", "cudaSetDevice", "cudaFree"):
            setattr(runtime, name, trap)
        import fhelium.residency
        import fhelium.residency._runtime.cuda_events as events
        import fhelium.residency._runtime.torch_runtime
        assert events._cudart is runtime
        print("imported")
        """
    )
    result = subprocess.run(
        capped([sys.executable, "-c", script]),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "imported"


# --------------------------------------------------------------------------------------------
# (12) The pool, with the fake bindings (no probe involved).


@pytest.fixture
def bindings(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(cuda_events, "_cudart", fake)
    return fake


def _completed(pool: CudaEventPool, count: int) -> list[CudaEvent]:
    events = [pool.record(7, 0) for _ in range(count)]
    for event in events:
        assert event.query()
    return events


class _Cycle:
    """Keeps an event alive in a reference cycle, so only the garbage collector frees it."""

    def __init__(self, event: CudaEvent) -> None:
        self.event = event
        self.me = self


def _run_with_finalizers_inside_the_pool(
    action: Callable[[], object], finalize_one: Callable[[], object]
) -> int:
    """Runs `action` on a thread that, before every C call made by the pool's own code
    (where an allocation could run the garbage collector), finalizes one more event.
    Fails, rather than hangs, if that deadlocks; returns how many times it finalized."""
    errors: list[BaseException] = []
    fired: list[None] = []
    source = cuda_events.__file__

    def hook(frame: FrameType, event: str, arg: object) -> None:
        # Profile functions run untraced, so the finalizer's own pool calls do not recurse.
        if event == "c_call" and frame.f_code.co_filename == source:
            fired.append(None)
            finalize_one()

    def worker() -> None:
        sys.setprofile(hook)
        try:
            action()
        except BaseException as error:  # reported by the test thread
            errors.append(error)
        finally:
            sys.setprofile(None)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    thread.join(DEADLOCK_TIMEOUT_S)
    assert not thread.is_alive(), "the pool deadlocked on an event finalized inside it"
    assert errors == []
    return len(fired)


def _finalizer(mode: str, events: list[CudaEvent]) -> Callable[[], object]:
    """How one event is finalized: by dropping its last reference (`__del__` runs at once),
    or, with the events in reference cycles, by a garbage-collector pass; for the latter the
    caller has disabled automatic collection, so only the hook's pass frees them."""
    if mode == "last-reference":

        def drop() -> None:
            if events:
                events.pop()

        return drop
    for event in events:
        _Cycle(event)
    events.clear()
    return gc.collect


@pytest.mark.parametrize("mode", ["last-reference", "gc"])
@pytest.mark.parametrize("operation", ["record", "release"])
def test_an_event_finalized_inside_the_pool_does_not_deadlock(
    bindings: FakeCudart, mode: str, operation: str
) -> None:
    # A finalizer run by the collector inside a pool operation, on the same thread, gives
    # an event back to the same pool: that must neither deadlock nor lose the event.
    pool = CudaEventPool()
    pending = _completed(pool, 8)
    released = _completed(pool, 1)
    kept: list[CudaEvent] = []
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        finalize_one = _finalizer(mode, pending)
        if operation == "record":
            action: Callable[[], object] = lambda: kept.append(pool.record(7, 0))  # noqa: E731
        else:
            action = released.clear  # the event's `__del__` gives it back
        assert _run_with_finalizers_inside_the_pool(action, finalize_one) > 0
        if mode == "last-reference":
            assert len(pending) < 8  # some were finalized inside the pool's operation
    finally:
        if was_enabled:
            gc.enable()
    pending.clear()
    released.clear()
    gc.collect()
    # Every completed event went back to the pool (none destroyed, none lost or doubled).
    assert bindings.destroyed == []
    assert bindings.foreign == []
    assert len(bindings.live) == pool.pooled(0) + len(kept)
    assert pool.pooled(0) >= 8


def test_the_pool_keeps_at_most_the_limit_and_destroys_the_rest(bindings: FakeCudart) -> None:
    limit = cuda_events._POOL_LIMIT
    pool = CudaEventPool()
    events = _completed(pool, limit + 10)
    assert len(bindings.live) == limit + 10
    events.clear()
    assert pool.pooled(0) == limit
    assert len(bindings.destroyed) == 10
    assert len(bindings.live) == limit
    # Pooled events are re-recorded rather than created.
    creates = bindings.names().count("cudaEventCreateWithFlags")
    reused = pool.record(9, 0)
    assert bindings.names().count("cudaEventCreateWithFlags") == creates
    assert pool.pooled(0) == limit - 1
    name, (handle, stream) = bindings.calls[-1]
    assert (name, stream) == ("cudaEventRecord", 9)
    assert handle in bindings.live
    del reused  # never completed: destroyed, not pooled
    assert pool.pooled(0) == limit - 1
    assert len(bindings.live) == limit - 1


def test_the_pool_is_per_device(bindings: FakeCudart) -> None:
    pool = CudaEventPool()
    on_0 = pool.record(7, 0)
    on_1 = pool.record(8, 1)
    on_0.synchronize()
    on_1.synchronize()
    del on_0, on_1
    assert [pool.pooled(device) for device in range(3)] == [1, 1, 0]
    pool.record(7, 2).synchronize()
    assert bindings.names().count("cudaEventCreateWithFlags") == 3


def test_incomplete_events_are_destroyed_not_pooled(bindings: FakeCudart) -> None:
    bindings.query_answer = CudaError.cudaErrorNotReady
    pool = CudaEventPool()
    event = pool.record(7, 0)
    assert event.query() is False
    del event
    assert pool.pooled(0) == 0
    assert bindings.live == set()


def test_a_binding_error_after_the_probe_still_raises(bindings: FakeCudart) -> None:
    pool = CudaEventPool()
    bindings.errors["cudaEventRecord"] = CudaError.cudaErrorInsufficientDriver
    with pytest.raises(RuntimeError, match="cudaEventRecord failed"):
        pool.record(7, 0)
    gc.collect()
    assert bindings.live == set()  # the event that failed to record is destroyed
    del bindings.errors["cudaEventRecord"]
    bindings.errors["cudaEventCreateWithFlags"] = CudaError.cudaErrorInsufficientDriver
    with pytest.raises(RuntimeError, match="cudaEventCreateWithFlags failed"):
        pool.record(7, 0)
    del bindings.errors["cudaEventCreateWithFlags"]
    event = pool.record(7, 0)
    bindings.errors["cudaEventQuery"] = CudaError.cudaErrorInsufficientDriver
    with pytest.raises(RuntimeError, match="cudaEventQuery failed"):
        event.query()


def test_concurrent_releases_neither_lose_nor_double_pool_events(bindings: FakeCudart) -> None:
    pool = CudaEventPool()
    rounds = 300

    def churn() -> None:
        for _ in range(rounds):
            events = _completed(pool, 3)
            events.clear()

    threads = [threading.Thread(target=churn, daemon=True) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLOCK_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads)
    assert len(bindings.live) == pool.pooled(0)
    assert bindings.foreign == []  # nothing destroyed twice
    assert pool.pooled(0) <= cuda_events._POOL_LIMIT
