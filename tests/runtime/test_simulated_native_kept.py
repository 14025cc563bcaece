"""What the simulated runtime's native calls keep from one call to the next
(docs/concepts/simulation.md#native-calls): the last device given, the last copy's log
record, the streams used lately, and the freed-storage queue. Each is a shortcut: the
results must be what the Python methods give (a subclass, which never gets the native
calls, is the reference), whatever changed in between."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import pytest
import torch

from fhelium.residency import cuda_location
from fhelium.residency.simulation import SimulatedRuntime
from fhelium.values import ResidentTensor

ON_CUDA0 = cuda_location("cuda:0")
ON_CUDA1 = cuda_location("cuda:1")


class PythonPath(SimulatedRuntime):
    """The same runtime, without native calls (only the exact class gets them)."""


def _copies_across(runtime: SimulatedRuntime) -> dict[str, Any]:
    """Copies to both devices, on default and made streams, blocking or not, with the
    device named by new objects, equal ones and strings; what the runtime observed."""
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    # Six streams of their own: more than the native calls keep.
    streams = [runtime.create_stream(cuda0 if i % 2 else cuda1) for i in range(6)]
    source = ResidentTensor(torch.arange(8.0))
    kept = []
    placements = []
    plan: list[tuple[torch.device, Any, bool]] = [
        (cuda0, None, True),
        (cuda0, None, True),
        (cuda0, None, False),
        (torch.device("cuda", 0), None, False),  # an equal device, another object
        (cuda1, None, False),
        (cuda0, streams[1], True),
        (cuda1, streams[0], True),
        (cuda1, streams[0], True),
        *[(stream.device, stream, bool(i % 3)) for i, stream in enumerate(streams * 2)],
        (cuda0, None, True),
    ]
    for device, stream, non_blocking in plan:
        copy, facts = runtime.copy_to_cuda_measured(
            source, device, stream, non_blocking=non_blocking
        )
        assert facts is not None
        kept.append(copy)
        placements.append((runtime.placement(copy), facts.device, facts.storage_nbytes))
    events = [runtime.record_event(stream) for stream in streams * 2]
    log = [
        (copy.destination, None if copy.stream is None else copy.stream.handle, copy.non_blocking)
        for copy in runtime.copies
    ]
    expected = [
        (
            cuda_location(device),
            runtime.current_stream(device).handle if stream is None else stream.handle,
            non_blocking,
        )
        for device, stream, non_blocking in plan
    ]
    assert log == expected
    return {
        "log": [(destination, non_blocking) for destination, _, non_blocking in log],
        "placements": placements,
        "events": [(event.device, runtime.event_query(event)) for event in events],
        "samples": [runtime.memory_sample(cuda0), runtime.memory_sample(cuda1)],
        "calls": dict(runtime.calls),
    }


@pytest.mark.parametrize("auto_complete", [True, False], ids=["auto-complete", "pending"])
def test_copies_to_changing_devices_and_streams_log_and_place_what_they_should(
    auto_complete: bool,
) -> None:
    native = _copies_across(SimulatedRuntime(2, auto_complete=auto_complete))
    python = _copies_across(PythonPath(2, auto_complete=auto_complete))
    assert native == python


def test_a_log_cleared_between_copies_gets_the_next_copy() -> None:
    runtime = SimulatedRuntime(1, auto_complete=True)
    cuda0 = torch.device("cuda", 0)
    source = ResidentTensor(torch.ones(4))
    runtime.copy_to_cuda(source, cuda0, None, non_blocking=True)
    runtime.copies.clear()
    runtime.copy_to_cuda(source, cuda0, None, non_blocking=True)
    assert [(c.destination, c.stream, c.non_blocking) for c in runtime.copies] == [
        (ON_CUDA0, runtime.current_stream(cuda0), True)
    ]


def test_a_device_not_simulated_after_one_that_is_raises_as_before() -> None:
    for runtime in (SimulatedRuntime(1, auto_complete=True), PythonPath(1, auto_complete=True)):
        source = ResidentTensor(torch.ones(4))
        runtime.copy_to_cuda(source, torch.device("cuda", 0), None, non_blocking=True)
        with pytest.raises(ValueError, match="not a simulated CUDA device"):
            runtime.copy_to_cuda(source, torch.device("cuda", 1), None, non_blocking=True)
        assert runtime.memory_sample(torch.device("cuda", 1)) is None
        assert runtime.memory_sample(torch.device("cuda", 0)) is not None


def test_a_stream_of_another_device_raises_after_the_stream_was_used() -> None:
    for runtime in (SimulatedRuntime(2, auto_complete=True), PythonPath(2, auto_complete=True)):
        source = ResidentTensor(torch.ones(4))
        stream = runtime.create_stream(torch.device("cuda", 1))
        runtime.copy_to_cuda(source, torch.device("cuda", 1), stream, non_blocking=True)
        with pytest.raises(ValueError, match="is on cuda:1, not on cuda:0"):
            runtime.copy_to_cuda(source, torch.device("cuda", 0), stream, non_blocking=True)


def _source_changed_in_place(runtime: SimulatedRuntime) -> list[Any]:
    """Copies of one source tensor, changed in place between them in ways that leave its
    ``_version`` alone (``.data``, its storage resized) and in ways that bump it."""
    cuda0 = torch.device("cuda", 0)
    tensor = torch.arange(12.0).view(3, 4)
    source = ResidentTensor(tensor)

    def whole_storage_again() -> None:
        # Its new bytes set: they are not initialised.
        tensor.resize_(4, 6)[2:].zero_()

    changes = [
        lambda: None,
        lambda: tensor.add_(1),
        lambda: setattr(tensor, "data", tensor.data.t()),  # not contiguous now
        lambda: setattr(tensor, "data", tensor.data.t().contiguous()),
        lambda: tensor.untyped_storage().resize_(96),  # more storage than the tensor
        whole_storage_again,
        lambda: tensor.as_strided_((6, 4), (1, 6)),
    ]
    seen = []
    for change in changes:
        change()
        copy, facts = runtime.copy_to_cuda_measured(source, cuda0, None, non_blocking=True)
        measured = runtime.measure(copy)
        assert facts is None or facts == measured
        copied = copy.tensor
        seen.append(
            (
                copied.tolist(),
                (copied.shape, copied.stride(), copied.storage_offset()),
                measured.logical_nbytes,
                measured.storage_nbytes,
                runtime.placement(copy),
            )
        )
    seen.append(dict(runtime.calls))
    return seen


def test_a_source_changed_in_place_between_copies_is_copied_as_it_is_then() -> None:
    native = _source_changed_in_place(SimulatedRuntime(1, auto_complete=True))
    python = _source_changed_in_place(PythonPath(1, auto_complete=True))
    assert native == python
    # The change reached the copies: each copy is the source as it was then.
    assert native[1][0][0][0] == 1.0
    assert native[2][1][1] != native[1][1][1]


def test_storages_freed_anywhere_leave_the_counters() -> None:
    runtime = SimulatedRuntime(1, auto_complete=True)
    cuda0 = torch.device("cuda", 0)
    source = ResidentTensor(torch.ones(256))
    copies = [runtime.copy_to_cuda(source, cuda0, None, non_blocking=True) for _ in range(3)]
    assert runtime.memory_sample(cuda0) == (3 * 1024, 3 * 1024)
    del copies[0]
    assert runtime.memory_sample(cuda0) == (2 * 1024, 2 * 1024)
    # Freed on another thread: its weak reference's callback runs there.
    dropped = threading.Thread(target=copies.pop)
    dropped.start()
    dropped.join()
    assert runtime.memory_sample(cuda0) == (1024, 1024)
    # Freed while a copy registers another: both counted right.
    runtime.copy_to_cuda(copies.pop(), cuda0, None, non_blocking=True)
    assert runtime.memory_sample(cuda0) == (0, 0)
    assert runtime._storage.entries == {}


def test_a_runtime_whose_native_calls_kept_streams_and_records_is_collected() -> None:
    runtime = SimulatedRuntime(2, auto_complete=True)
    source = ResidentTensor(torch.ones(4))
    for index in (0, 1):
        stream = runtime.create_stream(torch.device("cuda", index))
        copy = runtime.copy_to_cuda(source, torch.device("cuda", index), stream, non_blocking=True)
        runtime.record_event(stream)
    gone = weakref.ref(runtime)
    del runtime, stream, copy
    gc.collect()
    assert gone() is None
