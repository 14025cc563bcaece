"""Shared helpers for the lifetime tests (test_lifetimes_*.py); this module holds no tests.

Written from the documented behaviour (docs/concepts/lifetimes.md), not from the
implementation.

* `rt` fixture: a two-device `LoggingRuntime` (a `SimulatedRuntime` that also logs every
  `record_event` call with its stream and event) installed for the whole test. Managers
  capture the runtime at construction, so construct them inside the test.
* `replicated(...)`: an adopted REPLICABLE value, plus replicas at the given locations.
* `assert_not_reaped` / `assert_reaped`: observe whether a pending CUDA lease whose events
  have completed is still waiting to be reaped, *without* the observation itself reaping: an
  injected `event_query` failure only fires if something is still left to query.
* `recorded_warnings()`: records every warning (filters set to "always").
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from fhelium.residency._runtime import SimulatedRuntime, SimulatedStream, use_runtime
from fhelium.residency.location import PAGEABLE_HOST, ResidencyLocation
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.model import ResidencyHandle
from helpers.manager import REPLICABLE, tensor_value, val_snap

__all__ = [
    "LoggingRuntime",
    "QueryFault",
    "assert_not_reaped",
    "assert_reaped",
    "cuda_stream",
    "mat",
    "recorded_warnings",
    "replicated",
    "require",
    "of_category",
    "root_lists_holding",
    "rt_fixture",
]


class LoggingRuntime(SimulatedRuntime):
    """A `SimulatedRuntime` that logs `(stream, event)` for every `record_event` call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._log_lock = threading.Lock()
        self.recorded: list[tuple[Any, Any]] = []

    def record_event(self, stream: Any) -> Any:
        event = super().record_event(stream)
        with self._log_lock:
            self.recorded.append((stream, event))
        return event

    def mark(self) -> int:
        with self._log_lock:
            return len(self.recorded)

    def since(self, mark: int) -> list[tuple[Any, Any]]:
        with self._log_lock:
            return list(self.recorded[mark:])


@pytest.fixture(name="rt")
def rt_fixture() -> Iterator[LoggingRuntime]:
    """A two-device `LoggingRuntime`, installed for the whole test."""
    runtime = LoggingRuntime(device_count=2)
    with use_runtime(runtime):
        yield runtime


def cuda_stream(runtime: SimulatedRuntime, index: int = 0) -> SimulatedStream:
    """A fresh simulated stream on simulated cuda:`index` (never the device's current one)."""
    return SimulatedStream(runtime, torch.device("cuda", index))


def replicated(
    manager: ResidencyManager, *locations: ResidencyLocation, n: int = 4
) -> ResidencyHandle[Any]:
    """Adopt a pageable REPLICABLE `n`-float32 value and ensure replicas at `locations`."""
    handle = manager.adopt(tensor_value(n), replica_mode=REPLICABLE)
    for location in locations:
        if location != PAGEABLE_HOST:
            manager.ensure(handle, location)
    return handle


PLAN_METHODS = ("execute_actions", "explain", "scope")


def require(manager: Any, name: str) -> None:
    """Skip the test when `manager.<name>` (plans may not exist yet) does not exist."""
    if not callable(getattr(manager, name, None)):
        pytest.skip(f"ResidencyManager.{name} is not implemented yet")


def mat(snapshot: Any, handle: ResidencyHandle[Any], location: ResidencyLocation) -> Any:
    """The handle's `MaterializationSnapshot` at `location` (AssertionError when absent)."""
    for entry in val_snap(snapshot, handle).materializations:
        if entry.location == location:
            return entry
    raise AssertionError(f"{handle} has no materialisation at {location}")


class QueryFault(RuntimeError):
    """Injected into `event_query` to detect whether anything was left to reap."""


def assert_reaped(manager: ResidencyManager, runtime: SimulatedRuntime) -> None:
    """Nothing is pending any more: reading the version must not need to query an event."""
    runtime.fail_next("event_query", exc=QueryFault("observer"))
    try:
        _ = manager.state_version
    except QueryFault:
        pytest.fail("a pending lease was still waiting to be reaped")
    finally:
        runtime.clear_faults()


def assert_not_reaped(manager: ResidencyManager, runtime: SimulatedRuntime) -> None:
    """A pending lease is still recorded: reading the version has to query its events."""
    runtime.fail_next("event_query", exc=QueryFault("observer"))
    try:
        with pytest.raises(QueryFault):
            _ = manager.state_version
    finally:
        runtime.clear_faults()


@contextmanager
def recorded_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Record every warning raised in the block (nothing is turned into an error)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def of_category(
    caught: list[warnings.WarningMessage], category: type[Warning]
) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, category)]


def root_lists_holding(manager: ResidencyManager) -> list[list[Any]]:
    """The module-level lists of `fhelium.residency.lease` that hold `manager` (by identity)."""
    import fhelium.residency.lease as lease_module

    return [
        value
        for value in vars(lease_module).values()
        if isinstance(value, list) and any(item is manager for item in value)
    ]
