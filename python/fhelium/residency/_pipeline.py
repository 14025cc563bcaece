"""A pipeline's state and its steps: what `ResidencyPipeline` iterates. See
docs/concepts/controller.md#prefetch for the rules this module implements.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Generator, Iterable, Mapping
from functools import partial
from typing import Any

from fhelium.errors import (
    ResidencyBudgetError,
    ResidencyError,
    ResidencyPlanError,
    ResidencyStaleStateError,
)
from fhelium.residency import _plans
from fhelium.residency._decided import staged_found_run, staged_run
from fhelium.residency._decider import Decider
from fhelium.residency._restaging import restage, restage_first
from fhelium.residency._staging import (
    Shape,
    Staged,
    blocks_host,
    extra_headroom,
    release_all,
    release_on_device,
    settle_transfers,
    shape_of,
    streams_for,
    transfer_streams,
    wait_oldest,
)
from fhelium.residency._use import (
    STALE_RETRIES,
    Controller,
    ResidencyUse,
    enter_staged,
    exit_deferred,
    normalize_streams,
    step_tokens,
    use_for_step,
)
from fhelium.residency._validation import require_count
from fhelium.residency.lease import ResidencyReservation, release_deferred
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.request import ResidencyRequest
from fhelium.residency.schedule import ScheduleAwarePolicy, position_after

__all__ = ["Pipeline"]


class Pipeline:
    """A pipeline's state and its steps (`run`)."""

    __slots__ = (
        "active",
        "closed",
        "consumers",
        "controller",
        "created",
        "current",
        "dropped",
        "guard",
        "held",
        "native",
        "position",
        "prefetch",
        "requests",
        "staged",
        "streams",
        "transfers",
    )

    def __init__(
        self,
        controller: Controller,
        requests: Iterable[ResidencyRequest],
        *,
        prefetch: int,
        consumer_streams: Mapping[ResidencyLocation, Any] | None,
        transfer_streams: Mapping[ResidencyLocation, Any] | None,
    ) -> None:
        if isinstance(requests, (str, bytes, ResidencyRequest)) or not isinstance(
            requests, Iterable
        ):
            raise TypeError(
                f"requests must be an iterable of ResidencyRequest, got {type(requests).__name__}"
            )
        require_count(prefetch, "prefetch")
        manager = controller.manager
        self.controller = controller
        self.requests = iter(requests)
        self.prefetch = prefetch
        self.consumers = normalize_streams(manager, consumer_streams, "consumer_streams")
        self.transfers = normalize_streams(manager, transfer_streams, "transfer_streams")
        # Transfer streams the pipeline created, by location, for prefetches.
        self.created: dict[ResidencyLocation, Any] = {}
        self.current: ResidencyUse | None = None
        self.staged: dict[int, Staged] = {}
        # An error staging raised before the active step's body, raised after it.
        self.held: Exception | None = None
        # Headroom kept for the staged steps' reservations beyond the active step's own
        # (docs/concepts/controller.md#staging), per location.
        self.guard: dict[ResidencyLocation, list[ResidencyReservation]] = {}
        # The active step's reservation bytes per location.
        self.active: dict[ResidencyLocation, int] = {}
        # The consumer and transfer streams by a request's CUDA locations, as their
        # device indices (`_streams`).
        self.streams: dict[
            tuple[int, ...],
            tuple[dict[ResidencyLocation, Any], dict[ResidencyLocation, Any]],
        ] = {}
        self.position = 0
        # Its controller is the plain decider with a built-in policy: a staging may run
        # its last plan again (`_restaging.restage_first`).
        self.native = type(controller) is Decider and controller.identity is not None
        self.closed = False
        # Dropped (or collected) rather than closed: set by the pipeline's finalizer.
        self.dropped = False

    def streams_of(
        self, shape: Shape
    ) -> tuple[dict[ResidencyLocation, Any], dict[ResidencyLocation, Any]]:
        """The consumer and transfer streams of a request with ``shape``, made once per
        set of CUDA locations."""
        streams = self.streams.get(shape.devices)
        if streams is None:
            request = shape.request
            streams = self.streams[shape.devices] = (
                streams_for(request, self.consumers),
                transfer_streams(
                    request, self.transfers, self.prefetch, self.created, self.controller.engine
                ),
            )
        return streams

    # ------------------------------------------------------------------ the steps

    def run(self) -> Generator[ResidencyUse, None, None]:
        ahead: collections.deque[tuple[int, ResidencyRequest]] = collections.deque()
        # The lease (and transfer) tokens of the steps already ended, oldest first:
        # what a step that does not fit may wait for. Entries that completed on their
        # own are dropped from the front as they are met.
        ended: collections.deque[list[int]] = collections.deque()
        exhausted = False
        fetched = 0
        # Bound once: the loop runs them every step.
        requests = self.requests
        prefetch = self.prefetch
        enter = self._enter
        stage_ahead = self._stage_ahead
        try:
            while True:
                while not exhausted and len(ahead) <= prefetch:
                    try:
                        request = next(requests)
                    except StopIteration:
                        exhausted = True
                        break
                    index, fetched = fetched, fetched + 1
                    if not isinstance(request, ResidencyRequest):
                        raise TypeError(
                            f"requests[{index}] must be a ResidencyRequest, "
                            f"got {type(request).__name__}"
                        )
                    ahead.append((index, request))
                if not ahead:
                    return
                index, request = ahead[0]
                staged = self.staged.get(index) if self.native else None
                if staged is not None and not staged.reads and not staged.needs and not self.guard:
                    # A staged step without reservations, no headroom kept, the plain
                    # decider (`_enter`'s first case, without its frames).
                    del self.staged[index]
                    if request.reservations:
                        # Not without reservations (`_enter_staged`'s refusal): as `_enter`.
                        staged.release()
                        use = self.current = enter(index, request, ended)
                    else:
                        # `_enter_staged`, inline (`self.native`: the plain decider).
                        shape = staged.shape
                        holds = staged.holds
                        try:
                            entered = enter_staged(
                                self.controller, request, staged.streams, shape, holds
                            )
                        finally:
                            # Leased now (or failed): any hold left (it was refused
                            # first) goes here.
                            if holds:
                                staged.release()
                        self.active = shape.needs
                        if self.staged:
                            # The headroom the steps still staged need (`_entered`).
                            entered = self._entered(entered, shape.needs)
                        use = self.current = entered
                else:
                    use = self.current = enter(index, request, ended)
                self.position = index + 1
                # Once this step has ended, the copies its values came in by are done
                # too (its consumers waited for them): waiting for the step waits for
                # them.
                tokens = step_tokens(use)
                # Before the body: what fits without waiting for anything. After it
                # (its work is queued, so a wait cannot starve the device): the rest,
                # waiting for ended steps where that frees memory or better victims.
                if len(ahead) != 2 or self.staged or not self.native or self.held is not None:
                    stage_ahead(index, ahead, ended, False)
                else:
                    # The one step after it, where nothing is staged (`_stage_ahead`'s
                    # case, its last plan run again when decided again).
                    later, upcoming = ahead[1]
                    try:
                        again = restage_first(self, later, later - index, upcoming, ended, False)
                    except Exception as error:
                        self.held = error  # raised after the body, as `_stage_ahead` does
                    else:
                        if again is None:
                            stage_ahead(index, ahead, ended, False)
                yield use
                # (Nothing to do when every later step is staged and no error is held.)
                if self.held is not None or len(self.staged) + 1 < len(ahead):
                    stage_ahead(index, ahead, ended, True)
                self.current = None
                use.__exit__(None, None, None)
                if tokens:
                    ended.append(tokens)
                ahead.popleft()
        finally:
            self._finish()

    def _finish(self) -> None:
        """Ends the active step, releases every staged step, and waits for the transfers
        still in flight, so nothing of the pipeline's outlives it. A pipeline dropped
        where this thread cannot enter the manager queues all of that instead."""
        if self.dropped and self.controller.engine.blocked_here():
            self._finish_deferred()
            return
        use, self.current = self.current, None
        staged, self.staged = self.staged, {}
        self.held = None  # its step is never entered now
        error: BaseException | None = None
        if use is not None:
            try:
                use.__exit__(None, None, None)
            except BaseException as failure:
                error = failure
        for step in staged.values():
            try:
                step.release()
            except BaseException as failure:
                error = error or failure
        try:
            self.forget_reads(staged)
        except BaseException as failure:
            error = error or failure
        try:
            self._release_guard()
        except BaseException as failure:
            error = error or failure
        try:
            settle_transfers(self.controller.engine)
        except BaseException as failure:
            error = error or failure
        self.closed = True
        if error is not None:
            raise error

    def _finish_deferred(self) -> None:
        """`_finish` as finalizers release: nothing waits and nothing is refused. The
        releases are queued and applied as soon as the source callback returns, or else
        by the next operation; the copies in flight stay protected by their events and
        are reaped as they complete, like a released lease's
        (docs/concepts/controller.md#ending-a-pipeline)."""
        use, self.current = self.current, None
        staged, self.staged = self.staged, {}
        guard, self.guard = self.guard, {}
        self.closed = True
        if use is not None:
            exit_deferred(use)
        for step in staged.values():
            step.release_deferred()
        for kept in guard.values():
            for reservation in kept:
                release_deferred(reservation)

    def _enter(
        self,
        index: int,
        request: ResidencyRequest,
        ended: collections.deque[list[int]],
    ) -> ResidencyUse:
        """Enters step ``index``'s use; when it does not fit, waits for the oldest ended
        step's leases and tries again."""
        staged = self.staged.pop(index, None)
        if staged is not None and staged.reads:
            # A read from disk it deferred failed: the step that needs the value raises,
            # holding nothing, with the value's partial copies gone.
            failure = staged.failure()
            if failure is not None:
                staged.release()
                self._release_staged()
                self._release_guard()
                self._drop_unread(request)
                raise failure
        # The headroom kept for the staged steps is free for this step's own scope; what
        # the steps still staged need beyond it is kept again once it is entered.
        if self.guard:
            self._release_guard()
        if staged is not None:
            entered = self._enter_staged(staged, request)
            if entered is not None:
                return entered
            # Its values stay where the prefetch put them: the use requires them there,
            # so its decision never evicts them.
            staged.release()
        controller = self.controller
        engine = controller.engine
        # A staged step's values are in place and its reservations' headroom was kept:
        # it evicts nothing, so there is nothing to wait for first.
        released = False
        while ended and staged is None:
            # A step that must evict while ended steps still protect values releases
            # them first: their values may be the better victims (in a cyclic
            # schedule, the one just used is the one needed farthest ahead). Device
            # waits first, with no host round trip; a host wait only for what needs one
            # (docs/concepts/controller.md#evicting-around-reads-in-flight).
            if not engine.pending_among(ended[0]):
                ended.popleft()
                continue
            try:
                if not controller.decide(request).plan.reclaim:
                    break
            except (ResidencyPlanError, ResidencyBudgetError):
                pass  # releasing below may make it fit
            if not released:
                released = True
                release_on_device(engine, ended)
                continue
            wait_oldest(engine, ended)
        settled = False
        shape = shape_of(controller, request)
        consumers, transfers = self.streams_of(shape)
        while True:
            use = use_for_step(controller, request, consumers, transfers, shape.cuda, shape.grouped)
            try:
                entered = use.__enter__()
            except (ResidencyPlanError, ResidencyBudgetError):
                if wait_oldest(engine, ended):
                    continue
                if settled:
                    raise
                # Last, the copies still in flight: a source they read stays
                # protected until they complete, which only a host wait observes
                # once their steps were released on the device.
                settled = True
                settle_transfers(self.controller.engine)
            else:
                return self._entered(entered, shape.needs)

    def _enter_staged(self, staged: Staged, request: ResidencyRequest) -> ResidencyUse | None:
        """Enters a staged step without a plan, where its request has no reservations
        and the controller is the plain one: its values are still held where its staging
        put them, so the leases are taken before the holds go and the decision is the
        satisfied one (`_use.enter_staged`). None where that does not apply; the holds
        are then still held."""
        controller = self.controller
        if request.reservations or type(controller) is not Decider:
            return None
        # Its staging's request (this very one), whose shape and streams it kept.
        shape = staged.shape
        holds = staged.holds
        try:
            entered = enter_staged(controller, request, staged.streams, shape, holds)
        finally:
            # Leased now (or failed): the holds have done their part. The entry took
            # them out of the list; any left (it was refused first) go here.
            if holds:
                staged.release()
        if not self.staged:
            # Nothing staged: no headroom to keep (`_entered`).
            self.active = shape.needs
            return entered
        return self._entered(entered, shape.needs)

    def _entered(self, entered: ResidencyUse, needs: dict[ResidencyLocation, int]) -> ResidencyUse:
        """The active step is ``entered``, its scope reserving ``needs``: the headroom
        the steps still staged need beyond it is kept again. The use is exited if that
        fails other than by the budget."""
        self.active = needs
        if not self.staged:
            # Nothing staged: no headroom to keep (`_extra`).
            return entered
        try:
            try:
                self._keep_guard({})
            except ResidencyBudgetError:
                # Another thread took the headroom released for this entry: the steps
                # staged are given up (they are decided afresh at their turn), and with
                # them the headroom they needed.
                self._release_staged()
                self._release_guard()
        except BaseException:
            entered.__exit__(None, None, None)
            raise
        return entered

    def _release_staged(self) -> None:
        staged, self.staged = self.staged, {}
        try:
            error: BaseException | None = None
            for step in staged.values():
                try:
                    step.release()
                except BaseException as failure:
                    error = error or failure
            if error is not None:
                raise error
        finally:
            self.forget_reads(staged)

    def forget_reads(self, staged: dict[int, Staged]) -> None:
        """Steps given up before their turn: the copies of their failed deferred reads
        are dropped (nobody needs the value now; its next use reads it again)."""
        for step in staged.values():
            if step.reads and step.failure() is not None:
                self._drop_unread(step.request)

    def _drop_unread(self, request: ResidencyRequest) -> None:
        """Drops the request's device copies that can go: what a failed deferred read
        wrote is one of them (its error claimed, nothing protects it any more). A copy
        that cannot go (in use, or the value's only one) was not written by a read from
        disk, which leaves the disk copy: it stays."""
        manager = self.controller.manager
        for requirement in request.requirements:
            if requirement.location.kind == "cuda":
                with contextlib.suppress(ResidencyError):
                    manager.drop(requirement.handle, requirement.location)

    def _extra(self, needs: dict[ResidencyLocation, int]) -> dict[ResidencyLocation, int]:
        """The headroom the staged steps (and a step needing ``needs``) would find
        missing at their entry (`_staging.extra_headroom`)."""
        if not needs and not self.staged:
            return {}
        return extra_headroom(needs, self.staged.values(), self.active, self.guard)

    def _keep_guard(self, needs: dict[ResidencyLocation, int]) -> None:
        """Reserves the headroom `_extra` finds missing."""
        extra = self._extra(needs)
        if not extra:
            return
        manager = self.controller.manager
        for location, nbytes in extra.items():
            self.guard.setdefault(location, []).append(
                manager.reserve(location, nbytes, label="prefetch headroom")
            )

    def _release_guard(self) -> None:
        if not self.guard:
            return
        guard, self.guard = self.guard, {}
        release_all(reservation for kept in guard.values() for reservation in kept)

    def _stage_ahead(
        self,
        index: int,
        ahead: collections.deque[tuple[int, ResidencyRequest]],
        ended: collections.deque[list[int]],
        wait: bool,
    ) -> None:
        """Stages the steps after the active one ``index`` in order, up to the first
        that cannot be staged now. An error before the body (``wait`` false) is held
        and raised after it: the active step's body runs first, and the error comes
        from the iteration that ends it, as when that staging runs after the body."""
        held = self.held
        if held is not None:
            self.held = None
            raise held
        count = len(ahead)
        # The staged steps are among those after the active one: as many of them means
        # every one is staged.
        if len(self.staged) + 1 >= count:
            return
        for position in range(1, count):
            later, upcoming = ahead[position]
            if later in self.staged:
                continue
            try:
                staged = self._stage(later, later - index, upcoming, ended, wait=wait)
            except Exception as error:
                if wait:
                    raise
                self.held = error
                return
            if not staged:
                return

    def _stage(
        self,
        index: int,
        distance: int,
        request: ResidencyRequest,
        ended: collections.deque[list[int]],
        *,
        wait: bool,
    ) -> bool:
        """Issues step ``index``'s transfers ahead of its turn, ``distance`` steps after
        the active one, and holds its values and headroom. False when it does not fit,
        or would evict while ended steps still protect values (their memory, once
        free, may hold better victims): with ``wait``, the oldest ended step is waited
        for and the step decided again, until none is left to wait for."""
        if self.native and not self.staged:
            restaged = restage_first(self, index, distance, request, ended, wait)
            if restaged is not None:
                return restaged
        controller = self.controller
        policy = controller.policy
        position = None
        if isinstance(policy, ScheduleAwarePolicy):
            # The policy already stands past the active step; a cyclic schedule wraps.
            position = position_after(policy, policy.position, distance - 1)
        engine = controller.engine
        shape = shape_of(controller, request)
        needs = shape.needs
        by_location = shape.by_location
        runtime = engine.runtime
        # Before the body, a step whose copies would block the host is not staged now
        # (`_staging.blocks_host`), checked once: natively by a staging run again.
        blocking = None if wait else getattr(runtime, "staged_events", False)
        pending_among = engine.pending_among
        plain = type(controller) is Decider
        native = plain and controller.identity is not None  # type: ignore[attr-defined]
        stale = 0
        while True:
            while ended and not pending_among(ended[0]):
                ended.popleft()  # completed on their own: nothing to wait for
            # The step's values, with the headroom its reservations (and the staged
            # steps') would find missing at its entry, decided together. Without
            # reservations and with no step staged, there is none: the request itself.
            staging = shape.staging_request(self._extra(needs)) if needs or self.staged else request
            last = shape.runs.last if native and staging is request else None
            if last is not None and (
                last[0][0] is not request or last[0][1] != engine.discard_count()
            ):
                last = None
            if last is None and blocking is not None:
                if blocks_host(engine, by_location, blocking):
                    return False
                blocking = None
            try:
                if last is not None:
                    # Its last staging's plan, run again when decided again.
                    again = restage(self, index, request, position, shape, last, ended, blocking)
                    blocking = None
                    if again is None:
                        return False  # its copies would block the host
                    found, ran = again
                    if ran:
                        return True
                elif plain:
                    # The plain decider's search, without its decision record: the
                    # staging only runs the plan.
                    found = controller.decide_found(staging, position)  # type: ignore[attr-defined]
                else:
                    decision = controller.decide(staging, position)
            except (ResidencyPlanError, ResidencyBudgetError):
                if wait and (release_on_device(engine, ended) or wait_oldest(engine, ended)):
                    continue
                return False
            # The plan, its actions and their lowering, as the last staging of this
            # request ran them when it decided the same.
            if plain:
                version = found[1]
                plan, actions, lowered = staged_found_run(
                    engine.manager_id,
                    staging,
                    policy,
                    controller.identity,  # type: ignore[attr-defined]
                    found,
                    shape.runs,
                    engine.discard_count(),
                )
            else:
                version = decision.expected_state_version
                plan, actions, lowered = staged_run(decision, shape.runs, engine.discard_count())
            if plan.reclaim and ended:
                # Before the body nothing is released: staging may block the host (a
                # read from disk), which must not delay the body's kernels.
                if not wait:
                    return False
                if not release_on_device(engine, ended):
                    wait_oldest(engine, ended)
                continue
            streams = self.streams_of(shape)
            staged = Staged(shape, streams, engine)
            # Under the plan's hold of the manager, what it made resident is held (a
            # hold per location, `Shape.holds`) before any other thread can evict it,
            # and then the headroom the decision counted, still free, is kept. A
            # failure there releases those holds.
            keep = partial(self._keep_guard, needs) if needs or self.staged else None

            # Reads from disk (and loads by sources that load alone) are left to the
            # disk tier's I/O thread (docs/concepts/controller.md#staging).
            tier = engine.disk
            reads, previous = tier.defer(runtime)
            try:
                try:
                    # Asynchronously, without a report.
                    _plans.run_actions(
                        engine,
                        actions,
                        request.name,
                        streams[1],
                        version,
                        True,
                        keep,
                        lowered,
                        (shape.holds, staged.holds),
                    )
                finally:
                    tier.undefer(previous)
                    staged.reads = reads
            except ResidencyStaleStateError:
                self.forget_reads({index: staged})
                # Another thread changed the manager since the decision: decide again,
                # or leave the step to be staged (or entered) later.
                stale += 1
                if stale > STALE_RETRIES:
                    return False
                continue
            except BaseException:
                # What the plan committed stays (an interrupt after the holds were
                # taken releases them); a failed read's copy goes.
                try:
                    staged.release()
                finally:
                    self.forget_reads({index: staged})
                raise
            self.staged[index] = staged
            return True
