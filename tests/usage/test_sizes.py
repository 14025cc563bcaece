"""Byte counts in human units: parsed exactly (IEC and SI, case-insensitive), anything
else refused with a ValueError that shows how to write one; shown in the largest binary
unit that reads well."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fhelium.residency.sizes import MAX_BYTES, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("8GiB", 8 << 30),
        ("8gib", 8 << 30),
        ("8 GIB", 8 << 30),
        ("512MB", 512_000_000),
        ("512mb", 512_000_000),
        ("1.5 GiB", 3 << 29),
        ("0.5KiB", 512),
        (".5 kib", 512),
        ("2TB", 2 * 10**12),
        ("3 TiB", 3 << 40),
        ("1kb", 1000),
        ("17", 17),
        ("17 bytes", 17),
        ("17B", 17),
        (" 4096 ", 4096),
        ("0", 0),
    ],
)
def test_strings_parse_to_exact_counts(text: str, count: int) -> None:
    assert parse_size(text) == count


def test_ints_pass_through_exactly() -> None:
    assert parse_size(123456789012345) == 123456789012345
    assert parse_size(MAX_BYTES) == MAX_BYTES


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("8 G", "unknown unit 'G'"),
        ("12QB", "unknown unit"),
        ("1.5B", "not a whole number of bytes"),
        ("0.1 KiB", "not a whole number of bytes"),
        ("-1GiB", "not a byte count"),
        ("GiB", "not a byte count"),
        ("", "not a byte count"),
        ("1e9", "not a byte count"),
        (-3, ">= 0"),
        (MAX_BYTES + 1, "2**64 - 1"),
        ("16385 PiB", "2**64 - 1"),
    ],
)
def test_anything_else_is_a_value_error_that_says_how(value: object, says: str) -> None:
    with pytest.raises(ValueError, match="budget") as error:
        parse_size(value, "budget")
    assert says in str(error.value)


@pytest.mark.parametrize("value", [1.5, None, True, b"8GiB", [8]])
def test_other_types_are_a_type_error(value: object) -> None:
    with pytest.raises(TypeError, match="'8GiB'"):
        parse_size(value)


@pytest.mark.parametrize(
    ("count", "shown"),
    [
        (0, "0 bytes"),
        (1, "1 byte"),
        (1023, "1023 bytes"),
        (1024, "1 KiB"),
        (256 << 10, "256 KiB"),
        (6 << 20, "6 MiB"),
        (3 << 29, "1.5 GiB"),
        (3 * 10**9, "2.79 GiB"),
        (MAX_BYTES, "16384 PiB"),
    ],
)
def test_counts_show_in_the_largest_unit(count: int, shown: str) -> None:
    assert format_size(count) == shown


def test_messages_carry_the_exact_count() -> None:
    assert format_size(3 << 29, exact=True) == "1.5 GiB (1610612736 bytes)"
    assert format_size(17, exact=True) == "17 bytes"


@given(st.integers(min_value=0, max_value=MAX_BYTES))
def test_a_count_round_trips_through_its_exact_text(count: int) -> None:
    assert parse_size(f"{count}") == count
    assert parse_size(f"{count} B") == count


@given(st.integers(min_value=0, max_value=(1 << 34) - 1), st.sampled_from(["KiB", "MiB", "GiB"]))
def test_whole_units_scale_exactly(number: int, unit: str) -> None:
    scale = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]
    assert parse_size(f"{number}{unit}") == number * scale
