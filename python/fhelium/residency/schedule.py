"""Schedule-aware eviction: a policy for workloads whose future requests are known.

Streaming the layers of a model once per token, or the rotation keys of a compiled
homomorphic circuit once per evaluation, repeats one access order. LRU evicts exactly
the value that order needs next; this policy evicts the value needed farthest ahead
(Belady's MIN rule), which moves the fewest values
(docs/concepts/controller.md#schedule-aware-eviction).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import os
import sys
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from fhelium.errors import ResidencyScheduleExhaustedWarning
from fhelium.residency._validation import require_bool, require_count, require_strict_int
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.model import ResidencyHandle
from fhelium.residency.policy import DeterministicTieredLRU, ResidencyEvictionCandidate
from fhelium.residency.request import ResidencyRequest

__all__ = ["ScheduleAwarePolicy"]

# The next use of a value the rest of the schedule never requests: beyond every step.
_NEVER = float("inf")

# fhelium's own source folder: a warning names the first caller outside it.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _outside_fhelium() -> int:
    """The ``stacklevel`` of the innermost caller outside fhelium, counted from the caller
    of this function's caller (the one that warns)."""
    frame = sys._getframe(1).f_back
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    return level


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

    With ``cyclic=True`` the schedule repeats forever (a model's forward, token after
    token): after its last step the position wraps to 0, and a next use may lie in the next
    pass (see `next_use`). Without it the schedule is one pass: once every step is done the
    policy is `exhausted`, has no next use left for anything and orders as
    `DeterministicTieredLRU`; a controller that still decides with it warns once
    (`fhelium.errors.ResidencyScheduleExhaustedWarning`) until `seek` starts a new pass.

    ``fallback_tiers`` are `DeterministicTieredLRU`'s. A controller using this policy moves
    `position` forward itself through `observe`, which counts the steps used off the
    schedule (`misses`); `advance` and `seek` move it by hand. The schedule, ``cyclic`` and
    the tiers are immutable; the position and the counts are the only state, safe to move
    from several threads. See docs/concepts/controller.md#schedule-aware-eviction.

    Args:
        schedule: The future steps, read once.
        cyclic: Whether the schedule repeats after its last step.
        fallback_tiers: Spill destinations by location, as for `DeterministicTieredLRU`.

    Raises:
        TypeError: ``schedule`` is a string or not iterable, a step is neither a request nor
            an iterable of handles, ``cyclic`` is not a bool, or ``fallback_tiers`` is
            malformed.
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
            assert not policy.observe([a]) and policy.misses == 1  # step 1 requests b

            repeating = ScheduleAwarePolicy([[a], [b]], cyclic=True)
            assert repeating.observe([a]) and repeating.observe([b])
            assert repeating.position == 0  # wrapped: the next pass
            repeating.advance()
            assert repeating.next_use(a) == 2  # step 0 of the next pass
        ```
    """

    __slots__ = (
        "_cyclic",
        "_identity",
        "_lock",
        "_misses",
        "_position",
        "_steps",
        "_tiered",
        "_uses",
        "_warned",
    )

    def __init__(
        self,
        schedule: Iterable[ResidencyRequest | Iterable[ResidencyHandle[Any]]],
        *,
        cyclic: bool = False,
        fallback_tiers: Mapping[ResidencyLocation, Sequence[ResidencyLocation]] | None = None,
    ) -> None:
        if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Iterable):
            raise TypeError(f"schedule must be an iterable of steps, got {type(schedule).__name__}")
        require_bool(cyclic, "cyclic")
        steps = tuple(_step_handles(step, index) for index, step in enumerate(schedule))
        self._tiered = DeterministicTieredLRU(fallback_tiers)
        self._steps = steps
        self._cyclic = cyclic
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
            ("cyclic", cyclic),
            *self._tiered.config_identity,
        )
        self._position = 0
        self._misses = 0
        # Whether this exhaustion was warned about: set by the first decide past the
        # end, cleared by `seek` (a new pass).
        self._warned = False
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        """The policy name, always ``"schedule-aware"``."""
        return "schedule-aware"

    @property
    def config_identity(self) -> tuple[tuple[str, object], ...]:
        """``(("schedule", (step count, sha256 of the steps' ids)), ("cyclic", bool),
        ("fallback_tiers", ...))``.

        The position and the counts are state, not configuration, so a decision stays usable
        as the policy advances.
        """
        return self._identity

    @property
    def schedule(self) -> tuple[frozenset[ResidencyHandle[Any]], ...]:
        """The steps, each as the set of handles it requests."""
        return self._steps

    @property
    def cyclic(self) -> bool:
        """Whether the schedule repeats: after its last step, its first step comes next."""
        return self._cyclic

    @property
    def position(self) -> int:
        """The step the policy stands at.

        In ``0..len(schedule) - 1`` for a cyclic schedule (0 again after the last step); a
        one-pass schedule reaches ``len(schedule)`` once every step is done.
        """
        return self._position

    @property
    def exhausted(self) -> bool:
        """Whether a one-pass schedule has run out: every step done, no next use left.

        An exhausted policy orders as `DeterministicTieredLRU`; a controller that decides
        with it warns once (`fhelium.errors.ResidencyScheduleExhaustedWarning`). `seek`
        starts a new pass. Never true for a cyclic schedule.
        """
        return not self._cyclic and self._position >= len(self._steps)

    @property
    def misses(self) -> int:
        """How many `observe` calls did not advance: steps used off the schedule.

        A step whose handles are not exactly those of the step at `position` (another
        order, or any step once the schedule is `exhausted`) counts one. The count only
        grows; a controller's decisions for such steps follow the schedule only as far as
        it still predicts them.
        """
        return self._misses

    def _after(self, position: int, steps: int) -> int:
        """The position ``steps`` steps after ``position``: wrapped when cyclic, else never
        past the end."""
        count = len(self._steps)
        if self._cyclic:
            return (position + steps) % count if count else 0
        return min(count, position + steps)

    def advance(self, steps: int = 1) -> int:
        """Move ``steps`` steps forward, wrapping when cyclic, never past a one-pass end.

        Past the last step of a cyclic schedule comes its first; a one-pass schedule stops
        at ``len(schedule)``.

        Args:
            steps: How many steps (an int >= 0).

        Returns:
            The new position.

        Raises:
            TypeError: ``steps`` is a ``bool`` or not an int.
            ValueError: A negative ``steps``.
        """
        require_count(steps, "steps")
        with self._lock:
            self._position = self._after(self._position, steps)
            return self._position

    def seek(self, position: int) -> None:
        """Stand at step ``position``, for a new pass or a schedule driven by hand.

        A one-pass schedule sought back before its end is no longer `exhausted`, and a
        later exhaustion warns again.

        Args:
            position: The step, ``0..len(schedule)``; a cyclic schedule takes
                ``len(schedule)`` as 0, the next pass's first step.

        Raises:
            TypeError: ``position`` is a ``bool`` or not an int.
            ValueError: ``position`` is out of range.
        """
        require_strict_int(position, "position")
        if not 0 <= position <= len(self._steps):
            raise ValueError(f"position must be in 0..{len(self._steps)}, got {position}")
        with self._lock:
            self._position = self._after(position, 0)
            self._warned = False

    def observe(self, handles: Iterable[ResidencyHandle[Any]]) -> bool:
        """Record a used step: advance past the current step if ``handles`` are exactly its own.

        The controller calls it after each successful use. Past the last step, a cyclic
        schedule stands at its first step again. Any other set of handles leaves the position
        where it is and counts one of `misses`.

        Args:
            handles: The handles the used request required.

        Returns:
            Whether the policy advanced.

        Raises:
            TypeError: ``handles`` is not iterable, or holds an unhashable object.
        """
        return observed(self, frozenset(handles))

    def next_use(self, handle: ResidencyHandle[Any]) -> int | None:
        """Return the first step at or after `position` requesting ``handle``.

        Steps are counted on from the start of the current pass: in a cyclic schedule, a
        request only in the next pass is at ``len(schedule) + i`` for its step ``i``
        (standing at 5 of 8, a value requested only at step 2 is next used at 10). So
        ``next_use(handle) - position`` is always the distance to the next use, and a
        farther use is always a larger number, across the wrap too.

        Args:
            handle: The value.

        Returns:
            That step's index, or ``None`` when it is never requested again (in a cyclic
            schedule: when no step requests it).

        Raises:
            TypeError: ``handle`` is unhashable.
        """
        steps = self._uses.get(handle)
        if not steps:
            return None
        position = self._position
        at = bisect.bisect_left(steps, position)
        if at < len(steps):
            return steps[at]
        return steps[0] + len(self._steps) if self._cyclic else None

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
            f"cyclic={self._cyclic}, misses={self._misses}, fallback_tiers={self._tiered!r})"
        )


# ---------------------------------------------------------------------- for the controller


def tiered_of(policy: ScheduleAwarePolicy) -> DeterministicTieredLRU:
    """The tiered LRU a schedule-aware policy falls back to (its ``fallback_tiers``)."""
    return policy._tiered


def position_after(policy: ScheduleAwarePolicy, position: int, steps: int) -> int:
    """The position ``steps`` steps after ``position``: wrapped when cyclic, else never
    past the end."""
    return policy._after(position, steps)


@contextlib.contextmanager
def standing_at(policy: ScheduleAwarePolicy, position: int) -> Iterator[None]:
    """The policy stands at step ``position`` (in range) for the block, then where it
    stood: not a new pass, so an exhaustion already warned about stays warned."""
    with policy._lock:
        standing = policy._position
        policy._position = policy._after(position, 0)
    try:
        yield
    finally:
        with policy._lock:
            policy._position = policy._after(standing, 0)


def observed(policy: ScheduleAwarePolicy, used: frozenset[ResidencyHandle[Any]]) -> bool:
    """`ScheduleAwarePolicy.observe` of a step's handles already as a set (a pipeline's
    staged step, whose request's set is made once)."""
    with policy._lock:
        position = policy._position
        steps = policy._steps
        count = len(steps)
        if position < count and steps[position] == used:
            # `_after(position, 1)`, inline.
            policy._position = (position + 1) % count if policy._cyclic else position + 1
            return True
        policy._misses += 1
        return False


def deciding_at(policy: ScheduleAwarePolicy, position: int) -> None:
    """A controller decides for step ``position``: warns once per exhaustion when a
    one-pass schedule has no step left there
    (docs/concepts/controller.md#schedule-aware-eviction)."""
    count = len(policy._steps)
    if policy._cyclic or position < count:
        return
    with policy._lock:
        if policy._warned:
            return
        policy._warned = True
    warnings.warn(
        f"the ScheduleAwarePolicy's one-pass schedule is exhausted: a decision stands "
        f"past its last step (of {count}), so it and every later one fall back to the "
        "DeterministicTieredLRU order. Build ScheduleAwarePolicy(..., cyclic=True) for a "
        "schedule that repeats, or call policy.seek(0) before a new pass",
        ResidencyScheduleExhaustedWarning,
        stacklevel=_outside_fhelium(),
    )
