r"""The JSON numbers a model may write, for `structured.json_schema` and `structured.json_any`.

The digit caps, one rule for every grammar (this module owns it; both import the caps):
every number a grammar accepts has at most `MAX_INTEGER_DIGITS` (20) digits before the
point, at most `MAX_FRACTION_DIGITS` (20) after it and at most `MAX_EXPONENT_DIGITS` (2) in
its exponent (`e-99`..`e+99`). So its magnitude is below 10^20 * 10^99 = 1e119, far from
the largest double (1.8e308): parsed as a float it is always finite (`1e400` would be `inf`
in json.loads and jiter alike, which `json.dumps` writes as `Infinity`, not JSON, and
pydantic's `FiniteFloat` / `allow_inf_nan=False` refuse), an integer is far below Python's
4,300-digit parsing limit, and a model under greedy decoding cannot write digits until
`max_tokens`. (A number that is not zero is at least 1e-119: it never underflows to 0.)

`ANY_INTEGER`: the integers `-?(0|[1-9][0-9]{0,19})` but `-0`, so |n| < 10^20.
`ANY_NUMBER`: the JSON numbers within the caps, `-?(0|[1-9][0-9]{0,19})`, then
  `(\.[0-9]{1,20})?`, then `([eE][+-]?[0-9]{1,2})?` (`-0` and `-0.0` too, as JSON has them).
`integer_range(lo, hi)`: the integers of `ANY_INTEGER` in [lo, hi] (either end may be None:
  unbounded); never `-0`. A range is clipped to the cap: `minimum: 0` is 0..10^20 - 1, and a
  bound beyond the cap (a maximum of 1e30) stands for the cap. None if no integer is left.
`decimal_range(lower, upper)`: the numbers written without an exponent,
  `-?(0|[1-9][0-9]*)(\.[0-9]+)?` within the digit caps, whose value lies within the bounds;
  each bound is a `Bound` (an exact `Decimal` and whether it is exclusive) or None. Trailing
  zeros may be written (`0.50` is 0.5) up to the fraction cap, but a zero value never takes
  a `-` (`-0`, `-0.0` are refused, as `-0` is for integers). Bounds stay exact, even one
  with more fraction digits than the cap: a minimum of 0.1234567890123456789012 admits
  0.12345678901234567891, never 0.1234567890123456789 (the writable values closest to it
  are what is lost). The integer cap clips a range as for integers (|value| < 10^20). None
  if no value is left, e.g. for bounds 1e-30..2e-30, which no 20-digit fraction reaches.

All use only the dialect shared by Python's `re` and `structured.regex`. Bounds are clipped
and truncated to the caps first, so a regex's text is linear in the caps whatever the
bounds; its expanded NFA is at most quadratic in `MAX_FRACTION_DIGITS` (up to 20 free digits
after each deciding digit): 1.1k states for `exclusiveMinimum: 0`, about 2.5k for the
largest float bounds seen. Construction: a sign, then a magnitude range (negatives are `-`
and the mirrored range of positive magnitudes). Within a magnitude range [a, b], the integer
part lies strictly between floor(a) and floor(b) with any fraction, or equals one of them
with a fraction compared digit by digit with the bound's fraction; integer parts use the
classic digit-range split (a ragged low end, whole blocks, a ragged high end).
"""
from __future__ import annotations

import re
from decimal import Decimal
from typing import NamedTuple

# 20 digits hold every 64-bit integer (2^64 = 18446744073709551616 has 20); beyond 2^64 few
# consumers keep an integer exact (int64/uint64 columns, doubles, JavaScript), so a longer
# one is hardly meant. It also keeps |value| * 10^99 far below the largest double.
MAX_INTEGER_DIGITS = 20
# A double holds at most 17 significant digits, so 20 fraction digits lose nothing a float
# keeps down to 1e-3 (smaller values take the exponent where one is allowed).
MAX_FRACTION_DIGITS = 20
# e-99..e+99: with the caps above, |value| < 1e119, so no number parses to inf.
MAX_EXPONENT_DIGITS = 2


class Bound(NamedTuple):
    """One end of a range: an exact decimal value, excluded from the range or not."""

    value: Decimal
    exclusive: bool


def _alt(alternatives: list[str]) -> str:
    """Alternatives as one regex that is safe to concatenate."""
    return alternatives[0] if len(alternatives) == 1 else f"(?:{'|'.join(alternatives)})"


def _run(atom: str, lo: int, hi: int) -> str:
    """`atom` (a character or a class) repeated lo..hi times."""
    if lo == hi:
        return atom * lo if lo <= 1 or len(atom) * lo <= 3 else f"{atom}{{{lo}}}"
    return atom + ("?" if (lo, hi) == (0, 1) else f"{{{lo},{hi}}}")


def _digit(lo: int, hi: int) -> str:
    """One digit in lo..hi."""
    return str(lo) if lo == hi else f"[{lo}-{hi}]"


# The caps are read when a regex is made (not frozen at import), so a test may lower them.
def _whole() -> str:
    return "-?(?:0|[1-9]" + _run("[0-9]", 0, MAX_INTEGER_DIGITS - 1) + ")"


def _any_integer() -> str:
    return "(?:0|-?[1-9]" + _run("[0-9]", 0, MAX_INTEGER_DIGITS - 1) + ")"  # never -0


def _any_fraction() -> str:
    return r"(?:\." + _run("[0-9]", 1, MAX_FRACTION_DIGITS) + ")?"


def _any_number() -> str:
    return _whole() + _any_fraction() + "(?:[eE][+-]?" + _run("[0-9]", 1, MAX_EXPONENT_DIGITS) + ")?"


ANY_INTEGER = _any_integer()  # (?:0|-?[1-9][0-9]{0,19})
ANY_NUMBER = _any_number()  # -?(?:0|[1-9][0-9]{0,19})(?:\.[0-9]{1,20})?(?:[eE][+-]?[0-9]{1,2})?


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


def _natural_range(lo: int, hi: int) -> str:
    """Naturals in [lo, hi] (lo <= hi) without leading zeros: per length, a digit range,
    except that the lengths whose every number is in range share one part."""
    parts, full = [], []
    for digits in range(len(str(lo)), len(str(hi)) + 1):
        start, end = max(lo, 10 ** (digits - 1) if digits > 1 else 0), min(hi, 10**digits - 1)
        if start == max(10 ** (digits - 1), 1) and end == 10**digits - 1:
            full.append(digits - 1)  # as many digits after the first
        else:
            parts.append(_same_length_range(str(start), str(end)))
    if full:  # consecutive lengths, so one part
        parts.append("[1-9]" + _run("[0-9]", full[0], full[-1]))
    return _alt(parts)


def integer_range(lo: int | None, hi: int | None) -> str | None:
    """Canonical JSON integers in [lo, hi] (None: unbounded) within the digit cap; never
    `-0`; None if none is."""
    if lo is None and hi is None:
        return _any_integer()
    top = 10**MAX_INTEGER_DIGITS - 1
    lo, hi = -top if lo is None else max(lo, -top), top if hi is None else min(hi, top)
    if lo > hi:
        return None
    parts = []
    if lo < 0:  # negatives, as '-' and a magnitude
        parts.append("-" + _natural_range(max(-hi, 1), -lo))
    if hi >= 0:
        parts.append(_natural_range(max(lo, 0), hi))
    return _alt(parts)


# ---- fractions --------------------------------------------------------------------------
# A fraction is the digit string D after the point, worth 0.D; the empty D is a number
# written without a fraction (worth 0). A set of them holds only strings of at most `room`
# digits (MAX_FRACTION_DIGITS less the digits already written). Bounds on it are given as
# digit strings without trailing zeros ("" is 0), no longer than `room`. A leading run of
# zeros in a bound is one step, not one per zero, so the regex nests once per non-zero digit
# of a bound.
class _Digits(NamedTuple):
    """A set of fractions: a regex of its non-empty strings (None: none) and whether the
    empty string belongs."""

    regex: str | None
    empty: bool


_DIGIT_RUN = re.compile(r"(0|\[0-9\])(?:\{1,(\d+)\})?")  # what `_run(atom, 1, n)` writes


def _optional(digits: _Digits) -> str | None:
    """The set as one regex, the empty string included where it belongs; None if empty."""
    if digits.regex is None:
        return "" if digits.empty else None
    if not digits.empty:
        return digits.regex
    run = _DIGIT_RUN.fullmatch(digits.regex)
    return _run(run.group(1), 0, int(run.group(2) or 1)) if run else f"(?:{digits.regex})?"


def _non_zero_within(count: int, room: int) -> list[str]:
    """Alternatives for the fractions of at most `room` digits whose first non-zero digit
    is among their first `count` (count <= room)."""
    return [_run("0", k, k) + "[1-9]" + _run("[0-9]", 0, room - k - 1) for k in range(count)]


def _at_least(d: str, exclusive: bool, room: int) -> _Digits:
    """Fractions 0.D >= 0.d (> if exclusive)."""
    if not d:
        if exclusive:
            return _Digits(_alt(_non_zero_within(room, room)) if room else None, False)
        return _Digits(_run("[0-9]", 1, room) if room else None, True)
    zeros = len(d) - len(d.lstrip("0"))
    first, lead, left = int(d[zeros]), _run("0", zeros, zeros), room - zeros - 1
    parts = _non_zero_within(zeros, room)  # larger within the zeros
    if first < 9:
        parts.append(lead + _digit(first + 1, 9) + _run("[0-9]", 0, left))
    rest = _optional(_at_least(d[zeros + 1:], exclusive, left))
    if rest is not None:
        parts.append(lead + d[zeros] + rest)
    return _Digits(_alt(parts) if parts else None, False)


def _at_most(d: str, exclusive: bool, room: int) -> _Digits:
    """Fractions 0.D <= 0.d (< if exclusive)."""
    if not d:
        if exclusive:
            return _Digits(None, False)
        return _Digits(_run("0", 1, room) if room else None, True)
    zeros = len(d) - len(d.lstrip("0"))
    last, lead, left = int(d[zeros]), _run("0", zeros, zeros), room - zeros - 1
    parts = [_run("0", 1, zeros)] if zeros else []  # zeros only, ending before `last`
    parts.append(lead + _digit(0, last - 1) + _run("[0-9]", 0, left))
    rest = _optional(_at_most(d[zeros + 1:], exclusive, left))
    if rest is not None:
        parts.append(lead + d[zeros] + rest)
    return _Digits(_alt(parts), True)


def _between(a: str, a_exclusive: bool, b: str, b_exclusive: bool, room: int) -> _Digits:
    """Fractions 0.a <= 0.D <= 0.b (each end excluded if so marked), where 0.a <= 0.b: a
    common prefix, then the first digit where a and b differ splits the set in three."""
    if a == b:
        if a_exclusive or b_exclusive:
            return _Digits(None, False)
        if a:
            return _Digits(a + _run("0", 0, room - len(a)), False)
        return _Digits(_run("0", 1, room) if room else None, True)
    width = max(len(a), len(b))
    a_padded, b_padded = a.ljust(width, "0"), b.ljust(width, "0")
    k = next(i for i in range(width) if a_padded[i] != b_padded[i])
    zeros = k - len(a_padded[:k].lstrip("0"))
    prefix, low, high = _run("0", zeros, zeros) + a_padded[zeros:k], int(a_padded[k]), int(b_padded[k])
    left = room - k - 1
    parts = []
    empty = not a and not a_exclusive
    if not a_exclusive and len(a) <= k and (a or k):  # ending in the prefix: `a`, zeros
        parts.append(a + _run("0", 0, k - len(a)) if a else _run("0", 1, k))
    rest = _optional(_at_least(a[k + 1:], a_exclusive, left))
    if rest is not None:
        parts.append(prefix + str(low) + rest)
    if high - low > 1:
        parts.append(prefix + _digit(low + 1, high - 1) + _run("[0-9]", 0, left))
    rest = _optional(_at_most(b[k + 1:], b_exclusive, left))
    if rest is not None:
        parts.append(prefix + str(high) + rest)
    return _Digits(_alt(parts) if parts else None, empty)


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


def _empty(lower: Bound, upper: Bound) -> bool:
    """Whether no value lies within the bounds."""
    return lower.value > upper.value or lower.value == upper.value and (lower.exclusive or upper.exclusive)


def _magnitude_range(lower: Bound, upper: Bound) -> str | None:
    """Unsigned numbers `(0|[1-9][0-9]*)(\\.[0-9]+)?` within the digit caps and the bounds
    (0 <= lower.value, upper.value <= 10^MAX_INTEGER_DIGITS); None if none is."""
    cap = MAX_FRACTION_DIGITS
    (low_whole, low_fraction), low_exclusive = _split(lower.value), lower.exclusive
    (high_whole, high_fraction), high_exclusive = _split(upper.value), upper.exclusive
    # No writable value equals a bound with more fraction digits than the cap: one above the
    # bound is one above its truncation, one below it is one at most its truncation.
    if len(low_fraction) > cap:
        low_fraction, low_exclusive = low_fraction[:cap].rstrip("0"), True
    if len(high_fraction) > cap:
        high_fraction, high_exclusive = high_fraction[:cap].rstrip("0"), False
    low, high = (low_whole, low_fraction.ljust(cap, "0")), (high_whole, high_fraction.ljust(cap, "0"))
    if low > high or low == high and (low_exclusive or high_exclusive):
        return None
    if low_whole == high_whole:
        return _with_fraction(low_whole, _between(low_fraction, low_exclusive, high_fraction, high_exclusive, cap))
    parts = [_with_fraction(low_whole, _at_least(low_fraction, low_exclusive, cap))]
    if high_whole - low_whole > 1:
        parts.append(_natural_range(low_whole + 1, high_whole - 1) + _any_fraction())
    parts.append(_with_fraction(high_whole, _at_most(high_fraction, high_exclusive, cap)))
    parts = [part for part in parts if part is not None]
    return _alt(parts) if parts else None


def decimal_range(lower: Bound | None, upper: Bound | None) -> str | None:
    """JSON numbers without exponent within the digit caps and the bounds (a None bound:
    unbounded), never a `-` before a zero value; None if no value is left."""
    cap = Decimal(10**MAX_INTEGER_DIGITS)
    if lower is None or lower.value <= cap.copy_negate():  # the tighter of the bound and the cap
        lower = Bound(cap.copy_negate(), True)
    if upper is None or upper.value >= cap:
        upper = Bound(cap, True)
    if _empty(lower, upper):
        return None
    parts = []
    if upper.value > 0 or upper.value == 0 and not upper.exclusive:
        parts.append(_magnitude_range(lower if lower.value >= 0 else Bound(Decimal(0), False), upper))
    if lower.value < 0:  # '-' and a magnitude > 0, the bounds mirrored
        smallest = Bound(upper.value.copy_negate(), upper.exclusive) if upper.value < 0 else Bound(Decimal(0), True)
        magnitude = _magnitude_range(smallest, Bound(lower.value.copy_negate(), lower.exclusive))
        parts.append(None if magnitude is None else "-" + magnitude)
    parts = [part for part in parts if part is not None]
    return _alt(parts) if parts else None
