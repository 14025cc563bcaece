"""`ResidencyController.run` (docs/concepts/controller.md#prefetch): each step sees its
own values, budgets hold, later steps' transfers are issued ahead on transfer streams
and waited for by the consumer only when first used, and every way out of a pipeline
(the end, `break`, a failing source, copy or body) leaves nothing of it behind."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fhelium.errors import ResidencyPlanError
from fhelium.residency import (
    PINNED_HOST,
    DeterministicTieredLRU,
    MemoryReservation,
    Recoverability,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    ResidencyUse,
    ResidencyValueSpec,
    cuda_location,
)
from fhelium.residency._runtime import SimulatedRuntime, use_runtime
from fhelium.residency.pipeline import ResidencyPipeline
from fhelium.residency.schedule import ScheduleAwarePolicy
from fhelium.values import ResidentTensor
from helpers.controller import fewest_misses, leftovers
from helpers.manager import assert_balanced

CUDA = cuda_location("cuda:0")
N = 256  # floats per value
SIZE = 4 * N
SPEC = ResidencyValueSpec(
    ResidentTensor, SIZE, SIZE, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
)


class _Source:
    """Loads value `index` (every element equal to `index`) into pinned memory; can be
    told to fail from its `fail_from`-th load on."""

    def __init__(self, runtime: SimulatedRuntime, index: int) -> None:
        self.runtime = runtime
        self.index = index
        self.loads = 0
        self.fail_from: int | None = None

    def load(self) -> ResidentTensor:
        self.loads += 1
        if self.fail_from is not None and self.loads >= self.fail_from:
            raise OSError(f"source {self.index} is unreadable")
        return self.runtime.pin(ResidentTensor(torch.full((N,), float(self.index))))


class _Env:
    def __init__(self, runtime: SimulatedRuntime, slots: int, count: int) -> None:
        self.runtime = runtime
        self.manager = ResidencyManager({CUDA: slots * SIZE, PINNED_HOST: 64 * SIZE})
        self.sources = [_Source(runtime, index) for index in range(count)]
        self.handles = [
            self.manager.register_source(SPEC, source, source_location=PINNED_HOST)
            for source in self.sources
        ]
        self.stream = runtime.current_stream(torch.device("cuda", 0))

    def request(self, step: int, *indices: int, reserve: int = 0) -> ResidencyRequest:
        return ResidencyRequest(
            f"step-{step}",
            tuple(ResidencyRequirement(self.handles[i], CUDA) for i in indices),
            (MemoryReservation(CUDA, reserve, "scratch"),) if reserve else (),
        )

    def requests(self, order: list[tuple[int, ...]]) -> list[ResidencyRequest]:
        return [self.request(step, *indices) for step, indices in enumerate(order)]


@pytest.fixture
def runtime() -> Iterator[SimulatedRuntime]:
    simulated = SimulatedRuntime(1, pinned=True)
    with use_runtime(simulated):
        yield simulated


def _run(
    env: _Env,
    controller: ResidencyController,
    requests: list[ResidencyRequest],
    prefetch: int,
) -> list[float]:
    """Runs the pipeline; returns each step's values (their first elements), checking
    each step's budget and balance, and completing events as a GPU would."""
    seen: list[float] = []
    with controller.run(requests, prefetch=prefetch, consumer_streams={CUDA: env.stream}) as steps:
        for step in steps:
            for requirement in step.request.requirements:
                value = step.value(requirement.handle, at=CUDA)
                assert isinstance(value, ResidentTensor)
                seen.append(float(value.tensor[0]))
            snapshot = env.manager.snapshot()
            assert_balanced(snapshot)
            for entry in snapshot.locations:
                if entry.budget_bytes is not None:
                    assert entry.used_bytes + entry.reserved_bytes <= entry.budget_bytes
            env.runtime.complete_events()
    return seen


def _consume(steps: ResidencyPipeline, runtime: SimulatedRuntime) -> None:
    for _step in steps:
        runtime.complete_events()


def test_prefetch_zero_is_use_after_use(runtime: SimulatedRuntime) -> None:
    order = [(0,), (1,), (2,), (0,), (3,), (1,)]
    plain = _Env(runtime, 2, 4)
    other = SimulatedRuntime(1, pinned=True)
    with use_runtime(other):
        piped = _Env(other, 2, 4)
    decisions = []
    controller = ResidencyController(plain.manager)
    for request in plain.requests(order):
        with controller.use(request, consumer_streams={CUDA: plain.stream}) as use:
            decisions.append([str(action) for action in use.decision.plan.reclaim])
        runtime.complete_events()
    with use_runtime(piped.runtime):
        controller = ResidencyController(piped.manager)
        got = []
        with controller.run(
            piped.requests(order), consumer_streams={CUDA: piped.stream}
        ) as pipeline:
            assert isinstance(pipeline, ResidencyPipeline)
            for step in pipeline:
                assert isinstance(step, ResidencyUse)
                assert pipeline.staged == ()
                got.append([str(action) for action in step.decision.plan.reclaim])
                piped.runtime.complete_events()
    # The same evictions, named by each manager's own handles.
    assert [len(actions) for actions in got] == [len(actions) for actions in decisions]
    assert [s.loads for s in piped.sources] == [s.loads for s in plain.sources]


@settings(max_examples=40, deadline=None)
@given(
    order=st.lists(st.integers(0, 5), min_size=1, max_size=24),
    slots=st.integers(2, 4),
    prefetch=st.integers(0, 3),
    aware=st.booleans(),
)
def test_every_step_sees_its_own_values(
    order: list[int], slots: int, prefetch: int, aware: bool
) -> None:
    runtime = SimulatedRuntime(1, pinned=True)
    with use_runtime(runtime):
        env = _Env(runtime, slots, 6)
        requests = env.requests([(index,) for index in order])
        policy = ScheduleAwarePolicy(requests) if aware else DeterministicTieredLRU()
        controller = ResidencyController(env.manager, policy=policy)
        assert _run(env, controller, requests, prefetch) == [float(i) for i in order]
        assert leftovers(env.manager) == (0, 0, 0)
        assert env.manager._engine.core.transfer_count() == 0
        env.manager.close()


def test_transfers_are_issued_one_step_ahead_on_a_transfer_stream(
    runtime: SimulatedRuntime,
) -> None:
    env = _Env(runtime, 3, 4)
    requests = env.requests([(0,), (1,), (2,), (3,)])
    controller = ResidencyController(env.manager)
    with controller.run(requests, prefetch=1, consumer_streams={CUDA: env.stream}) as steps:
        first = next(steps)
        assert first.request.name == "step-0"
        # Step 1's copy was issued before step 0's body, on a stream of its own, and
        # nothing has waited for it yet.
        assert steps.staged == (1,)
        assert len(runtime.copies) == 2
        transfer = runtime.copies[1].stream
        assert transfer is not None
        assert transfer is not env.stream
        assert runtime.copies[1].non_blocking
        assert runtime.waits == []
        assert env.manager._engine.core.transfer_count() == 1
        second = next(steps)
        # First use: the consumer stream waits for the transfer's event, on the device.
        assert [(stream, event.stream) for stream, event in runtime.waits] == [
            (env.stream, transfer)
        ]
        assert float(second.value(env.handles[1], at=CUDA).tensor[0]) == 1.0
        assert steps.staged == (2,)


def test_a_prefetched_value_is_protected_until_its_copy_completes(
    runtime: SimulatedRuntime,
) -> None:
    env = _Env(runtime, 3, 3)
    env.manager.ensure(env.handles[1], PINNED_HOST)
    controller = ResidencyController(env.manager)
    requests = env.requests([(0,), (1,)])
    with controller.run(requests, prefetch=1, consumer_streams={CUDA: env.stream}) as steps:
        next(steps)
        entry = next(v for v in env.manager.snapshot().values if v.handle == env.handles[1])
        (pinned,) = [m for m in entry.materializations if m.location == PINNED_HOST]
        (on_device,) = [m for m in entry.materializations if m.location == CUDA]
        # The destination is held for its step and pending on the copy; the source the
        # copy reads is pending on it too.
        assert (on_device.hold_count, on_device.pending_event_count) == (1, 1)
        assert pinned.pending_event_count == 1
        runtime.complete_events()
        entry = next(v for v in env.manager.snapshot().values if v.handle == env.handles[1])
        assert [m.pending_event_count for m in entry.materializations] == [0, 0]


def test_prefetch_never_evicts_the_active_steps_values(runtime: SimulatedRuntime) -> None:
    # Two slots: step 1 cannot be staged while step 0 holds one slot and step -1's
    # pending lease the other, until that lease's events are waited for.
    env = _Env(runtime, 2, 3)
    controller = ResidencyController(env.manager)
    requests = env.requests([(0,), (1,), (2,), (0,)])
    seen = []
    with controller.run(requests, prefetch=1, consumer_streams={CUDA: env.stream}) as steps:
        for step in steps:
            (requirement,) = step.request.requirements
            seen.append(float(step.value(requirement.handle, at=CUDA).tensor[0]))
            # Never complete events by hand: the pipeline waits for them itself.
    assert seen == [0.0, 1.0, 2.0, 0.0]
    assert runtime.calls["synchronize_event"] > 0


def test_reservations_are_kept_for_a_staged_step(runtime: SimulatedRuntime) -> None:
    env = _Env(runtime, 4, 3)
    controller = ResidencyController(env.manager)
    requests = [env.request(0, 0), env.request(1, 1, reserve=SIZE), env.request(2, 2)]
    with controller.run(requests, prefetch=1, consumer_streams={CUDA: env.stream}) as steps:
        next(steps)
        cuda = next(e for e in env.manager.snapshot().locations if e.location == CUDA)
        assert cuda.reserved_bytes == SIZE  # staged step 1's scratch
        next(steps)
        cuda = next(e for e in env.manager.snapshot().locations if e.location == CUDA)
        assert cuda.reserved_bytes == SIZE  # now the step's own scope holds it
        next(steps)
    assert leftovers(env.manager) == (0, 0, 0)


def test_break_releases_everything(runtime: SimulatedRuntime) -> None:
    env = _Env(runtime, 4, 6)
    controller = ResidencyController(env.manager)
    requests = env.requests([(i % 6,) for i in range(12)])
    for step in controller.run(requests, prefetch=2, consumer_streams={CUDA: env.stream}):
        if step.request.name == "step-2":
            break
    assert leftovers(env.manager) == (0, 0, 0)
    assert env.manager._engine.core.transfer_count() == 0
    runtime.complete_events()
    env.manager.close()  # nothing left open: no ResidencyInUseError


def test_a_closed_pipeline_yields_nothing(runtime: SimulatedRuntime) -> None:
    env = _Env(runtime, 3, 3)
    pipeline = ResidencyController(env.manager).run(
        env.requests([(0,), (1,)]), prefetch=1, consumer_streams={CUDA: env.stream}
    )
    step = next(pipeline)
    pipeline.close()
    with pytest.raises(RuntimeError):
        _ = step.values
    assert list(pipeline) == []
    assert leftovers(env.manager) == (0, 0, 0)


@pytest.mark.parametrize("failing_load", [1, 2, 3])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_a_failing_source_leaves_nothing_behind(
    runtime: SimulatedRuntime, failing_load: int, prefetch: int
) -> None:
    env = _Env(runtime, 2, 4)
    env.sources[2].fail_from = failing_load
    controller = ResidencyController(env.manager)
    # Two slots, four values: every value is evicted between two of its uses.
    requests = env.requests([(2,), (0,), (1,), (3,), (2,), (0,), (1,), (3,), (2,)])
    with pytest.raises(Exception) as raised:  # noqa: PT011 - checked below
        _run(env, controller, requests, prefetch)
    assert "unreadable" in "".join(map(str, [raised.value, raised.value.__cause__]))
    assert leftovers(env.manager) == (0, 0, 0)
    assert env.manager._engine.core.transfer_count() == 0
    assert_balanced(env.manager.snapshot())
    runtime.complete_events()
    env.manager.close()


@pytest.mark.parametrize("failing_copy", [1, 2, 3])
def test_a_failing_copy_leaves_nothing_behind(runtime: SimulatedRuntime, failing_copy: int) -> None:
    env = _Env(runtime, 3, 4)
    controller = ResidencyController(env.manager)
    requests = env.requests([(0,), (1,), (2,), (3,), (0,), (1,)])
    pipeline = controller.run(requests, prefetch=1, consumer_streams={CUDA: env.stream})

    def consume() -> None:
        for index, _step in enumerate(pipeline):
            if index + 1 == failing_copy:
                runtime.fail_next("copy_to_cuda")
            runtime.complete_events()

    with pytest.raises(RuntimeError, match="injected failure"), pipeline:
        consume()
    assert leftovers(env.manager) == (0, 0, 0)
    assert env.manager._engine.core.transfer_count() == 0
    assert_balanced(env.manager.snapshot())
    runtime.complete_events()
    env.manager.close()


@pytest.mark.parametrize("failing_step", [0, 1, 3])
def test_a_raising_body_leaves_nothing_behind(runtime: SimulatedRuntime, failing_step: int) -> None:
    env = _Env(runtime, 3, 4)
    controller = ResidencyController(env.manager)
    requests = env.requests([(0,), (1,), (2,), (3,)])

    def consume(steps: ResidencyPipeline) -> None:
        for index, _step in enumerate(steps):
            if index == failing_step:
                _ = 1 / 0

    steps = controller.run(requests, prefetch=2, consumer_streams={CUDA: env.stream})
    with pytest.raises(ZeroDivisionError), steps:
        consume(steps)
    assert leftovers(env.manager) == (0, 0, 0)
    assert env.manager._engine.core.transfer_count() == 0
    runtime.complete_events()
    env.manager.close()


def test_a_step_that_cannot_fit_raises_and_releases(runtime: SimulatedRuntime) -> None:
    env = _Env(runtime, 1, 3)
    controller = ResidencyController(env.manager)
    requests = [env.request(0, 0), env.request(1, 1, 2)]  # step 1 needs two slots
    pipeline = controller.run(requests, prefetch=1, consumer_streams={CUDA: env.stream})
    with pytest.raises(ResidencyPlanError), pipeline:
        _consume(pipeline, runtime)
    assert leftovers(env.manager) == (0, 0, 0)


def test_argument_checks(runtime: SimulatedRuntime) -> None:
    env = _Env(runtime, 2, 2)
    controller = ResidencyController(env.manager)
    requests = env.requests([(0,)])
    with pytest.raises(TypeError):
        controller.run(requests[0])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        controller.run(requests, prefetch=1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        controller.run(requests, prefetch=True)
    with pytest.raises(ValueError, match="prefetch"):
        controller.run(requests, prefetch=-1)
    with pytest.raises(TypeError):
        controller.run(requests, consumer_streams=[env.stream])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a CUDA location"):
        controller.run(requests, consumer_streams={PINNED_HOST: env.stream})
    steps: Any = controller.run(["not a request"], consumer_streams={CUDA: env.stream})
    with pytest.raises(TypeError, match=r"requests\[0\]"):
        next(steps)
    # A request whose CUDA location has no consumer stream: use's own check.
    with pytest.raises(ValueError, match="consumer_streams"):
        next(controller.run(requests))


def test_a_joining_consumer_stream_waits_for_an_in_flight_copy(
    runtime: SimulatedRuntime,
) -> None:
    env = _Env(runtime, 3, 3)
    controller = ResidencyController(env.manager)
    requests = env.requests([(0,), (1,)])
    other = runtime.create_stream(torch.device("cuda", 0))
    with controller.run(requests, prefetch=1, consumer_streams={CUDA: env.stream}) as steps:
        next(steps)
        step = next(steps)  # step 1's copy is still in flight: nothing completed it
        assert len(runtime.waits) == 1
        # A staged step's leases are one native object: its one lease joins the stream
        # as `ResidencyLease.add_consumer_stream` does.
        step._entry.add_consumer_stream(0, other)
        assert [stream for stream, _ in runtime.waits] == [env.stream, other]


def test_a_copy_reading_an_in_flight_value_waits_for_it(runtime: SimulatedRuntime) -> None:
    env = _Env(runtime, 3, 3)
    controller = ResidencyController(env.manager)
    requests = env.requests([(0,), (1,)])
    with controller.run(requests, prefetch=1, consumer_streams={CUDA: env.stream}) as steps:
        next(steps)
        # Step 1's value was loaded and copied in: the device copy, still in flight, is
        # its only materialisation. Copying it out reads it, so the copy is waited for.
        before = runtime.calls["synchronize_event"]
        env.manager.ensure(env.handles[1], PINNED_HOST)
        assert runtime.calls["synchronize_event"] == before + 1
        value = env.manager.acquire([env.handles[1]], at=PINNED_HOST)
        assert float(value.values[env.handles[1]].tensor[0]) == 1.0
        value.release()


@settings(max_examples=40, deadline=None)
@given(
    order=st.lists(st.integers(0, 5), min_size=1, max_size=14),
    slots=st.integers(1, 4),
    cyclic=st.booleans(),
)
def test_without_prefetch_schedule_aware_loads_as_few_as_possible(
    order: list[int], slots: int, cyclic: bool
) -> None:
    # Each step waits for the ended steps before it evicts, so the value just used is
    # a candidate like any other, and the count is Belady's MIN (here: the fewest
    # misses over every choice of victims, by exhaustive search).
    if cyclic:
        order = [step % (slots + 2) for step in range(len(order))]
    runtime = SimulatedRuntime(1, pinned=True)
    with use_runtime(runtime):
        env = _Env(runtime, slots, 6)
        requests = env.requests([(index,) for index in order])
        controller = ResidencyController(env.manager, policy=ScheduleAwarePolicy(requests))
        with controller.run(requests, consumer_streams={CUDA: env.stream}) as steps:
            for _step in steps:
                pass  # never completed by hand: the pipeline waits where it must
        loads = sum(source.loads for source in env.sources)
        assert loads == fewest_misses(tuple(order), slots)
        runtime.complete_events()
        env.manager.close()
