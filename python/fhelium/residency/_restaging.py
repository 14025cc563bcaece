"""A pipeline's restagings: a step staged again, in a cyclic schedule's steady state,
by its request's last plan run again (docs/concepts/controller.md#staging). Split from
`_pipeline` (its `Pipeline` calls these), whose state they read and change.
"""

from __future__ import annotations

import collections
import time
from typing import Any, NoReturn, Protocol

from fhelium.errors import ResidencyBudgetError, ResidencyPlanError
from fhelium.residency import _plans
from fhelium.residency._decider import Decider
from fhelium.residency._staging import Shape, Staged
from fhelium.residency.request import ResidencyRequest
from fhelium.residency.schedule import ScheduleAwarePolicy, deciding_at, position_after


class Pipeline(Protocol):
    """What a restaging reads and changes of its pipeline (`_pipeline.Pipeline`, which
    calls these: this module does not import it)."""

    controller: Any
    staged: dict[int, Staged]
    streams: dict[Any, tuple[dict[Any, Any], dict[Any, Any]]]

    def streams_of(self, shape: Shape) -> tuple[dict[Any, Any], dict[Any, Any]]: ...

    def forget_reads(self, staged: dict[int, Staged]) -> None: ...


__all__ = ["restage", "restage_first"]

_time_ns = time.time_ns
_new_object = object.__new__


def restage_first(
    pipeline: Pipeline,
    index: int,
    distance: int,
    request: ResidencyRequest,
    ended: collections.deque[list[int]],
    wait: bool,
) -> bool | None:
    """`Pipeline._stage`'s first decision where nothing else is staged and the step's request,
    without reservations, was staged before since the last discard (a cyclic
    schedule's steady state): its last plan runs again if decided again, by the
    native call `Decider.restage` makes, its arguments kept with the request's runs
    (`StagedRuns.kit`, lowered while as many values were discarded as when that plan
    was; a value discarded since makes the core refuse them). Whether
    the step is staged; None where this does not apply or the search decided
    otherwise (nothing ran: `Pipeline._stage` decides afresh)."""
    controller: Decider = pipeline.controller
    shape = controller.shapes.get(id(request))
    if shape is None or shape.request is not request or shape.needs:
        return None
    runs = shape.runs
    last = runs.last
    if last is None or last[0][0] is not request:
        return None
    engine = controller.engine
    pending_among = engine.pending_among
    while ended and not pending_among(ended[0]):
        ended.popleft()  # completed on their own: nothing to wait for
    kit = runs.kit
    if kit is None or kit[0] != last[0][1]:
        discards = engine.discard_count()
        if last[0][1] != discards:
            return None
        arguments = controller.rerun_arguments(request, discards)
        if arguments is None:
            return None  # not lowered for it yet: `Pipeline._stage` runs it again (`restage`)
        kit = runs.kit = (discards, *arguments)
    _, lowering, limit, cuda_count, native, schedule_index = kit
    schedule = None
    if schedule_index is not None:
        # As `Decider.restage`: a forked child is refused first, and a one-pass
        # schedule that has run out says so.
        engine.check_process()
        policy: ScheduleAwarePolicy = controller.policy  # type: ignore[assignment]
        position = position_after(policy, policy.position, distance - 1)
        deciding_at(policy, position)
        schedule = (schedule_index, position)
    blocking = None if wait else getattr(engine.runtime, "staged_events", False)
    (_, _, previous), (_, actions, lowered) = last
    streams = pipeline.streams.get(shape.devices)
    if streams is None:
        streams = pipeline.streams_of(shape)
    # `Staged(shape, streams, engine)`, without its frame.
    staged = _new_object(Staged)
    staged.engine = engine
    holds: list[int] = []
    staged.holds = holds
    staged.needs = shape.needs
    staged.request = request
    staged.shape = shape
    staged.streams = streams
    tier = engine.disk  # reads from disk go to its I/O thread, as in `Pipeline._stage`
    reads, deferred = tier.defer(engine.runtime)
    run = engine.plan_run()
    started = _time_ns()
    try:
        try:
            # `with controller.lock`, spelled out: the same hold, fewer steps.
            lock = controller.lock
            lock.acquire()
            try:
                again = engine.stage_request(
                    lowering,
                    limit,
                    cuda_count,
                    previous,
                    run,
                    lowered.ir,
                    lowered.handles,
                    actions,
                    streams[1],
                    (shape.holds, holds),
                    native,
                    schedule,
                    None,
                    not ended,
                    blocking,
                )
            finally:
                lock.release()
        finally:
            tier.undefer(deferred)
            staged.reads = reads
    except BaseException as error:
        if run.phase is None and not len(run) and not staged.holds:
            # The search's (nothing ran): as `Pipeline._stage`, not staged now; with
            # ``wait``, it waits and decides again.
            if isinstance(error, (ResidencyPlanError, ResidencyBudgetError)):
                return None if wait else False
            raise
        try:
            restage_failed(pipeline, index, request, run, staged, started, error, actions)
        except (ResidencyPlanError, ResidencyBudgetError):
            return None if wait else False  # as the search's refusal
    if again is None:
        return False  # its copies would block the host
    found, ran = again
    if ran:
        pipeline.staged[index] = staged
        return True
    if found is not None and not found.feasible:
        return None if wait else False  # as the search's refusal
    return None


def restage_failed(
    pipeline: Pipeline,
    index: int,
    request: ResidencyRequest,
    run: Any,
    staged: Staged,
    started: int,
    error: BaseException,
    actions: tuple[Any, ...],
) -> NoReturn:
    """Raises what a staging's plan run again raised for ``error`` once it had run
    (part of) its plan: what the plan committed stays; a failed read's copy goes."""
    try:
        staged.release()
    finally:
        pipeline.forget_reads({index: staged})
    failure = _plans.staging_failure(request.name, run, started, error, actions)
    if failure is error:
        raise error
    raise failure from error


def restage(
    pipeline: Pipeline,
    index: int,
    request: ResidencyRequest,
    position: int | None,
    shape: Shape,
    last: tuple[tuple[Any, ...], Any],
    ended: collections.deque[list[int]],
    blocking: bool | None,
) -> tuple[tuple[tuple[Any, Any], int, int], bool] | None:
    """Step ``index``'s staging where its last staging of ``request`` ran ``last``:
    when the search decides the same (evicting nothing while ``ended`` steps are
    pending), that plan runs again in the same hold of the manager, its values held
    (`Decider.restage`). The search's result, and whether the step is staged; None,
    with ``blocking``, when its copies would block the host; errors as `decide_found`
    and `Pipeline._stage`'s run raise them, its holds released."""
    controller: Decider = pipeline.controller
    engine = controller.engine
    (_, _, previous), (_, actions, lowered) = last
    streams = pipeline.streams_of(shape)
    staged = Staged(shape, streams, engine)
    tier = engine.disk  # reads from disk go to its I/O thread, as in `Pipeline._stage`
    reads, deferred = tier.defer(engine.runtime)
    run = engine.plan_run()
    started = _time_ns()
    hold = (shape.holds, staged.holds)
    rerun = (previous, run, lowered.ir, lowered.handles, actions, streams[1], hold)
    try:
        try:
            again = controller.restage(request, position, rerun, not ended, blocking)
        finally:
            tier.undefer(deferred)
            staged.reads = reads
    except BaseException as error:
        if run.phase is None and not len(run) and not staged.holds:
            raise  # the search's (nothing ran)
        restage_failed(pipeline, index, request, run, staged, started, error, actions)
    if again is not None and again[1]:
        pipeline.staged[index] = staged
    return again
