"""The fewest host-to-device bytes for a cyclic order of steps at a byte budget: a reference.

An independent implementation of Belady's MIN rule with variable sizes, written for the
tests of `fhelium.residency.nn.offload` (tests/nn/test_models.py) and sharing no code with
the library. A step requires a set of values, all resident at once. Before a step runs,
its missing values are loaded; while they do not fit, the resident value not required by
this step whose next use in the cyclic order is farthest ahead is evicted (ties: the one
used least recently first, then the one seen first in the order). Evictions are drops (the
host keeps every value), so only loads move bytes. With equal sizes this rule is optimal.
With variable sizes it is the rule the offload's schedule-aware policy applies, and the
one its byte counts are checked against, but not always the minimum: it may drop several
small values where one large one would do (tests/nn/test_belady.py has an order where it
moves 11 bytes a pass and the optimum 8).

The order repeats pass after pass (one pass per forward), from a given resident set (an
empty device, or what the offload held after its first forward). The passes reach a steady
state: the resident set at the start of a pass repeats, and from then on the bytes per pass
cycle, with a period that can exceed one pass (three equal values, room for two: 1, 2, 1,
2, ... bytes).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["BeladyRun", "belady_run"]


@dataclass(frozen=True)
class BeladyRun:
    """What the farthest-next-use rule loads, pass by pass.

    Attributes:
        pass_bytes: Bytes loaded in each simulated pass, from the starting resident set.
        steady: Bytes per pass over one period of the steady state (the resident set at
            the start of a pass repeats), from its first pass.
        first_steady_pass: The index in ``pass_bytes`` where that period starts.
    """

    pass_bytes: tuple[int, ...]
    steady: tuple[int, ...]
    first_steady_pass: int


def belady_run(
    steps: Sequence[Iterable[Hashable]],
    sizes: Mapping[Hashable, int],
    budget: int,
    *,
    resident: Iterable[Hashable] = (),
    passes: int = 1,
    max_passes: int = 256,
) -> BeladyRun:
    """Simulate the farthest-next-use rule over ``steps`` repeated.

    Args:
        steps: One pass of the cyclic order: each step the set of values it requires.
        sizes: Bytes of each value (its charge at the device).
        budget: Device bytes; every step must fit on its own.
        resident: The values on the device before the first simulated pass (empty: a cold
            device). They count as used in the previous pass, at their place in the order,
            which fixes the least-recently-used tie-break.
        passes: Simulate at least this many passes (and on until the steady state).
        max_passes: Passes simulated at most while looking for the steady state.

    Raises:
        ValueError: An empty order, a value without a size, a step over the budget, a
            starting set that is not in the order or over the budget, or no steady state
            within ``max_passes``.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be an int >= 0, got {budget!r}")
    frozen = tuple(frozenset(step) for step in steps)
    if not frozen:
        raise ValueError("the order has no step")
    n = len(frozen)
    order: dict[Hashable, int] = {}
    uses: dict[Hashable, list[int]] = {}
    for index, step in enumerate(frozen):
        for key in step:
            if key not in sizes:
                raise ValueError(f"step {index} requires {key!r}, which has no size")
            order.setdefault(key, len(order))
            uses.setdefault(key, []).append(index)
        need = sum(sizes[key] for key in step)
        if need > budget:
            raise ValueError(f"step {index} requires {need} bytes, over the budget of {budget}")
    start = set(resident)
    for key in start:
        if key not in uses:
            raise ValueError(f"the starting value {key!r} is in no step")
    used = sum(sizes[key] for key in start)
    if used > budget:
        raise ValueError(f"the starting values take {used} bytes, over the budget of {budget}")

    def distance(key: Hashable, index: int) -> int:
        """Steps from ``index`` to ``key``'s next use, strictly after ``index``, cyclically."""
        positions = uses[key]
        at = bisect.bisect_right(positions, index)
        return positions[at] - index if at < len(positions) else positions[0] + n - index

    # Every value counts as used in a previous pass at its last place in the order, so the
    # recency order at the start of every pass is the same and the resident set is the state.
    last_used = {key: positions[-1] - n for key, positions in uses.items()}
    clock = 0
    seen: dict[frozenset[Hashable], int] = {}
    steady: tuple[int, int] | None = None
    pass_bytes: list[int] = []
    while steady is None or len(pass_bytes) < passes:
        if steady is None:
            state = frozenset(start)
            if state in seen:
                steady = (seen[state], len(pass_bytes))
                continue
            if len(pass_bytes) >= max_passes:
                raise ValueError(f"no steady state within {max_passes} passes")
            seen[state] = len(pass_bytes)
        loaded = 0
        for index, step in enumerate(frozen):
            missing = step - start
            need = sum(sizes[key] for key in missing)
            while used + need > budget:
                victim = max(
                    start - step,
                    key=lambda key: (distance(key, index), -last_used[key], -order[key]),
                )
                start.remove(victim)
                used -= sizes[victim]
            start |= missing
            used += need
            loaded += need
            for key in step:
                last_used[key] = clock
            clock += 1
        pass_bytes.append(loaded)
    first, end = steady
    return BeladyRun(tuple(pass_bytes), tuple(pass_bytes[first:end]), first)
