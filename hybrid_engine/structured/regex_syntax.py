r"""Reading a regular expression for `structured.regex`: the abstract syntax, the parser
that builds it from a pattern, and the sets of code points at its leaves with the UTF-8
byte-range sequences that spell them, which the automaton side follows.

Supported syntax (ECMA-262 / JSON-Schema style, ASCII meaning of the shorthand classes):

- literal characters (any Unicode); `.` is any character except "\n";
- escapes `\n \t \r \f \v \0`, `\xhh`, `\uhhhh` (a `\uD83D\uDE00` surrogate pair is one
  character), `\Uhhhhhhhh`; any other escaped character that is not an ASCII letter or
  digit is itself (`\. \* \\ \{ \/` ...);
- `\d` = [0-9], `\w` = [A-Za-z0-9_], `\s` = [ \t\n\r\f\v] and their negations `\D \W \S`;
- classes `[...]` and `[^...]`: ranges, escapes, shorthand classes; `]` first or escaped
  and `-` first or last are literal; `\b` in a class is the backspace;
- groups `(...)`, `(?:...)`, `(?P<name>...)`, `(?<name>...)` (all only group); alternation
  `|`, empty alternatives too;
- quantifiers `* + ? {m} {m,} {,n} {m,n}` and their lazy forms `*? +? ?? {m,n}?` (laziness
  does not change full matches); a `{` that starts no quantifier is literal, as in Python;
- `^` as the pattern's first and `$` as its last character (no-ops: matches are whole).

Refused with ValueError("regex: ... at position N"): backreferences, lookarounds, `\b \B
\A \Z \z \G` outside classes, inline flags, atomic groups, possessive quantifiers, `\p{..}`
property classes, octal escapes, lone surrogates, and anything malformed.

Characters are the code points U+0000..U+10FFFF except the surrogates; negated classes and
`.` include every non-ASCII one. Their byte-range sequences spell only valid UTF-8 (no
overlong forms, no surrogates, nothing above U+10FFFF).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

MAX_NFA_STATES = 200_000  # bounds compile time and memory once bounded repeats are expanded
MAX_NESTING = 100  # group depth; deeper patterns would exhaust Python's recursion limit
MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)


class Span(NamedTuple):
    """An inclusive range of code points or of byte values."""

    lo: int
    hi: int


# ---- abstract syntax --------------------------------------------------------------------
@dataclass(frozen=True)
class CharSet:
    """A set of code points: sorted, disjoint, non-adjacent spans."""

    spans: tuple[Span, ...]


@dataclass(frozen=True)
class Concat:
    """The items in sequence (no items: the empty string)."""

    items: tuple[Node, ...]


@dataclass(frozen=True)
class Alternation:
    """Any one of the options."""

    options: tuple[Node, ...]


@dataclass(frozen=True)
class Repeat:
    """`child` between `min` and `max` times (`max` None: unbounded)."""

    child: Node
    min: int
    max: int | None


Node = CharSet | Concat | Alternation | Repeat


def char_set(spans: list[Span] | tuple[Span, ...]) -> CharSet:
    """The CharSet of the union of `spans` (in any order, overlapping or not)."""
    merged: list[Span] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1].hi + 1:
            merged[-1] = Span(merged[-1].lo, max(merged[-1].hi, hi))
        else:
            merged.append(Span(lo, hi))
    return CharSet(tuple(merged))


def complement(charset: CharSet) -> CharSet:
    """Every code point not in `charset` (surrogates are dropped later, when encoding)."""
    spans, next_lo = [], 0
    for lo, hi in charset.spans:
        if lo > next_lo:
            spans.append(Span(next_lo, lo - 1))
        next_lo = hi + 1
    if next_lo <= MAX_CODE_POINT:
        spans.append(Span(next_lo, MAX_CODE_POINT))
    return CharSet(tuple(spans))


DIGIT = char_set([Span(0x30, 0x39)])
WORD = char_set([Span(0x30, 0x39), Span(0x41, 0x5A), Span(0x5F, 0x5F), Span(0x61, 0x7A)])
SPACE = char_set([Span(0x09, 0x0D), Span(0x20, 0x20)])
SHORTHANDS = {"d": DIGIT, "D": complement(DIGIT), "w": WORD, "W": complement(WORD),
              "s": SPACE, "S": complement(SPACE)}
NOT_NEWLINE = complement(char_set([Span(0x0A, 0x0A)]))
CONTROL_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B}
HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
DIGITS = frozenset("0123456789")
# A brace that does not start one of these (with a bound or a comma) is a literal, as in
# Python (`a{`, `a{}`, `a{x}`).
BRACES = re.compile(r"\{(?P<min>\d*)(?P<comma>,?)(?P<max>\d*)\}")
LOW_SURROGATE_ESCAPE = re.compile(r"\\u([dD][c-fC-F][0-9a-fA-F]{2})")
REFUSED_GROUPS = {"?=": "lookahead (?=...)", "?!": "lookahead (?!...)",
                  "?<=": "lookbehind (?<=...)", "?<!": "lookbehind (?<!...)",
                  "?P=": "backreference (?P=name)", "?>": "atomic group (?>...)",
                  "?#": "comment group (?#...)"}


# ---- parser -----------------------------------------------------------------------------
def parse(pattern: str) -> Node:
    """The syntax tree of `pattern`; ValueError("regex: ... at position N") if it is malformed
    or uses what is not supported (module docstring)."""
    return _Parser(pattern).parse()


class _Parser:
    """Recursive descent over the pattern; `pos` is the index of the next character."""

    def __init__(self, pattern: str) -> None:
        self.text = pattern
        self.pos = 0
        self.depth = 0

    def error(self, what: str, pos: int | None = None) -> ValueError:
        return ValueError(f"regex: {what} at position {self.pos if pos is None else pos}")

    def peek(self, ahead: int = 0) -> str:
        i = self.pos + ahead
        return self.text[i] if i < len(self.text) else ""

    def parse(self) -> Node:
        if self.peek() == "^":
            self.pos = 1
        node = self.alternation()
        if self.pos < len(self.text):
            raise self.error("unbalanced ')'")
        return node

    def alternation(self) -> Node:
        options = [self.concat()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.concat())
        return options[0] if len(options) == 1 else Alternation(tuple(options))

    def concat(self) -> Node:
        items: list[Node] = []
        while self.pos < len(self.text) and self.peek() not in "|)":
            atom_pos = self.pos
            atom = self.atom()
            bounds = self.quantifier()
            if bounds is not None:
                if atom is None:
                    raise self.error("nothing to repeat", atom_pos)
                atom = Repeat(atom, *bounds)
                if self.peek() in ("*", "+", "?") or self.braces() is not None:
                    raise self.error("multiple repeat")
            if atom is not None:
                items.append(atom)
        return items[0] if len(items) == 1 else Concat(tuple(items))

    def braces(self) -> re.Match[str] | None:
        match = BRACES.match(self.text, self.pos)
        return match if match and (match["min"] or match["comma"]) else None

    def quantifier(self) -> tuple[int, int | None] | None:
        c = self.peek()
        if c in ("*", "+", "?"):
            bounds: tuple[int, int | None] = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            self.pos += 1
        elif (braces := self.braces()) is not None:
            lo = int(braces["min"] or 0)
            hi = int(braces["max"]) if braces["max"] else None if braces["comma"] else lo
            if hi is not None and hi < lo:
                raise self.error(f"repeat {{{lo},{hi}}} has max < min")
            if max(lo, hi or 0) > MAX_NFA_STATES:
                raise too_large()
            bounds = (lo, hi)
            self.pos = braces.end()
        else:
            return None
        if self.peek() == "?":  # lazy: the same set of full matches
            self.pos += 1
        elif self.peek() == "+":
            raise self.error("possessive quantifier is not supported")
        return bounds

    def atom(self) -> Node | None:
        """The next atom, or None for an anchor (which matches the empty string here)."""
        c, start = self.peek(), self.pos
        if c == "(":
            return self.group()
        if c == "[":
            return self.char_class()
        if c == "\\":
            return self.as_node(self.escape(in_class=False))
        if c in ("*", "+", "?") or (c == "{" and self.braces() is not None):
            raise self.error("nothing to repeat")
        self.pos += 1
        if c == ".":
            return NOT_NEWLINE
        if c == "^":
            raise self.error("'^' is only supported as the first character", start)
        if c == "$":
            if self.pos == len(self.text):
                return None
            raise self.error("'$' is only supported as the last character", start)
        return self.as_node(self.literal(c, start))

    def as_node(self, item: int | CharSet) -> CharSet:
        return item if isinstance(item, CharSet) else CharSet((Span(item, item),))

    def literal(self, c: str, pos: int) -> int:
        if SURROGATES[0] <= ord(c) <= SURROGATES[1]:
            raise self.error(f"lone surrogate U+{ord(c):04X}", pos)
        return ord(c)

    def group(self) -> Node:
        start = self.pos
        self.pos += 1
        if self.peek() == "?":
            self.group_prefix(start)
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise self.error(f"groups nested deeper than {MAX_NESTING}", start)
        node = self.alternation()
        self.depth -= 1
        if self.peek() != ")":
            raise self.error("missing ')' for the group opened", start)
        self.pos += 1
        return node

    def group_prefix(self, start: int) -> None:
        """Consumes `?:`, `?P<name>` or `?<name>`; refuses every other `(?` construct."""
        rest = self.text[self.pos:self.pos + 4]
        if rest.startswith("?:"):
            self.pos += 2
            return
        for prefix, what in REFUSED_GROUPS.items():
            if rest.startswith(prefix):
                raise self.error(f"{what} is not supported", start)
        if not (rest.startswith("?P<") or rest.startswith("?<")):
            raise self.error("inline flags (?...) are not supported", start)
        self.pos += 3 if rest.startswith("?P<") else 2
        close = self.text.find(">", self.pos)
        if close < 0 or not self.text[self.pos:close].isidentifier():
            raise self.error("bad group name", self.pos)
        self.pos = close + 1

    def char_class(self) -> CharSet:
        start = self.pos
        self.pos += 1
        negate = self.peek() == "^"
        self.pos += negate
        spans: list[Span] = []
        first = True
        while self.peek() != "]" or first:
            if self.pos >= len(self.text):
                raise self.error("missing ']' for the class opened", start)
            first = False
            item_pos = self.pos
            lo = self.class_item()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.pos += 1
                hi = self.class_item()
                if isinstance(lo, CharSet) or isinstance(hi, CharSet):
                    raise self.error("bad character range (a class as an end)", item_pos)
                if hi < lo:
                    raise self.error("character range out of order", item_pos)
                spans.append(Span(lo, hi))
            else:
                spans.extend(lo.spans if isinstance(lo, CharSet) else [Span(lo, lo)])
        self.pos += 1
        charset = char_set(spans)
        return complement(charset) if negate else charset

    def class_item(self) -> int | CharSet:
        c = self.peek()
        if c == "\\":
            return self.escape(in_class=True)
        self.pos += 1
        return self.literal(c, self.pos - 1)

    def escape(self, in_class: bool) -> int | CharSet:
        """The escape at `pos` (its backslash): one code point or a shorthand class."""
        start = self.pos
        c = self.peek(1)
        self.pos += 2
        if c == "":
            raise self.error("trailing backslash", start)
        if c in SHORTHANDS:
            return SHORTHANDS[c]
        if c in CONTROL_ESCAPES:
            return CONTROL_ESCAPES[c]
        if c == "b" and in_class:
            return 0x08
        if c in HEX_DIGITS:
            return self.hex_escape(c, start)
        if c == "0":
            if self.peek() and self.peek() in DIGITS:
                raise self.error("octal escapes are not supported", start)
            return 0
        if c in DIGITS or c == "k":
            raise self.error(f"backreference \\{c} is not supported", start)
        if c in "bBAZzG":
            raise self.error(f"assertion \\{c} is not supported", start)
        if c in "pP":
            raise self.error(f"Unicode property class \\{c} is not supported", start)
        if c.isascii() and c.isalnum():
            raise self.error(f"unknown escape \\{c}", start)
        return self.literal(c, start)

    def hex_escape(self, kind: str, start: int) -> int:
        width = HEX_DIGITS[kind]
        digits = self.text[self.pos:self.pos + width]
        if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
            raise self.error(f"\\{kind} needs {width} hex digits", start)
        self.pos += width
        value = int(digits, 16)
        if value > MAX_CODE_POINT:
            raise self.error(f"code point {value:#x} is above U+10FFFF", start)
        if kind == "u" and 0xD800 <= value <= 0xDBFF and (
                low := LOW_SURROGATE_ESCAPE.match(self.text, self.pos)) is not None:
            self.pos = low.end()
            return 0x10000 + ((value - 0xD800) << 10) + (int(low[1], 16) - 0xDC00)
        if SURROGATES[0] <= value <= SURROGATES[1]:
            raise self.error(f"lone surrogate U+{value:04X}", start)
        return value


def too_large() -> ValueError:
    """The error of a pattern whose NFA would pass `MAX_NFA_STATES`."""
    return ValueError(f"regex: the pattern is too large (more than {MAX_NFA_STATES} NFA "
                      "states once its bounded repeats {m,n} are expanded)")


# ---- UTF-8 ------------------------------------------------------------------------------
def _split_range(r: Span) -> tuple[Span, Span] | None:
    """Two halves of `r` if its code points differ in encoded length or in a byte before
    the one where they vary (so no single byte-range sequence covers exactly `r`)."""
    for max_of_length in (0x7F, 0x7FF, 0xFFFF):
        if r.lo <= max_of_length < r.hi:
            return Span(r.lo, max_of_length), Span(max_of_length + 1, r.hi)
    if r.hi <= 0x7F:
        return None
    for i in (1, 2, 3):
        mask = (1 << (6 * i)) - 1  # the bits in the last i bytes
        if r.lo & ~mask != r.hi & ~mask:
            if r.lo & mask != 0:
                return Span(r.lo, r.lo | mask), Span((r.lo | mask) + 1, r.hi)
            if r.hi & mask != mask:
                return Span(r.lo, (r.hi & ~mask) - 1), Span(r.hi & ~mask, r.hi)
    return None


@lru_cache(maxsize=1024)
def utf8_sequences(charset: CharSet) -> tuple[tuple[Span, ...], ...]:
    """Byte-range sequences whose byte strings are exactly the UTF-8 encodings of the
    non-surrogate code points in `charset` (the splitting of Russ Cox's RE2 and of
    regex-automata: each sequence's strings are the product of its byte ranges)."""
    sequences: list[tuple[Span, ...]] = []
    stack = list(charset.spans)
    while stack:
        r = stack.pop()
        if r.lo <= SURROGATES[1] and r.hi >= SURROGATES[0]:
            stack += [s for s in (Span(r.lo, SURROGATES[0] - 1), Span(SURROGATES[1] + 1, r.hi))
                      if s.lo <= s.hi]
        elif (halves := _split_range(r)) is not None:
            stack += halves
        else:
            first, last = chr(r.lo).encode(), chr(r.hi).encode()
            sequences.append(tuple(Span(a, b) for a, b in zip(first, last)))
    return tuple(sorted(sequences))
