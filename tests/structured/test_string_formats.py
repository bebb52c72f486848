"""Tests for `hybrid_engine.structured.string_formats`: every string a format's regex admits
is accepted by the strict consumers (Python's parsers, pydantic v2, email-validator when it
is installed) and obeys the RFC, checked on thousands of seeded random walks through the
engine's automaton of the regex; and the valid values in the documented shapes all match
(exhaustively on grids of near misses, where the rule is exact)."""
import datetime
import functools
import ipaddress
import itertools
import json
import random
import re
import uuid

import numpy as np
import pydantic
import pytest

from hybrid_engine.structured.automaton import DEAD, ByteAutomaton
from hybrid_engine.structured.regex import compile_regex
from hybrid_engine.structured.string_formats import FORMATS

_BYTES = np.arange(256, dtype=np.uint8).reshape(256, 1)
_ONES = np.ones(256, dtype=np.int64)


def successors(automaton: ByteAutomaton, state: int) -> np.ndarray:
    """The state after each of the 256 bytes."""
    return automaton.walk_tokens(state, _BYTES, _ONES)


def finish(automaton: ByteAutomaton, state: int) -> bytes:
    """The shortest bytes from live `state` to an accepting state (breadth first)."""
    paths, frontier = {state: b""}, [state]
    while frontier:
        reached = []
        for current in frontier:
            if automaton.is_accepting(current):
                return paths[current]
            for byte, nxt in enumerate(successors(automaton, current).tolist()):
                if nxt != DEAD and nxt not in paths:
                    paths[nxt] = paths[current] + bytes([byte])
                    reached.append(nxt)
        frontier = reached
    raise AssertionError(f"live state {state} cannot reach an accepting one")


def random_texts(automaton: ByteAutomaton, seed: int, count: int, stop: float = 0.25,
                 max_bytes: int = 400) -> list[str]:
    """`count` texts the automaton accepts, from seeded random walks: each step chooses
    uniformly among the distinct live successor states (so a rare branch, such as February
    29 of a leap year, is as likely as the common one beside it) and then a byte leading
    there; at an accepting state the walk stops with probability `stop`, and past
    `max_bytes` it takes the shortest way to accept. Every text must be valid UTF-8."""
    rng, texts, moves = random.Random(seed), [], {}  # moves: state -> [(successor, its bytes)]
    for _ in range(count):
        state, text = automaton.start, bytearray()
        while len(text) < max_bytes:
            if state not in moves:
                row = successors(automaton, state)
                moves[state] = [(s, np.flatnonzero(row == s).tolist()) for s in sorted(set(row.tolist()) - {DEAD})]
            if not moves[state] or (automaton.is_accepting(state) and rng.random() < stop):
                break
            state, byte_values = rng.choice(moves[state])
            text.append(rng.choice(byte_values))
        text += finish(automaton, state)
        assert automaton.is_accepting(automaton.walk(automaton.start, bytes(text))), bytes(text)
        texts.append(bytes(text).decode("utf-8"))
    return texts


def samples(name: str, count: int = 3000) -> list[str]:
    return random_texts(compile_regex(FORMATS[name]), seed=len(name), count=count)


def matches(name: str, text: str) -> bool:
    return re.fullmatch(FORMATS[name], text, re.ASCII) is not None


@functools.cache
def adapter(kind: object) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(kind)


def pydantic_accepts(kind: object, text: str) -> bool:
    """Whether pydantic validates `text`, as a JSON string, as a `kind`, lax and strict."""
    try:
        for strict in (False, True):
            adapter(kind).validate_json(json.dumps(text), strict=strict)
    except pydantic.ValidationError:
        return False
    return True


def python_accepts(parse: object, text: str) -> bool:
    try:
        parse(text)
    except ValueError:
        return False
    return True


# ---- date, time, date-time ---------------------------------------------------------------
def is_leap(year: int) -> bool:
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def valid_date(text: str) -> bool:
    """RFC 3339 full-date, a real Gregorian date of year 1-9999, accepted by Python and
    pydantic; the day checked against the month's length computed here."""
    match = re.fullmatch(r"(\d{4})-(\d{2})-(\d{2})", text)
    if match is None:
        return False
    year, month, day = map(int, match.groups())
    days = [31, 29 if is_leap(year) else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
    return (1 <= year and 1 <= month <= 12 and 1 <= day <= days[month - 1]
            and python_accepts(datetime.date.fromisoformat, text) and pydantic_accepts(datetime.date, text))


_TIME = r"(\d{2}):(\d{2}):(\d{2})(\.\d{1,6})?(Z|[+-](\d{2}):(\d{2}))"


def valid_time(text: str) -> bool:
    """RFC 3339 full-time (offset required) with the fields in range, accepted by Python
    and pydantic with its offset kept."""
    match = re.fullmatch(_TIME, text)
    if match is None:
        return False
    hour, minute, second = map(int, match.group(1, 2, 3))
    offset = [int(match.group(i) or 0) for i in (6, 7)]
    return (hour <= 23 and minute <= 59 and second <= 59 and offset[0] <= 23 and offset[1] <= 59
            and aware(datetime.time, text))


def aware(kind: type, text: str) -> bool:
    """Whether Python's `kind.fromisoformat` and pydantic's `kind` accept `text`, both
    keeping an offset."""
    if not (python_accepts(kind.fromisoformat, text) and pydantic_accepts(kind, text)):
        return False
    return kind.fromisoformat(text).tzinfo is not None and adapter(kind).validate_json(json.dumps(text)).tzinfo is not None


def valid_date_time(text: str) -> bool:
    return (len(text) > 11 and text[10] == "T" and valid_date(text[:10]) and valid_time(text[11:])
            and aware(datetime.datetime, text))


@pytest.mark.parametrize("name, valid", [("date", valid_date), ("time", valid_time), ("date-time", valid_date_time)])
def test_random_dates_and_times_are_valid(name: str, valid: object) -> None:
    texts = samples(name)
    for text in texts:
        assert valid(text), text
    # The walks reach the corners: leap days (a century's too), month ends, the largest
    # offsets and fractions, year 0001.
    joined = "\n".join(texts)
    if name != "time":
        assert re.search(r"\d\d00-02-29", joined) and re.search(r"-02-29", joined) and "0001-" in joined
        assert re.search(r"-(0[469]|11)-30", joined) and re.search(r"-(0[13578]|1[02])-31", joined)
    if name != "date":
        assert re.search(r"\.\d{6}[Z+-]", joined) and re.search(r"[+-]2[0-3]:5\d", joined) and "Z" in joined


def test_every_real_date_matches_and_nothing_else_on_a_grid() -> None:
    """Every day of years around the leap rule's corners matches; on a grid of years x
    months 00-19 x days 00-39 a string matches exactly when it is a real date."""
    years = [1, 2, 3, 4, 96, 99, 100, 104, 200, 300, 400, 1582, 1600, 1700, 1800, 1900, 1999, 2000, 2023,
             2024, 2100, 2400, 9996, 9999] + random.Random(1).sample(range(1, 10000), 40)
    for year in years:
        first = datetime.date(year, 1, 1).toordinal()
        for ordinal in range(first, first + 365 + is_leap(year)):
            day = datetime.date.fromordinal(ordinal)
            assert day.year == year and matches("date", day.isoformat()), day
    for year in years + [0]:
        for month, day in itertools.product(range(20), range(40)):
            text = f"{year:04d}-{month:02d}-{day:02d}"
            assert matches("date", text) == valid_date(text), text
    for text in ["2024-2-01", "24-02-01", "2024-02-1", "20240201", "2024/02/01", "+2024-02-01", "2024-02-01T",
                 "２024-02-01", "12024-01-01"]:
        assert not matches("date", text), text


def test_times_match_exactly_on_a_grid() -> None:
    """Times with fields just inside and outside their ranges, with and without fractions
    and each kind of offset: a string matches exactly when it is valid; lower-case `z`,
    missing offset or seconds, 7 fraction digits, comma fractions and compact forms never."""
    fields = ["00", "09", "19", "20", "23", "24", "29", "59", "60", "61", "99"]
    fractions = ["", ".0", ".5", ".123", ".999999"]
    offsets = ["Z", "+00:00", "-00:00", "+05:30", "-23:59", "+24:00", "-12:60", "+23:00"]
    count = 0
    for hour, minute, second in itertools.product(fields, repeat=3):
        for fraction, offset in itertools.product(fractions, offsets):
            text = f"{hour}:{minute}:{second}{fraction}{offset}"
            assert matches("time", text) == valid_time(text), text
            count += matches("time", text)
    assert count == 5 * 8 * 8 * 5 * 6  # valid hours x minutes x seconds x fractions x offsets
    assert matches("time", "23:59:59.999999-23:59")
    for text in ["12:00:00z", "12:00:00", "12:00Z", "12:00:00.1234567Z", "12:00:00,5Z", "120000Z",
                 "12:00:00+0100", "12:00:00+01", "12:00:00.Z", "1:00:00Z", "12:00:00 Z", "12:00:00+01:00:00",
                 "23:59:60Z", "T12:00:00Z"]:
        assert not matches("time", text), text


def test_date_times_match_exactly_on_samples() -> None:
    """Date-times from real datetimes in RFC 3339 form match; near misses (a separator
    other than `T`, a bad date or time part) match exactly when valid."""
    rng = random.Random(2)
    for _ in range(2000):
        moment = datetime.datetime(rng.randint(1, 9999), rng.randint(1, 12), rng.randint(1, 28),
                                   rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59),
                                   rng.choice([0, rng.randint(0, 999_999)]))
        offset = rng.choice(["Z", f"{rng.choice('+-')}{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"])
        text = moment.isoformat() + offset
        assert matches("date-time", text), text
        date, time = text[:10], text[11:]
        for near in [date + rng.choice(" t_") + time, text.replace("-", "/", 1), text[:-1],
                     f"{date[:8]}{rng.randint(28, 32):02d}T{time}", f"{date[:5]}02-29T{time}",
                     f"{date}T{rng.randint(20, 25):02d}{time[2:]}", f"{date}T{time[:6]}{rng.randint(55, 61):02d}{time[8:]}"]:
            assert matches("date-time", near) == valid_date_time(near), near


# ---- uuid, ipv4 --------------------------------------------------------------------------
def test_random_uuids_and_ipv4s_are_valid() -> None:
    for text in samples("uuid"):
        assert str(uuid.UUID(text)) == text.lower() and pydantic_accepts(uuid.UUID, text), text
    for text in samples("ipv4"):
        assert str(ipaddress.IPv4Address(text)) == text and pydantic_accepts(ipaddress.IPv4Address, text), text


def test_uuids_and_ipv4s_match_exactly() -> None:
    rng = random.Random(3)
    for _ in range(500):
        value = uuid.UUID(int=rng.getrandbits(128))
        assert matches("uuid", str(value)) and matches("uuid", str(value).upper())
        assert not matches("uuid", value.hex) and not matches("uuid", "{" + str(value) + "}")
        assert not matches("uuid", str(value)[:-1] + "g") and not matches("uuid", "urn:uuid:" + str(value))
    assert matches("uuid", str(uuid.UUID(int=0))) and matches("uuid", "FFFFFFFF-ffff-FFFF-ffff-FFFFFFFFFFFF")
    octets = [str(n) for n in range(300)] + ["00", "01", "010", "001", "0255", "-1", "", " 1", "1e2", "1_0"]
    for quad in itertools.product(octets, repeat=2):
        for text in [f"{quad[0]}.{quad[1]}.0.1", f"10.1.{quad[0]}.{quad[1]}"]:
            assert matches("ipv4", text) == python_accepts(ipaddress.IPv4Address, text), text
    for text in ["1.2.3", "1.2.3.4.5", "1.2.3.4.", ".1.2.3.4", "1..2.3", "１.2.3.4"]:
        assert not matches("ipv4", text), text


# ---- email -------------------------------------------------------------------------------
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
SPECIAL_USE = {"arpa", "invalid", "local", "localhost", "onion", "test"}


def email_rule(text: str) -> bool:
    """The module's documented email rule, written out directly."""
    local, at, domain = text.partition("@")
    atoms, labels = local.split("."), domain.split(".")
    if not at or not 1 <= len(atoms) <= 4 or not 2 <= len(labels) <= 5:
        return False
    if not all(re.fullmatch(f"{_ATEXT}+", atom) for atom in atoms) or len(local) > 64:
        return False
    if max(map(len, atoms)) > [64, 31, 20, 15][len(atoms) - 1]:
        return False
    longest = [63, 62, 41, 30][len(labels) - 2]
    return re.fullmatch("[A-Za-z]{2,63}", labels[-1]) is not None and all(
        re.fullmatch("[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?", label) and len(label) <= longest
        and label[2:4] != "--" for label in labels[:-1])


def within_rfc_limits(text: str) -> bool:
    """RFC 5321/1035 sizes: local part 64, domain 253, label 63, address 254."""
    local, _, domain = text.rpartition("@")
    return (len(local) <= 64 and len(domain) <= 253 and len(text) <= 254
            and max(map(len, domain.split("."))) <= 63)


def email_samples() -> list[str]:
    return random_texts(compile_regex(FORMATS["email"]), seed=5, count=3000, stop=0.1)


def test_random_emails_obey_the_rule_and_the_rfc_limits() -> None:
    texts = email_samples()
    for text in texts:
        assert email_rule(text) and within_rfc_limits(text), text
    assert max(map(len, texts)) > 80 and any(text.count(".") >= 6 for text in texts)


def test_random_emails_are_accepted_by_email_validator() -> None:
    """email-validator as pydantic calls it (`EmailStr`): every sample but those under a
    special-use top-level name, which the module documents as not excluded."""
    email_validator = pytest.importorskip("email_validator")  # (not installed: skipped)
    special = 0
    for text in email_samples():
        if text.rsplit(".", 1)[1].lower() in SPECIAL_USE:
            special += 1
            continue
        email_validator.validate_email(text, check_deliverability=False)
        assert pydantic_accepts(pydantic.EmailStr, text), text
    assert special < 10
    for text in ["a@b.test", "a@x.LOCAL", "a@b.onion"]:  # (the documented exception)
        assert matches("email", text)
        with pytest.raises(email_validator.EmailNotValidError):
            email_validator.validate_email(text, check_deliverability=False)


def test_emails_match_exactly_the_rule() -> None:
    """Valid shapes at the length limits match; near misses (bad dots, hyphens, lengths,
    characters, an IDNA-reserved `--`) match exactly when the rule holds."""
    assert matches("email", "a" * 64 + "@" + "b" * 63 + "." + "c" * 63)
    assert matches("email", "!#$%&'*+/=?^_`{|}~-@x-1.y.co")
    assert matches("email", "first.m.last+tag@mail.eng.example.org")
    for longest in ["f" * 64 + "@" + "d" * 62 + "." + "d" * 62 + "." + "t" * 63,
                    "e" * 15 + (".e" + "e" * 14) * 3 + "@" + ".".join(["d" * 30] * 4) + "." + "t" * 63]:
        assert matches("email", longest) and within_rfc_limits(longest)
    assert len(longest) == 251 and not matches("email", "f" * 64 + "@" + "d" * 63 + "." + "d" * 62 + ".co")
    rng = random.Random(4)
    # Mostly valid pieces, and lengths on both sides of each limit.
    atoms = ["a", "Zq", "9", "x_y", "+", "'", "{|}"] * 4 + ["", "é", " ", '"', "(", "@", "\\"]
    atoms += ["k" * n for n in (14, 15, 16, 20, 21, 31, 32, 63, 64, 65)]
    labels = ["a", "b1", "x-y", "9", "a--b"] * 4 + ["-a", "a-", "ab--c", "xn--p1ai", "", "_", "é", "b."]
    labels += ["h" * n for n in (29, 30, 31, 40, 41, 42, 61, 62, 63, 64)]
    tlds = ["co", "ORG", "museum"] * 3 + ["c", "c1", "x-y", "t" * 63, "t" * 64, "", "é"]
    count = 0
    for _ in range(20_000):
        local = ".".join(rng.choice(atoms) for _ in range(rng.choice([1, 1, 2, 3, 4, 5])))
        domain = ".".join([rng.choice(labels) for _ in range(rng.choice([0, 1, 1, 2, 3, 4, 5]))] + [rng.choice(tlds)])
        text = f"{local}@{domain}"
        if rng.random() < 0.2:
            i = rng.randrange(len(text) + 1)
            text = text[:i] + rng.choice(".-@a") + text[i + rng.randint(0, 1):]
        assert matches("email", text) == email_rule(text), text
        count += email_rule(text)
    assert 1_500 < count < 18_500  # both verdicts common
    for text in ["a@b", "a@b.c", "a@b.c1", "a@-b.co", "a@b-.co", "a@ab--c.co", "a@xn--p1ai.co", ".a@b.co",
                 "a.@b.co", "a..b@b.co", "a@b..co", "\"a\"@b.co", "a@[1.2.3.4]", "a@b.co.", "a" * 65 + "@b.co",
                 "a@" + "b" * 64 + ".co", "a@b." + "c" * 64, "é@b.co", "a@é.co"]:
        assert not matches("email", text), text


def test_formats_compile_small() -> None:
    """The engine compiles each format into a small automaton."""
    for name, regex in FORMATS.items():
        automaton = compile_regex(regex)
        assert automaton.can_continue(automaton.start), name
        assert len(regex) < 1_500, name
