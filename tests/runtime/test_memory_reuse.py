"""The simulated runtime's memory-reuse check (docs/concepts/simulation.md#memory-reuse):
a freed device block keeps its readers, and an allocation on the stream that owns it
is a hazard unless every reader is ordered before it (a device wait, a host
synchronisation, or the same stream)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from fhelium.residency.simulation import SimulatedHazard, SimulatedRuntime, Timeline
from fhelium.values import ResidentTensor

DEVICE = torch.device("cuda", 0)


def _setup(
    runtime: SimulatedRuntime,
) -> tuple[object, object, ResidentTensor]:
    transfer = runtime.create_stream(DEVICE)
    consumer = runtime.create_stream(DEVICE)
    value = ResidentTensor(torch.arange(1024, dtype=torch.float32))
    copied = runtime.copy_to_cuda(value, DEVICE, transfer, non_blocking=True)
    assert isinstance(copied, ResidentTensor)
    return transfer, consumer, copied


def _reallocate(runtime: SimulatedRuntime, transfer: object) -> None:
    """After the caller dropped its copy: a new allocation on ``transfer``."""
    gc.collect()
    runtime.copy_to_cuda(ResidentTensor(torch.zeros(1024)), DEVICE, transfer, non_blocking=True)


def test_a_block_reused_while_its_reader_runs_is_a_hazard() -> None:
    runtime = SimulatedRuntime(1)
    transfer, consumer, copied = _setup(runtime)
    runtime.read(consumer, copied)
    runtime.record_event(consumer)  # the lease's release event: never waited for
    del copied
    _reallocate(runtime, transfer)
    assert runtime.hazards == [SimulatedHazard(DEVICE, transfer, consumer, 4096)]
    # Reported once: the block left the pool.
    runtime.copy_to_cuda(ResidentTensor(torch.zeros(4)), DEVICE, transfer, non_blocking=True)
    assert len(runtime.hazards) == 1


def test_a_device_wait_on_the_owning_stream_orders_the_reuse() -> None:
    runtime = SimulatedRuntime(1)
    transfer, consumer, copied = _setup(runtime)
    runtime.read(consumer, copied)
    runtime.wait_event(transfer, runtime.record_event(consumer))
    del copied
    _reallocate(runtime, transfer)
    assert runtime.hazards == []
    assert runtime.pending_event_count() == 1  # nothing waited on the host


def test_a_wait_recorded_before_the_read_does_not_order_it() -> None:
    runtime = SimulatedRuntime(1)
    transfer, consumer, copied = _setup(runtime)
    runtime.wait_event(transfer, runtime.record_event(consumer))
    runtime.read(consumer, copied)
    del copied
    _reallocate(runtime, transfer)
    assert [hazard.reader for hazard in runtime.hazards] == [consumer]


def test_a_wait_by_another_stream_does_not_order_the_owning_one() -> None:
    runtime = SimulatedRuntime(1)
    transfer, consumer, copied = _setup(runtime)
    other = runtime.create_stream(DEVICE)
    runtime.read(consumer, copied)
    runtime.wait_event(other, runtime.record_event(consumer))
    del copied
    _reallocate(runtime, transfer)
    assert [hazard.stream for hazard in runtime.hazards] == [transfer]
    # An allocation on the other stream never reuses the block: no hazard there.
    runtime.hazards.clear()
    _transfer2, consumer2, copied2 = _setup(runtime)
    runtime.read(consumer2, copied2)
    runtime.record_event(consumer2)
    del copied2
    gc.collect()
    runtime.empty_cuda(16, DEVICE, other)
    assert runtime.hazards == []


@pytest.mark.parametrize("how", ["event", "stream", "device", "complete_events", "by_hand"])
def test_a_host_synchronisation_orders_every_later_allocation(how: str) -> None:
    runtime = SimulatedRuntime(1)
    transfer, consumer, copied = _setup(runtime)
    runtime.read(consumer, copied)
    event = runtime.record_event(consumer)
    if how == "event":
        runtime.synchronize_event(event)
    elif how == "stream":
        runtime.synchronize_stream(consumer)
    elif how == "device":
        runtime.synchronize_device(DEVICE)
    elif how == "complete_events":
        runtime.complete_events()
    else:
        event.complete()
    del copied
    _reallocate(runtime, transfer)
    assert runtime.hazards == []


def test_a_read_on_the_owning_stream_is_ordered_by_the_stream() -> None:
    runtime = SimulatedRuntime(1)
    transfer, _consumer, copied = _setup(runtime)
    runtime.read(transfer, copied)
    del copied
    _reallocate(runtime, transfer)
    assert runtime.hazards == []


def test_with_a_timeline_an_event_the_host_reached_orders_the_reuse() -> None:
    runtime = SimulatedRuntime(1, timeline=Timeline())
    transfer, consumer, copied = _setup(runtime)
    runtime.compute(consumer, 0.001, reads=copied)
    event = runtime.record_event(consumer)
    assert not runtime.event_query(event)
    runtime.compute(consumer, 0.0)
    runtime.synchronize_stream(consumer)
    assert runtime.event_query(event)
    del copied
    _reallocate(runtime, transfer)
    assert runtime.hazards == []


def test_a_chain_of_waits_orders_transitively() -> None:
    runtime = SimulatedRuntime(1)
    transfer, consumer, copied = _setup(runtime)
    middle = runtime.create_stream(DEVICE)
    runtime.read(consumer, copied)
    runtime.wait_event(middle, runtime.record_event(consumer))
    runtime.wait_event(transfer, runtime.record_event(middle))
    del copied
    _reallocate(runtime, transfer)
    assert runtime.hazards == []


def test_read_checks_its_arguments() -> None:
    runtime = SimulatedRuntime(1)
    stream = runtime.create_stream(DEVICE)
    with pytest.raises(TypeError):
        runtime.read(stream, object())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        runtime.read(object(), torch.zeros(1))


def test_with_auto_complete_an_event_recorded_after_the_read_orders_the_reuse() -> None:
    # The event completes when recorded: the host has seen it, so every later
    # allocation is ordered after the read; a wait for it adds nothing but the log.
    runtime = SimulatedRuntime(1, auto_complete=True)
    transfer, consumer, copied = _setup(runtime)
    runtime.read(consumer, copied)
    event = runtime.record_event(consumer)
    assert runtime.event_query(event)
    runtime.wait_event(transfer, event)
    assert runtime.waits == [(transfer, event)]
    del copied
    _reallocate(runtime, transfer)
    assert runtime.hazards == []


def test_with_auto_complete_a_read_after_the_last_event_is_a_hazard() -> None:
    runtime = SimulatedRuntime(1, auto_complete=True)
    transfer, consumer, copied = _setup(runtime)
    runtime.wait_event(transfer, runtime.record_event(consumer))
    runtime.read(consumer, copied)
    del copied
    _reallocate(runtime, transfer)
    assert runtime.hazards == [SimulatedHazard(DEVICE, transfer, consumer, 4096)]


def test_with_auto_complete_work_after_an_event_is_taken_in_by_the_next_one() -> None:
    # The first event takes the consumer's work in; the read after it is new work, which
    # the next event (not the first) orders before the reuse.
    runtime = SimulatedRuntime(1, auto_complete=True)
    transfer, consumer, copied = _setup(runtime)
    runtime.record_event(consumer)
    runtime.read(consumer, copied)
    runtime.record_event(consumer)
    del copied
    _reallocate(runtime, transfer)
    assert runtime.hazards == []


def test_a_wait_after_a_host_synchronisation_is_taken_in_by_the_next_one() -> None:
    # The consumer, synchronised once, then waits for the reader's event: synchronising
    # it again orders the read (before that event) before every later allocation.
    runtime = SimulatedRuntime(1)
    transfer, consumer, copied = _setup(runtime)
    reader = runtime.create_stream(DEVICE)
    runtime.read(reader, copied)
    event = runtime.record_event(reader)
    runtime.synchronize_stream(consumer)
    runtime.wait_event(consumer, event)
    runtime.synchronize_stream(consumer)
    del copied
    _reallocate(runtime, transfer)
    assert runtime.hazards == []
    assert runtime.pending_event_count() == 1  # the reader's own event was not waited for


def test_a_runtime_whose_order_keeps_its_streams_is_collected() -> None:
    """The order keeps each reading stream (to name it in a hazard), and a stream refers
    to its runtime: the collector still sees the cycle (a runtime without native calls,
    whose parts are the order and the registry alone)."""

    class Subclass(SimulatedRuntime):
        pass

    runtime = Subclass(1, auto_complete=True)
    stream = runtime.create_stream(DEVICE)
    value = runtime.to_device(ResidentTensor(torch.zeros(4)), 0)
    runtime.read(stream, value)
    collected = weakref.ref(runtime)
    del runtime, stream, value
    gc.collect()
    assert collected() is None


def test_a_runtime_with_native_calls_is_collected() -> None:
    """The exact class holds its native calls' object, which holds the runtime's parts
    (its copies log reaches its streams, which refer back to it): the collector sees
    that cycle too, after a copy, an event and a hazard-free read."""
    runtime = SimulatedRuntime(1, auto_complete=True)
    stream = runtime.create_stream(DEVICE)
    source = runtime.pin(ResidentTensor(torch.zeros(4)))
    copy, _ = runtime.copy_to_cuda_measured(source, DEVICE, stream, non_blocking=True)
    event = runtime.record_event(stream)
    assert runtime.event_query(event)
    assert runtime.copies  # the log refers to the stream
    collected = weakref.ref(runtime)
    del runtime, stream, source, copy, event
    gc.collect()
    assert collected() is None
