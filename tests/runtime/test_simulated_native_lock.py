"""The simulated runtime's native calls count as the Python methods count and keep to
the runtime's lock (docs/concepts/simulation.md#native-calls): a count is the value
plus one, whatever the value; a native call whose work needs the lock waits while
another thread holds it, and leaves it free."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from fhelium.residency.simulation import SimulatedRuntime
from fhelium.values import ResidentTensor

CUDA0 = torch.device("cuda", 0)


class PythonPath(SimulatedRuntime):
    """The same runtime, without native calls (only the exact class gets them)."""


def _counted(runtime: SimulatedRuntime) -> dict[str, Any]:
    stream = runtime.current_stream(CUDA0)
    runtime.calls["record_event"] = -3
    runtime.calls["event_query"] = 1.5
    runtime.calls["memory_sample"] = 1 << 70
    event = runtime.record_event(stream)
    runtime.event_query(event)
    runtime.memory_sample(CUDA0)
    return dict(runtime.calls)


def test_a_native_count_adds_one_to_whatever_value_calls_holds() -> None:
    counted = _counted(SimulatedRuntime(1, auto_complete=True))
    assert counted == _counted(PythonPath(1, auto_complete=True))
    assert counted["record_event"] == -2
    assert counted["event_query"] == 2.5
    assert counted["memory_sample"] == (1 << 70) + 1


def _copied(runtime: SimulatedRuntime) -> Any:
    """A stream whose last work is a copy (the host has not taken it in since)."""
    stream = runtime.current_stream(CUDA0)
    runtime.copy_to_cuda_measured(
        runtime.pin(ResidentTensor(torch.ones(4))), CUDA0, stream, non_blocking=True
    )
    return stream


@pytest.mark.parametrize(
    "call",
    [
        lambda runtime, stream: runtime.record_event(stream),
        lambda runtime, stream: runtime.memory_sample(CUDA0),
    ],
    ids=["record_event", "memory_sample"],
)
def test_a_native_call_waits_for_the_lock_another_thread_holds(
    call: Callable[[SimulatedRuntime, Any], Any],
) -> None:
    runtime = SimulatedRuntime(1, auto_complete=True)
    stream = _copied(runtime)
    lock = runtime._lock
    done = threading.Event()

    def run() -> None:
        call(runtime, stream)
        done.set()

    lock.acquire()
    try:
        worker = threading.Thread(target=run)
        worker.start()
        assert not done.wait(0.2)
    finally:
        lock.release()
    worker.join(10)
    assert done.is_set()
    assert not lock.locked()
    # Free, it is not left held either.
    _copied(runtime)
    call(runtime, stream)
    assert not lock.locked()
