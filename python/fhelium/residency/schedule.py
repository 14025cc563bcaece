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
    """Evicts the value whose next request in ``schedule`` is farthest ahead.

    ``schedule`` is the future sequence of steps, each a `ResidencyRequest` or an
    iterable of handles. The policy stands at one step, its ``position`` (0 at first):
    a value's next use is the first step at or after ``position`` that requests it.
    Candidates are ordered, first evicted first, by

    1. priority (`ResidencyPolicyMetadata.priority`), as `DeterministicTieredLRU`;
    2. next use: never requested again first, then the farthest next use;
    3. then `DeterministicTieredLRU`'s order (access epoch, stable key, registration).

    ``fallback_tiers`` are `DeterministicTieredLRU`'s. A controller using this policy
    moves ``position`` forward itself: when a request it uses requests exactly the
    handles of the step at ``position``, the policy advances past that step
    (`observe`). ``advance`` and ``seek`` move it by hand, for a schedule driven
    outside the controller. The schedule and the tiers are immutable; the position is
    the policy's only state, and it is safe to move from several threads.
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
        """Always ``"schedule-aware"``."""
        return "schedule-aware"

    @property
    def config_identity(self) -> tuple[tuple[str, object], ...]:
        """``(("schedule", (step count, sha256 of the steps' handle ids)),
        ("fallback_tiers", ...))``: the position is not part of it."""
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
        """Moves ``steps`` steps forward (never past the end); returns the position."""
        if isinstance(steps, bool) or not isinstance(steps, int):
            raise TypeError(f"steps must be an int, got {type(steps).__name__}")
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        with self._lock:
            self._position = min(len(self._steps), self._position + steps)
            return self._position

    def seek(self, position: int) -> None:
        """Stands at step ``position`` (``0..len(schedule)``), for a new pass."""
        if isinstance(position, bool) or not isinstance(position, int):
            raise TypeError(f"position must be an int, got {type(position).__name__}")
        if not 0 <= position <= len(self._steps):
            raise ValueError(f"position must be in 0..{len(self._steps)}, got {position}")
        with self._lock:
            self._position = position

    def observe(self, handles: Iterable[ResidencyHandle[Any]]) -> bool:
        """A step was used: advances past the current step when ``handles`` are
        exactly its handles, and says whether it did. Any other use leaves the
        position where it is."""
        used = frozenset(handles)
        with self._lock:
            if self._position < len(self._steps) and self._steps[self._position] == used:
                self._position += 1
                return True
            return False

    def next_use(self, handle: ResidencyHandle[Any]) -> int | None:
        """The first step at or after ``position`` requesting ``handle``, or None."""
        steps = self._uses.get(handle)
        if not steps:
            return None
        at = bisect.bisect_left(steps, self._position)
        return steps[at] if at < len(steps) else None

    def fallback_locations(self, location: ResidencyLocation) -> tuple[ResidencyLocation, ...]:
        """The configured destinations for ``location``, or ``()``."""
        return self._tiered.fallback_locations(location)

    def order_candidates(
        self, candidates: Iterable[ResidencyEvictionCandidate]
    ) -> tuple[ResidencyEvictionCandidate, ...]:
        """Stable sort by ``(priority, next use, then DeterministicTieredLRU's keys)``,
        never-used-again and farthest next uses first."""
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
