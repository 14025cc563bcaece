"""Shared helpers for the `ResidencyManager` tests (test_manager_*.py).

Written from the documented behaviour (docs/concepts/transitions.md, values.md,
locations-and-budgets.md, snapshots.md), not from the implementation. The helpers encode the
generic book-keeping rules once:

* `assert_balanced(snapshot)`: per location, `used_bytes` equals the sum of the charges of the
  materialisations there, `value_count` their number, `reserved_bytes` the sum of the listed
  reservations, and the remaining budget is `budget - used - reserved`;
* `state_key(snapshot)`: a comparable, tensor-free rendering of everything a snapshot says
  except its capture time and the process-wide allocator readings;
* `run_with_timeout(fn)`: runs `fn` on a daemon thread so a deadlock fails the test instead of
  hanging the suite.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, ResidencyLocation, cuda_location
from fhelium.residency.model import (
    Recoverability,
    ReplicaMode,
    ResidencyHandle,
    ResidencyValueSpec,
)
from fhelium.values import ResidentTensor, TensorBundle, TensorResident

CUDA0 = cuda_location("cuda:0")
CUDA1 = cuda_location("cuda:1")
ALL_LOCATIONS = (PAGEABLE_HOST, PINNED_HOST, CUDA0, CUDA1)

REPLICABLE = ReplicaMode.REPLICABLE
EXCLUSIVE = ReplicaMode.EXCLUSIVE
RECONSTRUCTIBLE = Recoverability.RECONSTRUCTIBLE
MUST_PRESERVE = Recoverability.MUST_PRESERVE

# The three no-op reasons (docs/concepts/transitions.md#no-op-rules).
ENSURE_NOOP = "destination already resident"
MOVE_NOOP = "destination already owns the selected replica"
DROP_NOOP = "materialization already absent"


def canonical_key(location: ResidencyLocation) -> tuple[int, int]:
    """The deterministic source order (docs/concepts/values.md#source-order)."""
    if location == PAGEABLE_HOST:
        return (0, -1)
    if location == PINNED_HOST:
        return (1, -1)
    if location.kind == "disk":
        return (3, 0)  # the tests name one disk directory at a time
    index = location.device.index
    assert index is not None
    return (2, index)


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------


def tensor_value(n: int = 4, start: float = 0.0) -> ResidentTensor:
    """A pageable `ResidentTensor` of `n` float32 elements (`4 * n` bytes)."""
    return ResidentTensor(torch.arange(start, start + n, dtype=torch.float32))


def view_value(n: int = 4, backing: int = 64) -> ResidentTensor:
    """A view of `n` float32s into a `backing`-element allocation: storage > logical bytes."""
    return ResidentTensor(torch.zeros(backing, dtype=torch.float32)[:n])


def bundle_value(n: int = 3) -> TensorBundle:
    return TensorBundle(a=torch.ones(n, dtype=torch.float32), b=torch.zeros(n, dtype=torch.int64))


class Other(TensorResident):
    """A second `TensorResident` kind, unrelated to `ResidentTensor`."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    @property
    def _resident_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.t,)

    def _with_resident_tensors(self, tensors: tuple[torch.Tensor, ...]) -> Other:
        (t,) = tensors
        return Other(t)


class SubTensor(ResidentTensor):
    """A subclass of `ResidentTensor`; accepted wherever `ResidentTensor` is the spec type."""

    __slots__ = ()


class NoTensors(TensorResident):
    """A value without tensor fields: `value.device` raises `RuntimeError`."""

    __slots__ = ()

    @property
    def _resident_tensors(self) -> tuple[torch.Tensor, ...]:
        return ()

    def _with_resident_tensors(self, tensors: tuple[torch.Tensor, ...]) -> NoTensors:
        return NoTensors()


def spec(
    n: int = 4,
    *,
    replica: ReplicaMode = REPLICABLE,
    recoverability: Recoverability = RECONSTRUCTIBLE,
    storage: int | None = None,
    value_type: type = ResidentTensor,
) -> ResidencyValueSpec[Any]:
    """A spec for an `n`-float32 value (logical `4 * n` bytes)."""
    logical = 4 * n
    return ResidencyValueSpec(
        value_type, logical, logical if storage is None else storage, replica, recoverability
    )


class Source:
    """A reconstruction source: `load()` calls `factory()` and counts the calls.

    `before_load` runs inside `load()` first (so inside the manager's callback window) and its
    return value is ignored; it may raise.
    """

    def __init__(
        self,
        factory: Callable[[], TensorResident],
        *,
        before_load: Callable[[], object] | None = None,
    ) -> None:
        self.factory = factory
        self.before_load = before_load
        self.calls = 0

    def load(self) -> TensorResident:
        self.calls += 1
        if self.before_load is not None:
            self.before_load()
        return self.factory()


def fresh(n: int = 4) -> Callable[[], TensorResident]:
    """A factory of new, independent pageable `n`-float32 values."""
    return lambda: tensor_value(n)


def foreign_handle(value_type: type = ResidentTensor) -> ResidencyHandle[Any]:
    return ResidencyHandle("not-this-manager", "some-handle", value_type)


# --------------------------------------------------------------------------------------------
# Snapshot helpers
# --------------------------------------------------------------------------------------------


def loc_snap(snapshot: Any, location: ResidencyLocation) -> Any:
    """The `ResidencyLocationSnapshot` for `location`, or None when it is not registered."""
    for entry in snapshot.locations:
        if entry.location == location:
            return entry
    return None


def val_snap(snapshot: Any, handle: ResidencyHandle[Any]) -> Any:
    for entry in snapshot.values:
        if entry.handle == handle:
            return entry
    raise AssertionError(f"handle {handle} not in snapshot")


def mat_locs(snapshot: Any, handle: ResidencyHandle[Any]) -> tuple[ResidencyLocation, ...]:
    """The handle's materialisation locations, in the snapshot's (install) order."""
    return tuple(m.location for m in val_snap(snapshot, handle).materializations)


def used(snapshot: Any, location: ResidencyLocation) -> int:
    entry = loc_snap(snapshot, location)
    return 0 if entry is None else entry.used_bytes


def assert_balanced(snapshot: Any) -> None:
    """Per location the books balance (docs/concepts/locations-and-budgets.md#charges)."""
    charges: dict[ResidencyLocation, int] = {}
    counts: dict[ResidencyLocation, int] = {}
    for value in snapshot.values:
        if value.discarded:
            assert value.materializations == ()
            assert not value.has_source
        for mat in value.materializations:
            charges[mat.location] = charges.get(mat.location, 0) + mat.charged_nbytes
            counts[mat.location] = counts.get(mat.location, 0) + 1
            assert mat.charged_nbytes == value.spec.storage_nbytes
            assert mat.logical_nbytes == value.spec.logical_nbytes
            assert mat.storage_nbytes <= mat.charged_nbytes
    reserved: dict[ResidencyLocation, int] = {}
    reservations: dict[ResidencyLocation, int] = {}
    for res in snapshot.reservations:
        reserved[res.location] = reserved.get(res.location, 0) + res.nbytes
        reservations[res.location] = reservations.get(res.location, 0) + 1
    registered = {entry.location for entry in snapshot.locations}
    assert set(charges) <= registered, "a materialisation lives at an unregistered location"
    assert set(reserved) <= registered, "a reservation lives at an unregistered location"
    for entry in snapshot.locations:
        loc = entry.location
        assert entry.used_bytes == charges.get(loc, 0), (
            f"{loc}: used_bytes={entry.used_bytes} but materialisation charges sum to "
            f"{charges.get(loc, 0)}"
        )
        assert entry.value_count == counts.get(loc, 0), f"{loc}: value_count mismatch"
        assert entry.reserved_bytes == reserved.get(loc, 0), f"{loc}: reserved_bytes mismatch"
        assert entry.reservation_count == reservations.get(loc, 0)
        assert entry.peak_used_bytes >= entry.used_bytes
        assert entry.peak_charged_bytes >= entry.used_bytes + entry.reserved_bytes
        if entry.budget_bytes is None:
            assert entry.remaining_budget_bytes is None
        else:
            assert entry.remaining_budget_bytes == (
                entry.budget_bytes - entry.used_bytes - entry.reserved_bytes
            )


def state_key(snapshot: Any, *, ignore_peak_charged: tuple[ResidencyLocation, ...] = ()) -> Any:
    """Everything the snapshot states except `captured_at_ns` and allocator readings.

    `ignore_peak_charged` masks `peak_charged_bytes` at the given locations (a failed
    reconstruction is allowed to leave a raised charged peak behind,
    docs/concepts/locations-and-budgets.md#peaks).
    """
    locations = tuple(
        (
            e.location,
            e.budget_bytes,
            e.used_bytes,
            e.reserved_bytes,
            e.remaining_budget_bytes,
            e.peak_used_bytes,
            None if e.location in ignore_peak_charged else e.peak_charged_bytes,
            e.value_count,
            e.reservation_count,
            e.use_count,
            e.hold_count,
            e.pending_event_count,
        )
        for e in snapshot.locations
    )
    values = tuple(
        (
            v.handle,
            v.spec,
            tuple(
                (
                    m.location,
                    m.logical_nbytes,
                    m.storage_nbytes,
                    m.charged_nbytes,
                    m.use_count,
                    m.hold_count,
                    m.pending_event_count,
                )
                for m in v.materializations
            ),
            v.has_source,
            v.source_location,
            v.discarded,
        )
        for v in snapshot.values
    )
    reservations = tuple((r.location, r.nbytes, r.label) for r in snapshot.reservations)
    return (snapshot.manager_id, snapshot.state_version, values, locations, reservations)


# --------------------------------------------------------------------------------------------
# Threads and timeouts
# --------------------------------------------------------------------------------------------

DEADLOCK_TIMEOUT = 10.0


def run_with_timeout(fn: Callable[[], Any], timeout: float = DEADLOCK_TIMEOUT) -> Any:
    """Run `fn()` on a daemon thread; fail the test if it does not finish within `timeout`.

    Re-raises whatever `fn` raised, so `pytest.raises` works around it.
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"call did not finish within {timeout} s (deadlock?)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def capture(fn: Callable[[], Any]) -> BaseException | None:
    """Call `fn` and return the exception it raised, or None."""
    try:
        fn()
    except BaseException as exc:
        return exc
    return None


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.monotonic() - self.start


# --------------------------------------------------------------------------------------------
# The simulated device runtime
# --------------------------------------------------------------------------------------------


@contextmanager
def simulated(device_count: int = 2, **kwargs: Any) -> Iterator[Any]:
    """Install a fresh `SimulatedRuntime` for the duration of the block and yield it."""
    from fhelium.residency._runtime import SimulatedRuntime, use_runtime

    runtime = SimulatedRuntime(device_count=device_count, **kwargs)
    with use_runtime(runtime):
        yield runtime


@pytest.fixture(name="sim")
def sim_fixture() -> Iterator[Any]:
    """Fixture `sim`: a two-device `SimulatedRuntime`, installed for the whole test.

    Managers capture the runtime current at construction, so construct them in the test.
    Import `sim_fixture` into a test module to make the `sim` fixture available there.
    """
    with simulated() as runtime:
        yield runtime


def stream(runtime: Any, index: int) -> Any:
    from fhelium.residency._runtime import SimulatedStream

    return SimulatedStream(runtime, torch.device("cuda", index))


def on(runtime: Any, location: ResidencyLocation, value: TensorResident) -> TensorResident:
    """A copy of `value` placed at `location` under the simulated runtime."""
    if location == PAGEABLE_HOST:
        return value
    if location == PINNED_HOST:
        return runtime.pin(value)
    return runtime.to_device(value, location.name)


def sim_factory(runtime: Any, location: ResidencyLocation, n: int = 4) -> Callable[[], Any]:
    """A factory of fresh `n`-float32 values already placed at `location`."""
    return lambda: on(runtime, location, tensor_value(n))


# --------------------------------------------------------------------------------------------
# reserve() (docs/concepts/lifetimes.md#reservations) came later; tests that need it skip
# without it
# --------------------------------------------------------------------------------------------


def has_reserve(manager: Any) -> bool:
    return callable(getattr(manager, "reserve", None))


def reserve(manager: Any, location: ResidencyLocation, nbytes: int, label: str) -> Any:
    """`manager.reserve(...)`, or skip the test when reservations are not implemented yet."""
    if not has_reserve(manager):
        pytest.skip("ResidencyManager.reserve is not implemented yet")
    try:
        return manager.reserve(location, nbytes, label=label)
    except NotImplementedError:
        pytest.skip("ResidencyManager.reserve is not implemented yet")
