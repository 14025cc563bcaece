"""Eviction policy: the protocol the controller consults and the built-in tiered LRU.

Policies see only frozen, tensor-free candidates and must order them deterministically;
they never run sources or transitions.
"""

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, runtime_checkable

from fhelium.residency._validation import (
    require_count,
    require_instance,
    require_optional_count,
    require_optional_non_empty_str,
    require_strict_int,
    seal,
)
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.model import ResidencyHandle

__all__ = [
    "ResidencyPolicyMetadata",
    "ResidencyEvictionCandidate",
    "ResidencyPolicy",
    "DeterministicTieredLRU",
]


@dataclass(frozen=True, slots=True)
class ResidencyPolicyMetadata:
    """Application hints for eviction: a higher ``priority`` is kept longer.

    Set per handle with `ResidencyController.set_policy_metadata`; handles without metadata
    use ``ResidencyPolicyMetadata()``. See docs/concepts/controller.md#policy-metadata.

    Attributes:
        priority: A strict int of any sign; lower priorities are evicted first.
        stable_key: ``None`` or a non-empty string that orders otherwise-equal candidates
            independently of registration order (keyed candidates go first).

    Raises:
        TypeError: ``priority`` is not a strict int, or ``stable_key`` not a string.
        ValueError: A blank ``stable_key``.
    """

    priority: int = 0
    stable_key: str | None = None

    def __post_init__(self) -> None:
        require_strict_int(self.priority, "priority")
        require_optional_non_empty_str(self.stable_key, "stable_key")


@dataclass(frozen=True, slots=True)
class ResidencyEvictionCandidate:
    """One unprotected materialisation the controller could evict, as a policy sees it.

    A frozen, tensor-free record handed to `ResidencyPolicy.order_candidates` (see
    docs/concepts/controller.md#candidates).

    Attributes:
        handle: The value.
        location: Where the materialisation lives.
        charged_nbytes: Its charge.
        registration_index: The value's position among all issued handles.
        last_access_epoch: The controller epoch of its last use, or ``None`` if never used.
        metadata: The value's policy metadata.

    Raises:
        TypeError: A field of the wrong kind.
        ValueError: A negative count.
    """

    handle: ResidencyHandle[Any]
    location: ResidencyLocation
    charged_nbytes: int
    registration_index: int
    last_access_epoch: int | None
    metadata: ResidencyPolicyMetadata

    def __post_init__(self) -> None:
        require_instance(self.handle, ResidencyHandle, "handle")
        require_instance(self.location, ResidencyLocation, "location")
        require_count(self.charged_nbytes, "charged_nbytes")
        require_count(self.registration_index, "registration_index")
        require_optional_count(self.last_access_epoch, "last_access_epoch")
        require_instance(self.metadata, ResidencyPolicyMetadata, "metadata")


@runtime_checkable
class ResidencyPolicy(Protocol):
    """What the controller asks of an eviction policy: a runtime-checkable protocol.

    ``isinstance`` only checks that the four members exist. Policies see frozen, tensor-free
    candidates and never call sources or run transitions. `DeterministicTieredLRU` and
    `fhelium.residency.schedule.ScheduleAwarePolicy` implement it. A policy may also define
    ``observe(handles)``, which the controller calls after each successful use. See
    docs/concepts/controller.md#policies.
    """

    @property
    def name(self) -> str:
        """A stable, non-empty diagnostic name, stored in decisions."""
        ...

    @property
    def config_identity(self) -> tuple[tuple[str, object], ...]:
        """Frozen configuration evidence, compared for equality when a decision is used."""
        ...

    def fallback_locations(self, location: ResidencyLocation) -> tuple[ResidencyLocation, ...]:
        """Return the configured spill tiers for ``location``, in preference order.

        Args:
            location: The location the controller needs room at.

        Returns:
            The locations its values may spill to; ``()`` for none.

        Raises:
            TypeError: An implementation may refuse a non-location.
        """
        ...

    def order_candidates(
        self, candidates: Iterable[ResidencyEvictionCandidate]
    ) -> tuple[ResidencyEvictionCandidate, ...]:
        """Return every candidate exactly once, first-evicted first.

        Args:
            candidates: The unprotected materialisations at one location.

        Returns:
            The same candidates, ordered.

        Raises:
            TypeError: An implementation may refuse a non-candidate. (A result that does not
                hold each candidate exactly once makes `ResidencyController.decide` raise
                `RuntimeError`.)
        """
        ...


_TierTable = tuple[tuple[ResidencyLocation, tuple[ResidencyLocation, ...]], ...]


def _eviction_key(candidate: ResidencyEvictionCandidate) -> tuple[int, int, int, str, int]:
    metadata = candidate.metadata
    epoch = candidate.last_access_epoch
    key = metadata.stable_key
    # Never-accessed values count as oldest; keyed candidates go before unkeyed ones.
    return (
        metadata.priority,
        -1 if epoch is None else epoch,
        1 if key is None else 0,
        "" if key is None else key,
        candidate.registration_index,
    )


class DeterministicTieredLRU:
    """The built-in policy: lowest priority first, then least recently used, then key or age.

    ``fallback_tiers`` maps a location to the locations its values may spill to, in
    preference order; tiers are never inferred. The order never depends on time, random
    state or allocator readings. Immutable after construction. See
    docs/concepts/controller.md#deterministictieredlru.

    Args:
        fallback_tiers: Spill destinations by location, or ``None`` for none.

    Raises:
        TypeError: ``fallback_tiers`` is not a mapping, or holds a non-location key or
            destination.
        ValueError: A location listed among its own destinations, or a repeated destination.

    Example:
        ```python
        from fhelium.residency import PAGEABLE_HOST, PINNED_HOST, DeterministicTieredLRU
        from fhelium.residency import cuda_location

        policy = DeterministicTieredLRU({cuda_location("cuda:0"): [PINNED_HOST, PAGEABLE_HOST]})
        assert policy.fallback_locations(PINNED_HOST) == ()
        ```
    """

    __slots__ = ("_config_identity", "_destinations", "_tiers")

    _tiers: _TierTable
    _destinations: Mapping[ResidencyLocation, tuple[ResidencyLocation, ...]]
    _config_identity: tuple[tuple[str, object], ...]

    def __init__(
        self,
        fallback_tiers: Mapping[ResidencyLocation, Sequence[ResidencyLocation]] | None = None,
    ) -> None:
        if fallback_tiers is not None and not isinstance(fallback_tiers, Mapping):
            raise TypeError(
                "fallback_tiers must be a Mapping of locations to location sequences, "
                f"got {type(fallback_tiers).__name__}"
            )
        tiers: list[tuple[ResidencyLocation, tuple[ResidencyLocation, ...]]] = []
        for source, destinations in (fallback_tiers or {}).items():
            require_instance(source, ResidencyLocation, "fallback_tiers key")
            targets = tuple(destinations)
            for target in targets:
                require_instance(target, ResidencyLocation, f"fallback tier of {source}")
            if source in targets:
                raise ValueError(f"fallback tiers of {source} include {source} itself")
            if len(set(targets)) != len(targets):
                raise ValueError(f"fallback tiers of {source} repeat a location: {targets}")
            tiers.append((source, targets))
        table = tuple(tiers)
        identity = tuple((source.name, tuple(t.name for t in targets)) for source, targets in table)
        object.__setattr__(self, "_tiers", table)
        object.__setattr__(self, "_destinations", dict(table))
        object.__setattr__(self, "_config_identity", (("fallback_tiers", identity),))

    @property
    def name(self) -> str:
        """The policy name, always ``"deterministic-tiered-lru"``."""
        return "deterministic-tiered-lru"

    @property
    def config_identity(self) -> tuple[tuple[str, object], ...]:
        """``(("fallback_tiers", ((source name, (destination names...)), ...)),)``, by name."""
        return self._config_identity

    def fallback_locations(self, location: ResidencyLocation) -> tuple[ResidencyLocation, ...]:
        """Return the configured destinations for ``location``, or ``()``.

        Args:
            location: The location the controller needs room at.

        Returns:
            Its spill destinations, in preference order.

        Raises:
            TypeError: ``location`` is not a `ResidencyLocation`.
        """
        require_instance(location, ResidencyLocation, "location")
        return self._destinations.get(location, ())

    def order_candidates(
        self, candidates: Iterable[ResidencyEvictionCandidate]
    ) -> tuple[ResidencyEvictionCandidate, ...]:
        """Sort stably by ``(priority, epoch, has-key rank, key, registration index)``.

        ``epoch`` is -1 for a never-used value (oldest); keyed candidates go before unkeyed ones.

        Args:
            candidates: The candidates, any iterable.

        Returns:
            The candidates, first-evicted first.

        Raises:
            TypeError: An element is not a `ResidencyEvictionCandidate`.
        """
        ordered = tuple(candidates)
        for index, candidate in enumerate(ordered):
            require_instance(candidate, ResidencyEvictionCandidate, f"candidates[{index}]")
        return tuple(sorted(ordered, key=_eviction_key))

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise _immutable(self)

    def __delattr__(self, name: str) -> NoReturn:
        raise _immutable(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # Default slot pickling restores state through the blocked __setattr__.
        return (type(self), (dict(self._tiers),))

    def __repr__(self) -> str:
        tiers = ", ".join(
            f"{source}: [{', '.join(str(t) for t in targets)}]" for source, targets in self._tiers
        )
        return f"{type(self).__name__}(fallback_tiers={{{tiers}}})"


seal(ResidencyPolicyMetadata, ResidencyEvictionCandidate)


def _immutable(policy: DeterministicTieredLRU) -> AttributeError:
    return AttributeError(f"{type(policy).__name__} is immutable")


def tier_table(policy: DeterministicTieredLRU) -> _TierTable:
    """The policy's fallback tiers, ``((source, (destinations...)), ...)``: an immutable
    table, the same object for the policy's life (the controller lowers it once)."""
    return policy._tiers
