"""`offload(module, ...)`: run a PyTorch module whose weights do not fit on its device.

Each unit's weights are one managed value; forward wrappers make a unit's value resident on
the device for its forward (a step of `ResidencyController.run`) and put placeholders back
after it. The first forward is recorded; later forwards follow the recording cyclically,
prefetching the next steps, and a forward that takes another order is followed as it goes
and recorded again. See docs/concepts/offload.md for the rules this module implements.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_map

from fhelium.errors import ResidencyBudgetError, ResidencyClosedError, ResidencyPlanError
from fhelium.residency._runtime import current_runtime
from fhelium.residency._runtime.torch_runtime import TorchCudaRuntime
from fhelium.residency._validation import require_strict_int
from fhelium.residency.controller import ResidencyController
from fhelium.residency.disk import disk_location
from fhelium.residency.location import (
    PAGEABLE_HOST,
    PINNED_HOST,
    ResidencyLocation,
    cuda_location,
)
from fhelium.residency.manager import ResidencyManager, engine_of
from fhelium.residency.model import (
    ReplicaMode,
    ResidencyHandle,
)
from fhelium.residency.nn._loading import GroupSource, group_sources
from fhelium.residency.nn._units import (
    Placeholder,
    TensorGroup,
    UnitRule,
    placeholders,
    plan_units,
)
from fhelium.residency.pipeline import ResidencyPipeline
from fhelium.residency.policy import DeterministicTieredLRU, ResidencyPolicy
from fhelium.residency.request import ResidencyRequest, ResidencyRequirement
from fhelium.residency.schedule import ScheduleAwarePolicy
from fhelium.values import TensorBundle

__all__ = ["Offload", "OffloadStats", "OffloadUnit", "offload"]

# An offload's own manager keeps this many transition reports between two readings
# (each forward's end reads and clears them for `stats`).
_TRACE_CAPACITY: Final = 1 << 16

PolicyName = Literal["schedule-aware", "lru"]
Key = tuple[int, ...]
_ABSENT: Final = object()  # a step: the units active when it was entered, outermost first


@dataclass(frozen=True)
class OffloadUnit:
    """One unit of an offload: a module whose forward is one step.

    Attributes:
        name: The module's qualified name (``"<root>"`` for the root).
        module: The module.
        handles: The values its forward requires: its own tensors first (when it has
            any), then each tied tensor it shares with other units.
        nbytes: The bytes those values are charged on the device.
    """

    name: str
    module: nn.Module
    handles: tuple[ResidencyHandle[TensorBundle], ...]
    nbytes: int


@dataclass(frozen=True)
class OffloadStats:
    """What an offload did, since it was opened (docs/concepts/offload.md#stats).

    Attributes:
        forwards: Root forwards run.
        steps: Unit forwards run (each a step).
        loads: Copies into the device (a value made resident there).
        h2d_bytes: Bytes copied from host memory to the device.
        d2h_bytes: Bytes copied from the device to host memory.
        disk_read_bytes: Bytes read from the disk location.
        disk_write_bytes: Bytes written to the disk location.
        stalls: Steps whose values were not all copied in ahead of their turn.
        mispredictions: Steps that were not the recording's prediction.
        rerecords: Times the recording was replaced by a forward's real order.
        device_peak_bytes: The device's peak of charged bytes (used plus reserved).
        host_peak_bytes: The host location's peak of used bytes.
    """

    forwards: int
    steps: int
    loads: int
    h2d_bytes: int
    d2h_bytes: int
    disk_read_bytes: int
    disk_write_bytes: int
    stalls: int
    mispredictions: int
    rerecords: int
    device_peak_bytes: int
    host_peak_bytes: int


class _Counters:
    __slots__ = (
        "d2h",
        "disk_read",
        "disk_write",
        "forwards",
        "h2d",
        "loads",
        "mispredictions",
        "rerecords",
        "stalls",
        "steps",
    )

    def __init__(self) -> None:
        self.forwards = self.steps = self.loads = self.stalls = 0
        self.h2d = self.d2h = self.disk_read = self.disk_write = 0
        self.mispredictions = self.rerecords = 0


class _Value:
    """A managed value of the offload: its handle, slots and placeholders, and the
    device tensors last installed (reused while the same materialisation is resident)."""

    __slots__ = (
        "bundle",
        "group",
        "handle",
        "index",
        "installed",
        "kept",
        "placeholders",
        "reconstructible",
        "tensors",
    )

    def __init__(
        self, index: int, group: TensorGroup, handle: ResidencyHandle[TensorBundle]
    ) -> None:
        self.index = index
        self.group = group
        self.handle = handle
        self.placeholders: list[Placeholder] = []
        self.installed = 0  # how many active units use it
        # Read from a checkpoint: each step also keeps a host copy (a cache of the
        # file), docs/concepts/offload.md#checkpoints.
        self.reconstructible = False
        # Its buffers a checkpoint does not hold, as the module built them: `close`
        # puts them back (docs/concepts/offload.md#checkpoints).
        self.kept: dict[str, torch.Tensor] = {}
        self.bundle: TensorBundle | None = None
        self.tensors: list[torch.Tensor] = []

    def install(self, bundle: Any) -> None:
        if bundle is not self.bundle:
            tensors: list[torch.Tensor] = []
            for tensor, slots in zip(bundle.tensors.values(), self.group.slots, strict=True):
                if slots[0].is_parameter:
                    tensors.append(nn.Parameter(tensor, requires_grad=False))
                else:
                    tensors.append(tensor)
            self.bundle, self.tensors = bundle, tensors
        for tensor, slots in zip(self.tensors, self.group.slots, strict=True):
            for slot in slots:
                slot.install(tensor)

    def uninstall(self) -> None:
        for placeholder, slots in zip(self.placeholders, self.group.slots, strict=True):
            for slot in slots:
                slot.install(placeholder)


class _Feeder:
    """The pipeline's requests: the step about to be entered, then the recording's
    predictions (docs/concepts/offload.md#the-schedule)."""

    __slots__ = ("handed", "offload", "stopped", "upcoming")

    def __init__(self, offload: Offload) -> None:
        self.offload = offload
        self.upcoming: Key | None = None
        self.handed: deque[tuple[Key, int]] = deque()
        self.stopped = False

    def __iter__(self) -> _Feeder:
        return self

    def __next__(self) -> ResidencyRequest:
        offload = self.offload
        if self.upcoming is not None:
            key, self.upcoming = self.upcoming, None
            return offload._request(key)
        predicted = offload._predict()
        if predicted is None:
            self.stopped = True
            raise StopIteration
        self.handed.append(predicted)
        return offload._request(predicted[0])


class Offload:
    """A module offloaded by `offload`: a context manager; `close` puts the module back.

    While it is open, calling the module (and transformers' ``generate``) works unchanged
    and computes on `location`'s device; each unit's weights are resident there only
    around its forward, under the manager's strict device budget. Forwards run one at a
    time (a lock serialises threads). Constructed by `offload`, whose arguments these
    are. See docs/concepts/offload.md.

    Args:
        module: The module to run.
        device: The CUDA device it computes on.
        budget: The device's byte budget, or ``None`` with ``manager``.
        host: ``"pinned"`` or ``"pageable"``: where the weights wait.
        host_budget: The host's byte budget, or ``None`` for none.
        disk: A directory for the weights the host budget cannot hold, or ``None``.
        disk_budget: The disk directory's byte budget, or ``None``.
        prefetch: How many later steps' copies are issued ahead.
        policy: ``"schedule-aware"``, ``"lru"`` or a `ResidencyPolicy`.
        units: The unit rule (docs/concepts/offload.md#units).
        checkpoint: A safetensors file or directory to read the weights from.
        dtype: The floating dtype the weights are cast to, or ``None``.
        manager: A manager to use instead of a new one.

    Raises:
        TypeError: See `offload`.
        ValueError: See `offload`.
        ResidencyBudgetError: See `offload`.
        ResidencyCheckpointError: See `offload`.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        device: str | torch.device,
        budget: int | None,
        host: Literal["pinned", "pageable"],
        host_budget: int | None,
        disk: str | os.PathLike[str] | None,
        disk_budget: int | None,
        prefetch: int,
        policy: PolicyName | ResidencyPolicy,
        units: UnitRule,
        checkpoint: str | os.PathLike[str] | None,
        dtype: torch.dtype | None,
        manager: ResidencyManager | None,
    ) -> None:
        self._closed = True  # until fully built: close() then restores what was done
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if require_strict_int(prefetch, "prefetch") < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if host not in ("pinned", "pageable"):
            raise ValueError(f"host must be 'pinned' or 'pageable', got {host!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, got {type(dtype).__name__}")
        if isinstance(policy, str):
            if policy not in ("schedule-aware", "lru"):
                raise ValueError(f"policy must be 'schedule-aware' or 'lru', got {policy!r}")
        elif not isinstance(policy, ResidencyPolicy):
            raise TypeError("policy must be 'schedule-aware', 'lru' or a ResidencyPolicy")
        for name, amount in (("budget", budget), ("host_budget", host_budget)):
            if amount is not None and require_strict_int(amount, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {amount}")
        if disk_budget is not None and require_strict_int(disk_budget, "disk_budget") < 0:
            raise ValueError(f"disk_budget must be >= 0, got {disk_budget}")
        if disk_budget is not None and disk is None:
            raise ValueError("disk_budget needs disk= (the directory spills go to)")
        if manager is None and budget is None:
            raise TypeError("offload() needs budget= (the device's byte budget), or manager=")
        if manager is not None and not isinstance(manager, ResidencyManager):
            raise TypeError(f"manager must be a ResidencyManager, got {type(manager).__name__}")
        torch_device = torch.device(device) if isinstance(device, str) else device
        if not isinstance(torch_device, torch.device) or torch_device.type != "cuda":
            raise ValueError(
                f"device must be a CUDA device ('cuda:0'); got {device!r} (without a GPU, "
                "install the simulated runtime: docs/concepts/simulation.md)"
            )
        if torch_device.index is None:
            torch_device = torch.device("cuda", 0)
        if torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
            raise ValueError(
                "offload() is for inference: the module has parameters that require grad "
                "while autograd is enabled. Call it under `torch.no_grad()` or "
                "`torch.inference_mode()`, or call `module.requires_grad_(False)` first"
            )
        self._module = module
        self._location = cuda_location(torch_device)
        self._prefetch = prefetch
        self._policy_choice = policy
        self._owns_manager = manager is None
        self._counters = _Counters()
        # The modules whose forward is wrapped, each with its own `forward` attribute
        # before (or `_ABSENT`), and the lock that runs one forward at a time.
        self._wrapped: list[tuple[nn.Module, Any]] = []
        self._lock = threading.RLock()
        self._values: list[_Value] = []
        self._pipeline: ResidencyPipeline | None = None
        self._feeder: _Feeder | None = None
        self._stack: list[int] = []
        self._requests: dict[Key, ResidencyRequest] = {}
        self._recording: list[Key] | None = None
        self._positions: dict[Key, list[int]] = {}
        self._cursor = 0
        self._actual: list[Key] = []
        self._depth = 0
        # Resident mode (docs/concepts/offload.md#resident-mode): when every value the
        # recording uses fits the device at once, one use keeps them all there.
        self._resident: Any = None
        self._resident_units: frozenset[int] = frozenset()
        self._from_checkpoint = checkpoint is not None
        self._trace_seen: Any = None
        # The peaks last read, for `stats` after the manager closed.
        self._peaks = (0, 0)
        self._disk = None if disk is None else disk_location(Path(disk))
        self._host_budget = host_budget
        if manager is None:
            runtime = current_runtime()
            self._host = _host_location(runtime, host)
            budgets: dict[ResidencyLocation, int] = {self._location: int(budget or 0)}
            if host_budget is not None:
                budgets[self._host] = host_budget
            if self._disk is not None and disk_budget is not None:
                budgets[self._disk] = disk_budget
            manager = ResidencyManager(budgets, trace_capacity=_TRACE_CAPACITY)
        else:
            if budget is not None or host_budget is not None or disk_budget is not None:
                raise ValueError(
                    "with manager=, budgets are the manager's: leave budget, host_budget "
                    "and disk_budget unset"
                )
            self._host = _host_location(engine_of(manager).runtime, host)
        self._manager = manager
        self._budget = next(
            (
                record.budget_bytes
                for record in manager.snapshot().locations
                if record.location == self._location
            ),
            None,
        )
        self._runtime = engine_of(manager).runtime
        self._simulated = type(self._runtime) is not TorchCudaRuntime
        # Where the compute tensors physically are: the device, or the CPU tensors
        # that stand for it on the simulated runtime.
        self._compute_device = torch.device("cpu") if self._simulated else torch_device
        self._stream = self._runtime.current_stream(torch_device)
        self._build(units, checkpoint, dtype)

    # ------------------------------------------------------------------ building

    def _build(
        self,
        rule: UnitRule,
        checkpoint: str | os.PathLike[str] | None,
        dtype: torch.dtype | None,
    ) -> None:
        unit_plans, groups = plan_units(self._module, rule)
        if not unit_plans:
            raise ValueError("the module has no parameters or buffers to offload")
        for group in groups:
            for name, tensor in zip(group.names, group.tensors, strict=True):
                if isinstance(tensor, Placeholder):
                    raise ValueError(
                        f"{name} is already offloaded: close the other offload of this module first"
                    )
        if checkpoint is None:
            for group in groups:
                for name, tensor in zip(group.names, group.tensors, strict=True):
                    if tensor.is_meta:
                        raise ValueError(
                            f"{name} is on the meta device: pass checkpoint= to load the "
                            "weights, or build the module with real tensors"
                        )
                    if tensor.device.type != "cpu":
                        raise ValueError(
                            f"{name} is on {tensor.device}: offload() takes a module whose "
                            "tensors are on the CPU (or on meta, with checkpoint=)"
                        )
        sources = None
        if checkpoint is not None:
            sources = group_sources(checkpoint, groups, dtype)
        self._sources = sources or []
        self._closed = False
        try:
            self._adopt(groups, sources, dtype)
        except BaseException:
            self.close()
            raise
        self._units = tuple(
            OffloadUnit(
                plan.name,
                plan.module,
                tuple(self._values[g].handle for g in plan.groups),
                sum(self._nbytes[g] for g in plan.groups),
            )
            for plan in unit_plans
        )
        self._unit_values = [[self._values[g] for g in plan.groups] for plan in unit_plans]
        limits = [("on the device", "budget", self._budget)]
        if self._from_checkpoint:
            limits.append(("in host memory", "host_budget", self._host_budget))
        for unit in self._units:
            for where, name, limit in limits:
                if limit is not None and unit.nbytes > limit:
                    self.close()
                    raise ValueError(
                        f"unit {unit.name!r} needs {unit.nbytes} bytes {where}, more than "
                        f"{name}={limit}: raise {name}, or pass units= to cut the module "
                        "finer (docs/concepts/offload.md#units)"
                    )
        self._controller = self._make_controller()
        for index, plan in enumerate(unit_plans):
            self._wrap_unit(index, plan.module)
        self._wrap_root()

    def _adopt(
        self,
        groups: list[TensorGroup],
        sources: list[GroupSource] | None,
        dtype: torch.dtype | None,
    ) -> None:
        """Registers every group as a value: read from ``sources``, or adopted from the
        module and moved to the host tier (or, past the host budget, to disk)."""
        manager = self._manager
        self._nbytes = [0] * len(groups)
        if sources is not None:
            for index, (group, source) in enumerate(zip(groups, sources, strict=True)):
                handle = manager.register_source(source.spec(), source)
                value = _Value(index, group, handle)
                value.reconstructible = True
                value.kept = source.kept
                self._nbytes[index] = source.nbytes
                self._install_placeholders(value)
            return
        # Where each group goes: the host tier while its budget lasts, then disk. The
        # groups bound for disk are adopted (and moved) first, so a budgeted pageable
        # host never holds them.
        host, disk = self._host, self._disk
        room = self._room(host)
        sizes = [_storage_nbytes(group.tensors, dtype) for group in groups]
        if room is not None and disk is not None and host == PAGEABLE_HOST:
            # A read from disk lands in pageable memory first: room for the largest.
            room = max(0, room - max(sizes))
        targets: list[ResidencyLocation] = []
        for nbytes in sizes:
            target = host
            if room is not None and nbytes > room:
                if disk is None:
                    # Refused as the manager would refuse it; nothing was adopted.
                    budget_bytes = self._host_budget or 0
                    raise ResidencyBudgetError(
                        location=host.name,
                        budget_bytes=budget_bytes,
                        used_bytes=budget_bytes - room,
                        reserved_bytes=0,
                        requested_bytes=nbytes,
                    )
                target = disk
            elif room is not None:
                room -= nbytes
            targets.append(target)
        order = sorted(range(len(groups)), key=lambda index: targets[index] == host)
        for index in order:
            group, target = groups[index], targets[index]
            bundle = TensorBundle(
                {
                    name: (
                        tensor.detach().to(dtype)
                        if dtype is not None and tensor.is_floating_point()
                        else tensor.detach()
                    )
                    for name, tensor in zip(group.names, group.tensors, strict=True)
                }
            )
            # Where adopt puts it (docs/concepts/values.md#adopt).
            adopted = PINNED_HOST if self._runtime.value_is_pinned(bundle) else PAGEABLE_HOST
            handle = manager.adopt(bundle, at=adopted, replica_mode=ReplicaMode.REPLICABLE)
            self._nbytes[index] = bundle.storage_nbytes
            del bundle
            value = _Value(index, group, handle)
            self._install_placeholders(value)
            if target != adopted:
                manager.move(handle, target)
        self._values.sort(key=lambda value: value.index)

    def _install_placeholders(self, value: _Value) -> None:
        """Puts ``value``'s placeholders in its slots; the group forgets the module's
        original tensors (their memory is freed once the manager moved them)."""
        group = value.group
        value.placeholders = list(placeholders(group, self._compute_device))
        group.tensors = list(value.placeholders)
        value.uninstall()
        self._values.append(value)

    def _room(self, location: ResidencyLocation) -> int | None:
        for record in self._manager.snapshot().locations:
            if record.location == location:
                return record.remaining_budget_bytes
        return None

    def _make_controller(self) -> ResidencyController:
        tiers: dict[ResidencyLocation, list[ResidencyLocation]] = {self._location: [self._host]}
        if self._disk is not None:
            tiers[self._host] = [self._disk]
        choice = self._policy_choice
        policy: ResidencyPolicy
        if not isinstance(choice, str):
            policy = choice
        elif choice == "lru" or not self._recording:
            policy = DeterministicTieredLRU(tiers)
        else:
            steps = [self._request(key) for key in self._recording]
            policy = ScheduleAwarePolicy(steps, cyclic=True, fallback_tiers=tiers)
        return ResidencyController(self._manager, policy=policy)

    # ------------------------------------------------------------------ the steps

    def _request(self, key: Key) -> ResidencyRequest:
        request = self._requests.get(key)
        if request is None:
            requirements: dict[ResidencyRequirement, None] = {}
            for unit in key:
                for value in self._unit_values[unit]:
                    # The host copy first: the device's is then copied from it.
                    if value.reconstructible:
                        requirements[ResidencyRequirement(value.handle, self._host)] = None
                    requirements[ResidencyRequirement(value.handle, self._location)] = None
            request = self._requests[key] = ResidencyRequest(
                "/".join(self._units[unit].name for unit in key), list(requirements)
            )
        return request

    def _predict(self) -> tuple[Key, int] | None:
        """The recording's next step and its position, or None without a recording."""
        recording = self._recording
        if not recording:
            return None
        position = self._cursor
        self._cursor = (position + 1) % len(recording)
        return recording[position], position

    def _resync(self, key: Key, expected: int) -> None:
        """After a misprediction: predict from the recording's next occurrence of
        ``key`` at or after position ``expected`` (cyclically)."""
        recording = self._recording
        positions = self._positions.get(key)
        if not recording or not positions:
            return
        at = bisect.bisect_left(positions, expected)
        position = positions[at] if at < len(positions) else positions[0]
        self._cursor = (position + 1) % len(recording)
        policy = self._controller.policy
        if isinstance(policy, ScheduleAwarePolicy):
            policy.seek(position)

    def _follow(self, key: Key) -> None:
        """Moves the prediction past ``key``: the recording's next step, or (a
        misprediction) the step after ``key``'s next occurrence in the recording."""
        recording = self._recording
        if not recording:
            return
        if recording[self._cursor] == key:
            self._cursor = (self._cursor + 1) % len(recording)
        else:
            self._counters.mispredictions += 1
            self._resync(key, self._cursor)

    def _restart(self, key: Key, *, follow: bool = True) -> Any:
        """A new pipeline whose first step is ``key``, then the predictions."""
        self._stop_pipeline()
        if follow:
            self._follow(key)
        feeder = self._feeder = _Feeder(self)
        feeder.upcoming = key
        # Without a recording there is nothing to prefetch: the steps are handed to
        # the pipeline one at a time, as they come.
        prefetch = self._prefetch if self._recording else 0
        self._pipeline = self._controller.run(
            feeder, prefetch=prefetch, consumer_streams={self._location: self._stream}
        )
        return self._next(self._pipeline, staged=False)

    def _next(self, pipeline: ResidencyPipeline, *, staged: bool) -> Any:
        """Enters the pipeline's next step; a step that was not staged ahead and had to
        copy something in at its turn is a stall."""
        use = next(pipeline)
        if not staged and use.decision.plan.enter:
            self._counters.stalls += 1
        return use

    def _stop_pipeline(self) -> None:
        """Ends the pipeline and resident mode, and waits on the host for the device's
        reads of their steps: the next pipeline cannot wait for leases it did not take,
        and needs their room (a misprediction, a new recording, `materialize`, `close`)."""
        pipeline, self._pipeline = self._pipeline, None
        self._feeder = None
        resident, self._resident = self._resident, None
        self._resident_units = frozenset()
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
                self._runtime.synchronize_stream(self._stream)

    def _enter_resident(self) -> None:
        """Keeps every value the recording uses on the device under one use, when they
        fit the budget together; steps then only put tensors in place."""
        recording = self._recording
        if not recording or self._resident is not None or self._budget is None:
            return
        units = frozenset(unit for key in recording for unit in key)
        values = {id(v): v for unit in units for v in self._unit_values[unit]}
        if sum(self._nbytes[v.index] for v in values.values()) > self._budget:
            return
        self._stop_pipeline()
        location = self._location
        request = ResidencyRequest(
            "resident", [ResidencyRequirement(v.handle, location) for v in values.values()]
        )
        use = self._controller.use(request, consumer_streams={location: self._stream})
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
        self._resident, self._resident_units = use, units

    def _enter(self, key: Key) -> Any:
        self._counters.steps += 1
        feeder, pipeline = self._feeder, self._pipeline
        if feeder is not None and pipeline is not None:
            handed = feeder.handed
            if handed:
                predicted, position = handed[0]
                if predicted == key:
                    handed.popleft()
                    try:
                        return self._next(pipeline, staged=pipeline.position in pipeline.staged)
                    except StopIteration:
                        pass
                else:
                    # Predict again from where this step was expected; `_restart`
                    # counts the misprediction and finds the step in the recording.
                    self._stop_pipeline()
                    self._cursor = position
            elif not feeder.stopped:
                self._follow(key)
                feeder.upcoming = key
                try:
                    return self._next(pipeline, staged=False)
                except StopIteration:
                    return self._restart(key, follow=False)
        return self._restart(key)

    def _unit_enter(self, unit: int) -> None:
        """Before unit ``unit``'s forward: its step, and its tensors in their slots."""
        stack = self._stack
        stack.append(unit)
        key = tuple(stack)
        self._actual.append(key)
        try:
            if self._resident is not None:
                if unit in self._resident_units:
                    self._counters.steps += 1
                    for value in self._unit_values[unit]:
                        value.installed += 1
                        if value.installed == 1:
                            value.install(value.bundle)
                    return
                self._stop_pipeline()
            use = self._enter(key)
            location = self._location
            for value in self._unit_values[unit]:
                value.installed += 1
                if value.installed == 1:
                    value.install(use.value(value.handle, at=location))
        except BaseException:
            self._unit_exit(unit)
            raise

    def _unit_exit(self, unit: int) -> None:
        """After unit ``unit``'s forward (or a failed entry): placeholders back."""
        stack = self._stack
        if stack and stack[-1] == unit:
            stack.pop()
        for value in self._unit_values[unit]:
            if value.installed:
                value.installed -= 1
                if value.installed == 0:
                    value.uninstall()

    def _wrap_unit(self, unit: int, module: nn.Module) -> None:
        original = module.forward
        lock, enter, leave = self._lock, self._unit_enter, self._unit_exit

        def forward(*args: Any, **kwargs: Any) -> Any:
            with lock:
                enter(unit)
                try:
                    return original(*args, **kwargs)
                finally:
                    leave(unit)

        self._wrap(module, forward)

    def _wrap_root(self) -> None:
        module = self._module
        original = module.forward
        lock = self._lock
        device = None if self._simulated else self._compute_device

        def move(item: Any) -> Any:
            if isinstance(item, torch.Tensor) and item.device != device:
                return item.to(device, non_blocking=True)
            return item

        def forward(*args: Any, **kwargs: Any) -> Any:
            with lock:
                if device is not None:
                    args, kwargs = tree_map(move, (args, kwargs))
                self._depth += 1
                finished = False
                try:
                    output = original(*args, **kwargs)
                    finished = True
                    return output
                finally:
                    self._depth -= 1
                    if not self._depth:
                        self._pass_end(finished)

        self._wrap(module, forward)

    def _wrap(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        """Puts ``forward`` in front of ``module.forward``; `close` undoes it."""
        self._wrapped.append((module, module.__dict__.get("forward", _ABSENT)))
        module.forward = forward

    def _unwrap(self) -> None:
        wrapped, self._wrapped = self._wrapped, []
        for module, previous in reversed(wrapped):
            if previous is _ABSENT:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous

    def _pass_end(self, finished: bool) -> None:
        """After a root forward: a forward that finished and took another order than
        the recording is the new recording (one that raised records nothing)."""
        actual, self._actual = self._actual, []
        if self._stack:
            # A forward interrupted inside a unit (KeyboardInterrupt, say) left it
            # entered: placeholders back everywhere.
            for unit in reversed(self._stack):
                self._unit_exit(unit)
            self._stack = []
        if not finished:
            return
        self._counters.forwards += 1
        if actual != self._recording:
            if self._recording is not None:
                self._counters.rerecords += 1
            self._record(actual)
        if self._resident is None:
            self._enter_resident()
        self._collect()

    def _record(self, actual: list[Key]) -> None:
        self._stop_pipeline()
        self._recording = actual
        positions: dict[Key, list[int]] = {}
        for position, key in enumerate(actual):
            positions.setdefault(key, []).append(position)
        self._positions = positions
        self._cursor = 0
        self._controller = self._make_controller()

    # ------------------------------------------------------------------ stats

    def _collect(self) -> None:
        """Counts the transitions since the last reading (the manager's trace)."""
        manager = self._manager
        reports = manager.trace()
        if not self._owns_manager:
            seen = self._trace_seen
            start = 0
            if seen is not None:
                for index in range(len(reports) - 1, -1, -1):
                    if reports[index] is seen:
                        start = index + 1
                        break
            self._trace_seen = reports[-1] if reports else seen
            reports = reports[start:]
        else:
            manager.clear_trace()
        counters = self._counters
        for report in reports:
            if report.no_op or report.destination is None or report.source is None:
                continue
            source: str = report.source.kind
            destination: str = report.destination.kind
            nbytes = report.storage_nbytes
            if destination == "cuda":
                counters.loads += 1
                if source in ("pinned-host", "pageable-host"):
                    counters.h2d += nbytes
            elif source == "cuda" and destination in ("pinned-host", "pageable-host"):
                counters.d2h += nbytes
            if source == "disk":
                counters.disk_read += nbytes
            if destination == "disk":
                counters.disk_write += nbytes

    # ------------------------------------------------------------------ public

    @property
    def module(self) -> nn.Module:
        """The offloaded module."""
        return self._module

    @property
    def manager(self) -> ResidencyManager:
        """The manager that owns the weights."""
        return self._manager

    @property
    def controller(self) -> ResidencyController:
        """The controller that decides the evictions (a new one after each recording)."""
        return self._controller

    @property
    def location(self) -> ResidencyLocation:
        """The device's location."""
        return self._location

    @property
    def units(self) -> tuple[OffloadUnit, ...]:
        """The units, in module order."""
        return self._units

    @property
    def schedule(self) -> tuple[tuple[str, ...], ...]:
        """The recorded order: per step, the names of the units active when it was
        entered, outermost first; empty before the first forward."""
        names = [unit.name for unit in self._units]
        return tuple(tuple(names[u] for u in key) for key in self._recording or ())

    def stats(self) -> OffloadStats:
        """Return what the offload did so far (see `OffloadStats`); works after `close`.

        Returns:
            The counts and peaks, from the offload's opening to now (to the close).

        Raises:
            ResidencyReentrancyError: Called from inside a source's ``load()``.
        """
        with self._lock:
            return self._stats()

    def _stats(self) -> OffloadStats:
        if not self._manager_closed():
            self._collect()
        counters = self._counters
        device_peak = host_peak = 0
        if not self._manager_closed():
            for record in self._manager.snapshot().locations:
                if record.location == self._location:
                    device_peak = record.peak_charged_bytes
                elif record.location == self._host:
                    host_peak = record.peak_used_bytes
            self._peaks = (device_peak, host_peak)
        else:
            device_peak, host_peak = self._peaks
        return OffloadStats(
            forwards=counters.forwards,
            steps=counters.steps,
            loads=counters.loads,
            h2d_bytes=counters.h2d,
            d2h_bytes=counters.d2h,
            disk_read_bytes=counters.disk_read
            + sum(source.reads * source.read_nbytes for source in self._sources),
            disk_write_bytes=counters.disk_write,
            stalls=counters.stalls,
            mispredictions=counters.mispredictions,
            rerecords=counters.rerecords,
            device_peak_bytes=device_peak,
            host_peak_bytes=host_peak,
        )

    def _manager_closed(self) -> bool:
        return bool(engine_of(self._manager).core.closed)

    @contextlib.contextmanager
    def materialize(self, submodule: nn.Module) -> Iterator[nn.Module]:
        """Give temporary, budgeted access to ``submodule``'s weights on the device.

        Every unit inside ``submodule`` (and every unit that contains it) is made
        resident on the device, evicting others as needed, and its tensors are put in
        place until the block ends; then the placeholders are back. Outside a forward
        only (the prefetched steps are given up first).

        Args:
            submodule: The offloaded module or one of its submodules.

        Yields:
            ``submodule``, its tensors in place until the block ends.

        Raises:
            ValueError: ``submodule`` is not part of the offloaded module.
            ResidencyPlanError: Its weights do not fit the device budget.
            ResidencyClosedError: The offload is closed.

        Example:
            ```python
            import torch
            from torch import nn
            from fhelium.residency.nn import offload
            from fhelium.residency.simulation import SimulatedRuntime, use_runtime

            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            with torch.no_grad(), use_runtime(SimulatedRuntime(1)):
                with offload(model, budget=1 << 20) as off, off.materialize(model[1]):
                    total = model[1].weight.sum()  # readable inside the block only
            ```
        """
        with self._lock:
            if self._closed:
                raise ResidencyClosedError("the offload is closed: materialize needs it open")
            with self._materialize(submodule) as module:
                yield module

    @contextlib.contextmanager
    def _materialize(self, submodule: nn.Module) -> Iterator[nn.Module]:
        if not any(submodule is m for m in self._module.modules()):
            raise ValueError("submodule is not part of the offloaded module")
        inside = {id(m) for m in submodule.modules()}
        ancestors = _ancestors_of(self._module, submodule)
        wanted = [
            index
            for index, unit in enumerate(self._units)
            if id(unit.module) in inside or any(unit.module is m for m in ancestors)
        ]
        self._stop_pipeline()
        values: dict[int, _Value] = {}
        for index in wanted:
            for value in self._unit_values[index]:
                values[id(value)] = value
        if not values:
            yield submodule
            return
        request = ResidencyRequest(
            "materialize",
            [ResidencyRequirement(value.handle, self._location) for value in values.values()],
        )
        with self._controller.use(request, consumer_streams={self._location: self._stream}) as use:
            for value in values.values():
                value.installed += 1
                if value.installed == 1:
                    value.install(use.value(value.handle, at=self._location))
            try:
                yield submodule
            finally:
                for value in values.values():
                    value.installed -= 1
                    if value.installed == 0:
                        value.uninstall()

    def close(self) -> None:
        """Unwrap every forward and put the module back as it was; idempotent.

        Parameters and buffers go back to pageable CPU memory (new `nn.Parameter`
        objects with ``requires_grad=False``), or to meta when they came from a
        checkpoint. The manager is closed when the offload created it.

        Raises:
            Exception: An error from ending the pipeline or from copying a value back
                propagates after every other step ran.
        """
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._closed and not self._values:
            return
        self._closed = True
        error: BaseException | None = None
        try:
            self._stop_pipeline()
            # The device's reads of the last steps (and of `materialize`) end before
            # the device copies are dropped.
            self._runtime.synchronize_stream(self._stream)
        except BaseException as failure:
            error = failure
        self._unwrap()
        self._stack = []
        values, self._values = self._values, []
        if not self._manager_closed():
            try:
                self._collect()
                self._stats()
            except BaseException as failure:
                error = error or failure
        held: dict[ResidencyHandle[Any], set[ResidencyLocation]] = {}
        if values and not self._manager_closed():
            for entry in self._manager.snapshot().values:
                held[entry.handle] = {m.location for m in entry.materializations}
        # Those with a pageable copy first: each discard frees room for the next copy.
        values.sort(key=lambda value: PAGEABLE_HOST not in held.get(value.handle, ()))
        for value in values:
            try:
                self._restore(value, held.get(value.handle, set()))
            except BaseException as failure:
                error = error or failure
        if self._owns_manager:
            try:
                self._manager.close()
            except BaseException as failure:
                error = error or failure
        if error is not None:
            raise error

    def _restore(self, value: _Value, held: set[ResidencyLocation]) -> None:
        """Puts ``value``'s tensors back in its slots (``held``: where it lives), and
        discards it from a caller's manager."""
        group = value.group
        if self._from_checkpoint:
            for name, placeholder, slots, grad in zip(
                group.names, value.placeholders, group.slots, group.requires_grad, strict=True
            ):
                empty = value.kept.get(name)
                if empty is None:
                    empty = torch.empty(placeholder.shape, dtype=placeholder.dtype, device="meta")
                tensor: torch.Tensor = (
                    nn.Parameter(empty, requires_grad=grad) if slots[0].is_parameter else empty
                )
                for slot in slots:
                    slot.install(tensor)
            if not self._owns_manager:
                self._manager.discard(value.handle)
            return
        # Back in pageable memory, as the module's tensors were: copied out of whatever
        # the value lives in (one value's bytes extra at a time).
        manager = self._manager
        handle = value.handle
        if PAGEABLE_HOST not in held:
            manager.ensure(handle, PAGEABLE_HOST)
        with manager.acquire([handle], at=PAGEABLE_HOST) as borrowed:
            bundle = borrowed[handle]
        assert isinstance(bundle, TensorBundle)  # every offload value is one
        # Forgotten at once: its charges are free for the next value's copy.
        manager.discard(handle)
        for tensor, slots, grad in zip(
            bundle.tensors.values(), group.slots, group.requires_grad, strict=True
        ):
            plain = tensor
            if tensor.is_inference():
                # Copied under `torch.inference_mode()`: the module's tensors were
                # ordinary ones, usable with autograd; so are these.
                with torch.inference_mode(False):
                    plain = tensor.clone()
            restored: torch.Tensor = (
                nn.Parameter(plain, requires_grad=grad) if slots[0].is_parameter else plain
            )
            for slot in slots:
                slot.install(restored)

    def __enter__(self) -> Offload:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, traceback: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"Offload({type(self._module).__name__}, units={len(self._units)}, "
            f"device={self._location.name}, prefetch={self._prefetch}, {state})"
        )


def _storage_nbytes(tensors: list[torch.Tensor], dtype: torch.dtype | None) -> int:
    """The bytes a bundle of ``tensors`` (cast to ``dtype``) is charged: each storage
    once, a cast tensor its own size."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if dtype is not None and tensor.is_floating_point():
            total += tensor.numel() * dtype.itemsize
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen or storage.nbytes() == 0:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _host_location(runtime: Any, host: str) -> ResidencyLocation:
    """The host tier: pinned where the runtime has pinned memory, else pageable (with
    one warning)."""
    if host == "pageable":
        return PAGEABLE_HOST
    try:
        runtime.empty_pinned(1)
    except RuntimeError:
        warnings.warn(
            "pinned host memory is not available here; the offload keeps weights in "
            "pageable host memory (copies to the device are slower)",
            UserWarning,
            stacklevel=4,
        )
        return PAGEABLE_HOST
    return PINNED_HOST


def _ancestors_of(root: nn.Module, target: nn.Module) -> list[nn.Module]:
    """The modules on the path from ``root`` down to ``target`` (both included)."""
    path: list[nn.Module] = []

    def walk(module: nn.Module) -> bool:
        path.append(module)
        if module is target:
            return True
        for child in module.children():
            if walk(child):
                return True
        path.pop()
        return False

    walk(root)
    return path


def offload(
    module: nn.Module,
    *,
    device: str | torch.device = "cuda:0",
    budget: int | None = None,
    host: Literal["pinned", "pageable"] = "pinned",
    host_budget: int | None = None,
    disk: str | os.PathLike[str] | None = None,
    disk_budget: int | None = None,
    prefetch: int = 1,
    policy: PolicyName | ResidencyPolicy = "schedule-aware",
    units: UnitRule = None,
    checkpoint: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
    manager: ResidencyManager | None = None,
) -> Offload:
    """Run ``module`` with its weights on ``device`` only around each unit's forward.

    While the returned `Offload` is open, calling ``module`` (and transformers'
    ``generate``) works unchanged and computes on ``device``. The module is cut into
    units (by default each module that directly owns parameters or buffers; ``units=``
    chooses blocks), each unit's tensors one managed value (a tied tensor is one value
    shared by its units). The weights wait in host memory (pinned where available), or
    on disk past ``host_budget``; the device holds at most ``budget`` bytes of them
    (activations are not charged). The first forward is recorded; later forwards follow
    the recording cyclically, evicting the value used farthest ahead and issuing the
    next ``prefetch`` units' copies ahead, and a forward that takes another order is
    followed as it goes and recorded again. When everything the forward uses fits the
    budget, it stays resident. Inference only. See docs/concepts/offload.md.

    Args:
        module: The module, for inference: its tensors on the CPU, or its parameters on
            meta with ``checkpoint`` (build it under `init_empty_weights`).
        device: The CUDA device to compute on (a simulated one under the simulated
            runtime, docs/concepts/simulation.md); ``"cuda"`` means ``"cuda:0"``.
        budget: The device's strict byte budget for the weights (a strict int >= 0);
            required unless ``manager`` is given. Every unit must fit it.
        host: Where the weights wait: ``"pinned"`` (pageable, with one `UserWarning`,
            where pinned memory is not available) or ``"pageable"``.
        host_budget: The host's byte budget, or ``None`` for none.
        disk: A directory that takes the weights the host budget cannot hold, and the
            host's spills.
        disk_budget: The disk directory's byte budget, or ``None``; needs ``disk``.
        prefetch: How many predicted steps to stage while a step runs (a strict int
            >= 0); 0 loads each step at its turn.
        policy: ``"schedule-aware"`` (Belady's rule over the recorded order, cyclic),
            ``"lru"`` (`DeterministicTieredLRU`), or any `ResidencyPolicy`.
        units: What moves as one value: ``None``, a module class, a tuple of classes, or
            a predicate ``(module) -> bool`` or ``(qualified name, module) -> bool``;
            a matching module is a
            unit with its whole subtree (docs/concepts/offload.md#units).
        checkpoint: A safetensors file, or a directory with ``model.safetensors`` or
            ``model.safetensors.index.json`` (what ``save_pretrained`` writes), read a
            unit at a time; keys are the module's ``state_dict()`` names.
        dtype: A floating dtype to cast floating weights to as they are adopted or
            loaded, or ``None`` to keep theirs.
        manager: A manager to keep the weights in (its budgets apply; ``budget``,
            ``host_budget`` and ``disk_budget`` must then be ``None``); it is not
            closed with the offload. By default a new one, closed by `Offload.close`.

    Returns:
        The open `Offload`: a context manager, with ``close()``, ``stats()``,
        ``materialize()``, ``units`` and ``schedule``.

    Raises:
        TypeError: ``module`` is not a module; no ``budget`` and no ``manager``;
            ``budget``, ``host_budget``, ``disk_budget`` or ``prefetch`` is not a strict
            int; ``dtype``, ``policy``, ``units`` or ``manager`` of the wrong kind.
        ValueError: A non-CUDA ``device``, a negative ``prefetch`` or budget, an unknown
            ``host`` or ``policy``, ``disk_budget`` without ``disk``, parameters that
            require grad while autograd is on, tensors on meta without ``checkpoint``
            (or off the CPU), budgets given with ``manager``, a module with no
            parameters or buffers, a module already offloaded (and not closed), or a
            unit larger than the device budget (or, with
            ``checkpoint``, than ``host_budget``).
        ResidencyBudgetError: The host budget cannot hold the weights and there is no
            ``disk``; the module is left as it was.
        ResidencyCheckpointError: A tensor missing from the checkpoint, or of another
            shape, or of a dtype that does not load; nothing was loaded.

    Example:
        ```python
        import torch
        from torch import nn
        from fhelium.residency.nn import offload
        from fhelium.residency.simulation import SimulatedRuntime, use_runtime

        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]).eval()  # 16,640 B each
        x = torch.randn(2, 64)
        with torch.no_grad():
            expected = model(x)
            with use_runtime(SimulatedRuntime(1)), offload(model, budget=40_000) as off:
                for _ in range(3):                      # a third of the weights fit
                    assert torch.equal(model(x), expected)
                stats = off.stats()
        assert stats.forwards == 3 and stats.device_peak_bytes <= 40_000
        ```
    """
    return Offload(
        module,
        device=device,
        budget=budget,
        host=host,
        host_budget=host_budget,
        disk=disk,
        disk_budget=disk_budget,
        prefetch=prefetch,
        policy=policy,
        units=units,
        checkpoint=checkpoint,
        dtype=dtype,
        manager=manager,
    )
