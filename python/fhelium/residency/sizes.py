"""Byte counts as people write and read them: `parse_size` turns ``"8GiB"``, ``"512MB"``
or ``"1.5 GiB"`` into an exact ``int``; `format_size` shows an ``int`` in the largest
binary unit that reads well. See docs/concepts/locations-and-budgets.md#byte-counts."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Final

__all__ = ["format_size", "parse_size"]

# The largest count the core keeps (an unsigned 64-bit integer).
MAX_BYTES: Final = (1 << 64) - 1

# Case-insensitive: IEC units are powers of 1024, SI units powers of 1000.
_UNITS: Final[dict[str, int]] = {
    "": 1,
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "pib": 1 << 50,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
}
_PATTERN: Final = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*", re.IGNORECASE)
_SHOWN: Final = (
    ("PiB", 1 << 50),
    ("TiB", 1 << 40),
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
)


def parse_size(value: object, what: str = "byte count") -> int:
    """``value`` as an exact number of bytes.

    A non-negative ``int`` is returned as it is. A string is a number and an optional
    unit: ``B``, ``KiB`` to ``PiB`` in powers of 1024, ``KB`` to ``PB`` in powers of 1000,
    case-insensitive, spaces allowed. A fractional number must come to a whole number of
    bytes (``"1.5 GiB"`` does; ``"1.5 B"`` does not).

    Args:
        value: The count: an ``int`` or a string such as ``"8GiB"``.
        what: What the count is, for the error messages (``"budget"``, say).

    Returns:
        The exact number of bytes.

    Raises:
        TypeError: ``value`` is neither an ``int`` nor a ``str`` (``bool`` included).
        ValueError: a negative count, a string that is not a count, an unknown unit, a
            count that is not a whole number of bytes, or one past 2**64 - 1.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"{what} must be an int or a string such as '8GiB', got {type(value).__name__}"
        )
    if isinstance(value, int):
        count = value
    else:
        match = _PATTERN.fullmatch(value)
        if match is None:
            raise ValueError(
                f"{what} {value!r} is not a byte count: write a number with an optional "
                f"unit, such as '8GiB', '512MB' or '1.5 GiB'"
            )
        number, unit = match.group(1), match.group(2).lower()
        scale = _UNITS.get(unit)
        if scale is None:
            raise ValueError(
                f"{what} {value!r} has an unknown unit {match.group(2)!r}: use B, KiB, MiB, "
                f"GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000)"
            )
        try:
            exact = Decimal(number) * scale
        except InvalidOperation as error:  # pragma: no cover - the pattern admits none
            raise ValueError(f"{what} {value!r} is not a byte count") from error
        if exact != exact.to_integral_value():
            raise ValueError(f"{what} {value!r} is {exact} bytes, not a whole number of bytes")
        count = int(exact)
    if count < 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}")
    if count > MAX_BYTES:
        raise ValueError(f"{what} {value!r} is more than 2**64 - 1 bytes")
    return count


def format_size(count: int, *, exact: bool = False) -> str:
    """``count`` bytes in the largest binary unit it reaches, to three significant digits
    at most.

    Args:
        count: A number of bytes.
        exact: Also show the exact count, in parentheses, when the unit is not bytes.

    Returns:
        ``"6 MiB"``, ``"256 KiB"``, ``"1.5 GiB"``, ``"17 bytes"``; with ``exact``,
        ``"1.5 GiB (1610612736 bytes)"``.

    Example:
        ```python
        from fhelium.residency.sizes import format_size, parse_size

        assert parse_size("1.5 GiB") == 1610612736
        assert format_size(parse_size("1.5 GiB"), exact=True) == "1.5 GiB (1610612736 bytes)"
        ```
    """
    if exact:
        shown = format_size(count)
        return shown if shown.endswith(("bytes", "byte")) else f"{shown} ({count} bytes)"
    size = abs(count)
    for unit, scale in _SHOWN:
        if size >= scale:
            shown = f"{count / scale:.3g}"
            if "e" in shown:  # past 999 PiB: no exponent, the whole number
                shown = f"{count / scale:.0f}"
            return f"{shown} {unit}"
    return f"{count} byte" if size == 1 else f"{count} bytes"
