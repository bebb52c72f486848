"""Tests for `hybrid_engine.structured.number_range`: the digit caps that every grammar's
numbers obey. With the caps lowered, every text of a small universe (past each cap too) is
tried against an exact decimal oracle, in Python's `re` and in the engine's automaton; at
the real caps, texts at and just past each cap, and random walks that favour digits (as
greedy decoding may) checked with json.loads, jiter and pydantic. `check_number` and
`greedy_walks` serve the grammar tests too."""
import itertools
import json
import math
import random
import re
import sys
from decimal import Decimal

import numpy as np
import pydantic
import pydantic_core
import pytest

from hybrid_engine.structured import number_range
from hybrid_engine.structured.automaton import DEAD, ByteAutomaton
from hybrid_engine.structured.number_range import (
    ANY_INTEGER,
    ANY_NUMBER,
    MAX_EXPONENT_DIGITS,
    MAX_FRACTION_DIGITS,
    MAX_INTEGER_DIGITS,
    Bound,
    decimal_range,
    integer_range,
)
from hybrid_engine.structured.regex import compile_regex
from tests.structured.test_string_formats import finish, successors

JSON_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(?:\.([0-9]+))?(?:[eE][+-]?([0-9]+))?")
FINITE_FLOAT = pydantic.TypeAdapter(pydantic.FiniteFloat)
INTEGER_LIMIT = 10**MAX_INTEGER_DIGITS  # every magnitude written is below it


def parts(text: str) -> tuple[str, str, str]:
    """A JSON number's integer, fraction and exponent digits ("" where absent)."""
    match = JSON_NUMBER.fullmatch(text)
    assert match is not None, text
    return match.group(1), match.group(2) or "", match.group(3) or ""


def check_number(text: str) -> None:
    """`text` is a JSON number within the caps that every consumer reads as what it says: a
    finite float (json.loads, jiter, pydantic's FiniteFloat; json.dumps writes it back as
    JSON), not 0 unless it is 0, and an integer text an exact int below 10^MAX_INTEGER_DIGITS."""
    whole, fraction, exponent = parts(text)
    assert len(whole) <= MAX_INTEGER_DIGITS and len(fraction) <= MAX_FRACTION_DIGITS, text
    assert len(exponent) <= MAX_EXPONENT_DIGITS, text
    exact, value, strict = Decimal(text), json.loads(text), pydantic_core.from_json(text, allow_inf_nan=False)
    if fraction or exponent:
        assert math.isfinite(value) and math.isfinite(strict) and value == strict, text
    else:
        assert type(value) is int and value == strict == exact and abs(value) < INTEGER_LIMIT, text
    assert math.isfinite(FINITE_FLOAT.validate_json(text)), text
    assert (float(value) == 0) == (exact == 0), text
    json.dumps(value, allow_nan=False)


def _reject(constant: str) -> float:
    raise ValueError(f"{constant} is not JSON")


def numbers_in(text: str | bytes) -> list[str]:
    """The number texts of a JSON text, as written."""
    found: list[str] = []
    json.loads(text, parse_int=lambda s: found.append(s) or 0, parse_float=lambda s: found.append(s) or 0.0,
               parse_constant=_reject)
    return found


_DIGIT_BYTES = frozenset(b"0123456789")


def greedy_walks(automaton: ByteAutomaton, seed: int, count: int, max_bytes: int = 150) -> list[str]:
    """`count` texts the automaton accepts, from seeded random walks that favour digits, as
    a model under greedy decoding may: each walk takes a digit, where one is live, with its
    own probability (0.3 to 1), else one of the distinct live successor states uniformly;
    at an accepting state it stops with probability 0.03, and past `max_bytes` it takes the
    shortest way to accept."""
    rng, texts, moves = random.Random(seed), [], {}  # moves: state -> ([(successor, bytes)], digits)
    for _ in range(count):
        greed = rng.choice([0.3, 0.8, 0.95, 1.0])
        state, text = automaton.start, bytearray()
        while len(text) < max_bytes:
            if state not in moves:
                row = successors(automaton, state)
                options = [(s, np.flatnonzero(row == s).tolist()) for s in sorted(set(row.tolist()) - {DEAD})]
                digits = [(s, [b for b in bs if b in _DIGIT_BYTES]) for s, bs in options]
                moves[state] = options, [(s, bs) for s, bs in digits if bs]
            options, digits = moves[state]
            if not options or (automaton.is_accepting(state) and rng.random() < 0.03):
                break
            state, byte_values = rng.choice(digits if digits and rng.random() < greed else options)
            text.append(rng.choice(byte_values))
        text += finish(automaton, state)
        assert automaton.is_accepting(automaton.walk(automaton.start, bytes(text))), bytes(text)
        texts.append(bytes(text).decode("utf-8"))
    return texts


def accepts(automaton: ByteAutomaton, text: str) -> bool:
    return automaton.is_accepting(automaton.walk(automaton.start, text.encode()))


# ---- the rule ----------------------------------------------------------------------------
def test_the_caps_keep_every_number_finite_and_every_64_bit_integer() -> None:
    largest = f"{'9' * MAX_INTEGER_DIGITS}.{'9' * MAX_FRACTION_DIGITS}e+{'9' * MAX_EXPONENT_DIGITS}"
    smallest = f"0.{'0' * (MAX_FRACTION_DIGITS - 1)}1e-{'9' * MAX_EXPONENT_DIGITS}"
    check_number(largest)
    check_number("-" + largest)
    check_number(smallest)
    assert Decimal(largest) < Decimal(sys.float_info.max) and Decimal(smallest) > Decimal(sys.float_info.min)
    assert len(str(2**64)) <= MAX_INTEGER_DIGITS  # every int64 and uint64 fits


AT_THE_CAPS = [  # (text, is it within the caps)
    ("9" * MAX_INTEGER_DIGITS, True), ("-" + "9" * MAX_INTEGER_DIGITS, True), ("1" + "0" * (MAX_INTEGER_DIGITS - 1), True),
    ("1" + "0" * MAX_INTEGER_DIGITS, False), ("-" + "9" * (MAX_INTEGER_DIGITS + 1), False), ("1" * 4301, False),
    ("0." + "9" * MAX_FRACTION_DIGITS, True), ("-0." + "0" * MAX_FRACTION_DIGITS, True),
    ("0." + "0" * (MAX_FRACTION_DIGITS + 1), False), ("1." + "5" * (MAX_FRACTION_DIGITS + 1), False),
    ("1e99", True), ("1E-99", True), ("1e+09", True), ("-9.5e-0", True), ("0e00", True),
    ("1e100", False), ("1e099", False), ("1e400", False), ("9e99999999", False), ("1e-400", False),
    ("9" * MAX_INTEGER_DIGITS + "e99", True), ("9" * (MAX_INTEGER_DIGITS + 1) + "e9", False),
    ("0", True), ("-0", True), ("-0.0", True), ("01", False), ("1.", False), (".5", False), ("+1", False),
]


def test_any_number_and_any_integer_at_and_past_the_caps() -> None:
    number, integer = compile_regex(ANY_NUMBER), compile_regex(ANY_INTEGER)
    for text, within in AT_THE_CAPS:
        assert (re.fullmatch(ANY_NUMBER, text) is not None) == accepts(number, text) == within, text
        plain = "e" not in text.lower() and "." not in text and text != "-0"  # (an integer is never -0)
        assert (re.fullmatch(ANY_INTEGER, text) is not None) == accepts(integer, text) == (within and plain), text
        if within:
            check_number(text)
    assert json.loads("1e400") == math.inf and json.loads("9e99999999") == math.inf  # what the caps prevent


@pytest.mark.parametrize("regex", [ANY_NUMBER, ANY_INTEGER], ids=["number", "integer"])
def test_greedy_walks_write_only_numbers_within_the_caps(regex: str) -> None:
    """Random walks that favour digits reach every cap, and every text is a number that
    the consumers read as finite (exact for integers)."""
    reached = set()
    for text in greedy_walks(compile_regex(regex), seed=len(regex), count=1500):
        check_number(text)
        whole, fraction, exponent = parts(text)
        reached |= {("whole", len(whole)), ("fraction", len(fraction)), ("exponent", len(exponent))}
    assert ("whole", MAX_INTEGER_DIGITS) in reached
    if regex == ANY_NUMBER:
        assert {("fraction", MAX_FRACTION_DIGITS), ("exponent", MAX_EXPONENT_DIGITS)} <= reached


# ---- exhaustive, with the caps lowered ---------------------------------------------------
SCALE = 10**4  # universe values and bounds have at most 4 fraction digits


@pytest.fixture
def small_caps(monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """Caps of 1 integer digit and 2 fraction digits, so a small universe passes them."""
    monkeypatch.setattr(number_range, "MAX_INTEGER_DIGITS", 1)
    monkeypatch.setattr(number_range, "MAX_FRACTION_DIGITS", 2)
    return 1, 2


def decimal_universe(caps: tuple[int, int]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Every text of a sign, an integer part (some past the cap, some with a leading zero)
    and a fraction of up to one digit past the cap; with each its value times SCALE and
    whether it is in the bounded form within the caps (a zero value without a `-`)."""
    integer_cap, fraction_cap = caps
    fractions = [None] + ["".join(p) for n in range(1, fraction_cap + 2) for p in itertools.product("0123456789", repeat=n)]
    texts, values, valid = [], [], []
    for sign, whole, fraction in itertools.product(["", "-"], ["0", "1", "2", "5", "9", "10", "12", "99", "00", "01"],
                                                   fractions):
        text = sign + whole + ("" if fraction is None else "." + fraction)
        magnitude = int(whole) * SCALE + int((fraction or "").ljust(4, "0"))
        texts.append(text)
        values.append(-magnitude if sign else magnitude)
        valid.append(len(whole) <= integer_cap and (whole == "0" or whole[0] != "0")
                     and len(fraction or "") <= fraction_cap and not (sign and magnitude == 0))
    return texts, np.array(values, dtype=np.int64), np.array(valid)


def random_bound(rng: random.Random) -> Decimal:
    """A bound of up to 4 fraction digits (past the lowered fraction cap), at times past
    the lowered integer cap."""
    whole = rng.choice([0, 0, 1, 2, 5, 9, 9, 10, 12, 150])
    fraction = "".join(rng.choice("0123456789") for _ in range(rng.choice([0, 1, 2, 3, 4, 4])))
    if rng.random() < 0.3:
        fraction = rng.choice(["99", "999", "9999", "995", "01", "001", "0001", "5"])
    value = Decimal(f"{whole}.{fraction or '0'}")
    return -value if rng.random() < 0.4 else value


def test_decimal_range_is_exact_within_lowered_caps(small_caps: tuple[int, int]) -> None:
    """Every text of the universe matches exactly when the oracle says so: in the bounded
    form within the caps, its exact value within the bounds; bounds past a cap included."""
    texts, values, valid = decimal_universe(small_caps)
    blob, index = "\n".join(texts), np.array(texts)
    by_length = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    table = np.zeros((len(texts), max(map(len, texts))), dtype=np.uint8)
    for row, i in enumerate(by_length):
        table[row, : len(texts[i])] = list(texts[i].encode())
    lengths = np.array([len(texts[i]) for i in by_length])
    rng, empty, matched = random.Random(2024), 0, 0
    for trial in range(300):
        lower = None if rng.random() < 0.2 else Bound(random_bound(rng), rng.random() < 0.5)
        upper = None if rng.random() < 0.2 else Bound(random_bound(rng), rng.random() < 0.5)
        if lower is not None and upper is not None and rng.random() < 0.1:
            upper = Bound(lower.value, rng.random() < 0.5)
        expected = valid.copy()
        if lower is not None:
            low = int(lower.value * SCALE)
            expected &= values > low if lower.exclusive else values >= low
        if upper is not None:
            high = int(upper.value * SCALE)
            expected &= values < high if upper.exclusive else values <= high
        regex = decimal_range(lower, upper)
        if not expected.any():
            empty += 1
            assert regex is None, (lower, upper, regex)
            continue
        assert regex is not None, (lower, upper)
        assert set(re.findall(f"(?m)^(?:{regex})$", blob)) == set(index[expected]), (lower, upper, regex)
        matched += int(expected.sum())
        if trial % 10 == 0:  # the engine's own compiler agrees
            automaton = compile_regex(regex)
            ends = automaton.walk_tokens(automaton.start, table, lengths)
            accepted = np.zeros(len(texts), dtype=bool)
            accepted[by_length] = [automaton.is_accepting(int(e)) for e in ends]
            assert np.array_equal(accepted, expected), (lower, upper, regex)
    assert empty > 10 and matched > 100_000, (empty, matched)


def test_integer_range_is_exact_within_a_lowered_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(number_range, "MAX_INTEGER_DIGITS", 2)
    texts = [str(n) for n in range(-250, 251)] + ["-0", "00", "01", "-01", "007", "+1", "1.0", "1e1"]
    blob = "\n".join(texts)
    rng = random.Random(5)
    for _ in range(400):
        lo = None if rng.random() < 0.25 else rng.randint(-200, 200)
        hi = None if rng.random() < 0.25 else rng.randint(-200, 200)
        expected = {str(n) for n in range(-99, 100) if (lo is None or n >= lo) and (hi is None or n <= hi)}
        regex = integer_range(lo, hi)
        assert (regex is None) == (not expected), (lo, hi, regex)
        if regex is not None:
            assert set(re.findall(f"(?m)^(?:{regex})$", blob)) == expected, (lo, hi, regex)


# ---- at the real caps ----------------------------------------------------------------------
def test_integer_ranges_are_clipped_to_the_cap() -> None:
    top = INTEGER_LIMIT - 1
    for lo, hi, inside, outside in [
        (0, None, [0, top], [-1, top + 1]), (None, -5, [-5, -top], [-4, -top - 1]),
        (-(10**30), 10**30, [top, -top], [top + 1, -top - 1]), (top, None, [top], [top - 1, top + 1]),
        (None, None, [0, top, -top], [top + 1, -top - 1]),
    ]:
        regex = re.compile(integer_range(lo, hi))
        assert all(regex.fullmatch(str(n)) for n in inside), (lo, hi)
        assert not any(regex.fullmatch(str(n)) for n in outside), (lo, hi)
    assert integer_range(top + 1, None) is None and integer_range(None, -(10**25)) is None
    assert integer_range(5, 4) is None


def test_a_bound_with_more_fraction_digits_than_the_cap_is_never_crossed() -> None:
    bound = "0.1234567890123456789012345"  # 25 digits: no text within the caps equals it
    truncated = bound[: 2 + MAX_FRACTION_DIGITS]
    above = f"{Decimal(truncated) + Decimal(10) ** -MAX_FRACTION_DIGITS:f}"
    for exclusive in (False, True):
        at_least = re.compile(decimal_range(Bound(Decimal(bound), exclusive), None))
        at_most = re.compile(decimal_range(None, Bound(Decimal(bound), exclusive)))
        assert at_least.fullmatch(above) and not at_least.fullmatch(truncated) and not at_least.fullmatch(bound)
        assert at_most.fullmatch(truncated) and not at_most.fullmatch(above) and not at_most.fullmatch(bound)
        assert at_least.fullmatch("1") and not at_least.fullmatch("0.12") and at_most.fullmatch("0.12")
    # Within one writable step of each other: nothing within the caps lies between.
    assert decimal_range(Bound(Decimal(bound), False), Bound(Decimal(bound) + Decimal("1e-23"), False)) is None
    assert decimal_range(Bound(Decimal("1e-30"), False), Bound(Decimal("2e-30"), False)) is None
    assert re.fullmatch(decimal_range(Bound(Decimal("-1e-30"), False), Bound(Decimal("2e-30"), False)), "0.000")
    assert decimal_range(Bound(Decimal(INTEGER_LIMIT), False), None) is None


@pytest.mark.parametrize("lower, upper", [
    (None, None), ("0", None), (None, "0"), ("-273.15", None), ("0.1234567890123456789012345", None),
    (None, "-0.0000000000000000000001"), ("-1e30", "1e30"), ("12345678901234567890.5", None),
    ("0.5", "0.50000000000000000001"), ("-7", "7"),
])
def test_greedy_walks_of_decimal_ranges_stay_within_caps_and_bounds(lower: str | None, upper: str | None) -> None:
    """The numbers of a bounded range that random walks write, digits favoured: within the
    caps, readable as finite floats, and exactly within the bounds."""
    low = None if lower is None else Bound(Decimal(lower), False)
    high = None if upper is None else Bound(Decimal(upper), False)
    longest = 0
    for text in greedy_walks(compile_regex(decimal_range(low, high)), seed=7, count=400):
        check_number(text)
        assert (low is None or Decimal(text) >= low.value) and (high is None or Decimal(text) <= high.value), text
        longest = max(longest, len(parts(text)[1]))
    assert longest == MAX_FRACTION_DIGITS
