"""A pipeline stages the reconstruction of a value whose source `loads_alone` (never
calls a manager) and says its `layout()` before the active step's body: the disk
tier's I/O thread runs its `load()` and copies the value through the pinned staging
ring, and the host returns at once (docs/concepts/values.md#reconstruction). Any other
source still loads under the manager's gate, after the body."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from fhelium.errors import ResidencyMaterializationError
from fhelium.residency import (
    PAGEABLE_HOST,
    PINNED_HOST,
    Recoverability,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    ResidencyValueSpec,
    cuda_location,
)
from fhelium.residency.simulation import SimulatedRuntime, Timeline, use_runtime
from fhelium.values import TensorBundle

CUDA0 = cuda_location("cuda:0")
LAYER = 16384  # floats: 64 KiB, 1 ms at 64 MB/s
COMPUTE_S = 2e-3
IO_THREAD = "fhelium-disk-io"


class Layer:
    """A source like the checkpoint's: one named tensor per layer."""

    loads_alone = True

    def __init__(self, index: int, gate: threading.Event, log: list[tuple[int, str]]) -> None:
        self.index = index
        self.gate = gate
        self.log = log
        self.fail = False
        self.wrong = False
        self.pin: Any = None  # loads into pinned memory through this, when set

    def spec(self) -> ResidencyValueSpec[TensorBundle]:
        return ResidencyValueSpec(
            TensorBundle,
            LAYER * 4,
            LAYER * 4,
            ReplicaMode.REPLICABLE,
            Recoverability.RECONSTRUCTIBLE,
        )

    def layout(self) -> TensorBundle:
        return TensorBundle({"weight": torch.empty(LAYER, device="meta")})

    def load(self) -> TensorBundle:
        self.log.append((self.index, threading.current_thread().name))
        if not self.gate.wait(10):
            raise AssertionError("the test never opened the gate")
        if self.fail:
            raise ValueError(f"layer {self.index} cannot be read (injected)")
        size = LAYER // 2 if self.wrong else LAYER
        value = TensorBundle({"weight": torch.full((size,), float(self.index))})
        return value if self.pin is None else self.pin(value)


class Gated(Layer):
    """The same source without the promise: it loads under the manager's gate."""

    loads_alone = False


def _run(
    kind: type[Layer] = Layer,
    body: Any = None,
    setup: Any = None,
    *,
    pinned: bool = False,
) -> tuple[float, list[tuple[int, ...]], list[float], ResidencyManager, list[Any], list[Any]]:
    timeline = Timeline(h2d_bytes_per_s=64e6, d2h_bytes_per_s=64e6)
    runtime = SimulatedRuntime(1, timeline=timeline)
    gate = threading.Event()
    gate.set()
    log: list[tuple[int, str]] = []
    staged_in_body: list[tuple[int, ...]] = []
    sums: list[float] = []
    with use_runtime(runtime):
        manager = ResidencyManager({CUDA0: 8 * LAYER * 4})
        sources = [kind(index, gate, log) for index in range(4)]
        if setup is not None:
            setup(sources, gate)
        where = PINNED_HOST if pinned else PAGEABLE_HOST
        for source in sources:
            source.pin = runtime.pin if pinned else None
        handles = [
            manager.register_source(source.spec(), source, source_location=where)
            for source in sources
        ]
        requests = [
            ResidencyRequest(f"step-{i}", [ResidencyRequirement(h, CUDA0)])
            for i, h in enumerate(handles)
        ]
        consumer = runtime.create_stream(torch.device("cuda", 0))
        try:
            with ResidencyController(manager).run(
                requests, prefetch=1, consumer_streams={CUDA0: consumer}
            ) as steps:
                for number, step in enumerate(steps):
                    staged_in_body.append(steps.staged)
                    if body is not None:
                        body(number, steps, gate, log)
                    (requirement,) = step.request.requirements
                    value = step.value(requirement.handle, at=CUDA0)
                    assert isinstance(value, TensorBundle)
                    runtime.compute(consumer, COMPUTE_S, reads=value)
                    assert torch.equal(value["weight"], torch.full((LAYER,), float(number)))
                    sums.append(float(value["weight"][0]))
        finally:
            runtime.synchronize_device(torch.device("cuda", 0))
            _MANAGERS.append((manager, handles))
        assert runtime.hazards == []
    return timeline.makespan, staged_in_body, sums, manager, handles, log


_MANAGERS: list[tuple[ResidencyManager, list[Any]]] = []


@pytest.fixture(autouse=True)
def _close_managers() -> Any:
    yield
    while _MANAGERS:
        _MANAGERS.pop()[0].close()


@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
def test_a_source_that_loads_alone_is_staged_before_the_body(pinned: bool) -> None:
    makespan, staged, sums, _, _, log = _run(pinned=pinned)
    assert staged == [(1,), (2,), (3,), ()]
    assert sums == [0.0, 1.0, 2.0, 3.0]
    # Step 0 is loaded in its turn, on the pipeline's thread; the others on the I/O thread.
    assert [name.startswith(IO_THREAD) for _, name in log] == [False, True, True, True]
    assert makespan == pytest.approx(1e-3 + 4 * COMPUTE_S, rel=0.05)


def test_any_other_source_loads_under_the_gate_after_the_body() -> None:
    _, staged, sums, _, _, log = _run(Gated)
    assert staged == [(), (), (), ()]
    assert sums == [0.0, 1.0, 2.0, 3.0]
    assert not any(name.startswith(IO_THREAD) for _, name in log)


def test_the_host_returns_before_the_load_completes() -> None:
    seen: list[tuple[tuple[int, ...], list[int]]] = []

    def setup(sources: list[Layer], gate: threading.Event) -> None:
        sources[0].gate = threading.Event()
        sources[0].gate.set()  # step 0 is loaded in its turn
        gate.clear()

    def body(number: int, steps: Any, gate: threading.Event, log: list[Any]) -> None:
        if number == 0:
            # Step 1's load is running on the I/O thread, blocked: the host got here.
            for _ in range(1000):
                if len(log) == 2:
                    break
                threading.Event().wait(0.01)
            seen.append((steps.staged, [index for index, _ in log]))
            gate.set()

    _, _, sums, _, _, _ = _run(body=body, setup=setup)
    assert seen == [((1,), [0, 1])]
    assert sums == [0.0, 1.0, 2.0, 3.0]


def _nothing_left(manager: ResidencyManager, handles: list[Any], failed: int) -> None:
    assert manager.state_version > 0  # reading it reaps what completed
    snapshot = manager.snapshot()
    for value in snapshot.values:
        for materialization in value.materializations:
            assert (
                materialization.use_count,
                materialization.hold_count,
                materialization.pending_event_count,
            ) == (0, 0, 0)
    (failed_value,) = [v for v in snapshot.values if v.handle == handles[failed]]
    assert failed_value.materializations == ()
    for entry in snapshot.locations:
        assert entry.reserved_bytes == 0


@pytest.mark.parametrize("fault", ["raises", "wrong layout"])
def test_a_failing_source_raises_at_the_step_that_needs_it(fault: str) -> None:
    def setup(sources: list[Layer], gate: threading.Event) -> None:
        if fault == "raises":
            sources[2].fail = True
        else:
            sources[2].wrong = True

    reached: list[int] = []
    error = ValueError if fault == "raises" else ResidencyMaterializationError
    with pytest.raises(error, match="injected" if fault == "raises" else "layout"):
        _run(body=lambda number, *_: reached.append(number), setup=setup)
    assert reached == [0, 1]
    manager, handles = _MANAGERS[-1]
    _nothing_left(manager, handles, 2)
