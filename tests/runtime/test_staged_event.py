"""`StagedEvent`, the event of a read from disk that the disk tier's I/O thread is
still enqueueing (docs/concepts/locations-and-budgets.md#staging-and-direct-io), as the
simulated runtime takes it wherever it takes an event."""

from __future__ import annotations

import threading

import pytest
import torch

from fhelium.residency._runtime.base import StagedEvent
from fhelium.residency.simulation import SimulatedRuntime


def _runtime() -> tuple[SimulatedRuntime, object]:
    runtime = SimulatedRuntime(1)
    return runtime, runtime.create_stream(torch.device("cuda", 0))


def test_incomplete_until_enqueued_then_the_real_event() -> None:
    runtime, stream = _runtime()
    staged = StagedEvent()
    assert runtime.event_query(staged) is False
    real = runtime.record_event(stream)
    staged.finish(real, None)
    assert runtime.event_query(staged) is runtime.event_query(real)
    runtime.synchronize_event(staged)
    assert runtime.event_query(staged) is True


def test_a_wait_blocks_the_host_until_the_copies_are_enqueued() -> None:
    runtime, stream = _runtime()
    consumer = runtime.create_stream(torch.device("cuda", 0))
    staged = StagedEvent()
    real = runtime.record_event(stream)
    finisher = threading.Timer(0.05, staged.finish, (real, None))
    finisher.start()
    runtime.wait_event(consumer, staged)  # returns once finished, ordered after `real`
    assert staged.enqueued()
    assert runtime.waits[-1] == (consumer, real)
    finisher.join()


def test_a_failed_read_raises_until_claimed_and_protects_until_then() -> None:
    runtime, stream = _runtime()
    staged = StagedEvent()
    staged.finish(None, OSError("injected"))
    # Unclaimed: never complete, and whoever would read the bytes gets the error.
    assert runtime.event_query(staged) is False
    with pytest.raises(OSError, match="injected"):
        runtime.wait_event(stream, staged)
    with pytest.raises(OSError, match="injected"):
        runtime.synchronize_event(staged)
    # Its issuer claims it: from then on it is complete, with nothing to wait for.
    error = staged.claim()
    assert isinstance(error, OSError)
    assert runtime.event_query(staged) is True
    runtime.wait_event(stream, staged)
    runtime.synchronize_event(staged)
