"""Lockstep checking: SPMD ranks prove that they make the same residency decisions. A
decision's `DecisionDigest` names its values and locations the same way on every rank;
`check_lockstep` all-gathers the digests and raises `ResidencyDivergenceError` on every
rank when they differ, and `LockstepChecker` checks every decision of a controller. See
docs/concepts/distributed.md#lockstep-checking.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fhelium.errors import ResidencyDivergenceError
from fhelium.residency._decider import Decider, decider_of
from fhelium.residency._decisions import ResidencyDecision
from fhelium.residency._use import ResidencyUse
from fhelium.residency._validation import seal
from fhelium.residency.controller import ResidencyController, stable_key_of
from fhelium.residency.distributed._ranks import (
    all_gather_objects,
    communicating,
    rank_and_size,
    rank_location,
    transport,
)
from fhelium.residency.location import DiskLocation, ResidencyLocation
from fhelium.residency.manager import ResidencyManager, engine_of
from fhelium.residency.pipeline import ResidencyPipeline
from fhelium.residency.plan import DropResident, EnsureResident, MoveResident
from fhelium.residency.request import ResidencyRequest


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
        stable_key = stable_key_of(controller, handle)
        if stable_key is not None:
            return f"key:{stable_key}"
    index = engine_of(manager).resolve(handle)
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
    _, size = rank_and_size(group)
    if size == 1:
        return mine
    with communicating("lockstep check", "digest"):
        where = transport(group)
        local = torch.tensor(list(bytes.fromhex(mine.digest)), dtype=torch.uint8, device=where)
        gathered = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(gathered, local, group=group)
        digests = [bytes(tensor.cpu().tolist()).hex() for tensor in gathered]
    if all(digest == digests[0] for digest in digests):
        return mine
    # Every rank sees the same digests, so every rank takes this branch together.
    with communicating("lockstep check", "details"):
        everyone: list[DecisionDigest] = all_gather_objects(mine, group, size)
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
    """The controller as a `ResidencyUse` sees it (the `Controller` protocol of `_use`),
    with every decision for the step about to run checked."""

    def __init__(self, checker: LockstepChecker) -> None:
        self._checker = checker
        inner: Decider = decider_of(checker.controller)
        self._inner = inner
        self.manager = inner.manager
        self.policy = inner.policy
        self.engine = inner.engine
        self.shapes = inner.shapes

    def decide(self, request: ResidencyRequest, position: int | None = None) -> ResidencyDecision:
        # A decision for the step about to run (a use's entry) is checked in lockstep,
        # as `decide` is; a prefetch's decision for a later step is not.
        if position is None:
            return self._checker.decide(request)
        return self._inner.decide(request, position)

    def record_access(self, request: ResidencyRequest) -> None:
        self._inner.record_access(request)


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


# Documented, pickled and named where they are exported.
DecisionDigest.__module__ = "fhelium.residency.distributed"
LockstepChecker.__module__ = "fhelium.residency.distributed"
