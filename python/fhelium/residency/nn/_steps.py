"""An offload's steps: the forward wrappers, and the step driving behind them.

A unit's wrapped forward enters its step (a step of `ResidencyController.run`'s
pipeline, fed by the schedule's `Feeder`) and puts its values' device tensors in the
slots, then puts the placeholders back; the root's wrapped forward ends a pass, which
records the order it took when that differs from the recording. When every value the
recording uses fits the device at once, resident mode keeps them there under one use
and steps only put tensors in place (docs/concepts/offload.md#the-schedule,
#resident-mode).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch
from torch import nn
from torch.utils._pytree import tree_map

from fhelium.errors import ResidencyBudgetError, ResidencyPlanError
from fhelium.residency.controller import ResidencyController
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.nn._schedule import Feeder, Key, Schedule
from fhelium.residency.nn._stats import Counters
from fhelium.residency.nn._values import OffloadValue
from fhelium.residency.pipeline import ResidencyPipeline
from fhelium.residency.policy import ResidencyPolicy
from fhelium.residency.request import ResidencyRequest, ResidencyRequirement

__all__ = ["Steps", "Wrappers"]

_ABSENT: Final = object()  # a module without its own `forward` attribute


class Steps:
    """Enters and leaves an offload's steps, through the controller's pipeline or in
    resident mode.

    ``stack`` holds the units entered, outermost first; ``actual`` the steps of the pass
    so far; ``depth`` how deep the root's forward is nested. ``controller`` is replaced
    after each new recording.
    """

    __slots__ = (
        "actual",
        "budget",
        "choice",
        "controller",
        "counters",
        "depth",
        "feeder",
        "location",
        "manager",
        "oversized",
        "pipeline",
        "prefetch",
        "resident",
        "resident_units",
        "runtime",
        "schedule",
        "stack",
        "stream",
        "tiers",
        "unit_values",
    )

    def __init__(
        self,
        manager: ResidencyManager,
        schedule: Schedule,
        unit_values: Sequence[Sequence[OffloadValue]],
        *,
        choice: str | ResidencyPolicy,
        tiers: dict[ResidencyLocation, list[ResidencyLocation]],
        counters: Counters,
        location: ResidencyLocation,
        stream: Any,
        runtime: Any,
        budget: int | None,
        prefetch: int,
    ) -> None:
        self.manager = manager
        self.schedule = schedule
        self.unit_values = unit_values
        self.choice = choice
        self.tiers = tiers
        self.counters = counters
        self.location = location
        self.stream = stream
        self.runtime = runtime
        self.budget = budget
        self.prefetch = prefetch
        self.pipeline: ResidencyPipeline | None = None
        self.feeder: Feeder | None = None
        self.stack: list[int] = []
        self.actual: list[Key] = []
        self.depth = 0
        # Resident mode (docs/concepts/offload.md#resident-mode): when every value the
        # recording uses fits the device at once, one use keeps them all there.
        self.resident: Any = None
        self.resident_units: frozenset[int] = frozenset()
        # The recording whose values were found not to fit the budget together: not
        # summed again after each forward while it is the recording.
        self.oversized: Any = None
        self.controller = self.make_controller()

    def make_controller(self) -> ResidencyController:
        """A controller whose policy follows the recording (see `Schedule.policy_for`)."""
        return ResidencyController(
            self.manager, policy=self.schedule.policy_for(self.choice, self.tiers)
        )

    # ------------------------------------------------------------------ the pipeline

    def restart(self, key: Key, *, follow: bool = True) -> Any:
        """A new pipeline whose first step is ``key``, then the predictions."""
        self.stop()
        schedule = self.schedule
        if follow:
            schedule.follow(key)
        feeder = self.feeder = Feeder(schedule)
        feeder.upcoming = key
        # Without a recording there is nothing to prefetch: the steps are handed to
        # the pipeline one at a time, as they come.
        prefetch = self.prefetch if schedule.recording else 0
        self.pipeline = self.controller.run(
            feeder, prefetch=prefetch, consumer_streams={self.location: self.stream}
        )
        return self.advance(self.pipeline, staged=False)

    def advance(self, pipeline: ResidencyPipeline, *, staged: bool) -> Any:
        """Enters the pipeline's next step; a step that was not staged ahead and had to
        copy something in at its turn is a stall."""
        use = next(pipeline)
        if not staged and use.decision.plan.enter:
            self.counters.stalls += 1
        return use

    def stop(self) -> None:
        """Ends the pipeline and resident mode, and waits on the host for the device's
        reads of their steps: the next pipeline cannot wait for leases it did not take,
        and needs their room (a misprediction, a new recording, `materialize`, `close`)."""
        pipeline, self.pipeline = self.pipeline, None
        self.feeder = None
        resident, self.resident = self.resident, None
        self.resident_units = frozenset()
        if pipeline is None and resident is None:
            return
        try:
            if pipeline is not None:
                pipeline.close()
        finally:
            try:
                if resident is not None:
                    resident.__exit__(None, None, None)
            finally:
                self.runtime.synchronize_stream(self.stream)

    def enter(self, key: Key) -> Any:
        """Enters step ``key`` in the pipeline: the predicted step, or else a pipeline
        that starts again from it."""
        self.counters.steps += 1
        feeder, pipeline = self.feeder, self.pipeline
        if feeder is not None and pipeline is not None:
            handed = feeder.handed
            if handed:
                predicted, position = handed[0]
                if predicted == key:
                    handed.popleft()
                    try:
                        return self.advance(pipeline, staged=pipeline.position in pipeline.staged)
                    except StopIteration:
                        pass
                else:
                    # Predict again from where this step was expected; `restart`
                    # counts the misprediction and finds the step in the recording.
                    self.stop()
                    self.schedule.cursor = position
            elif not feeder.stopped:
                self.schedule.follow(key)
                feeder.upcoming = key
                try:
                    return self.advance(pipeline, staged=False)
                except StopIteration:
                    return self.restart(key, follow=False)
        return self.restart(key)

    # ------------------------------------------------------------------ resident mode

    def enter_resident(self) -> None:
        """Keeps every value the recording uses on the device under one use, when they
        fit the budget together; steps then only put tensors in place."""
        recording = self.schedule.recording
        if (
            not recording
            or self.resident is not None
            or self.budget is None
            or recording is self.oversized
        ):
            return
        units = frozenset(unit for key in recording for unit in key)
        values = {id(v): v for unit in units for v in self.unit_values[unit]}
        if sum(v.nbytes for v in values.values()) > self.budget:
            # The budget and the values' bytes do not change: nor does the answer.
            self.oversized = recording
            return
        self.stop()
        location = self.location
        request = ResidencyRequest(
            "resident", [ResidencyRequirement(v.handle, location) for v in values.values()]
        )
        use = self.controller.use(request, consumer_streams={location: self.stream})
        try:
            use.__enter__()
        except (ResidencyPlanError, ResidencyBudgetError):
            return  # something else holds the room: steps go through the pipeline
        for value in values.values():
            bundle = use.value(value.handle, at=location)
            if bundle is not value.bundle:
                value.install(bundle)
                if not value.installed:
                    value.uninstall()
        self.resident, self.resident_units = use, units

    # ------------------------------------------------------------------ units and passes

    def unit_enter(self, unit: int) -> None:
        """Before unit ``unit``'s forward: its step, and its tensors in their slots."""
        stack = self.stack
        stack.append(unit)
        key = tuple(stack)
        self.actual.append(key)
        try:
            if self.resident is not None:
                if unit in self.resident_units:
                    self.counters.steps += 1
                    for value in self.unit_values[unit]:
                        value.installed += 1
                        if value.installed == 1:
                            value.install(value.bundle)
                    return
                self.stop()
            use = self.enter(key)
            location = self.location
            for value in self.unit_values[unit]:
                value.installed += 1
                if value.installed == 1:
                    value.install(use.value(value.handle, at=location))
        except BaseException:
            self.unit_exit(unit)
            raise

    def unit_exit(self, unit: int) -> None:
        """After unit ``unit``'s forward (or a failed entry): placeholders back."""
        stack = self.stack
        if stack and stack[-1] == unit:
            stack.pop()
        for value in self.unit_values[unit]:
            if value.installed:
                value.installed -= 1
                if value.installed == 0:
                    value.uninstall()

    def pass_end(self, finished: bool) -> None:
        """After a root forward: a forward that finished and took another order than
        the recording is the new recording (one that raised records nothing)."""
        actual, self.actual = self.actual, []
        if self.stack:
            # A forward interrupted inside a unit (KeyboardInterrupt, say) left it
            # entered: placeholders back everywhere.
            for unit in reversed(self.stack):
                self.unit_exit(unit)
            self.stack = []
        if not finished:
            return
        counters = self.counters
        counters.forwards += 1
        schedule = self.schedule
        if actual != schedule.recording:
            if schedule.recording is not None:
                counters.rerecords += 1
            self.stop()
            schedule.record(actual)
            self.controller = self.make_controller()
        if self.resident is None:
            self.enter_resident()
        counters.collect()


class Wrappers:
    """The forwards an offload put in front of its modules' own; `unwrap` puts every
    module back as it was."""

    __slots__ = ("wrapped",)

    def __init__(self) -> None:
        # Each wrapped module with its own `forward` attribute before (or `_ABSENT`).
        self.wrapped: list[tuple[nn.Module, Any]] = []

    def wrap_unit(self, module: nn.Module, unit: int, steps: Steps, lock: threading.RLock) -> None:
        """Wraps unit ``unit``'s forward: its step around the module's own forward."""
        original = module.forward
        enter, leave = steps.unit_enter, steps.unit_exit

        # With the module's own signature (`functools.wraps`): model code reads it
        # (transformers' `generate` passes `position_ids` only to a forward that takes them).
        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with lock:
                enter(unit)
                try:
                    return original(*args, **kwargs)
                finally:
                    leave(unit)

        self.wrap(module, forward)

    def wrap_root(
        self,
        module: nn.Module,
        steps: Steps,
        lock: threading.RLock,
        device: torch.device | None,
    ) -> None:
        """Wraps the root's forward: its tensor arguments moved to ``device`` (unless
        None), and the pass ended when the outermost call returns."""
        original = module.forward

        def move(item: Any) -> Any:
            if isinstance(item, torch.Tensor) and item.device != device:
                return item.to(device, non_blocking=True)
            return item

        @functools.wraps(original)  # its signature, as `wrap_unit`'s
        def forward(*args: Any, **kwargs: Any) -> Any:
            with lock:
                if device is not None:
                    args, kwargs = tree_map(move, (args, kwargs))
                steps.depth += 1
                finished = False
                try:
                    output = original(*args, **kwargs)
                    finished = True
                    return output
                finally:
                    steps.depth -= 1
                    if not steps.depth:
                        steps.pass_end(finished)

        self.wrap(module, forward)

    def wrap(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        """Puts ``forward`` in front of ``module.forward``; `unwrap` undoes it."""
        self.wrapped.append((module, module.__dict__.get("forward", _ABSENT)))
        module.forward = forward

    def unwrap(self) -> None:
        """Puts every wrapped module's own forward back, the last wrapped first."""
        wrapped, self.wrapped = self.wrapped, []
        for module, previous in reversed(wrapped):
            if previous is _ABSENT:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
