r"""Regexes of the JSON numbers within bounds, for `structured.json_schema`.

`integer_range(lo, hi)`: the integers `-?(0|[1-9][0-9]*)` in [lo, hi] (either end may be
  None: unbounded); never `-0`.
`decimal_range(lower, upper)`: the numbers written without an exponent,
  `-?(0|[1-9][0-9]*)(\.[0-9]+)?`, whose value lies within the bounds; each bound is a
  `Bound` (an exact `Decimal` and whether it is exclusive) or None. Any number of fraction
  digits may be written, trailing zeros too (`0.50` is 0.5), but a zero value never takes
  a `-` (`-0`, `-0.0` are refused, as `-0` is for integers). None if no value is within.

Both use only the dialect shared by Python's `re` and `structured.regex`, and their size is
linear in the number of digits of the bounds. Construction: a sign, then a magnitude range
(negatives are `-` and the mirrored range of positive magnitudes). Within a magnitude range
[a, b], the integer part lies strictly between floor(a) and floor(b) with any fraction, or
equals one of them with a fraction compared digit by digit with the bound's fraction; integer
parts use the classic digit-range split (a ragged low end, whole blocks, a ragged high end).
"""
from __future__ import annotations

from decimal import Decimal
from typing import NamedTuple

_ANY_FRACTION = r"(?:\.[0-9]+)?"


class Bound(NamedTuple):
    """One end of a range: an exact decimal value, excluded from the range or not."""

    value: Decimal
    exclusive: bool


def _alt(alternatives: list[str]) -> str:
    """Alternatives as one regex that is safe to concatenate."""
    return alternatives[0] if len(alternatives) == 1 else f"(?:{'|'.join(alternatives)})"


def _run(atom: str, lo: int, hi: int | None) -> str:
    """`atom` (a character or a class) repeated lo..hi times (hi None: unbounded)."""
    if hi is None:
        return atom + ("*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}")
    if lo == hi:
        return atom * lo if lo <= 1 or len(atom) * lo <= 3 else f"{atom}{{{lo}}}"
    return atom + ("?" if (lo, hi) == (0, 1) else f"{{{lo},{hi}}}")


def _digit(lo: int, hi: int) -> str:
    """One digit in lo..hi."""
    return str(lo) if lo == hi else f"[{lo}-{hi}]"


# ---- integers ---------------------------------------------------------------------------
def _same_length_range(lo: str, hi: str) -> str:
    """Digit strings of one length between `lo` and `hi` (inclusive): the standard split
    into a ragged low end, a run of whole blocks in the middle and a ragged high end."""
    if not lo:
        return ""
    if lo[0] == hi[0]:
        return lo[0] + _same_length_range(lo[1:], hi[1:])
    rest = len(lo) - 1
    ragged_low, ragged_high = lo[1:] != "0" * rest, hi[1:] != "9" * rest
    first, last = int(lo[0]) + ragged_low, int(hi[0]) - ragged_high
    parts = [lo[0] + _same_length_range(lo[1:], "9" * rest)] if ragged_low else []
    if first <= last:
        parts.append(_digit(first, last) + _run("[0-9]", rest, rest))
    if ragged_high:
        parts.append(hi[0] + _same_length_range("0" * rest, hi[1:]))
    return _alt(parts)


def _natural_range(lo: int, hi: int | None) -> str:
    """Naturals in [lo, hi] (hi None: unbounded) without leading zeros: per length, a digit
    range, except that the lengths whose every number is in range share one part."""
    top = hi if hi is not None else 10 ** len(str(lo)) - 1
    parts, full = [], []
    for digits in range(len(str(lo)), len(str(top)) + 1):
        start, end = max(lo, 10 ** (digits - 1) if digits > 1 else 0), min(top, 10**digits - 1)
        if start == max(10 ** (digits - 1), 1) and end == 10**digits - 1:
            full.append(digits - 1)  # as many digits after the first
        else:
            parts.append(_same_length_range(str(start), str(end)))
    if hi is None:  # every longer number
        full.append(len(str(lo)))
    if full:  # consecutive lengths, so one part
        parts.append("[1-9]" + _run("[0-9]", full[0], None if hi is None else full[-1]))
    return _alt(parts)


def integer_range(lo: int | None, hi: int | None) -> str:
    """Canonical JSON integers in [lo, hi] (None: unbounded; lo <= hi); never `-0`."""
    parts = []
    if lo is None or lo < 0:  # negatives, as '-' and a magnitude
        parts.append("-" + _natural_range(1 if hi is None or hi >= 0 else -hi,
                                          None if lo is None else -lo))
    if hi is None or hi >= 0:
        parts.append(_natural_range(max(lo or 0, 0), hi))
    return _alt(parts)


# ---- fractions --------------------------------------------------------------------------
# A fraction is the digit string D after the point, worth 0.D; the empty D is a number
# written without a fraction (worth 0). Bounds on it are given as digit strings without
# trailing zeros ("" is 0). A leading run of zeros in a bound is one step, not one per zero,
# so the regex nests once per non-zero digit of a bound (a float has at most 17).
class _Digits(NamedTuple):
    """A set of fractions: a regex of its non-empty strings (None: none) and whether the
    empty string belongs."""

    regex: str | None
    empty: bool


def _optional(digits: _Digits) -> str | None:
    """The set as one regex, the empty string included where it belongs; None if empty."""
    if digits.regex is None:
        return "" if digits.empty else None
    if not digits.empty:
        return digits.regex
    return digits.regex[:-1] + "*" if digits.regex in ("0+", "[0-9]+") else f"(?:{digits.regex})?"


def _at_least(d: str, exclusive: bool) -> _Digits:
    """Fractions 0.D >= 0.d (> if exclusive)."""
    if not d:
        return _Digits("0*[1-9][0-9]*", False) if exclusive else _Digits("[0-9]+", True)
    zeros = len(d) - len(d.lstrip("0"))
    first = int(d[zeros])  # non-zero
    parts = [_run("0", 0, zeros - 1) + "[1-9][0-9]*"] if zeros else []  # larger within the zeros
    if first < 9:
        parts.append(_run("0", zeros, zeros) + _digit(first + 1, 9) + "[0-9]*")
    parts.append(_run("0", zeros, zeros) + d[zeros] + _optional(_at_least(d[zeros + 1:], exclusive)))
    return _Digits(_alt(parts), False)


def _at_most(d: str, exclusive: bool) -> _Digits:
    """Fractions 0.D <= 0.d (< if exclusive)."""
    if not d:
        return _Digits(None, False) if exclusive else _Digits("0+", True)
    zeros = len(d) - len(d.lstrip("0"))
    last = int(d[zeros])  # non-zero
    parts = [_run("0", 1, zeros)] if zeros else []  # zeros only, ending before `last`
    parts.append(_run("0", zeros, zeros) + _digit(0, last - 1) + "[0-9]*")
    rest = _optional(_at_most(d[zeros + 1:], exclusive))
    if rest is not None:
        parts.append(_run("0", zeros, zeros) + d[zeros] + rest)
    return _Digits(_alt(parts), True)


def _between(a: str, a_exclusive: bool, b: str, b_exclusive: bool) -> _Digits:
    """Fractions 0.a <= 0.D <= 0.b (each end excluded if so marked), where 0.a <= 0.b: a
    common prefix, then the first digit where a and b differ splits the set in three."""
    if a == b:
        if a_exclusive or b_exclusive:
            return _Digits(None, False)
        return _Digits(a + "0*" if a else "0+", not a)
    width = max(len(a), len(b))
    a_padded, b_padded = a.ljust(width, "0"), b.ljust(width, "0")
    k = next(i for i in range(width) if a_padded[i] != b_padded[i])
    zeros = k - len(a_padded[:k].lstrip("0"))
    prefix, low, high = _run("0", zeros, zeros) + a_padded[zeros:k], int(a_padded[k]), int(b_padded[k])
    parts = []
    empty = not a and not a_exclusive
    if not a_exclusive and len(a) <= k and (a or k):  # ending in the prefix: `a`, zeros
        parts.append(a + _run("0", 0, k - len(a)) if a else _run("0", 1, k))
    parts.append(prefix + str(low) + _optional(_at_least(a[k + 1:], a_exclusive)))
    if high - low > 1:
        parts.append(prefix + _digit(low + 1, high - 1) + "[0-9]*")
    rest = _optional(_at_most(b[k + 1:], b_exclusive))
    if rest is not None:
        parts.append(prefix + str(high) + rest)
    return _Digits(_alt(parts), empty)


# ---- decimals ---------------------------------------------------------------------------
def _split(value: Decimal) -> tuple[int, str]:
    """A non-negative value's integer part and its fraction digits without trailing zeros."""
    whole, _, fraction = format(value, "f").partition(".")
    return abs(int(whole)), fraction.rstrip("0")


def _with_fraction(whole: int, digits: _Digits) -> str | None:
    """The integer part `whole` followed by the fractions of `digits`; None if none."""
    if digits.regex is None:
        return str(whole) if digits.empty else None
    fraction = rf"\.{digits.regex}"
    return f"{whole}(?:{fraction})?" if digits.empty else f"{whole}{fraction}"


def _empty(lower: Bound | None, upper: Bound | None) -> bool:
    """Whether no value lies within the bounds."""
    return lower is not None and upper is not None and (
        lower.value > upper.value or lower.value == upper.value and (lower.exclusive or upper.exclusive))


def _magnitude_range(lower: Bound, upper: Bound | None) -> str | None:
    """Unsigned numbers `(0|[1-9][0-9]*)(\\.[0-9]+)?` within the bounds (lower.value >= 0);
    None if none is."""
    if _empty(lower, upper):
        return None
    low_whole, low_fraction = _split(lower.value)
    if upper is None:
        return _alt([_with_fraction(low_whole, _at_least(low_fraction, lower.exclusive)),
                     _natural_range(low_whole + 1, None) + _ANY_FRACTION])
    high_whole, high_fraction = _split(upper.value)
    if low_whole == high_whole:
        return _with_fraction(low_whole, _between(low_fraction, lower.exclusive, high_fraction, upper.exclusive))
    parts = [_with_fraction(low_whole, _at_least(low_fraction, lower.exclusive))]
    if high_whole - low_whole > 1:
        parts.append(_natural_range(low_whole + 1, high_whole - 1) + _ANY_FRACTION)
    parts.append(_with_fraction(high_whole, _at_most(high_fraction, upper.exclusive)))
    parts = [part for part in parts if part is not None]
    return _alt(parts) if parts else None


def decimal_range(lower: Bound | None, upper: Bound | None) -> str | None:
    """JSON numbers without exponent within the bounds (a None bound: unbounded), never a
    `-` before a zero value; None if no value is within them."""
    if _empty(lower, upper):
        return None
    parts = []
    if upper is None or upper.value > 0 or upper.value == 0 and not upper.exclusive:
        zero = Bound(Decimal(0), False)
        parts.append(_magnitude_range(lower if lower is not None and lower.value >= 0 else zero, upper))
    if lower is None or lower.value < 0:  # '-' and a magnitude > 0, the bounds mirrored
        smallest = (Bound(upper.value.copy_negate(), upper.exclusive) if upper is not None and upper.value < 0
                    else Bound(Decimal(0), True))
        largest = None if lower is None else Bound(lower.value.copy_negate(), lower.exclusive)
        magnitude = _magnitude_range(smallest, largest)
        parts.append(None if magnitude is None else "-" + magnitude)
    parts = [part for part in parts if part is not None]
    return _alt(parts) if parts else None
