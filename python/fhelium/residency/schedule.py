"""Schedule-aware eviction: a policy for workloads whose future requests are known.

Streaming the layers of a model once per token, or the rotation keys of a compiled
homomorphic circuit once per evaluation, repeats one access order. LRU evicts exactly
the value that order needs next; this policy evicts the value needed farthest ahead
(Belady's MIN rule), which moves the fewest values
(docs/concepts/controller.md#schedule-aware-eviction).
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fhelium.residency.location import ResidencyLocation
from fhelium.residency.model import ResidencyHandle
from fhelium.residency.policy import DeterministicTieredLRU, ResidencyEvictionCandidate
from fhelium.residency.request import ResidencyRequest

__all__ = ["ScheduleAwarePolicy"]

# The next use of a value the rest of the schedule never requests: beyond every step.
_NEVER = float("inf")


def _step_handles(step: object, index: int) -> frozenset[ResidencyHandle[Any]]:
    """The handles one schedule step requests: a request's, or an iterable of handles."""
    if isinstance(step, ResidencyRequest):
        return frozenset(requirement.handle for requirement in step.requirements)
    if isinstance(step, ResidencyHandle) or not isinstance(step, Iterable):
        raise TypeError(
            f"schedule[{index}] must be a ResidencyRequest or an iterable of handles, "
            f"got {type(step).__name__}"
        )
    handles = tuple(step)
    for handle in handles:
        if not isinstance(handle, ResidencyHandle):
            raise TypeError(
                f"schedule[{index}] must hold ResidencyHandle objects, got {type(handle).__name__}"
            )
    return frozenset(handles)


class ScheduleAwarePolicy:
    """Evicts the value whose next request in ``schedule`` is farthest ahead (Belady's MIN).

    ``schedule`` is the future sequence of steps, each a `ResidencyRequest` or an iterable of
    handles. The policy stands at one step, its `position` (0 at first): a value's next use
    is the first step at or after `position` that requests it. Candidates are ordered, first
    evicted first, by

    1. priority (`ResidencyPolicyMetadata.priority`), as `DeterministicTieredLRU`;
    2. next use: never requested again first, then the farthest next use;
    3. then `DeterministicTieredLRU`'s order (access epoch, stable key, registration).

    ``fallback_tiers`` are `DeterministicTieredLRU`'s. A controller using this policy moves
    `position` forward itself through `observe`; `advance` and `seek` move it by hand. The
    schedule and the tiers are immutable; the position is the only state, safe to move from
    several threads. See docs/concepts/controller.md#schedule-aware-eviction.

    Args:
        schedule: The future steps, read once.
        fallback_tiers: Spill destinations by location, as for `DeterministicTieredLRU`.

    Raises:
        TypeError: ``schedule`` is a string or not iterable, a step is neither a request nor
            an iterable of handles, or ``fallback_tiers`` is malformed.
        ValueError: ``fallback_tiers`` lists a location among its own destinations or repeats
            one.

    Example:
        ```python
        import torch
        from fhelium.residency import ResidencyManager
        from fhelium.residency.schedule import ScheduleAwarePolicy
        from fhelium.values import ResidentTensor

        with ResidencyManager() as manager:
            a, b = (manager.adopt(ResidentTensor(torch.ones(4))) for _ in range(2))
            policy = ScheduleAwarePolicy([[a], [b], [a]])
            assert (policy.next_use(a), policy.next_use(b)) == (0, 1)
            assert policy.observe([a]) and policy.position == 1
            assert policy.next_use(a) == 2
        ```
    """

    __slots__ = ("_identity", "_lock", "_position", "_steps", "_tiered", "_uses")

    def __init__(
        self,
        schedule: Iterable[ResidencyRequest | Iterable[ResidencyHandle[Any]]],
        *,
        fallback_tiers: Mapping[ResidencyLocation, Sequence[ResidencyLocation]] | None = None,
    ) -> None:
        if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Iterable):
            raise TypeError(f"schedule must be an iterable of steps, got {type(schedule).__name__}")
        steps = tuple(_step_handles(step, index) for index, step in enumerate(schedule))
        self._tiered = DeterministicTieredLRU(fallback_tiers)
        self._steps = steps
        uses: dict[ResidencyHandle[Any], list[int]] = {}
        for index, handles in enumerate(steps):
            for handle in handles:
                uses.setdefault(handle, []).append(index)
        self._uses = uses
        digest = hashlib.sha256()
        for handles in steps:
            for name in sorted(f"{h.manager_id}/{h.handle_id}" for h in handles):
                digest.update(name.encode("utf-8", "surrogatepass") + b"\0")
            digest.update(b"\1")
        self._identity = (
            ("schedule", (len(steps), digest.hexdigest())),
            *self._tiered.config_identity,
        )
        self._position = 0
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        """The policy name, always ``"schedule-aware"``."""
        return "schedule-aware"

    @property
    def config_identity(self) -> tuple[tuple[str, object], ...]:
        """``(("schedule", (step count, sha256 of the steps' ids)), ("fallback_tiers", ...))``.

        The position is state, not configuration, so a decision stays usable as the policy
        advances.
        """
        return self._identity

    @property
    def schedule(self) -> tuple[frozenset[ResidencyHandle[Any]], ...]:
        """The steps, each as the set of handles it requests."""
        return self._steps

    @property
    def position(self) -> int:
        """The step the policy stands at; ``len(schedule)`` once every step is done."""
        return self._position

    def advance(self, steps: int = 1) -> int:
        """Move ``steps`` steps forward, never past the end.

        Args:
            steps: How many steps (an int >= 0).

        Returns:
            The new position.

        Raises:
            TypeError: ``steps`` is a ``bool`` or not an int.
            ValueError: A negative ``steps``.
        """
        if isinstance(steps, bool) or not isinstance(steps, int):
            raise TypeError(f"steps must be an int, got {type(steps).__name__}")
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        with self._lock:
            self._position = min(len(self._steps), self._position + steps)
            return self._position

    def seek(self, position: int) -> None:
        """Stand at step ``position``, for a new pass or a schedule driven by hand.

        Args:
            position: The step, ``0..len(schedule)``.

        Raises:
            TypeError: ``position`` is a ``bool`` or not an int.
            ValueError: ``position`` is out of range.
        """
        if isinstance(position, bool) or not isinstance(position, int):
            raise TypeError(f"position must be an int, got {type(position).__name__}")
        if not 0 <= position <= len(self._steps):
            raise ValueError(f"position must be in 0..{len(self._steps)}, got {position}")
        with self._lock:
            self._position = position

    def observe(self, handles: Iterable[ResidencyHandle[Any]]) -> bool:
        """Record a used step: advance past the current step if ``handles`` are exactly its own.

        The controller calls it after each successful use. Any other set of handles leaves the
        position where it is.

        Args:
            handles: The handles the used request required.

        Returns:
            Whether the policy advanced.

        Raises:
            TypeError: ``handles`` is not iterable, or holds an unhashable object.
        """
        used = frozenset(handles)
        with self._lock:
            if self._position < len(self._steps) and self._steps[self._position] == used:
                self._position += 1
                return True
            return False

    def next_use(self, handle: ResidencyHandle[Any]) -> int | None:
        """Return the first step at or after `position` requesting ``handle``.

        Args:
            handle: The value.

        Returns:
            That step's index, or ``None`` when it is never requested again.

        Raises:
            TypeError: ``handle`` is unhashable.
        """
        steps = self._uses.get(handle)
        if not steps:
            return None
        at = bisect.bisect_left(steps, self._position)
        return steps[at] if at < len(steps) else None

    def fallback_locations(self, location: ResidencyLocation) -> tuple[ResidencyLocation, ...]:
        """Return the configured destinations for ``location``, or ``()``.

        Args:
            location: The location the controller needs room at.

        Returns:
            Its spill destinations, in preference order.

        Raises:
            TypeError: ``location`` is not a `ResidencyLocation`.
        """
        return self._tiered.fallback_locations(location)

    def order_candidates(
        self, candidates: Iterable[ResidencyEvictionCandidate]
    ) -> tuple[ResidencyEvictionCandidate, ...]:
        """Sort stably by ``(priority, next use)`` over `DeterministicTieredLRU`'s order.

        Never-used-again and farthest next uses go first; ties keep the tiered LRU's order.

        Args:
            candidates: The candidates, any iterable.

        Returns:
            The candidates, first-evicted first.

        Raises:
            TypeError: An element is not a `ResidencyEvictionCandidate`.
        """
        ordered = self._tiered.order_candidates(candidates)

        def key(candidate: ResidencyEvictionCandidate) -> tuple[int, float]:
            upcoming = self.next_use(candidate.handle)
            distance = _NEVER if upcoming is None else upcoming
            return (candidate.metadata.priority, -distance)

        # The tiered LRU's order first, then a stable sort by the schedule's key: ties
        # keep the tiered LRU's order.
        return tuple(sorted(ordered, key=key))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(steps={len(self._steps)}, position={self._position}, "
            f"fallback_tiers={self._tiered!r})"
        )
