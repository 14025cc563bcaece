"""`offload(module, ...)`: run a PyTorch module whose weights do not fit on its device.

Each unit's weights are one managed value (`fhelium.residency.nn._values`); forward
wrappers make a unit's value resident on the device for its forward (a step of
`ResidencyController.run`, `fhelium.residency.nn._steps`) and put placeholders back
after it. The first forward is recorded; later forwards follow the recording cyclically,
prefetching the next steps, and a forward that takes another order is followed as it goes
and recorded again (`fhelium.residency.nn._schedule`). `close` puts the module back
(`fhelium.residency.nn._restore`). See docs/concepts/offload.md for the rules these
modules implement.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from fhelium.errors import ResidencyClosedError
from fhelium.residency._runtime import current_runtime
from fhelium.residency._runtime.torch_runtime import TorchCudaRuntime
from fhelium.residency._validation import byte_count, require_strict_int
from fhelium.residency.controller import ResidencyController
from fhelium.residency.disk import disk_location
from fhelium.residency.location import ResidencyLocation, cuda_location
from fhelium.residency.manager import ResidencyManager, engine_of
from fhelium.residency.nn._loading import group_sources
from fhelium.residency.nn._restore import restore_values
from fhelium.residency.nn._schedule import Schedule
from fhelium.residency.nn._stats import TRACE_CAPACITY, Counters, OffloadStats, manager_closed
from fhelium.residency.nn._steps import Steps, Wrappers
from fhelium.residency.nn._units import Placeholder, UnitRule, plan_units
from fhelium.residency.nn._values import OffloadUnit, OffloadValue, adopt_groups, host_location
from fhelium.residency.policy import ResidencyPolicy
from fhelium.residency.request import ResidencyRequest, ResidencyRequirement
from fhelium.residency.sizes import parse_size

__all__ = ["Offload", "offload"]

PolicyName = Literal["schedule-aware", "lru"]


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
        budget: int | str | None,
        host: Literal["pinned", "pageable"],
        host_budget: int | str | None,
        disk: str | os.PathLike[str] | None,
        disk_budget: int | str | None,
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
        # Sizes such as "8GiB" are exact ints from here on
        # (docs/concepts/locations-and-budgets.md#byte-counts).
        budget, host_budget, disk_budget = (
            None if amount is None else _size(amount, name)
            for name, amount in (
                ("budget", budget),
                ("host_budget", host_budget),
                ("disk_budget", disk_budget),
            )
        )
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
        # The lock that runs one forward at a time, and the forwards put in front of the
        # modules' own.
        self._lock = threading.RLock()
        self._wrappers = Wrappers()
        self._values: list[OffloadValue] = []
        # The steps' driver, made once the units are known.
        self._steps: Steps | None = None
        self._from_checkpoint = checkpoint is not None
        self._disk = None if disk is None else disk_location(Path(disk))
        self._host_budget = host_budget
        if manager is None:
            runtime = current_runtime()
            self._host = host_location(runtime, host)
            budgets: dict[ResidencyLocation, int] = {self._location: int(budget or 0)}
            if host_budget is not None:
                budgets[self._host] = host_budget
            if self._disk is not None and disk_budget is not None:
                budgets[self._disk] = disk_budget
            manager = ResidencyManager(budgets, trace_capacity=TRACE_CAPACITY)
        else:
            if budget is not None or host_budget is not None or disk_budget is not None:
                raise ValueError(
                    "with manager=, budgets are the manager's: leave budget, host_budget "
                    "and disk_budget unset"
                )
            self._host = host_location(engine_of(manager).runtime, host)
        self._manager = manager
        self._counters = Counters(
            manager, owns_manager=self._owns_manager, location=self._location, host=self._host
        )
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
        self._counters.sources = sources or []
        self._closed = False
        try:
            adopt_groups(
                self._values,
                self._manager,
                groups,
                sources,
                dtype=dtype,
                runtime=self._runtime,
                host=self._host,
                host_budget=self._host_budget,
                disk=self._disk,
                device=self._compute_device,
            )
        except BaseException:
            self.close()
            raise
        values = self._values
        self._units = tuple(
            OffloadUnit(
                plan.name,
                plan.module,
                tuple(values[g].handle for g in plan.groups),
                sum(values[g].nbytes for g in plan.groups),
            )
            for plan in unit_plans
        )
        self._unit_values = [[values[g] for g in plan.groups] for plan in unit_plans]
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
        tiers: dict[ResidencyLocation, list[ResidencyLocation]] = {self._location: [self._host]}
        if self._disk is not None:
            tiers[self._host] = [self._disk]
        schedule = Schedule(
            self._unit_values,
            [unit.name for unit in self._units],
            location=self._location,
            host=self._host,
            counters=self._counters,
        )
        steps = self._steps = Steps(
            self._manager,
            schedule,
            self._unit_values,
            choice=self._policy_choice,
            tiers=tiers,
            counters=self._counters,
            location=self._location,
            stream=self._stream,
            runtime=self._runtime,
            budget=self._budget,
            prefetch=self._prefetch,
        )
        for index, plan in enumerate(unit_plans):
            self._wrappers.wrap_unit(plan.module, index, steps, self._lock)
        device = None if self._simulated else self._compute_device
        self._wrappers.wrap_root(self._module, steps, self._lock, device)

    def _built(self) -> Steps:
        """The steps' driver (there once `__init__` returned)."""
        steps = self._steps
        assert steps is not None, "the offload was not built"
        return steps

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
        return self._built().controller

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
        return self._built().schedule.named()

    def stats(self) -> OffloadStats:
        """Return what the offload did so far (see `OffloadStats`); works after `close`.

        Returns:
            The counts and peaks, from the offload's opening to now (to the close).

        Raises:
            ResidencyReentrancyError: Called from inside a source's ``load()``.
        """
        with self._lock:
            return self._counters.stats()

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
        steps = self._built()
        steps.stop()
        values: dict[int, OffloadValue] = {}
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
        with steps.controller.use(request, consumer_streams={self._location: self._stream}) as use:
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
        steps = self._steps
        try:
            if steps is not None:
                steps.stop()
            # The device's reads of the last steps (and of `materialize`) end before
            # the device copies are dropped.
            self._runtime.synchronize_stream(self._stream)
        except BaseException as failure:
            error = failure
        self._wrappers.unwrap()
        if steps is not None:
            steps.stack = []
        values, self._values = self._values, []
        if not manager_closed(self._manager):
            try:
                self._counters.stats()
            except BaseException as failure:
                error = error or failure
        restore_error = restore_values(
            self._manager,
            values,
            from_checkpoint=self._from_checkpoint,
            owns_manager=self._owns_manager,
        )
        error = error or restore_error
        if self._owns_manager:
            try:
                self._manager.close()
            except BaseException as failure:
                error = error or failure
        if error is not None:
            raise error

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


def _size(amount: object, name: str) -> int:
    """A budget argument: a strict int >= 0, or a size such as ``"8GiB"``."""
    if isinstance(amount, str):
        return parse_size(amount, name)
    if require_strict_int(amount, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {amount}")
    return byte_count(amount, name)  # type: ignore[arg-type]


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
    budget: int | str | None = None,
    host: Literal["pinned", "pageable"] = "pinned",
    host_budget: int | str | None = None,
    disk: str | os.PathLike[str] | None = None,
    disk_budget: int | str | None = None,
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
        budget: The device's strict byte budget for the weights: a strict int >= 0, or a
            size such as ``"8GiB"`` or ``"512MB"``
            (docs/concepts/locations-and-budgets.md#byte-counts); required unless
            ``manager`` is given. Every unit must fit it.
        host: Where the weights wait: ``"pinned"`` (pageable, with one `UserWarning`,
            where pinned memory is not available) or ``"pageable"``.
        host_budget: The host's byte budget (an int or a size), or ``None`` for none.
        disk: A directory that takes the weights the host budget cannot hold, and the
            host's spills.
        disk_budget: The disk directory's byte budget (an int or a size), or ``None``;
            needs ``disk``.
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
            ``budget``, ``host_budget`` or ``disk_budget`` is neither a strict int nor a
            string, or ``prefetch`` not a strict int; ``dtype``, ``policy``, ``units`` or
            ``manager`` of the wrong kind.
        ValueError: A non-CUDA ``device``, a negative ``prefetch`` or budget, a budget
            string that is not a byte count, an unknown
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
