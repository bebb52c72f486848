r"""The JSON-schema string `format`s that `structured.json_schema` supports, as regexes.

`FORMATS[name]` matches (in full, between the quotes) exactly the strings stated below, in
the dialect of `structured.regex` shared with Python's `re`. The rules are the narrower of
two meanings: what JSON Schema's RFC allows, and what strict consumers accept: pydantic v2
(`date`, `time`, `datetime`, `UUID`, `IPv4Address`, `EmailStr`), Python's
`date/time/datetime.fromisoformat` (3.11+), `uuid.UUID`, `ipaddress.IPv4Address` and
`email-validator` (`check_deliverability=False`, as pydantic calls it). All are ASCII, so
a format never needs a JSON escape.

date: `YYYY-MM-DD` (RFC 3339 full-date), a real day of the proleptic Gregorian calendar:
  year 0001-9999 (0000 is out of Python's range), month 01-12, day 01 up to the month's
  length, 02-29 only in leap years (divisible by 4, a century only if divisible by 400:
  2000 and 0400 are, 1900 is not).
time: `HH:MM:SS`, an optional fraction `.` and 1-6 digits, then a required offset (RFC
  3339 full-time): `Z`, or `+HH:MM` / `-HH:MM`. HH is 00-23 and MM, SS 00-59 (in the
  offset too). Left out although RFC 3339 allows them: the leap second `60` (Python and
  pydantic refuse it), fractions past microseconds (both truncate them), a lower-case `z`
  (`fromisoformat` refuses it). Never a time without seconds, a `,` fraction, or compact
  `HHMMSS` / `+HHMM`.
date-time: a date, an upper-case `T`, a time, as above (RFC 3339 date-time; no `t`, no
  space; the offset is required, so a pydantic `NaiveDatetime` refuses every one).
uuid: 8-4-4-4-12 hex digits of either case (RFC 9562's string form; any version and
  variant, nil and max too: `uuid.UUID` and pydantic's `UUID` accept all of them).
ipv4: four decimal octets 0-255 joined by `.`, without leading zeros (`ipaddress` refuses
  `01`).
email: `LOCAL@DOMAIN`, ASCII only (no quoted local part, no address literal, no IDN):
  LOCAL is 1-4 atoms of RFC 5322 atext `[A-Za-z0-9!#$%&'*+/=?^_\`{|}~-]` joined by single
  dots, of at most 64 characters in all (an atom holds up to 64, 31, 20 or 15 characters
  when there are 1, 2, 3 or 4 of them). DOMAIN is 1-4 labels, each followed by a dot,
  then a top-level label of 2-63 ASCII letters; a label is 1-63 letters, digits and
  hyphens, not starting or ending with a hyphen, and without `--` as its 3rd and 4th
  characters (reserved for IDNA `xn--` labels, which email-validator decodes and checks);
  n labels hold up to 63, 62, 41 or 30 characters each (n = 1..4). So the domain has at
  most 189 characters (RFC 1035: 253) and the address at most 254 (RFC 5321). Not left
  out: the special-use top-level names `arpa`, `invalid`, `local`, `localhost`, `onion`
  and `test` (any case), which email-validator (so pydantic's `EmailStr`) refuses as not
  deliverable: a model can still write `a@host.local`.
"""
from __future__ import annotations

__all__ = ["FORMATS"]

_DIGIT, _HEX = "[0-9]", "[0-9a-fA-F]"

# ---- date, time, date-time -------------------------------------------------------------
_YEAR = "(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"  # 0001-9999
_MULTIPLE_OF_4 = "(?:0[48]|[2468][048]|[13579][26])"  # two digits, 04..96 (not 00)
# Leap years: YY a multiple of 4 (any century, 0004 included), or YY = 00 and the century
# a multiple of 4 (0400, ..., 2000, ..., 9600; not 0000).
_LEAP_YEAR = f"(?:[0-9]{{2}}{_MULTIPLE_OF_4}|{_MULTIPLE_OF_4}00)"
_MONTH_DAY = ("(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])"  # days 01-28 of any month
              "|(?:0[13-9]|1[0-2])-(?:29|30)"  # 29 and 30 of all months but February
              "|(?:0[13578]|1[02])-31)")  # 31 of the months that have it
_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_HOUR, _SIXTY = "(?:[01][0-9]|2[0-3])", "[0-5][0-9]"
_TIME = rf"{_HOUR}:{_SIXTY}:{_SIXTY}(?:\.{_DIGIT}{{1,6}})?(?:Z|[+-]{_HOUR}:{_SIXTY})"

# ---- uuid, ipv4 --------------------------------------------------------------------------
_UUID = "-".join(f"{_HEX}{{{n}}}" for n in (8, 4, 4, 4, 12))
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = rf"{_OCTET}\.{_OCTET}\.{_OCTET}\.{_OCTET}"

# ---- email -------------------------------------------------------------------------------
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_LET_DIG, _LDH = "[A-Za-z0-9]", "[A-Za-z0-9-]"
MAX_LOCAL_ATOMS = 4
MAX_DOMAIN_LABELS = 4  # before the top-level label
LOCAL_LENGTH = 64  # RFC 5321 4.5.3.1.1
# Labels with their dots, so that local part, `@`, domain and top-level label fit the 254
# characters of an address: 254 - 64 - 1 - 63.
LABELS_LENGTH = 126


def _label(longest: int) -> str:
    """A domain label of 1..`longest` (5 or more) characters: letters, digits and hyphens,
    a letter or digit at both ends, and not `--` as the 3rd and 4th characters."""
    return (f"{_LET_DIG}(?:{_LDH}{{0,2}}{_LET_DIG}"  # 1 to 4 characters
            f"|{_LDH}(?:{_LET_DIG}{_LDH}|-{_LET_DIG}){_LDH}{{0,{longest - 5}}}{_LET_DIG})?")


def _local_part() -> str:
    """1..MAX_LOCAL_ATOMS dot-joined atoms, at most LOCAL_LENGTH characters in all."""
    shapes = []
    for n in range(1, MAX_LOCAL_ATOMS + 1):
        atom = f"{_ATEXT}{{1,{(LOCAL_LENGTH - (n - 1)) // n}}}"
        shapes.append(atom + (rf"(?:\.{atom}){{{n - 1}}}" if n > 1 else ""))
    return f"(?:{'|'.join(shapes)})"


def _domain() -> str:
    """1..MAX_DOMAIN_LABELS labels, each with its dot in LABELS_LENGTH characters in all
    and none over 63 (RFC 1035), then a top-level label of 2-63 letters."""
    shapes = []
    for n in range(1, MAX_DOMAIN_LABELS + 1):
        label = _label(min(63, LABELS_LENGTH // n - 1))
        shapes.append(rf"(?:{label}\.)" + (f"{{{n}}}" if n > 1 else ""))
    return f"(?:{'|'.join(shapes)})[A-Za-z]{{2,63}}"


FORMATS = {
    "date-time": f"{_DATE}T{_TIME}",
    "date": _DATE,
    "time": _TIME,
    "uuid": _UUID,
    "email": f"{_local_part()}@{_domain()}",
    "ipv4": _IPV4,
}
