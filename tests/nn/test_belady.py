"""The Belady reference of tests/helpers/belady.py, on hand-computed orders and against an
exhaustive optimum: equal to it for equal sizes, where the farthest-next-use rule is
optimal, and above it on a variable-size order where it is not."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers.belady import belady_run


def test_everything_fits_loads_once() -> None:
    run = belady_run([["a"], ["b"], ["c"]], {"a": 1, "b": 1, "c": 1}, 3, passes=3)
    assert run.pass_bytes == (3, 0, 0)
    assert (run.steady, run.first_steady_pass) == ((0,), 1)


def test_three_equal_values_room_for_two_alternate_one_and_two() -> None:
    # Pass 0: a, b, then c evicts b (a is needed sooner): 3 bytes, {a, c} left.
    # Pass 1: b evicts a (c is needed sooner), c hits: 1 byte, {b, c}.
    # Pass 2: a evicts c, b hits, c evicts b: 2 bytes, {a, c} again: the period is 2.
    # LRU would miss every step: 3 bytes per pass.
    run = belady_run([["a"], ["b"], ["c"]], {"a": 1, "b": 1, "c": 1}, 2, passes=5)
    assert run.pass_bytes == (3, 1, 2, 1, 2)
    assert (run.steady, run.first_steady_pass) == ((1, 2), 1)


def test_variable_sizes_evict_until_the_missing_bytes_fit() -> None:
    # Pass 0: a, b, c fill 8 bytes; d (4) evicts c (next use farthest), then b: 12 bytes.
    # Pass 1 from {a, d}: a hits; b evicts a (d is needed sooner); c fits; d hits: 4 bytes.
    # Pass 2 from {b, c, d}: a evicts d (4 bytes free, enough); b, c hit; d evicts c, then
    # b: 4 + 4 = 8 bytes, {a, d} again.
    sizes = {"a": 4, "b": 2, "c": 2, "d": 4}
    run = belady_run([["a"], ["b"], ["c"], ["d"]], sizes, 8, passes=4)
    assert run.pass_bytes == (12, 4, 8, 4)
    assert (run.steady, run.first_steady_pass) == ((4, 8), 1)


def test_a_value_shared_by_the_first_and_last_steps() -> None:
    # A tied embedding e, used by the first and the last step.
    # Pass 0: e, x fill 5; y evicts x (e is needed sooner): 7 bytes, {e, y}.
    # Pass 1: e hits; x evicts e (y is needed sooner); y hits; e evicts y: 2 + 3, {x, e}.
    # Pass 2: e, x hit; y evicts x; e hits: 2 bytes, {e, y}, as after pass 0.
    sizes = {"e": 3, "x": 2, "y": 2}
    run = belady_run([["e"], ["x"], ["y"], ["e"]], sizes, 5, passes=4)
    assert run.pass_bytes == (7, 5, 2, 5)
    assert (run.steady, run.first_steady_pass) == ((5, 2), 1)


def test_a_step_requires_all_its_values_at_once() -> None:
    # {a, b} then {c}: c evicts both (a first: least recently used, then first seen).
    run = belady_run([["a", "b"], ["c"]], {"a": 1, "b": 1, "c": 2}, 2, passes=2)
    assert run.pass_bytes == (4, 4)
    assert run.steady == (4,)


def test_a_starting_resident_set() -> None:
    # From {b, c}: the pass that starts there in the cold run above loads 2 bytes.
    run = belady_run([["a"], ["b"], ["c"]], {"a": 1, "b": 1, "c": 1}, 2, resident={"b", "c"})
    assert run.pass_bytes == (2, 1)
    assert (run.steady, run.first_steady_pass) == ((2, 1), 0)


@pytest.mark.parametrize(
    ("steps", "sizes", "budget", "resident", "message"),
    [
        ([], {}, 1, (), "no step"),
        ([["a"]], {}, 1, (), "has no size"),
        ([["a", "b"]], {"a": 2, "b": 2}, 3, (), "over the budget"),
        ([["a"]], {"a": 1, "z": 1}, 1, ("z",), "in no step"),
        ([["a"], ["b"]], {"a": 1, "b": 1}, 1, ("a", "b"), "starting values take 2"),
        ([["a"]], {"a": 1}, -1, (), "budget must be"),
    ],
)
def test_refuses_malformed_input(
    steps: list[list[str]],
    sizes: dict[str, int],
    budget: int,
    resident: tuple[str, ...],
    message: str,
) -> None:
    with pytest.raises(ValueError, match=message):
        belady_run(steps, sizes, budget, resident=resident)


def _optimum(steps: list[list[str]], sizes: dict[str, int], budget: int) -> int:
    """The fewest bytes loaded over ``steps`` from an empty device, over every choice of
    victims: dynamic programming over resident sets (evicting only when a step's missing
    values do not fit loses nothing)."""
    costs: dict[frozenset[str], int] = {frozenset(): 0}
    for step in steps:
        need = frozenset(step)
        following: dict[frozenset[str], int] = {}
        for resident, cost in costs.items():
            missing = need - resident
            load = sum(sizes[key] for key in missing)
            optional = sorted(resident - need)
            for count in range(len(optional) + 1):
                for out in itertools.combinations(optional, count):
                    kept = resident.difference(out)
                    if sum(sizes[key] for key in kept) + load > budget:
                        continue
                    state, total = kept | missing, cost + load
                    if following.get(state, total + 1) > total:
                        following[state] = total
        costs = following
    return min(costs.values())


def test_with_variable_sizes_the_rule_is_not_the_minimum() -> None:
    # The rule evicts the farthest values first even when they are small: at a, it drops
    # d, then c, and still needs b's room. Keeping c and d (3 bytes) and swapping a and b
    # through the other 4 moves 8 bytes a pass; the rule moves all 11.
    steps = [["a"], ["b"], ["c"], ["d"]]
    sizes = {"a": 4, "b": 4, "c": 2, "d": 1}
    run = belady_run(steps, sizes, 7, passes=4)
    assert run.pass_bytes == (11, 11, 11, 11)
    assert _optimum(steps * 4, sizes, 7) == 11 + 3 * 8


@given(
    order=st.lists(st.integers(0, 4), min_size=1, max_size=7),
    room=st.integers(1, 4),
    passes=st.integers(1, 3),
)
def test_equal_sizes_match_the_exhaustive_optimum(order: list[int], room: int, passes: int) -> None:
    # Single-value steps of one byte each: Belady's rule is optimal over any finite trace,
    # and the cyclic next use is one valid way to break its ties at the end of the trace.
    steps = [[str(value)] for value in order]
    sizes = {str(value): 1 for value in order}
    run = belady_run(steps, sizes, room, passes=passes)
    assert sum(run.pass_bytes[:passes]) == _optimum(steps * passes, sizes, room)
