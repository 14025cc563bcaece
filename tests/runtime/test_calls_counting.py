"""`SimulatedRuntime.calls` counts every seam call exactly, under threads too, and reads
as a ``Counter`` that can be cleared, copied and compared
(docs/concepts/simulation.md#instrumentation)."""

from __future__ import annotations

import collections
import threading

import torch

from fhelium.residency._runtime import SimulatedRuntime
from fhelium.values import ResidentTensor

CUDA0 = torch.device("cuda", 0)


def test_calls_reads_as_a_counter_of_every_call_since_the_last_clear() -> None:
    runtime = SimulatedRuntime(1, auto_complete=True)
    assert runtime.calls == {}
    assert isinstance(runtime.calls, collections.Counter)
    stream = runtime.current_stream(CUDA0)
    event = runtime.record_event(stream)
    runtime.event_query(event)
    runtime.event_query(event)
    assert runtime.calls == {"current_stream": 1, "record_event": 1, "event_query": 2}
    before = runtime.calls.copy()
    runtime.calls.clear()
    assert runtime.calls == {}
    runtime.event_query(event)
    runtime.copy_to_cuda_measured(
        runtime.pin(ResidentTensor(torch.ones(4))), CUDA0, stream, non_blocking=True
    )
    runtime.memory_sample(CUDA0)
    assert runtime.calls == {"event_query": 1, "copy_to_cuda": 1, "memory_sample": 1}
    assert before == {"current_stream": 1, "record_event": 1, "event_query": 2}
    # One Counter object, kept up to date at each read.
    assert runtime.calls is runtime.calls
    assert runtime.calls["wait_event"] == 0
    assert "wait_event" not in runtime.calls


def test_calls_can_be_replaced() -> None:
    runtime = SimulatedRuntime(1)
    runtime.current_stream(CUDA0)
    runtime.calls = collections.Counter({"measure": 5})
    runtime.current_stream(CUDA0)
    assert runtime.calls == {"measure": 5, "current_stream": 1}


def test_calls_are_exact_under_threads_and_reads() -> None:
    """Threads calling the counted seam methods at once, while another reads `calls`:
    every call counted once, none lost or doubled, and a reader never sees a count go
    back. (Clearing while others call is the caller's race: a count made between its
    read and its clear is dropped with it.)"""
    runtime = SimulatedRuntime(1, auto_complete=True)
    stream = runtime.current_stream(CUDA0)
    event = runtime.record_event(stream)
    runtime.event_query(event)
    runtime.is_stream(stream)
    names = ("event_query", "record_event", "is_stream")
    before = {name: runtime.calls[name] for name in names}
    threads, rounds = 4, 2000
    start = threading.Barrier(threads + 1)
    done = threading.Event()
    backwards: list[tuple[str, int, int]] = []
    reads = 0

    def call() -> None:
        start.wait()
        for _ in range(rounds):
            runtime.event_query(event)
            runtime.record_event(stream)
            runtime.is_stream(stream)

    def read() -> None:
        nonlocal reads
        start.wait()
        last = dict(before)
        while not done.is_set():
            calls = runtime.calls
            for name in names:
                count = calls[name]
                if count < last[name]:
                    backwards.append((name, last[name], count))
                last[name] = count
            reads += 1

    workers = [threading.Thread(target=call) for _ in range(threads)]
    reader = threading.Thread(target=read)
    for thread in [*workers, reader]:
        thread.start()
    for thread in workers:
        thread.join()
    done.set()
    reader.join()
    assert reads > 0
    assert backwards == []
    expected = threads * rounds
    assert {name: runtime.calls[name] - before[name] for name in names} == {
        name: expected for name in names
    }


def test_a_calls_counter_kept_from_before_counts_the_calls_made_after() -> None:
    # `calls` is the runtime's live Counter: a test may keep it and read it later.
    runtime = SimulatedRuntime(1, auto_complete=True)
    calls = runtime.calls
    stream = runtime.current_stream(CUDA0)
    event = runtime.record_event(stream)
    runtime.event_query(event)
    runtime.copy_to_cuda_measured(
        runtime.pin(ResidentTensor(torch.ones(4))), CUDA0, stream, non_blocking=True
    )
    runtime.memory_sample(CUDA0)
    assert calls == {
        "current_stream": 1,
        "record_event": 1,
        "event_query": 1,
        "copy_to_cuda": 1,
        "memory_sample": 1,
    }
