"""The documented exception hierarchy of fhelium.

Plain Python classes so users, type checkers and pickle see ordinary exceptions; the Rust
core maps each of its error kinds onto exactly one class here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "FHEliumError",
    "ResidencyError",
    "ResidencyBudgetError",
    "ResidencyHandleError",
    "ResidencyUnavailableError",
    "ResidencyInUseError",
    "ResidencyLifetimeClosedError",
    "ResidencyMaterializationError",
    "ResidencyIntegrityError",
    "ResidencyOwnershipError",
    "ResidencyPlanError",
    "ResidencyStaleStateError",
    "ResidencySearchLimitError",
    "ResidencyPlanExecutionError",
    "ResidencyClosedError",
    "ResidencyForkedError",
    "ResidencyReentrancyError",
    "ResidencyDivergenceError",
    "ResidencyCollectiveError",
    "ResidencyCommunicationError",
    "ResidencyCheckpointError",
    "ConfigurationError",
    "StateError",
    "ExecutionError",
    "ArtifactError",
    "ResidencyScheduleExhaustedWarning",
]


def _rebuild(cls: Callable[..., BaseException], kwargs: Mapping[str, Any]) -> BaseException:
    # Keyword-only constructors cannot be replayed from `args`, which is what
    # BaseException.__reduce__ hands to pickle.
    return cls(**kwargs)


class FHEliumError(Exception):
    """Base class of every error raised by fhelium itself.

    See docs/concepts/errors.md#hierarchy.
    """


class ConfigurationError(FHEliumError, ValueError):
    """An invalid configuration value; also a `ValueError`."""


class StateError(FHEliumError, RuntimeError):
    """An operation that the current object state does not allow; also a `RuntimeError`."""


class ExecutionError(FHEliumError):
    """A failure while executing a computation."""


class ArtifactError(FHEliumError):
    """A missing, corrupt or incompatible stored artifact."""


class ResidencyScheduleExhaustedWarning(UserWarning):
    """A controller decides with a one-pass `ScheduleAwarePolicy` whose schedule has run out.

    Warned once per exhaustion: every later decision falls back to
    `DeterministicTieredLRU`'s order, which misses every step of a repeating schedule that
    outgrows the budget. Build the policy with ``cyclic=True`` for a schedule that repeats,
    or call ``seek(0)`` before a new pass. A warning, not an error: every decision stays
    correct, only the choice of victims degrades. See
    docs/concepts/controller.md#schedule-aware-eviction.
    """


class ResidencyError(FHEliumError, RuntimeError):
    """Base class of residency failures; every one is also a `RuntimeError`.

    Argument-shape mistakes are never residency errors: they raise plain `TypeError` or
    `ValueError` before any state is consulted. Every residency error can be pickled. See
    docs/concepts/errors.md.
    """


class ResidencyBudgetError(ResidencyError):
    """Admitting a charge would take a location past its strict byte budget.

    Raised when ``used + reserved + incoming <= budget`` would fail: an install, the check
    before a copy, a temporary reconstruction charge, a reservation. The message contains
    the location and every field as ``key=value``, then in plain words how much more room
    is needed (MiB or GiB beside the exact bytes) and the ways to make it; the attributes
    are the stable interface (docs/concepts/errors.md#messages). See
    docs/concepts/locations-and-budgets.md#budget-admission.

    Args:
        location: The location (the manager passes its name).
        budget_bytes: The budget.
        used_bytes: The charges there.
        reserved_bytes: The reservations there.
        requested_bytes: The refused charge.

    Attributes:
        location: The location, as given.
        budget_bytes: The budget.
        used_bytes: The charges at the time.
        reserved_bytes: The reservations at the time.
        requested_bytes: The refused charge.
    """

    location: str
    budget_bytes: int
    used_bytes: int
    reserved_bytes: int
    requested_bytes: int

    def __init__(
        self,
        *,
        location: str,
        budget_bytes: int,
        used_bytes: int,
        reserved_bytes: int,
        requested_bytes: int,
    ) -> None:
        self.location = location
        self.budget_bytes = int(budget_bytes)
        self.used_bytes = int(used_bytes)
        self.reserved_bytes = int(reserved_bytes)
        self.requested_bytes = int(requested_bytes)
        super().__init__(
            f"residency budget exceeded at {location!r}: "
            f"budget_bytes={self.budget_bytes}, used_bytes={self.used_bytes}, "
            f"reserved_bytes={self.reserved_bytes}, requested_bytes={self.requested_bytes}. "
            + _budget_remedy(
                location,
                self.budget_bytes,
                self.used_bytes,
                self.reserved_bytes,
                self.requested_bytes,
            )
        )

    def __reduce__(self) -> tuple[Any, ...]:
        kwargs = {
            "location": self.location,
            "budget_bytes": self.budget_bytes,
            "used_bytes": self.used_bytes,
            "reserved_bytes": self.reserved_bytes,
            "requested_bytes": self.requested_bytes,
        }
        return (_rebuild, (type(self), kwargs), self.__dict__)


def _budget_remedy(location: str, budget: int, used: int, reserved: int, requested: int) -> str:
    """A budget refusal in plain words: the shortfall in units a person reads, and the
    ways to make room (docs/concepts/errors.md#messages)."""
    free = max(budget - used - reserved, 0)
    shortfall = max(requested - free, 0)
    wanted, whole = format_size(requested, exact=True), format_size(budget, exact=True)
    raise_it = (
        f"raise the budget by at least {format_size(shortfall)} "
        f"(fhelium.residency.sizes.parse_size('8GiB') gives a budget in bytes)"
    )
    if requested > budget:
        return (
            f"{wanted} is more than the whole budget of {whole} at {location}. "
            f"To make room: {raise_it}, or split the value into smaller ones"
        )
    return (
        f"{wanted} does not fit in the {format_size(free, exact=True)} free of the {whole} "
        f"budget at {location} ({format_size(used)} used, {format_size(reserved)} "
        f"reserved): {format_size(shortfall, exact=True)} more is needed. To make room: "
        f"{raise_it}, or free room there first (drop or move values away, or let a "
        f"ResidencyController evict them), or release the holds and reservations at "
        f"{location}"
    )


class ResidencyHandleError(ResidencyError):
    """A foreign, unknown or discarded handle, or a decision from another manager.

    Also raised for metadata of a handle that is not live
    (`ResidencyController.set_policy_metadata`).
    """


class ResidencyUnavailableError(ResidencyError):
    """A missing endpoint or reconstruction path, or a value that is not resident.

    No materialisation and no source; an explicit ``from_location`` not resident; `acquire`
    or `hold` where the value is not materialised; a borrowed lookup whose lease no longer
    holds.
    """


class ResidencyInUseError(ResidencyError):
    """A removal or close blocked by active leases, holds, reservations or pending events.

    The message is free text. The optional keyword attributes say what blocked the
    operation, so callers can act without parsing the message; each is ``None`` when the
    raiser did not supply it. See docs/concepts/lifetimes.md#protection.

    Args:
        *args: The message, as for `Exception`.
        handle_id: The blocked value's handle id.
        location: The blocked materialisation's location name.
        active_reads: Use tokens from active leases.
        holds: Hold tokens.
        pending_events: Pending tokens of released CUDA leases.

    Attributes:
        handle_id: The blocked value's handle id, or ``None``.
        location: The location name, or ``None``.
        active_reads: Use tokens, or ``None``.
        holds: Hold tokens, or ``None``.
        pending_events: Pending tokens, or ``None``.
    """

    handle_id: str | None
    location: str | None
    active_reads: int | None
    holds: int | None
    pending_events: int | None

    def __init__(
        self,
        *args: object,
        handle_id: str | None = None,
        location: str | None = None,
        active_reads: int | None = None,
        holds: int | None = None,
        pending_events: int | None = None,
    ) -> None:
        super().__init__(*args)
        self.handle_id = handle_id
        self.location = location
        self.active_reads = None if active_reads is None else int(active_reads)
        self.holds = None if holds is None else int(holds)
        self.pending_events = None if pending_events is None else int(pending_events)

    # BaseException.__reduce__ replays `args` and restores `__dict__`, which already
    # carries the keyword attributes, so no custom __reduce__ is needed here.


class ResidencyLifetimeClosedError(ResidencyError):
    """Reuse of a released lease, hold or reservation.

    Raised by ``values``, ``__enter__``, ``add_consumer_stream`` and `BorrowedValues` lookups
    (see docs/concepts/lifetimes.md).
    """


class ResidencyMaterializationError(ResidencyError):
    """A value with the wrong type, device, pinning, logical bytes or storage ceiling.

    Also a disk file that cannot be written or read back (see
    docs/concepts/values.md#install and docs/concepts/locations-and-budgets.md#disk).
    """


class ResidencyIntegrityError(ResidencyMaterializationError):
    """A disk file whose bytes no longer match the checksum recorded when it was written.

    Raised by a read from a disk location (to pageable, pinned or device memory) that
    found a damaged file (a flipped bit, a zeroed range, bytes written behind the
    manager's back), before any byte was installed: nothing is charged and the value
    keeps its other materialisations. See
    docs/concepts/locations-and-budgets.md#integrity.

    Args:
        path: The damaged file.
        expected: The checksum recorded at write, 16 hexadecimal digits.
        actual: The checksum of the bytes read, 16 hexadecimal digits.

    Attributes:
        path: The damaged file.
        expected: The recorded checksum (``str``).
        actual: The checksum of the bytes read (``str``).
    """

    path: str
    expected: str
    actual: str

    def __init__(self, *, path: str, expected: str, actual: str) -> None:
        self.path = str(path)
        self.expected = str(expected)
        self.actual = str(actual)
        super().__init__(
            f"{self.path} is damaged: its data's checksum is {self.actual}, not the "
            f"{self.expected} recorded when it was written (xxh3-64); nothing was installed. "
            "Drop that disk copy and read the value from another copy, or rebuild it from "
            "its source; if files keep failing, check the disk"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        kwargs = {"path": self.path, "expected": self.expected, "actual": self.actual}
        return (_rebuild, (type(self), kwargs), self.__dict__)


class ResidencyOwnershipError(ResidencyError):
    """A replica or recoverability invariant would be violated.

    Replicating an EXCLUSIVE value; dropping the last copy of a source-less value; storage
    aliasing managed storage; an EXCLUSIVE value required at several locations.
    """


class ResidencyPlanError(ResidencyError):
    """A plan or request is infeasible before anything has executed.

    Catching it means nothing ran (a sibling of `ResidencyPlanExecutionError`, not its base).
    See docs/concepts/plans.md#preflight.
    """


class ResidencyStaleStateError(ResidencyPlanError):
    """The manager state changed after the version a plan or decision was made against.

    Args:
        expected_version: The version the caller expected.
        actual_version: The current version.

    Attributes:
        expected_version: The version the caller expected.
        actual_version: The current version.
    """

    expected_version: int
    actual_version: int

    def __init__(self, *, expected_version: int, actual_version: int) -> None:
        self.expected_version = int(expected_version)
        self.actual_version = int(actual_version)
        super().__init__(
            "residency state changed since the plan was made: "
            f"expected_version={self.expected_version}, actual_version={self.actual_version}. "
            "Decide or build the plan again against the current state"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        kwargs = {
            "expected_version": self.expected_version,
            "actual_version": self.actual_version,
        }
        return (_rebuild, (type(self), kwargs), self.__dict__)


class ResidencySearchLimitError(ResidencyPlanError):
    """The controller's bounded search stopped before reaching a verdict.

    The request may still be feasible: raise ``search_state_limit`` or simplify it. The
    search stops at the first of three bounds (docs/concepts/controller.md#search-bounds):
    ``search_state_limit`` explored states, the depth of its path, or its memo's memory
    budget. See docs/concepts/controller.md#decide.

    Args:
        request_name: The request's name.
        state_limit: The controller's ``search_state_limit``.
        explored_states: States explored (equal to the limit when ``bound == "states"``).
        detail: The search's own account.
        bound: Which bound stopped it: ``"states"``, ``"depth"`` or ``"memory"``.

    Attributes:
        request_name: The request's name.
        state_limit: The limit.
        explored_states: States explored.
        detail: The search's own account.
        bound: Which bound stopped the search.
    """

    request_name: str
    state_limit: int
    explored_states: int
    detail: str
    bound: str

    def __init__(
        self,
        *,
        request_name: str,
        state_limit: int,
        explored_states: int,
        detail: str,
        bound: str = "states",
    ) -> None:
        self.request_name = str(request_name)
        self.state_limit = int(state_limit)
        self.explored_states = int(explored_states)
        self.detail = str(detail)
        self.bound = str(bound)
        super().__init__(
            f"residency search for request {self.request_name!r} is inconclusive: "
            f"state_limit={self.state_limit}, explored_states={self.explored_states}, "
            f"bound={self.bound}: {self.detail}. The request may still be feasible: "
            + (
                "raise the controller's search_state_limit, or require fewer values at once"
                if self.bound == "states"
                else "require fewer values at once, or split the request"
            )
        )

    def __reduce__(self) -> tuple[Any, ...]:
        kwargs = {
            "request_name": self.request_name,
            "state_limit": self.state_limit,
            "explored_states": self.explored_states,
            "detail": self.detail,
            "bound": self.bound,
        }
        return (_rebuild, (type(self), kwargs), self.__dict__)


class ResidencyPlanExecutionError(ResidencyError):
    """A runtime failure after a successful preflight; earlier transitions stay committed.

    A sibling of `ResidencyPlanError`, not a subclass: catching that one keeps the
    nothing-happened guarantee, while this one requires inspecting ``partial_report``. The
    original failure is the ``__cause__``. See docs/concepts/plans.md#execution-errors.

    Args:
        plan_name: The plan (or `execute_actions` name).
        phase: ``"execute"``, ``"reclaim"``, ``"reserve"``, ``"enter"`` or ``"exit"``.
        partial_report: The committed prefix.
        failed_action: The failed action, or ``None`` for ``"reserve"``.
        failed_action_index: Its 0-based index within its phase, or ``None``.
        detail: ``str()`` of the original error.
        failed_reservation: The failed reservation, for ``"reserve"`` only.
        failed_reservation_index: Its index, for ``"reserve"`` only.

    Attributes:
        plan_name: The plan's name.
        phase: Where it failed.
        partial_report: A `ResidencyPlanReport` of the transitions that stay committed.
        failed_action: The failed action, or ``None``.
        failed_action_index: Its index within its phase, or ``None``.
        detail: The original error's text.
        failed_reservation: The failed `MemoryReservation`, or ``None``.
        failed_reservation_index: Its index, or ``None``.
    """

    plan_name: str
    phase: str
    partial_report: ResidencyPlanReport
    failed_action: ResidencyAction | None
    failed_action_index: int | None
    detail: str
    failed_reservation: MemoryReservation | None
    failed_reservation_index: int | None

    def __init__(
        self,
        *,
        plan_name: str,
        phase: str,
        partial_report: ResidencyPlanReport,
        failed_action: ResidencyAction | None,
        failed_action_index: int | None,
        detail: str,
        failed_reservation: MemoryReservation | None = None,
        failed_reservation_index: int | None = None,
    ) -> None:
        self.plan_name = plan_name
        self.phase = phase
        self.partial_report = partial_report
        self.failed_action = failed_action
        self.failed_action_index = failed_action_index
        self.detail = detail
        self.failed_reservation = failed_reservation
        self.failed_reservation_index = failed_reservation_index
        completed = len(partial_report.transitions)
        super().__init__(
            f"residency plan {plan_name!r} failed in phase {phase!r} after "
            f"{completed} completed transitions: {detail}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        kwargs = {
            "plan_name": self.plan_name,
            "phase": self.phase,
            "partial_report": self.partial_report,
            "failed_action": self.failed_action,
            "failed_action_index": self.failed_action_index,
            "detail": self.detail,
            "failed_reservation": self.failed_reservation,
            "failed_reservation_index": self.failed_reservation_index,
        }
        return (_rebuild, (type(self), kwargs), self.__dict__)


class ResidencyClosedError(ResidencyError):
    """Use of a closed manager; see docs/concepts/lifetimes.md#close."""


class ResidencyForkedError(ResidencyClosedError):
    """Use of a manager in a process forked from the one that made it.

    A manager belongs to the process that made it: in a forked child (a DataLoader
    worker, a ``multiprocessing`` fork) every operation on an inherited manager raises
    this, before any lock, file or device is touched, and the child's finalizers leave
    the parent's values and files alone. Make a new manager in the child instead. See
    docs/concepts/lifetimes.md#fork.

    Args:
        message: What was refused.
        owner_pid: The process that made (and owns) the manager.
        pid: This process.

    Attributes:
        owner_pid: The owning process's id.
        pid: This process's id.
    """

    owner_pid: int
    pid: int

    def __init__(self, message: str, *, owner_pid: int, pid: int) -> None:
        self.owner_pid = int(owner_pid)
        self.pid = int(pid)
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_forked,
            (type(self), str(self), self.owner_pid, self.pid),
            self.__dict__,
        )


def _rebuild_forked(
    cls: type[ResidencyForkedError], message: str, owner_pid: int, pid: int
) -> ResidencyForkedError:
    return cls(message, owner_pid=owner_pid, pid=pid)


class ResidencyReentrancyError(ResidencyError):
    """Manager access while a source callback runs, or same-thread transition re-entry.

    See docs/concepts/lifetimes.md#re-entrancy-and-threads.
    """


class ResidencyDivergenceError(ResidencyError):
    """Ranks meant to decide in lockstep made different residency decisions.

    Raised on every rank of the group. See docs/concepts/distributed.md#lockstep-checking.

    Args:
        request_name: The request decided.
        rank: The first rank (in group rank order) whose decision differs.
        reference_rank: The rank it is compared with.
        action_index: The first differing position in the plan's actions (reclaim, then
            enter, then reservations), or ``None`` when the decisions differ before any
            action (request name, state version or policy).
        expected: The reference rank's canonical text of that entry.
        actual: The differing rank's text.

    Attributes:
        request_name: The request decided.
        rank: The first differing rank.
        reference_rank: The reference rank.
        action_index: The first differing action position, or ``None``.
        expected: The reference rank's entry.
        actual: The differing rank's entry.
    """

    request_name: str
    rank: int
    reference_rank: int
    action_index: int | None
    expected: str
    actual: str

    def __init__(
        self,
        *,
        request_name: str,
        rank: int,
        reference_rank: int,
        action_index: int | None,
        expected: str,
        actual: str,
    ) -> None:
        self.request_name = str(request_name)
        self.rank = int(rank)
        self.reference_rank = int(reference_rank)
        self.action_index = None if action_index is None else int(action_index)
        self.expected = str(expected)
        self.actual = str(actual)
        where = (
            "before any action"
            if self.action_index is None
            else f"action_index={self.action_index}"
        )
        super().__init__(
            f"residency decisions diverge for request {self.request_name!r}: "
            f"rank={self.rank} differs from reference_rank={self.reference_rank} {where}: "
            f"expected {self.expected!r}, got {self.actual!r}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        kwargs = {
            "request_name": self.request_name,
            "rank": self.rank,
            "reference_rank": self.reference_rank,
            "action_index": self.action_index,
            "expected": self.expected,
            "actual": self.actual,
        }
        return (_rebuild, (type(self), kwargs), self.__dict__)


class ResidencyCollectiveError(ResidencyError):
    """A value transfer between ranks (broadcast, scatter, gather) was refused or failed.

    Every rank of the group raises it, with the same fields, and no rank keeps a charge or
    a partial value. See docs/concepts/distributed.md#all-or-nothing.

    Args:
        operation: ``"broadcast"``, ``"scatter"`` or ``"gather"``.
        phase: ``"agreement"``, ``"admission"``, ``"transfer"`` or ``"commit"``.
        failed_ranks: The ranks that refused or failed, ascending.
        details: One text per failed rank, in the same order.

    Attributes:
        operation: The operation.
        phase: Where it stopped.
        failed_ranks: The failed ranks.
        details: Their reasons.
    """

    operation: str
    phase: str
    failed_ranks: tuple[int, ...]
    details: tuple[str, ...]

    def __init__(
        self,
        *,
        operation: str,
        phase: str,
        failed_ranks: tuple[int, ...],
        details: tuple[str, ...],
    ) -> None:
        self.operation = str(operation)
        self.phase = str(phase)
        self.failed_ranks = tuple(int(rank) for rank in failed_ranks)
        self.details = tuple(str(detail) for detail in details)
        super().__init__(self._message())

    def _message(self) -> str:
        reasons = "; ".join(
            f"rank {rank}: {detail}"
            for rank, detail in zip(self.failed_ranks, self.details, strict=False)
        )
        return (
            f"residency {self.operation} failed in phase {self.phase!r}: "
            f"failed_ranks={list(self.failed_ranks)}: {reasons}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        kwargs = {
            "operation": self.operation,
            "phase": self.phase,
            "failed_ranks": self.failed_ranks,
            "details": self.details,
        }
        return (_rebuild, (type(self), kwargs), self.__dict__)


class ResidencyCommunicationError(ResidencyCollectiveError):
    """The process group itself failed under a residency collective.

    A peer died or left, or the group's timeout passed. The backend's exception is the
    ``__cause__``; ``failed_ranks`` is empty (the survivors cannot tell who failed) and
    ``details`` holds the backend's message. Local charges were given back before it was
    raised; the group is not usable afterwards. See
    docs/concepts/distributed.md#timeouts-and-dead-ranks.

    Args:
        operation: The operation.
        phase: Where it stopped.
        detail: The backend's message.

    Attributes:
        detail: The backend's message.
    """

    def __init__(self, *, operation: str, phase: str, detail: str) -> None:
        self.detail = str(detail)
        super().__init__(operation=operation, phase=phase, failed_ranks=(), details=(detail,))

    def _message(self) -> str:
        return (
            f"residency {self.operation}: the process group failed in phase {self.phase!r} "
            f"(a peer died or the group's timeout passed): {self.detail}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        kwargs = {"operation": self.operation, "phase": self.phase, "detail": self.detail}
        return (_rebuild, (type(self), kwargs), self.__dict__)


class ResidencyCheckpointError(ResidencyError, ValueError):
    """A checkpoint that does not fit the module it is meant for, or cannot be parsed.

    A missing key, a tensor of another shape, a dtype that cannot be cast to the
    parameter's (a floating tensor for an integer or bool parameter, or the reverse), an
    unknown dtype, a damaged header or index: raised before anything is loaded. It is the
    one residency error that is also a `ValueError`, since what is wrong is the checkpoint
    handed in, not the manager's state. See docs/concepts/errors.md#structured-errors.

    Args:
        detail: What is wrong.
        key: The tensor's name in the checkpoint, or ``None`` when no one key is at fault.
        path: The file at fault (the shard, the index, the directory), or ``None``.

    Attributes:
        detail: What is wrong (``str``).
        key: The tensor's name, or ``None``.
        path: The file, or ``None``.
    """

    detail: str
    key: str | None
    path: str | None

    def __init__(self, detail: str, *, key: str | None = None, path: str | None = None) -> None:
        self.detail = str(detail)
        self.key = None if key is None else str(key)
        self.path = None if path is None else str(path)
        where = "checkpoint" if self.path is None else f"checkpoint {self.path}"
        what = "" if self.key is None else f", key {self.key!r}"
        super().__init__(f"{where}{what}: {self.detail}")

    def __reduce__(self) -> tuple[Any, ...]:
        kwargs = {"detail": self.detail, "key": self.key, "path": self.path}
        return (_rebuild, (type(self), kwargs), self.__dict__)


# The annotations above name record classes of fhelium.residency, which itself imports this
# module. Importing them here, after every exception class exists, keeps the import order
# acyclic in effect and lets `typing.get_type_hints` resolve the annotations at runtime.
from fhelium.residency.plan import MemoryReservation, ResidencyAction  # noqa: E402
from fhelium.residency.sizes import format_size  # noqa: E402
from fhelium.residency.snapshot import ResidencyPlanReport  # noqa: E402
