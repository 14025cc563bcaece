"""Residency across ranks under `torch.distributed`: one manager per rank.

`rank_manager` builds this rank's manager on its own device (``cuda:{LOCAL_RANK}``, or
a simulated ``cuda:0`` on a machine without CUDA). `LockstepChecker` and
`check_lockstep` prove that SPMD ranks make the same residency decisions: each
decision's digest is all-gathered and a divergence raises `ResidencyDivergenceError`
naming the first rank and the first action that differ. `broadcast`, `scatter` and
`gather` move managed values between the ranks' managers through the process group
(NCCL on GPUs, gloo on the CPU), all or nothing: each receiving rank admits the bytes
under its own budget first, a collective verdict follows every phase, and a refusal or
failure anywhere makes every rank raise `ResidencyCollectiveError` with nothing left
charged. An interrupt (any ``BaseException``) anywhere in a transfer leaves nothing of
it on that rank and propagates unchanged.

Everything here is collective: every rank of the group calls the same functions in the
same order. See docs/concepts/distributed.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fhelium.errors import (
    ResidencyCollectiveError,
    ResidencyCommunicationError,
    ResidencyDivergenceError,
)
from fhelium.residency._decisions import ResidencyDecision
from fhelium.residency._runtime import DeviceRuntime, current_runtime, set_runtime
from fhelium.residency._runtime.simulated import SimulatedRuntime
from fhelium.residency._use import ResidencyUse
from fhelium.residency._validation import seal
from fhelium.residency.controller import ResidencyController
from fhelium.residency.lease import ResidencyLease, ResidencyReservation
from fhelium.residency.location import (
    PINNED_HOST,
    DiskLocation,
    ResidencyLocation,
    cuda_location,
)
from fhelium.residency.manager import ResidencyManager, ResidencyScope, engine_of
from fhelium.residency.model import ReplicaMode, ResidencyHandle
from fhelium.residency.pipeline import ResidencyPipeline
from fhelium.residency.plan import DropResident, EnsureResident, MoveResident
from fhelium.residency.request import ResidencyRequest
from fhelium.values.tensor_resident import ResidentTensor, TensorResident

__all__ = [
    "DecisionDigest",
    "LockstepChecker",
    "broadcast",
    "check_lockstep",
    "decision_digest",
    "gather",
    "rank_location",
    "rank_manager",
    "scatter",
]

ValueT = TypeVar("ValueT", bound=TensorResident)
T = TypeVar("T")
Budgets = Mapping[ResidencyLocation, int]


# ---------------------------------------------------------------------- ranks


def _rank_and_size(group: Any) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; rank 0 of 1 without an
    initialised process group."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _local_rank() -> int:
    text = os.environ.get("LOCAL_RANK", "0")
    try:
        local = int(text)
    except ValueError:
        raise ValueError(f"LOCAL_RANK must be an integer, got {text!r}") from None
    if local < 0:
        raise ValueError(f"LOCAL_RANK must be >= 0, got {local}")
    return local


def rank_location() -> ResidencyLocation:
    """Return this rank's compute location.

    ``cuda:{LOCAL_RANK}`` when CUDA is available, otherwise the simulated ``cuda:0`` that
    `rank_manager` installs (every rank of a CPU machine has its own, in its own process).
    See docs/concepts/distributed.md#rank-local-managers.

    Returns:
        The CUDA location this rank computes on.

    Raises:
        ValueError: ``LOCAL_RANK`` is set but is not a valid device index.
    """
    if torch.cuda.is_available():
        return cuda_location(f"cuda:{_local_rank()}")
    return cuda_location("cuda:0")


def rank_manager(
    budgets: Budgets | Sequence[Budgets] | Callable[[int], Budgets],
    *,
    group: Any = None,
    runtime: SimulatedRuntime | None = None,
    trace_capacity: int = 4096,
) -> ResidencyManager:
    """Build this rank's manager, on this rank's own device.

    ``budgets`` is one mapping for every rank, a sequence with one mapping per rank of
    ``group`` (its length must be the group's size), or a callable taking the rank and
    returning its mapping. With CUDA, ``torch.cuda.set_device(LOCAL_RANK)`` is called
    and `rank_location` is ``cuda:{LOCAL_RANK}``. Without CUDA, ``runtime`` (a
    `SimulatedRuntime`) is installed process-wide (`set_runtime`) when given; otherwise
    the installed runtime is used when it is a `SimulatedRuntime`, and a
    ``SimulatedRuntime(1, auto_complete=True)`` (its events complete as they are
    recorded, as CPU work is done by then) is installed when it is not. Either way
    ``current_runtime()`` then gives its streams. Without an initialised process group
    the process is rank 0 of 1. See docs/concepts/distributed.md#rank-local-managers.

    Args:
        budgets: One budget mapping for every rank, a sequence with one mapping per rank of
            ``group``, or a callable taking the rank and returning its mapping.
        group: The process group; ``None`` for the default group (without an initialised
            group the process is rank 0 of 1).
        runtime: Without CUDA, a `SimulatedRuntime` to install process-wide; ``None`` to use
            (or install) one as described above.
        trace_capacity: As for `ResidencyManager`.

    Returns:
        A new `ResidencyManager` with this rank's budgets.

    Raises:
        TypeError: ``budgets`` of the wrong kind, a rank's budgets not a mapping, or a
            ``runtime`` that is not a `SimulatedRuntime`; as `ResidencyManager` raises.
        ValueError: A sequence whose length is not the group's size; as `ResidencyManager`
            raises.

    Example:
        ```python
        import torch
        from fhelium.residency.distributed import rank_location, rank_manager
        from fhelium.residency.simulation import SimulatedRuntime, use_runtime
        from fhelium.values import ResidentTensor

        with use_runtime(SimulatedRuntime(1, auto_complete=True)):  # a CPU rank
            device = rank_location()
            with rank_manager(lambda rank: {device: 1 << 20}) as manager:
                handle = manager.adopt(ResidentTensor(torch.ones(256)))
                manager.move(handle, device)
        ```
    """
    rank, size = _rank_and_size(group)
    if callable(budgets):
        chosen = budgets(rank)
    elif isinstance(budgets, Mapping):
        chosen = budgets
    elif isinstance(budgets, Sequence) and not isinstance(budgets, str | bytes):
        if len(budgets) != size:
            raise ValueError(
                f"budgets has {len(budgets)} entries for a group of {size} ranks; "
                "give one mapping per rank"
            )
        chosen = budgets[rank]
    else:
        raise TypeError(
            "budgets must be a Mapping, a sequence of one Mapping per rank, or a callable "
            f"rank -> Mapping, got {type(budgets).__name__}"
        )
    if not isinstance(chosen, Mapping):
        raise TypeError(
            f"the budgets of rank {rank} must be a Mapping, got {type(chosen).__name__}"
        )
    if runtime is not None and not isinstance(runtime, SimulatedRuntime):
        raise TypeError(f"runtime must be a SimulatedRuntime, got {type(runtime).__name__}")
    if torch.cuda.is_available():
        torch.cuda.set_device(_local_rank())
    elif runtime is not None:
        set_runtime(runtime)
    elif not isinstance(current_runtime(), SimulatedRuntime):
        set_runtime(SimulatedRuntime(1, auto_complete=True))
    return ResidencyManager(chosen, trace_capacity=trace_capacity)


def _transport(group: Any) -> torch.device:
    """Where the group's backend moves bytes from: the current CUDA device for NCCL,
    host memory otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _all_gather_objects(value: Any, group: Any, size: int) -> list[Any]:
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, value, group=group)
    return gathered


@contextlib.contextmanager
def _communicating(operation: str, phase: str) -> Iterator[None]:
    """A failure of the process group under ``phase`` becomes a
    `ResidencyCommunicationError`, the backend's exception its cause."""
    try:
        yield
    except ResidencyCollectiveError:
        raise
    except (RuntimeError, ValueError, OSError) as error:
        detail = (
            f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"
        )
        raise ResidencyCommunicationError(
            operation=operation, phase=phase, detail=detail
        ) from error


# ---------------------------------------------------------------------- digests


@dataclass(frozen=True, slots=True)
class DecisionDigest:
    """A rank-independent fingerprint of one `ResidencyDecision`: a frozen record.

    ``header`` holds the entries compared before any action (request name, state
    version when included, policy name); ``actions`` one canonical text per plan action
    (reclaim with its eviction's rank and released bytes, then enter, then the
    reservations); ``digest`` the blake2b-256 hex digest of both. Values are named by
    their controller stable key when they have one (``key:...``), otherwise by their
    registration index (``#N``); this rank's compute location reads ``rank-device``.
    See docs/concepts/distributed.md#what-a-digest-covers.

    Attributes:
        request_name: The decided request's name.
        header: The entries compared before any action.
        actions: One canonical text per plan action.
        digest: The blake2b-256 hex digest of header and actions.
    """

    request_name: str
    header: tuple[str, ...]
    actions: tuple[str, ...]
    digest: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "header", tuple(self.header))
        object.__setattr__(self, "actions", tuple(self.actions))


seal(DecisionDigest)


def _value_key(
    controller: ResidencyController | None, manager: ResidencyManager, handle: Any
) -> str:
    if controller is not None:
        metadata = controller._metadata.get(handle)
        if metadata is not None and metadata.stable_key is not None:
            return f"key:{metadata.stable_key}"
    index = engine_of(manager).core.resolve(handle)
    return "#?" if index is None else f"#{index}"


def _location_key(location: ResidencyLocation | None, device: ResidencyLocation) -> str:
    if location is None:
        return "-"
    if location == device:
        return "rank-device"
    if isinstance(location, DiskLocation):
        return "disk"
    return location.name


def decision_digest(
    decision: ResidencyDecision,
    controller: ResidencyController,
    *,
    include_state_version: bool = True,
    device: ResidencyLocation | None = None,
) -> DecisionDigest:
    """Compute the decision's `DecisionDigest` locally (no collective).

    ``controller`` is the one that made the decision (its manager resolves the handles,
    its metadata gives stable keys). ``device`` is the location read as
    ``rank-device`` (default: `rank_location`).

    Args:
        decision: The decision.
        controller: The controller that made it (its manager resolves the handles, its
            metadata gives stable keys).
        include_state_version: Whether the manager's state version is part of the header.
        device: The location read as ``rank-device``; ``None`` for `rank_location`.

    Returns:
        The digest.

    Raises:
        TypeError: ``decision`` is not a `ResidencyDecision` or ``controller`` not a
            `ResidencyController`.
    """
    if not isinstance(decision, ResidencyDecision):
        raise TypeError(f"decision must be a ResidencyDecision, got {type(decision).__name__}")
    if not isinstance(controller, ResidencyController):
        raise TypeError(
            f"controller must be a ResidencyController, got {type(controller).__name__}"
        )
    manager = controller.manager
    here = rank_location() if device is None else device
    header = [f"request {decision.request.name!r}", f"policy {decision.policy_name}"]
    if include_state_version:
        header.insert(1, f"state_version {decision.expected_state_version}")
    plan = decision.plan
    lines: list[str] = []

    def text(action: Any) -> str:
        key = _value_key(controller, manager, action.handle)
        if isinstance(action, MoveResident):
            return (
                f"move {key} to {_location_key(action.to, here)} "
                f"from {_location_key(action.from_location, here)}"
            )
        if isinstance(action, EnsureResident):
            return f"ensure {key} at {_location_key(action.location, here)}"
        if isinstance(action, DropResident):
            return f"drop {key} at {_location_key(action.location, here)}"
        return f"{type(action).__name__} {key}"

    for action, eviction in zip(plan.reclaim, decision.evictions, strict=True):
        lines.append(
            f"reclaim {text(action)} rank={eviction.rank} released={eviction.released_nbytes}"
        )
    lines.extend(f"enter {text(action)}" for action in plan.enter)
    lines.extend(
        f"reserve {_location_key(reservation.location, here)} {reservation.nbytes} "
        f"{reservation.label!r}"
        for reservation in plan.reservations
    )
    hasher = hashlib.blake2b(digest_size=32)
    for line in (*header, "--", *lines):
        hasher.update(line.encode())
        hasher.update(b"\n")
    return DecisionDigest(decision.request.name, tuple(header), tuple(lines), hasher.hexdigest())


def _first_difference(
    reference: DecisionDigest, other: DecisionDigest
) -> tuple[int | None, str, str]:
    """Where ``other`` first differs from ``reference``: an action index (``None`` for
    the header) and the two entries (``"<none>"`` past the end of a list)."""
    for mine, theirs in zip(reference.header, other.header, strict=False):
        if mine != theirs:
            return None, mine, theirs
    if len(reference.header) != len(other.header):
        return None, "; ".join(reference.header), "; ".join(other.header)
    count = max(len(reference.actions), len(other.actions))
    for index in range(count):
        mine = reference.actions[index] if index < len(reference.actions) else "<none>"
        theirs = other.actions[index] if index < len(other.actions) else "<none>"
        if mine != theirs:
            return index, mine, theirs
    return None, reference.digest, other.digest


def check_lockstep(
    decision: ResidencyDecision,
    controller: ResidencyController,
    *,
    group: Any = None,
    include_state_version: bool = True,
    device: ResidencyLocation | None = None,
) -> DecisionDigest:
    """All-gather the decision's digest over ``group``; return it when every rank agrees.

    A collective: every rank of the group calls it once per decision, in the same
    order. The common case costs one all-gather of 32 bytes; the canonical texts are
    gathered only when digests differ. A process group failure raises
    `ResidencyCommunicationError`.

    Args:
        decision: This rank's decision.
        controller: The controller that made it.
        group: The process group; ``None`` for the default group (without an initialised
            group the process is rank 0 of 1).
        include_state_version: Whether the state version must agree too.
        device: The location read as ``rank-device``; ``None`` for `rank_location`.

    Returns:
        This rank's digest, equal on every rank.

    Raises:
        ResidencyDivergenceError: The ranks' digests differ (raised on every rank, naming the
            first rank that differs from rank 0 and the first differing action).
        ResidencyCommunicationError: The process group failed.
        TypeError: As `decision_digest` raises.

    Example:
        ```python
        import torch
        from fhelium.residency import ResidencyController, ResidencyRequest, ResidencyRequirement
        from fhelium.residency.distributed import check_lockstep, rank_location, rank_manager
        from fhelium.residency.simulation import SimulatedRuntime, use_runtime
        from fhelium.values import ResidentTensor

        with use_runtime(SimulatedRuntime(1, auto_complete=True)):
            device = rank_location()
            with rank_manager({device: 1 << 20}) as manager:
                handle = manager.adopt(ResidentTensor(torch.ones(256)))
                controller = ResidencyController(manager)
                controller.set_policy_metadata(handle, stable_key="weights")
                request = ResidencyRequest("step", [ResidencyRequirement(handle, device)])
                digest = check_lockstep(controller.decide(request), controller)
                assert digest.request_name == "step"
        ```
    """
    mine = decision_digest(
        decision, controller, include_state_version=include_state_version, device=device
    )
    _, size = _rank_and_size(group)
    if size == 1:
        return mine
    with _communicating("lockstep check", "digest"):
        transport = _transport(group)
        local = torch.tensor(list(bytes.fromhex(mine.digest)), dtype=torch.uint8, device=transport)
        gathered = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(gathered, local, group=group)
        digests = [bytes(tensor.cpu().tolist()).hex() for tensor in gathered]
    if all(digest == digests[0] for digest in digests):
        return mine
    # Every rank sees the same digests, so every rank takes this branch together.
    with _communicating("lockstep check", "details"):
        everyone: list[DecisionDigest] = _all_gather_objects(mine, group, size)
    reference = everyone[0]
    for rank, other in enumerate(everyone):
        if other.digest != reference.digest:
            index, expected, actual = _first_difference(reference, other)
            raise ResidencyDivergenceError(
                request_name=reference.request_name,
                rank=rank,
                reference_rank=0,
                action_index=index,
                expected=expected,
                actual=actual,
            )
    return mine  # unreachable: the digests differed


class _CheckedController:
    """The controller as a `ResidencyUse` sees it, with every `decide` checked."""

    def __init__(self, checker: LockstepChecker) -> None:
        self._checker = checker
        inner = checker.controller
        self._inner = inner
        self._manager = inner.manager
        self._engine = inner._engine

    @property
    def manager(self) -> ResidencyManager:
        return self._inner.manager

    @property
    def policy(self) -> Any:
        return self._inner.policy

    def decide(self, request: ResidencyRequest) -> ResidencyDecision:
        return self._checker.decide(request)

    def _decide(self, request: ResidencyRequest, position: int | None) -> ResidencyDecision:
        # A decision for the step about to run (a use's entry) is checked in lockstep,
        # as `decide` is; a prefetch's decision for a later step is not.
        if position is None:
            return self._checker.decide(request)
        return self._inner._decide(request, position)

    def scope(self, decision: ResidencyDecision, *, transfer_streams: Any = None) -> ResidencyScope:
        return self._inner.scope(decision, transfer_streams=transfer_streams)

    def _record_access(self, request: ResidencyRequest) -> None:
        self._inner._record_access(request)


class LockstepChecker:
    """A controller whose decisions are checked across the ranks of ``group``.

    `decide` and `use` check each decision before anything runs; `run` checks each
    step's decision once the step is entered, before the body sees its values. Each
    check is a collective (see `check_lockstep`), so every rank must make the same
    sequence of calls. ``checks`` counts the decisions checked and ``last`` is the
    latest digest. See docs/concepts/distributed.md#lockstep-checking.

    Args:
        controller: The rank's controller.
        group: The process group; ``None`` for the default group (without an initialised
            group the process is rank 0 of 1).
        include_state_version: Whether the state version must agree too.
        device: The location read as ``rank-device``; ``None`` for `rank_location`.

    Attributes:
        controller: The wrapped controller.
        checks: How many decisions were checked.
        last: The latest `DecisionDigest`, or ``None``.

    Raises:
        TypeError: ``controller`` is not a `ResidencyController`.
    """

    __slots__ = ("_device", "_group", "_state_version", "checks", "controller", "last")

    def __init__(
        self,
        controller: ResidencyController,
        *,
        group: Any = None,
        include_state_version: bool = True,
        device: ResidencyLocation | None = None,
    ) -> None:
        if not isinstance(controller, ResidencyController):
            raise TypeError(
                f"controller must be a ResidencyController, got {type(controller).__name__}"
            )
        self.controller = controller
        self._group = group
        self._state_version = include_state_version
        self._device = rank_location() if device is None else device
        self.checks = 0
        self.last: DecisionDigest | None = None

    def check(self, decision: ResidencyDecision) -> DecisionDigest:
        """Run `check_lockstep` on ``decision`` over this checker's group.

        Args:
            decision: A decision of the checker's controller.

        Returns:
            The agreed digest (also stored as ``last``).

        Raises:
            ResidencyDivergenceError: The ranks' decisions differ.
            ResidencyCommunicationError: The process group failed.
        """
        digest = check_lockstep(
            decision,
            self.controller,
            group=self._group,
            include_state_version=self._state_version,
            device=self._device,
        )
        self.checks += 1
        self.last = digest
        return digest

    def decide(self, request: ResidencyRequest) -> ResidencyDecision:
        """Decide with the controller, then check the decision across the ranks.

        Args:
            request: The request.

        Returns:
            The checked decision.

        Raises:
            ResidencyDivergenceError: The ranks' decisions differ.
            ResidencyCommunicationError: The process group failed.
            ResidencyPlanError: As `ResidencyController.decide` raises (and its other errors).
        """
        decision = self.controller.decide(request)
        self.check(decision)
        return decision

    def use(
        self,
        request: ResidencyRequest,
        *,
        consumer_streams: Mapping[ResidencyLocation, Any] | None = None,
        transfer_streams: Mapping[ResidencyLocation, Any] | None = None,
    ) -> ResidencyUse:
        """Return the controller's `use`, with its decision checked before the scope is entered.

        Args:
            request: The request.
            consumer_streams: As for `ResidencyController.use`.
            transfer_streams: As for `ResidencyController.use`.

        Returns:
            The use, not yet entered.

        Raises:
            TypeError: As `ResidencyController.use` raises.
            ValueError: As `ResidencyController.use` raises.
            ResidencyDivergenceError: At entry, when the ranks' decisions differ.
        """
        return ResidencyUse(
            controller=_CheckedController(self),
            request=request,
            consumer_streams=consumer_streams,
            transfer_streams=transfer_streams,
        )

    def run(
        self,
        requests: Iterable[ResidencyRequest],
        *,
        prefetch: int = 0,
        consumer_streams: Mapping[ResidencyLocation, Any] | None = None,
        transfer_streams: Mapping[ResidencyLocation, Any] | None = None,
    ) -> Iterator[ResidencyUse]:
        """Run the controller's `run`, checking each step's decision as the step is entered.

        A generator of the pipeline's steps; the pipeline is closed when the generator
        ends, is closed, or a check raises.

        Args:
            requests: As for `ResidencyController.run`.
            prefetch: As for `ResidencyController.run`.
            consumer_streams: As for `ResidencyController.run`.
            transfer_streams: As for `ResidencyController.run`.

        Yields:
            Each entered step, after its decision was checked.

        Raises:
            ResidencyDivergenceError: A step's decisions differ across the ranks.
            ResidencyCommunicationError: The process group failed.
            TypeError: As `ResidencyController.run` raises.
        """
        pipeline: ResidencyPipeline = self.controller.run(
            requests,
            prefetch=prefetch,
            consumer_streams=consumer_streams,
            transfer_streams=transfer_streams,
        )
        with pipeline:
            for step in pipeline:
                self.check(step.decision)
                yield step

    def __repr__(self) -> str:
        return f"LockstepChecker(checks={self.checks}, policy={self.controller.policy.name!r})"


# ---------------------------------------------------------------------- transfers


@dataclass(frozen=True)
class _Layout:
    """What a receiver needs to rebuild one value: a tensor-free skeleton of it, the
    byte size of each unique storage, and where each tensor sits in them."""

    skeleton: bytes
    storages: tuple[int, ...]
    # (storage position or -1 for a tensor without storage bytes, storage offset in
    # elements, size, stride, dtype) per tensor field, in order.
    tensors: tuple[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], ...]
    replica_mode: ReplicaMode

    @property
    def nbytes(self) -> int:
        return sum(self.storages)


def _describe(
    value: TensorResident, replica_mode: ReplicaMode
) -> tuple[_Layout, list[torch.Tensor]]:
    """The value's layout and one flat ``uint8`` view per unique storage."""
    positions: dict[int, int] = {}
    flats: list[torch.Tensor] = []
    storages: list[int] = []
    tensors = []
    for tensor in value._resident_tensors:
        storage = tensor.untyped_storage()
        size = storage.nbytes()
        if size == 0:
            position = -1
        else:
            key = storage.data_ptr()
            position = positions.get(key, -1)
            if position < 0:
                position = len(flats)
                positions[key] = position
                flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
                flat.set_(storage)
                flats.append(flat)
                storages.append(size)
        tensors.append(
            (
                position,
                int(tensor.storage_offset()),
                tuple(int(n) for n in tensor.size()),
                tuple(tensor.stride()),
                tensor.dtype,
            )
        )
    skeleton = value._with_resident_tensors(
        tuple(torch.empty(0, dtype=tensor.dtype) for tensor in value._resident_tensors)
    )
    layout = _Layout(pickle.dumps(skeleton), tuple(storages), tuple(tensors), replica_mode)
    return layout, flats


class _Allocator:
    """New byte buffers at a location, through the manager's runtime."""

    def __init__(self, manager: ResidencyManager, at: ResidencyLocation) -> None:
        self.runtime = engine_of(manager).runtime
        self.at = at
        self.stream: Any = None
        if at.kind == "cuda":
            self.stream = self.runtime.current_stream(at.device)

    def empty(self, nbytes: int) -> torch.Tensor:
        if self.at.kind == "cuda":
            return self.runtime.empty_cuda(nbytes, self.at.device, self.stream)
        if self.at == PINNED_HOST:
            return self.runtime.empty_pinned(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.runtime.synchronize_stream(self.stream)
            if torch.cuda.is_available() and self.at.device.type == "cuda":
                torch.cuda.synchronize(self.at.device)


def _rebuild(layout: _Layout, buffers: list[torch.Tensor], allocator: _Allocator) -> TensorResident:
    skeleton = pickle.loads(layout.skeleton)
    if not isinstance(skeleton, TensorResident):
        raise TypeError(f"the layout describes a {type(skeleton).__name__}, not a TensorResident")
    tensors = []
    for position, offset, size, stride, dtype in layout.tensors:
        backing = buffers[position] if position >= 0 else allocator.empty(0)
        tensor = torch.empty(0, dtype=dtype, device=backing.device)
        tensor.set_(backing.untyped_storage(), offset, size, stride)
        tensors.append(tensor)
    return skeleton._with_resident_tensors(tuple(tensors))


def _check_location(at: object) -> ResidencyLocation:
    if not isinstance(at, ResidencyLocation):
        raise TypeError(f"at must be a ResidencyLocation, got {type(at).__name__}")
    if isinstance(at, DiskLocation):
        raise ValueError("values are transferred into host or CUDA locations, not to disk")
    return at


def _failure(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class _Transfer:
    """One collective transfer on this rank: what it sends, what it receives, the
    charges and values it holds until the verdict. See
    docs/concepts/distributed.md#all-or-nothing."""

    def __init__(
        self,
        operation: str,
        manager: ResidencyManager,
        at: ResidencyLocation,
        group: Any,
        call: tuple[Any, ...],
    ) -> None:
        if not isinstance(manager, ResidencyManager):
            raise TypeError(f"manager must be a ResidencyManager, got {type(manager).__name__}")
        self.operation = operation
        self.manager = manager
        self.at = _check_location(at)
        self.group = group
        self.rank, self.size = _rank_and_size(group)
        self.call = (operation, at.name if at.kind != "cuda" else "cuda", *call)
        self.leases: list[ResidencyLease] = []
        self.reservations: list[ResidencyReservation] = []
        self.adopted: list[ResidencyHandle[Any]] = []
        self.flats: dict[int, list[torch.Tensor]] = {}

    # --- local steps ----------------------------------------------------------------

    def offer(self, handles: Sequence[ResidencyHandle[Any]]) -> list[_Layout]:
        """Borrows the values this rank sends, at ``at``, and describes them."""
        layouts = []
        stream = None
        if self.at.kind == "cuda":
            stream = engine_of(self.manager).runtime.current_stream(self.at.device)
        snapshot = self.manager.snapshot()
        modes = {entry.handle: entry.spec.replica_mode for entry in snapshot.values}
        for position, handle in enumerate(handles):
            if not isinstance(handle, ResidencyHandle):
                raise TypeError(f"expected a ResidencyHandle, got {type(handle).__name__}")
            lease = self.manager.acquire([handle], at=self.at, consumer_stream=stream)
            self.leases.append(lease)
            layout, flats = _describe(
                lease.values[handle], modes.get(handle, ReplicaMode.EXCLUSIVE)
            )
            layouts.append(layout)
            self.flats[position] = flats
        return layouts

    def admit(self, layouts: Sequence[_Layout]) -> None:
        for index, layout in enumerate(layouts):
            self.reservations.append(
                self.manager.reserve(
                    self.at, layout.nbytes, label=f"{self.operation} incoming value {index}"
                )
            )

    def commit(
        self,
        layouts: Sequence[_Layout],
        buffers: Sequence[list[torch.Tensor]],
        allocator: _Allocator,
    ) -> list[ResidencyHandle[Any]]:
        """Rebuilds and adopts the received values, each adopted the moment its
        reservation is given back."""
        allocator.synchronize()
        handles = []
        for layout, parts, reservation in zip(layouts, buffers, self.reservations, strict=True):
            value = _rebuild(layout, parts, allocator)
            reservation.release()
            handle = self.manager.adopt(value, at=self.at, replica_mode=layout.replica_mode)
            self.adopted.append(handle)
            handles.append(handle)
        self.reservations.clear()
        return handles

    def undo(self, error: BaseException | None = None) -> None:
        """Gives back every charge and value this transfer took on this rank; each step
        that fails is a note on ``error`` (the error about to be raised), and the steps
        after it still run. Idempotent: what was given back is forgotten."""
        _drain(
            self.reservations,
            error,
            lambda reservation: f"releasing the reservation {reservation!r}",
            lambda reservation: reservation.release(),
        )
        _drain(
            self.adopted,
            error,
            lambda handle: f"discarding the adopted value {handle!r}",
            self.manager.discard,
        )
        self.release(error)

    def release(self, error: BaseException | None = None) -> None:
        """Releases this rank's leases (waiting for their events); without ``error`` a
        failure propagates, and the leases not yet released stay listed for `undo`."""
        _drain(
            self.leases,
            error,
            lambda lease: f"releasing the lease {lease!r}",
            _release_waiting,
        )

    # --- collective steps -------------------------------------------------------------

    def verdict(self, phase: str, error: BaseException | None) -> None:
        """Every rank's outcome of ``phase``; a failure anywhere raises the same
        `ResidencyCollectiveError` on every rank (`_collective` then undoes each rank's
        part)."""
        local = None if error is None else _failure(error)
        try:
            with _communicating(self.operation, phase):
                outcomes = _all_gather_objects(local, self.group, self.size)
        except ResidencyCommunicationError as failure:
            if error is not None:
                failure.add_note(f"this rank had failed too: {_failure(error)}")
            raise
        failed = tuple(rank for rank, outcome in enumerate(outcomes) if outcome is not None)
        if failed:
            raised = ResidencyCollectiveError(
                operation=self.operation,
                phase=phase,
                failed_ranks=failed,
                details=tuple(str(outcomes[rank]) for rank in failed),
            )
            raise raised from error

    def agree(self, offered: list[_Layout] | None, error: BaseException | None) -> list[Any]:
        """Phase 1: every rank's call and offered layouts; a mismatched call or a failed
        offer makes every rank raise."""
        mine: tuple[Any, ...] = (self.call, None if error is None else _failure(error), offered)
        with _communicating(self.operation, "agreement"):
            everyone = _all_gather_objects(mine, self.group, self.size)
        failed = []
        details = []
        for rank, (call, outcome, _) in enumerate(everyone):
            if call != everyone[0][0]:
                failed.append(rank)
                details.append(f"called {call!r}, rank 0 called {everyone[0][0]!r}")
            elif outcome is not None:
                failed.append(rank)
                details.append(outcome)
        if failed:
            raised = ResidencyCollectiveError(
                operation=self.operation,
                phase="agreement",
                failed_ranks=tuple(failed),
                details=tuple(details),
            )
            raise raised from error
        return [entry[2] for entry in everyone]


def _release_waiting(lease: ResidencyLease) -> None:
    lease.release(wait=True)


def _noted(error: BaseException | None, what: str, step: Callable[..., object], *args: Any) -> None:
    """Runs a clean-up ``step``; a failure becomes a note on ``error`` (or is raised
    when there is no error to carry it). With an error to carry it, an interrupt of the
    step (a second ``KeyboardInterrupt``) is a note too: ``error`` is what propagates."""
    try:
        step(*args)
    except BaseException as failure:
        if error is None:
            raise
        error.add_note(f"clean-up: {what} also failed: {failure!r}")


def _drain(
    items: list[T],
    error: BaseException | None,
    what: Callable[[T], str],
    step: Callable[[T], object],
) -> None:
    """Runs ``step`` on each of ``items`` in order, forgetting each once its step ran.
    Without ``error``, a failure propagates with the failed item and those after it
    still listed, so a later `_Transfer.undo` gives them back."""
    while items:
        item = items[0]
        _noted(error, what(item), step, item)
        del items[0]


def _receive_buffers(layouts: Sequence[_Layout], allocator: _Allocator) -> list[list[torch.Tensor]]:
    """The storages each incoming value will live in, allocated at the destination
    during admission (an allocation failure is a refused admission)."""
    return [[allocator.empty(nbytes) for nbytes in layout.storages] for layout in layouts]


class _Wire:
    """Where the process group's backend moves bytes (``device``: this rank's current
    CUDA device for NCCL, the host for gloo), and how this rank's buffers get there.

    A buffer is handed to the backend only when it lives on ``device`` itself, type and
    index, as the manager's runtime places it: a buffer on another GPU than the rank's
    (or on a GPU under gloo, or on the host under NCCL) goes through a staging buffer on
    ``device``. See docs/concepts/distributed.md#all-or-nothing."""

    def __init__(self, runtime: DeviceRuntime, device: torch.device) -> None:
        self.runtime = runtime
        self.device = device
        self.stream: Any = None
        if device.type == "cuda":
            self.stream = runtime.current_stream(device)

    def reaches(self, tensor: torch.Tensor) -> bool:
        """Whether the backend can move ``tensor``'s bytes where they are."""
        return self.runtime.value_device(ResidentTensor(tensor)) == self.device

    def empty(self, nbytes: int) -> torch.Tensor:
        """A new flat ``uint8`` buffer on ``device`` (a staging buffer)."""
        if self.stream is not None:
            return self.runtime.empty_cuda(nbytes, self.device, self.stream)
        return torch.empty(nbytes, dtype=torch.uint8)

    def send(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` itself when the backend reaches it, otherwise a copy on ``device``."""
        if self.reaches(flat):
            return flat
        value = ResidentTensor(flat)
        if self.stream is not None:
            copy = self.runtime.copy_to_cuda(value, self.device, self.stream, non_blocking=False)
        else:
            copy = self.runtime.copy_to_pageable(value)
        (tensor,) = copy._resident_tensors
        return tensor

    def staged(self, buffer: torch.Tensor) -> torch.Tensor:
        """The tensor the backend receives into for ``buffer``: itself when the backend
        reaches it, a staging buffer otherwise (copied in by `_land`)."""
        return buffer if self.reaches(buffer) else self.empty(buffer.numel())


def _wire(transfer: _Transfer) -> _Wire:
    return _Wire(engine_of(transfer.manager).runtime, _transport(transfer.group))


def _send(flat: torch.Tensor, wire: _Wire) -> torch.Tensor:
    return wire.send(flat)


def _land(buffer: torch.Tensor, staged: torch.Tensor) -> None:
    if staged is not buffer:
        buffer.copy_(staged)


def _outgoing(
    flat: torch.Tensor, wire: _Wire, error: BaseException | None
) -> tuple[torch.Tensor, BaseException | None]:
    """What this rank sends for ``flat``, and its first local failure so far. After a
    failure it still sends a buffer of the same size, so the other ranks' collectives
    complete and every rank learns of it at the transfer verdict."""
    if error is None:
        try:
            return _send(flat, wire), None
        except Exception as failure:
            error = failure
    return wire.empty(flat.numel()), error


def _landed(
    buffer: torch.Tensor, staged: torch.Tensor, error: BaseException | None
) -> BaseException | None:
    """Copies what arrived into its destination, unless an earlier copy failed; the
    first local failure so far (the collectives go on either way)."""
    if error is None:
        try:
            _land(buffer, staged)
        except Exception as failure:
            return failure
    return error


Mover = Callable[[_Wire, Sequence[list[torch.Tensor]], BaseException | None], BaseException | None]


def _collective(
    transfer: _Transfer,
    offer: Callable[[], list[_Layout]] | None,
    incoming: Callable[[list[Any]], list[_Layout]],
    move: Mover,
) -> tuple[list[Any], list[ResidencyHandle[Any]]]:
    """One transfer on this rank (docs/concepts/distributed.md#all-or-nothing): its four
    phases, and the undo of this rank's part when anything raises out of them, an
    interrupt (any ``BaseException``) included; the exception then propagates as it was.
    ``offer`` describes what this rank sends (None: nothing), ``incoming`` picks from
    every rank's offers what this rank receives, and ``move`` takes part in the
    transfer's collectives (given the wire, the receive buffers and the first local
    failure so far, it returns the first local failure). Returns every rank's offers and
    the handles this rank adopted."""
    try:
        return _phases(transfer, offer, incoming, move)
    except BaseException as error:
        transfer.undo(error)
        raise


def _phases(
    transfer: _Transfer,
    offer: Callable[[], list[_Layout]] | None,
    incoming: Callable[[list[Any]], list[_Layout]],
    move: Mover,
) -> tuple[list[Any], list[ResidencyHandle[Any]]]:
    offered: list[_Layout] | None = None
    error: BaseException | None = None
    try:
        if offer is not None:
            offered = offer()
    except Exception as failure:
        error = failure
    everyone = transfer.agree(offered, error)
    layouts = incoming(everyone)
    error = None
    received: list[list[torch.Tensor]] = []
    allocator = _Allocator(transfer.manager, transfer.at)
    wire: _Wire | None = None
    try:
        wire = _wire(transfer)
        if layouts:
            transfer.admit(layouts)
            received = _receive_buffers(layouts, allocator)
    except Exception as failure:
        error = failure
    transfer.verdict("admission", error)
    assert wire is not None  # the verdict raised otherwise
    with _communicating(transfer.operation, "transfer"):
        error = move(wire, received, None)
    transfer.verdict("transfer", error)
    return everyone, _finish(transfer, layouts, received, allocator)


def _check_rank(transfer: _Transfer, name: str, rank: int) -> None:
    if not 0 <= rank < transfer.size:
        raise ValueError(
            f"{name} must be a rank of the group (0 to {transfer.size - 1}), got {rank}"
        )


def _send_to(tensor: torch.Tensor, *, peer: int, group: Any) -> None:
    dist.send(tensor, peer, group=group)


def _receive_from(tensor: torch.Tensor, *, peer: int, group: Any) -> None:
    dist.recv(tensor, peer, group=group)


def _send_all(
    flats: Sequence[torch.Tensor],
    wire: _Wire,
    error: BaseException | None,
    send: Callable[[torch.Tensor], object],
) -> BaseException | None:
    for flat in flats:
        payload, error = _outgoing(flat, wire, error)
        send(payload)
    return error


def _receive_all(
    buffers: Sequence[torch.Tensor],
    wire: _Wire,
    error: BaseException | None,
    receive: Callable[[torch.Tensor], object],
) -> BaseException | None:
    for buffer in buffers:
        staged = wire.staged(buffer)
        receive(staged)
        error = _landed(buffer, staged, error)
    return error


def broadcast(
    manager: ResidencyManager,
    handle: ResidencyHandle[ValueT] | None,
    *,
    src: int,
    at: ResidencyLocation,
    group: Any = None,
) -> ResidencyHandle[ValueT]:
    """Copy the value ``handle`` names on rank ``src`` into every other rank's manager at ``at``.

    On ``src`` the value must be materialised at ``at``; the other ranks pass ``None``
    (anything they pass is ignored). Each receiving rank adopts a new MUST_PRESERVE
    value with ``src``'s replica mode, the same tensor layout and the same bytes. All or
    nothing: every rank admits the bytes under its own budget before any byte moves,
    and if any rank refuses or fails, every rank raises `ResidencyCollectiveError` (or
    `ResidencyCommunicationError` when the process group fails) and no rank keeps a
    charge or a value. See docs/concepts/distributed.md#broadcast.

    Args:
        manager: This rank's manager.
        handle: On ``src``, the value, materialised at ``at``; ignored elsewhere (pass
            ``None``).
        src: The sending rank (its rank in ``group``).
        at: Where the value lives on ``src`` and is adopted on the others.
        group: The process group; ``None`` for the default group (without an initialised
            group the process is rank 0 of 1).

    Returns:
        Each rank's handle: ``src``'s own on ``src``, a new MUST_PRESERVE value elsewhere.

    Raises:
        ResidencyCollectiveError: A rank refused or failed (every rank raises it).
        ResidencyCommunicationError: The process group failed.

    Example:
        ```python
        import os, tempfile
        import torch
        import torch.distributed as dist
        from fhelium.residency.distributed import broadcast, rank_location, rank_manager
        from fhelium.residency.simulation import SimulatedRuntime, use_runtime
        from fhelium.values import ResidentTensor

        # One rank here; under torchrun every rank runs the same code.
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "rendezvous"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            with use_runtime(SimulatedRuntime(1, auto_complete=True)):
                device = rank_location()
                with rank_manager({device: 1 << 20}) as manager:
                    weights = None
                    if dist.get_rank() == 0:
                        weights = manager.adopt(ResidentTensor(torch.ones(256)))
                        manager.move(weights, device)
                    weights = broadcast(manager, weights, src=0, at=device)
        finally:
            dist.destroy_process_group()
        ```
    """
    transfer = _Transfer("broadcast", manager, at, group, (src,))
    _check_rank(transfer, "src", src)
    sending = transfer.rank == src
    root = _global(group, src)

    def offer() -> list[_Layout]:
        if handle is None:
            raise TypeError("the src rank must pass the handle it broadcasts")
        return transfer.offer([handle])

    def move(
        wire: _Wire,
        received: Sequence[list[torch.Tensor]],
        error: BaseException | None,
    ) -> BaseException | None:
        def cast(tensor: torch.Tensor) -> object:
            return dist.broadcast(tensor, root, group=group)

        if sending:
            return _send_all(transfer.flats[0], wire, error, cast)
        return _receive_all(received[0], wire, error, cast)

    _, adopted = _collective(
        transfer,
        offer if sending else None,
        lambda everyone: [] if sending else list(everyone[src]),
        move,
    )
    return handle if sending else adopted[0]  # type: ignore[return-value]


def _finish(
    transfer: _Transfer,
    layouts: Sequence[_Layout],
    received: Sequence[list[torch.Tensor]],
    allocator: _Allocator,
) -> list[ResidencyHandle[Any]]:
    """Phase 4: adopt what arrived, agree, and keep it only when every rank did."""
    error: BaseException | None = None
    adopted: list[ResidencyHandle[Any]] = []
    try:
        if layouts:
            adopted = transfer.commit(layouts, received, allocator)
    except Exception as failure:
        error = failure
    transfer.verdict("commit", error)
    transfer.release()
    transfer.adopted.clear()
    return adopted


def scatter(
    manager: ResidencyManager,
    handles: Sequence[ResidencyHandle[Any]] | None,
    *,
    src: int,
    at: ResidencyLocation,
    group: Any = None,
) -> ResidencyHandle[Any]:
    """Send rank ``r`` the value ``handles[r]`` names on rank ``src``.

    On ``src``, ``handles`` has one handle per rank of the group, each materialised at
    ``at``; the other ranks pass ``None``. Each receiving rank admits only its own part;
    the all-or-nothing rule and the errors are `broadcast`'s. See
    docs/concepts/distributed.md#scatter-and-gather.

    Args:
        manager: This rank's manager.
        handles: On ``src``, one handle per rank of the group, each materialised at ``at``;
            ``None`` elsewhere.
        src: The sending rank.
        at: Where the values live on ``src`` and are adopted on the others.
        group: The process group; ``None`` for the default group (without an initialised
            group the process is rank 0 of 1).

    Returns:
        This rank's handle (on ``src``, ``handles[src]`` itself).

    Raises:
        ResidencyCollectiveError: A rank refused or failed (every rank raises it).
        ResidencyCommunicationError: The process group failed.
    """
    transfer = _Transfer("scatter", manager, at, group, (src,))
    _check_rank(transfer, "src", src)
    sending = transfer.rank == src
    root = _global(group, src)

    def offer() -> list[_Layout]:
        if handles is None or isinstance(handles, ResidencyHandle):
            raise TypeError("the src rank must pass one handle per rank")
        parts = list(handles)
        if len(parts) != transfer.size:
            raise ValueError(f"scatter needs {transfer.size} handles, got {len(parts)}")
        return transfer.offer(parts)

    def move(
        wire: _Wire,
        received: Sequence[list[torch.Tensor]],
        error: BaseException | None,
    ) -> BaseException | None:
        if not sending:
            return _receive_all(received[0], wire, error, lambda t: dist.recv(t, root, group=group))
        for rank in range(transfer.size):
            if rank != src:
                peer = _global(group, rank)
                error = _send_all(
                    transfer.flats[rank],
                    wire,
                    error,
                    partial(_send_to, peer=peer, group=group),
                )
        return error

    _, adopted = _collective(
        transfer,
        offer if sending else None,
        lambda everyone: [] if sending else [everyone[src][transfer.rank]],
        move,
    )
    if sending:
        assert handles is not None
        return handles[src]
    return adopted[0]


def gather(
    manager: ResidencyManager,
    handle: ResidencyHandle[Any],
    *,
    dst: int,
    at: ResidencyLocation,
    group: Any = None,
) -> list[ResidencyHandle[Any]] | None:
    """Collect every rank's value into rank ``dst``'s manager at ``at``.

    Every rank passes its own part, materialised at ``at``. On ``dst`` the result is one
    handle per rank, in rank order (its own part's handle at position ``dst``); the
    other ranks get ``None`` and keep their parts. ``dst`` admits every incoming part
    before any byte moves; the all-or-nothing rule and the errors are `broadcast`'s.
    See docs/concepts/distributed.md#scatter-and-gather.

    Args:
        manager: This rank's manager.
        handle: This rank's part, materialised at ``at``.
        dst: The receiving rank.
        at: Where the parts live and are adopted on ``dst``.
        group: The process group; ``None`` for the default group (without an initialised
            group the process is rank 0 of 1).

    Returns:
        On ``dst``, one handle per rank in rank order; ``None`` on the other ranks.

    Raises:
        ResidencyCollectiveError: A rank refused or failed (every rank raises it).
        ResidencyCommunicationError: The process group failed.
    """
    transfer = _Transfer("gather", manager, at, group, (dst,))
    _check_rank(transfer, "dst", dst)
    receiving = transfer.rank == dst
    senders = [rank for rank in range(transfer.size) if rank != dst]
    root = _global(group, dst)

    def move(
        wire: _Wire,
        received: Sequence[list[torch.Tensor]],
        error: BaseException | None,
    ) -> BaseException | None:
        if not receiving:
            return _send_all(
                transfer.flats[0], wire, error, lambda t: dist.send(t, root, group=group)
            )
        for rank, buffers in zip(senders, received, strict=True):
            peer = _global(group, rank)
            error = _receive_all(
                buffers, wire, error, partial(_receive_from, peer=peer, group=group)
            )
        return error

    _, adopted = _collective(
        transfer,
        lambda: transfer.offer([handle]),
        lambda everyone: [everyone[rank][0] for rank in senders] if receiving else [],
        move,
    )
    if not receiving:
        return None
    adopted.insert(dst, handle)
    return adopted
