"""The simulated runtime's share of a pipeline step (issue 26, per-step cost): the seam
calls of one step run few Python frames of the runtime's own, and what every step
repeats runs none. Counted with a profiler, not timed, so the figures are exact; the
behaviour they stand for is checked where it is documented (test_memory_reuse.py,
test_simulated_sampling.py, test_measured_copies.py)."""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable
from types import FrameType

import pytest
import torch

from fhelium.residency import cuda_location
from fhelium.residency.simulation import SimulatedRuntime
from fhelium.values import ResidentTensor, TensorBundle, TensorResident, TensorSequence

CUDA0 = torch.device("cuda", 0)

# The runtime's seam methods a step calls (bench_step.py): their own frames are the
# calls themselves, not counted against the runtime.
SEAM = {"copy_to_cuda_measured", "record_event", "event_query"}


def _frames_during(action: Callable[[], object]) -> list[str]:
    """The Python functions ``action`` (a Python function) enters, in order: its own
    frame is not listed, nor are C functions."""
    names: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            names.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    assert names[0] == action.__code__.co_name  # type: ignore[attr-defined]
    return names[1:]


def test_a_step_s_seam_calls_enter_few_frames_of_the_runtime() -> None:
    # As a step of `controller.run(..., prefetch=1)`: one copy of a pinned layer (an
    # older copy is freed), two events recorded after it, three queries.
    runtime = SimulatedRuntime(1, auto_complete=True)
    stream = runtime.create_stream(CUDA0)
    source = runtime.pin(ResidentTensor(torch.zeros(8)))
    alive: deque[TensorResident] = deque(maxlen=2)

    def step() -> None:
        copied, facts = runtime.copy_to_cuda_measured(source, CUDA0, stream, non_blocking=True)
        assert facts is not None
        alive.append(copied)
        first = runtime.record_event(stream)
        assert runtime.event_query(first)
        second = runtime.record_event(stream)
        assert runtime.event_query(second)
        assert runtime.event_query(first)

    for _ in range(3):
        step()
    frames = _frames_during(step)
    assert sum(name in SEAM for name in frames) == 6
    own = [name for name in frames if name not in SEAM]
    # The copy, its registration (which takes the freed copy out and checks the reuse
    # order) and the records' order are the native seam's (`SimulatedSeam`): none.
    assert own == [], own
    assert runtime.hazards == []
    assert runtime.memory_sample(CUDA0) == (64, 1024)
    assert runtime.placement(alive[-1]) == cuda_location("cuda:0")


@pytest.mark.parametrize(
    "value",
    [
        TensorBundle({"a": torch.zeros(2), "b": torch.ones(1)}),
        TensorSequence([torch.zeros(2), torch.ones(1)]),
    ],
    ids=["TensorBundle", "TensorSequence"],
)
def test_reading_a_library_value_s_fields_runs_no_python_code(value: TensorResident) -> None:
    assert _frames_during(lambda: value._resident_tensors) == []


def test_an_event_recorded_where_the_host_has_taken_everything_in_adds_no_frame() -> None:
    # With auto_complete the first record takes the stream's work in; a second one,
    # with nothing enqueued in between, has nothing to take in. Both are the native
    # seam's (`SimulatedSeam`), which takes the work in without a frame.
    runtime = SimulatedRuntime(1, auto_complete=True)
    stream = runtime.create_stream(CUDA0)
    runtime.copy_to_cuda(ResidentTensor(torch.zeros(4)), CUDA0, stream, non_blocking=True)
    assert _frames_during(lambda: runtime.record_event(stream)) == ["record_event"]
    assert runtime._order.clean == {stream.handle}
    assert _frames_during(lambda: runtime.record_event(stream)) == ["record_event"]
    assert runtime.calls["record_event"] == 2
