"""Shared helpers for the controller tests (test_controller_*.py); this module holds no tests.

Written from the documented behaviour (docs/concepts/controller.md), not from the
implementation.

* `RecordingPolicy`: wraps a policy and records every `order_candidates` input, so tests can
  observe the candidates (metadata, epochs, registration indices, charges) the controller
  builds;
* value builders placing values at chosen locations under the simulated runtime;
* `eviction_tuples(decision)` and `check_against_reference(...)`, which runs the
  transcription in `controller_reference.py` on the same snapshot and compares.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from fhelium.residency._runtime import SimulatedStream
from fhelium.residency.controller import ResidencyController, ResidencyDecision
from fhelium.residency.location import PAGEABLE_HOST, ResidencyLocation
from fhelium.residency.manager import ResidencyManager
from fhelium.residency.model import ReplicaMode, ResidencyHandle
from fhelium.residency.plan import MemoryReservation
from fhelium.residency.policy import (
    DeterministicTieredLRU,
    ResidencyEvictionCandidate,
    ResidencyPolicyMetadata,
)
from fhelium.residency.request import ResidencyRequest, ResidencyRequirement
from helpers.controller_reference import planning_input, reference_decide
from helpers.manager import RECONSTRUCTIBLE, REPLICABLE, Source, on, spec, tensor_value

__all__ = [
    "RecordingPolicy",
    "adopt_at",
    "check_against_reference",
    "cuda_stream",
    "eviction_tuples",
    "replicated_at",
    "request",
    "sourced",
]


class RecordingPolicy:
    """A `ResidencyPolicy` delegating to `inner` that records each `order_candidates` input."""

    def __init__(self, inner: Any = None, *, name: str = "recording") -> None:
        self.inner = DeterministicTieredLRU() if inner is None else inner
        self._name = name
        self.calls: list[tuple[ResidencyEvictionCandidate, ...]] = []

    @property
    def name(self) -> str:
        return self._name

    @property
    def config_identity(self) -> tuple[tuple[str, object], ...]:
        return (("inner", self.inner.config_identity),)

    def fallback_locations(self, location: ResidencyLocation) -> tuple[ResidencyLocation, ...]:
        return tuple(self.inner.fallback_locations(location))

    def order_candidates(
        self, candidates: Iterable[ResidencyEvictionCandidate]
    ) -> tuple[ResidencyEvictionCandidate, ...]:
        listed = tuple(candidates)
        self.calls.append(listed)
        return tuple(self.inner.order_candidates(listed))

    def seen(self) -> list[ResidencyEvictionCandidate]:
        """Every recorded candidate, flattened in call order."""
        return [c for call in self.calls for c in call]


def cuda_stream(runtime: Any, index: int = 0) -> SimulatedStream:
    return SimulatedStream(runtime, torch.device("cuda", index))


def adopt_at(
    manager: ResidencyManager,
    runtime: Any,
    location: ResidencyLocation,
    *,
    n: int = 4,
    replica: ReplicaMode = REPLICABLE,
) -> ResidencyHandle[Any]:
    """Adopt a MUST_PRESERVE `n`-float32 value (`4 * n` bytes) placed at `location`."""
    return manager.adopt(on(runtime, location, tensor_value(n)), at=location, replica_mode=replica)


def replicated_at(
    manager: ResidencyManager, runtime: Any, *locations: ResidencyLocation, n: int = 4
) -> ResidencyHandle[Any]:
    """A REPLICABLE MUST_PRESERVE value adopted at `locations[0]`, ensured at the rest."""
    handle = adopt_at(manager, runtime, locations[0], n=n)
    for location in locations[1:]:
        manager.ensure(handle, location)
    return handle


def sourced(
    manager: ResidencyManager,
    runtime: Any,
    *at: ResidencyLocation,
    n: int = 4,
    replica: ReplicaMode = REPLICABLE,
    source_location: ResidencyLocation = PAGEABLE_HOST,
    storage: int | None = None,
) -> tuple[ResidencyHandle[Any], Source]:
    """A RECONSTRUCTIBLE value registered with a source at `source_location`, ensured at `at`."""
    source = Source(lambda: on(runtime, source_location, tensor_value(n)))
    handle = manager.register_source(
        spec(n, replica=replica, recoverability=RECONSTRUCTIBLE, storage=storage),
        source,
        source_location=source_location,
    )
    for location in at:
        if replica is ReplicaMode.EXCLUSIVE:
            manager.move(handle, location)
        else:
            manager.ensure(handle, location)
    return handle, source


def request(
    name: str,
    *pairs: tuple[ResidencyHandle[Any], ResidencyLocation],
    reservations: Iterable[MemoryReservation] = (),
) -> ResidencyRequest:
    return ResidencyRequest(
        name, [ResidencyRequirement(h, loc) for h, loc in pairs], tuple(reservations)
    )


def eviction_tuples(decision: ResidencyDecision) -> tuple[tuple[Any, ...], ...]:
    return tuple(
        (e.action, e.rank, e.released_location, e.released_nbytes, e.reason)
        for e in decision.evictions
    )


def check_against_reference(
    controller: ResidencyController,
    decision: ResidencyDecision,
    *,
    metadata: Mapping[ResidencyHandle[Any], ResidencyPolicyMetadata] | None = None,
    epochs: Mapping[ResidencyHandle[Any], int] | None = None,
    search_state_limit: int = 100_000,
) -> None:
    """The reference transcription agrees with `decision` on the current manager state."""
    planning = planning_input(
        controller.manager,
        decision.request,
        policy=controller.policy,
        metadata=metadata,
        epochs=epochs,
        search_state_limit=search_state_limit,
    )
    outcome = reference_decide(planning)
    assert outcome.kind == "ok", outcome
    assert decision.plan.reclaim == outcome.reclaim
    assert decision.plan.enter == outcome.enter
    assert eviction_tuples(decision) == outcome.evictions
    assert decision.explored_states == outcome.explored_states


# The fields of `ResidencyDecision`, in order.
DECISION_FIELDS = (
    "manager_id",
    "expected_state_version",
    "explored_states",
    "request",
    "plan",
    "policy_name",
    "policy_config",
    "evictions",
    "explanation",
)


def fewest_misses(requests: tuple[int, ...], capacity: int) -> int:
    """The fewest misses of a cache of `capacity` equal values, over every choice of
    victims (exhaustive search with memoisation)."""

    @functools.cache
    def search(step: int, cached: frozenset[int]) -> int:
        if step == len(requests):
            return 0
        value = requests[step]
        if value in cached:
            return search(step + 1, cached)
        if len(cached) < capacity:
            return 1 + search(step + 1, cached | {value})
        return 1 + min(search(step + 1, (cached - {victim}) | {value}) for victim in cached)

    return search(0, frozenset())


def leftovers(manager: ResidencyManager) -> tuple[int, int, int]:
    """(use tokens, hold tokens, reserved bytes) anywhere in ``manager``'s books."""
    snapshot = manager.snapshot()
    return (
        sum(entry.use_count for entry in snapshot.locations),
        sum(entry.hold_count for entry in snapshot.locations),
        sum(entry.reserved_bytes for entry in snapshot.locations),
    )
