"""Typing for the compiled extension `fhelium._core` (Rust, PyO3)."""

from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Final, final

from typing_extensions import Buffer

__all__ = [
    "__version__",
    "MAX_CUDA_INDEX",
    "ActionKind",
    "Checksum",
    "CoreManager",
    "Decided",
    "LeaseFinalizer",
    "LifetimeKind",
    "LoweredRequest",
    "PlanIR",
    "PlanRun",
    "PolicyKeys",
    "RecordBuilder",
    "ScheduleIndex",
    "SimulatedSeam",
    "SimulationView",
    "StateView",
    "StepEntry",
    "TierTable",
    "checksum",
    "lower_plan",
    "lower_records",
    "measure_tensors",
]

__version__: Final[str]
MAX_CUDA_INDEX: Final[int]

@final
class ActionKind:
    """The kind of a residency action; equal to its former integer code."""

    ENSURE: ClassVar[ActionKind]
    MOVE: ClassVar[ActionKind]
    DROP: ClassVar[ActionKind]
    DISCARD: ClassVar[ActionKind]
    def __int__(self) -> int: ...

@final
class LifetimeKind:
    """Which kind of lifetime a token names."""

    LEASE: ClassVar[LifetimeKind]
    HOLD: ClassVar[LifetimeKind]
    RESERVATION: ClassVar[LifetimeKind]
    def __int__(self) -> int: ...

@final
class PlanIR:
    """A plan lowered into the Rust core: immutable, validated, shareable."""

@final
class PolicyKeys:
    """The built-in policy's keys by handle index, kept as they change."""

    def __init__(self) -> None: ...
    def set_epoch(self, index: int, epoch: int) -> None: ...
    def set_metadata(self, index: int, priority: int, key: str | None = None) -> None: ...
    def __len__(self) -> int: ...

@final
class TierTable:
    """The fallback tiers by location code, converted once per policy."""

    def __new__(cls, rows: list[tuple[int, list[int]]]) -> TierTable: ...

@final
class LoweredRequest:
    """A request as a decide reads it, converted once: requirements by handle index."""

    def __new__(
        cls,
        discards: int,
        rows: list[tuple[int, int]],
        name: str,
        reservations: list[tuple[int, int, str]],
        labels: list[str],
    ) -> LoweredRequest: ...
    @property
    def discards(self) -> int: ...

@final
class Decided:
    """What a decide returns: the decided plan, its simulation and evictions, read on
    demand. Rows are `(kind code: 0 ensure, 1 move, 2 drop, 3 discard, slot, location
    code, from code or -1)`."""

    @property
    def feasible(self) -> bool: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def explored(self) -> int: ...
    @property
    def state_version(self) -> int: ...
    @property
    def empty(self) -> bool: ...
    def ir(self) -> PlanIR: ...
    def simulation(self) -> SimulationView: ...
    def slots(self) -> list[int]: ...
    def reclaim_rows(self) -> list[tuple[int, int, int, int]]: ...
    def enter_rows(self) -> list[tuple[int, int, int, int]]: ...
    def eviction_rows(self) -> list[tuple[int, int, int, int, str]]: ...
    def same_actions(self, other: object) -> bool: ...

@final
class ScheduleIndex:
    """A schedule's steps as handle indices of one manager."""

    @property
    def discards(self) -> int: ...
    @property
    def cyclic(self) -> bool: ...
    def __len__(self) -> int: ...

def lower_plan(
    name: str,
    handles: list[tuple[str, str, int]],
    reclaim: list[tuple[ActionKind, int, int, int]],
    enter: list[tuple[ActionKind, int, int, int]],
    exit: list[tuple[ActionKind, int, int, int]],
    reservations: list[tuple[int, int, str]],
    /,
) -> PlanIR: ...
def lower_records(
    name: str,
    reclaim: Iterable[Any],
    enter: Iterable[Any],
    exit: Iterable[Any],
    reservations: Iterable[Any],
    kinds: dict[type, ActionKind],
    type_key: Callable[[type], int],
    /,
) -> tuple[PlanIR, tuple[Any, ...]]: ...

_NativeConfig = tuple[PolicyKeys, TierTable]

@final
class Checksum:
    """A streaming XXH3-64 checksum; bytes are hashed with the interpreter released."""

    algorithm: ClassVar[str]
    def __new__(cls) -> Checksum: ...
    def update(self, data: Buffer) -> None: ...
    def digest(self) -> int: ...
    def hexdigest(self) -> str: ...

@final
class SimulatedSeam:
    """A `SimulatedRuntime`'s hot seam methods in their common case, native; each
    returns ``None``, having done nothing, where that case does not apply."""

    def __new__(cls, runtime: Any, originals: tuple[Any, ...]) -> SimulatedSeam: ...
    def copy(
        self, runtime: Any, value: Any, device: Any, stream: Any, non_blocking: bool
    ) -> tuple[Any, Any] | None: ...
    def record_event(self, runtime: Any, stream: Any) -> Any | None: ...
    def event_query(self, runtime: Any, event: Any) -> bool | None: ...
    def memory_sample(self, runtime: Any, device: Any) -> tuple[int, int] | None: ...

def checksum(data: Buffer) -> int: ...
def measure_tensors(
    tensors: tuple[Any, ...], pinning_possible: bool = True, /
) -> tuple[Any, int, bool | None, int, int, list[tuple[int, int]]] | None: ...

@final
class CoreManager:
    """One manager's core state: records, books, protections, versions, the gate."""

    def __new__(
        cls,
        budgets: list[tuple[Any, Any]],
        budget_bytes: Callable[[Any, Any], int],
        handle_records: RecordBuilder,
        context: tuple[Any, ...],
        trace_capacity: int = 0,
    ) -> CoreManager: ...
    # One call per operation; each takes the gate itself.
    def run(self, action: Any, stream: Any = None) -> Any: ...
    def adopt(self, value: Any, at: Any, replica_mode: Any) -> Any: ...
    def ensure(self, handle: Any, at: Any, stream: Any = None) -> Any: ...
    def move_to(self, handle: Any, to: Any, from_location: Any, stream: Any = None) -> Any: ...
    def drop(self, handle: Any, at: Any) -> Any: ...
    def register_source(self, spec_record: Any, source: Any, source_location: Any) -> Any: ...
    def acquire(
        self, engine: Any, handles: Iterable[Any], at: Any, consumer_stream: Any = None
    ) -> Any: ...
    def hold(self, engine: Any, handles: Iterable[Any], at: Any) -> Any: ...
    def reserve(self, engine: Any, location: Any, nbytes: int, label: str) -> Any: ...
    def release(self, kind: LifetimeKind, token: int, finalizing: bool = False) -> None: ...
    def release_lease(
        self,
        token: int,
        location: Any,
        streams: list[Any],
        *,
        wait: bool,
        finalizing: bool = False,
        stacklevel: int = 2,
    ) -> None: ...
    def release_host_lease_now(self, token: int) -> bool: ...
    def track_lease(
        self, token: int, lease: Any, engine: Any, location: Any, streams: list[Any]
    ) -> None: ...
    def untrack_lease(self, token: int) -> None: ...
    def live_leases(self) -> list[Any]: ...
    def borrowed(self, token: int, handle: Any, location: Any) -> Any: ...
    def close(self, *, wait: bool, force: bool) -> None: ...
    def location_code(self, location: Any) -> int: ...
    def check_stream(self, stream: Any, location: Any) -> Any: ...
    def handle_error(self, handle: Any) -> BaseException: ...
    def schedule_index(self, steps: list[list[Any]], cyclic: bool = False) -> ScheduleIndex: ...
    def discard_count(self) -> int: ...
    # Plans, each in one call: gate, checks, preflight and phases (see PlanRun).
    def execute_plan(
        self,
        run: PlanRun,
        ir: PlanIR,
        handles: tuple[Any, ...],
        actions: tuple[Any, ...],
        transfer_streams: object,
        expected_version: object,
        *,
        asynchronous: bool = False,
        hold: tuple[tuple[tuple[tuple[Any, ...], Any], ...], list[int]] | None = None,
        then: Callable[[], Any] | None = None,
    ) -> Any: ...
    def wait_transfers(self, handles: Any, at: Any, stream: Any) -> None: ...
    def settle(self, tokens: list[int], *, transfers: bool = False) -> None: ...
    def settle_on_device(self, tokens: list[int], *, host: bool) -> list[int]: ...
    def blocks_host(self, handles: Any, at: Any, *, disk_deferred: bool = False) -> bool: ...
    def transfers_into(self, handles: Any, at: Any) -> list[int]: ...
    def transfer_count(self) -> int: ...
    def blocked_here(self) -> bool: ...
    def pending_among(self, tokens: list[int]) -> list[int]: ...
    def enter_scope(
        self,
        run: PlanRun,
        ir: PlanIR,
        handles: tuple[Any, ...],
        plan: Any,
        transfer_streams: object,
        expected_version: object,
        *,
        then: Callable[[], Any] | None = None,
    ) -> Any: ...
    def exit_scope(self, run: PlanRun, actions: tuple[Any, ...]) -> None: ...
    def explain_plan(
        self, ir: PlanIR, handles: tuple[Any, ...], plan: Any, expected_version: object
    ) -> SimulationView: ...
    def decide_request(
        self,
        request: LoweredRequest,
        limit: int,
        cuda_count: int,
        *,
        native: _NativeConfig | None = None,
        python: tuple[Any, Any] | None = None,
        schedule: tuple[ScheduleIndex, int] | None = None,
    ) -> Decided | None: ...
    def stage_request(
        self,
        request: LoweredRequest,
        limit: int,
        cuda_count: int,
        previous: Decided,
        run: PlanRun,
        ir: PlanIR,
        handles: tuple[Any, ...],
        actions: tuple[Any, ...],
        transfer_streams: Any,
        hold: tuple[tuple[Any, ...], list[int]],
        native: _NativeConfig,
        schedule: tuple[ScheduleIndex, int] | None = None,
        then: Any = None,
        reclaim: bool = False,
        blocking: bool | None = None,
    ) -> tuple[Decided | None, bool] | None: ...
    def enter_step(
        self,
        engine: Any,
        groups: tuple[tuple[Any, tuple[Any, ...]], ...],
        consumers: dict[Any, Any],
        holds: list[int],
    ) -> tuple[StateView, StepEntry, list[int]]: ...
    def trace_reports(self) -> tuple[Any, ...]: ...
    def clear_trace(self) -> None: ...
    @property
    def manager_id(self) -> str: ...
    def check_open(self) -> None: ...
    def check_process(self) -> None: ...
    @property
    def owner_pid(self) -> int: ...
    @property
    def version(self) -> int: ...
    def checked_version(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def location_records(self) -> list[Any]: ...
    def snapshot_state(self) -> tuple[StateView, int]: ...
    def resolve(self, handle: Any) -> int | None: ...
    def handle(self, index: int) -> Any: ...
    def spec(self, index: int) -> Any: ...
    def label(self, token: int) -> Any | None: ...

@final
class StateView:
    """An immutable published manager state; rows are produced on demand."""

    @property
    def version(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def value_count(self) -> int: ...
    def value_entries(
        self,
        manager: CoreManager,
        value_records: RecordBuilder,
        materialization_records: RecordBuilder,
        location_of: Callable[[int], Any],
    ) -> tuple[Any, ...]: ...
    def location_rows(
        self,
    ) -> list[tuple[int, int | None, int, int, int, int, int, int, int, int, int]]: ...
    def reservation_rows(self) -> list[tuple[int, int, int, str]]: ...

@final
class SimulationView:
    """One plan simulation (preflight or explain); per-action rows on demand."""

    @property
    def feasible(self) -> bool: ...
    @property
    def reason(self) -> str | None: ...
    def peaks(self) -> list[tuple[int, int]]: ...
    def action_entries(
        self,
        actions: tuple[Any, ...],
        action_records: RecordBuilder,
        location_of: Callable[[int], Any],
    ) -> tuple[Any, ...]: ...

@final
class LeaseFinalizer:
    """The callback of a tracked lease's weak reference: finalizes a lease collected
    before its release."""

    def __call__(self, reference: Any, /) -> None: ...

@final
class StepEntry:
    """A staged pipeline step's leases, one per location of its request (in order of
    first appearance), built by `CoreManager.enter_step`; finalized as a lease is when
    collected or alive at exit while still active."""

    def value(self, position: int, handle: Any) -> Any: ...
    def lookup(self, handle: Any, at: Any) -> Any | None: ...
    def check(self, position: int) -> None: ...
    def record_epochs(self, keys: PolicyKeys, epoch: int) -> None: ...
    def add_consumer_stream(self, position: int, stream: Any) -> None: ...
    def release(self, stacklevel: int = 2) -> None: ...
    def exit(self, _exc_type: Any, _exc: Any, _traceback: Any) -> bool: ...
    def release_deferred(self) -> None: ...
    def _abandon(self) -> None: ...

@final
class PlanRun:
    """How far one plan run got: its committed transitions (records built when read),
    the phase in progress, and the reservation tokens a scope holds."""

    def __new__(cls, reports: RecordBuilder) -> PlanRun: ...
    def __len__(self) -> int: ...
    @property
    def phase(self) -> str | None: ...
    @property
    def position(self) -> int: ...
    def reports(self) -> tuple[Any, ...]: ...
    def take_tokens(self) -> list[int]: ...

@final
class RecordBuilder:
    """Builds one frozen slots record class's instances in bulk, without its checks."""

    def __new__(cls, record: type, fill: type, names: list[str]) -> RecordBuilder: ...
    @property
    def record_class(self) -> type: ...
