r"""Regular expressions as byte automata: `compile_regex` turns a pattern into a
`ByteAutomaton` that accepts exactly the UTF-8 encodings of the strings the pattern fully
matches (like `re.fullmatch`), for constrained decoding.

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
`.` include every non-ASCII one. Only valid UTF-8 is accepted (no overlong forms, no
surrogates, nothing above U+10FFFF), and a byte prefix that ends inside a character is live
exactly when some allowed character completes it.

Compiling builds a Thompson NFA over byte ranges (bounded repeats expanded, at most
MAX_NFA_STATES states); DFA states, sets of NFA states, are made lazily as walks reach them.
"""
from __future__ import annotations

import re
from array import array
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, NamedTuple

import numpy as np

from hybrid_engine.structured.automaton import DEAD, ByteAutomaton

__all__ = ["compile_regex", "RegexAutomaton", "MAX_NFA_STATES"]

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
                raise _too_large()
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


# ---- NFA --------------------------------------------------------------------------------
class Fragment(NamedTuple):
    """A piece of NFA under construction: entered at `start`, left from `end` (which has
    no outgoing moves yet)."""

    start: int
    end: int


@dataclass
class Nfa:
    """A Thompson NFA over bytes, its moves in compressed rows: state s moves on no input to
    `epsilon_targets[i]` for i in epsilon_offsets[s]:epsilon_offsets[s + 1], and on any byte
    in edge_lo[i]..edge_hi[i] to edge_targets[i] for i in edge_offsets[s]:edge_offsets[s + 1].
    A string is accepted when it can end in `accept`."""

    num_states: int
    start: int
    accept: int
    epsilon_offsets: list[int]
    epsilon_targets: list[int]
    edge_offsets: list[int]
    edge_lo: list[int]
    edge_hi: list[int]
    edge_targets: list[int]


def _rows(num_states: int, sources: array | np.ndarray,
          *columns: array | np.ndarray) -> tuple[list[int], list[list[int]]]:
    """The row offsets of moves listed as (source, columns...), and the columns in row order."""
    source = np.frombuffer(sources, dtype=np.intc)
    offsets = np.zeros(num_states + 1, dtype=np.int64)
    np.cumsum(np.bincount(source, minlength=num_states), out=offsets[1:])
    order = np.argsort(source, kind="stable")
    return offsets.tolist(), [np.frombuffer(c, dtype=np.intc)[order].tolist() for c in columns]


class _NfaBuilder:
    """Builds an `Nfa` from the syntax tree, refusing more than MAX_NFA_STATES states. Moves
    are collected in flat int arrays: one list per state would be tens of thousands of
    objects for the garbage collector to walk again and again while they are made."""

    def __init__(self) -> None:
        self.num_states = 0
        self.epsilon_sources, self.epsilon_targets = array("i"), array("i")
        self.edge_sources, self.edge_lo, self.edge_hi, self.edge_targets = (
            array("i"), array("i"), array("i"), array("i"))

    def finish(self, root: Node) -> Nfa:
        body = self.build(root)
        accept = self.state()
        self.link(body.end, accept)
        epsilon_offsets, (epsilon_targets,) = _rows(
            self.num_states, self.epsilon_sources, self.epsilon_targets)
        edge_offsets, (lo, hi, targets) = _rows(
            self.num_states, self.edge_sources, self.edge_lo, self.edge_hi, self.edge_targets)
        return Nfa(self.num_states, body.start, accept, epsilon_offsets, epsilon_targets,
                   edge_offsets, lo, hi, targets)

    def state(self) -> int:
        if self.num_states >= MAX_NFA_STATES:
            raise _too_large()
        self.num_states += 1
        return self.num_states - 1

    def link(self, source: int, target: int) -> None:
        self.epsilon_sources.append(source)
        self.epsilon_targets.append(target)

    def edge(self, source: int, byte_range: Span, target: int) -> None:
        self.edge_sources.append(source)
        self.edge_lo.append(byte_range.lo)
        self.edge_hi.append(byte_range.hi)
        self.edge_targets.append(target)

    def build(self, node: Node) -> Fragment:
        if isinstance(node, CharSet):
            return self.char_set(node)
        if isinstance(node, Concat):
            return self.chain([self.build(item) for item in node.items])
        if isinstance(node, Alternation):
            start, end = self.state(), self.state()
            for option in node.options:
                piece = self.build(option)
                self.link(start, piece.start)
                self.link(piece.end, end)
            return Fragment(start, end)
        return self.repeat(node)

    def chain(self, pieces: list[Fragment]) -> Fragment:
        if not pieces:
            s = self.state()
            return Fragment(s, s)
        for a, b in zip(pieces, pieces[1:]):
            self.link(a.end, b.start)
        return Fragment(pieces[0].start, pieces[-1].end)

    def repeat(self, node: Repeat) -> Fragment:
        copies = node.min + (1 if node.max is None else node.max - node.min)
        if copies == 0:
            return self.chain([])
        # One copy's size tells at once whether all copies fit, rather than after building
        # MAX_NFA_STATES states.
        before = self.num_states
        made = [self.build(node.child)]
        if self.num_states + (self.num_states - before) * (copies - 1) > MAX_NFA_STATES:
            raise _too_large()

        def copy() -> Fragment:
            return made.pop() if made else self.build(node.child)

        pieces = [copy() for _ in range(node.min)]
        if node.max is None:
            pieces.append(self.star(copy()))
        elif node.max > node.min:
            pieces.append(self.optional_chain(copy, node.max - node.min))
        return self.chain(pieces)

    def star(self, body: Fragment) -> Fragment:
        hub = self.state()
        self.link(hub, body.start)
        self.link(body.end, hub)
        return Fragment(hub, hub)

    def optional_chain(self, copy: Callable[[], Fragment], count: int) -> Fragment:
        # Nested (x(x(x)?)?)? rather than x?x?x?: a DFA state then holds O(1) NFA states
        # of the chain instead of all the copies still ahead.
        end = self.state()
        start = gate = self.state()
        for i in range(count):
            body = copy()
            self.link(gate, end)
            self.link(gate, body.start)
            gate = self.state() if i < count - 1 else end
            self.link(body.end, gate)
        return Fragment(start, end)

    def char_set(self, charset: CharSet) -> Fragment:
        start, end = self.state(), self.state()
        # Sequences share their tails (most end in the same continuation-byte ranges).
        tails: dict[tuple[Span, ...], int] = {(): end}

        def enter(tail: tuple[Span, ...]) -> int:
            if tail not in tails:
                tails[tail] = self.state()
                self.edge(tails[tail], tail[0], enter(tail[1:]))
            return tails[tail]

        for sequence in utf8_sequences(charset):
            self.edge(start, sequence[0], enter(sequence[1:]))
        return Fragment(start, end)


def _too_large() -> ValueError:
    return ValueError(f"regex: the pattern is too large (more than {MAX_NFA_STATES} NFA "
                      "states once its bounded repeats {m,n} are expanded)")


def _co_reachable(nfa: Nfa) -> list[bool]:
    """Which NFA states can reach `accept`."""
    states = np.arange(nfa.num_states, dtype=np.intc)
    sources = np.concatenate([np.repeat(states, np.diff(nfa.epsilon_offsets)),
                              np.repeat(states, np.diff(nfa.edge_offsets))])
    targets = np.array(nfa.epsilon_targets + nfa.edge_targets, dtype=np.intc)
    offsets, (predecessors,) = _rows(nfa.num_states, targets, sources)
    reached = [False] * nfa.num_states
    reached[nfa.accept] = True
    stack = [nfa.accept]
    while stack:
        t = stack.pop()
        for s in predecessors[offsets[t]:offsets[t + 1]]:
            if not reached[s]:
                reached[s] = True
                stack.append(s)
    return reached


# ---- DFA --------------------------------------------------------------------------------
class RegexAutomaton(ByteAutomaton):
    """The lazily determinised byte automaton of one pattern (see `compile_regex`). A DFA
    state is the set of live NFA states that have byte moves or accept, after epsilon
    moves; an empty set is DEAD."""

    def __init__(self, nfa: Nfa) -> None:
        super().__init__()
        self._nfa = nfa
        self._live = _co_reachable(nfa)
        # Only states with byte moves (and accept) decide what may follow, so a DFA state
        # keeps just those: sets that differ in epsilon-only states are then one state.
        self._kept = [self._live[s] and (nfa.edge_offsets[s + 1] > nfa.edge_offsets[s]
                                         or s == nfa.accept) for s in range(nfa.num_states)]
        self._closures: dict[int, frozenset[int]] = {}
        self._ids: dict[frozenset[int], int] = {frozenset(): DEAD}
        self._sets: dict[int, frozenset[int]] = {DEAD: frozenset()}
        self._successors: dict[frozenset[int], int] = {}  # edge targets -> DFA state
        self._start = self._intern(self._closure(nfa.start))

    @property
    def start(self) -> int:
        """The state before any byte (DEAD if the pattern matches nothing)."""
        return self._start

    def _intern(self, nfa_states: frozenset[int]) -> int:
        state = self._ids.get(nfa_states)
        if state is None:
            state = self._ids[nfa_states] = self._new_state()
            self._sets[state] = nfa_states
        return state

    def _closure(self, s: int) -> frozenset[int]:
        """The kept states reachable from `s` by epsilon moves through live states."""
        closure = self._closures.get(s)
        if closure is None:
            offsets, targets = self._nfa.epsilon_offsets, self._nfa.epsilon_targets
            seen, stack, kept = {s}, [s], []
            while stack:
                u = stack.pop()
                if not self._live[u]:
                    continue
                if self._kept[u]:
                    kept.append(u)
                for v in targets[offsets[u]:offsets[u + 1]]:
                    if v not in seen:
                        seen.add(v)
                        stack.append(v)
            closure = self._closures[s] = frozenset(kept)
        return closure

    def _transitions(self, state: int) -> np.ndarray:
        # Group the moves by byte range, then sweep the range boundaries: between two
        # boundaries every byte has the same set of targets.
        nfa, targets_by_range = self._nfa, {}
        for s in self._sets[state]:
            for i in range(nfa.edge_offsets[s], nfa.edge_offsets[s + 1]):
                if self._live[nfa.edge_targets[i]]:
                    byte_range = Span(nfa.edge_lo[i], nfa.edge_hi[i])
                    targets_by_range.setdefault(byte_range, []).append(nfa.edge_targets[i])
        opening: dict[int, list[Span]] = {}
        for r in targets_by_range:
            opening.setdefault(r.lo, []).append(r)
        boundaries = sorted({r.lo for r in targets_by_range} | {r.hi + 1 for r in targets_by_range})
        row = np.full(256, DEAD, dtype=np.int32)
        active: list[Span] = []
        for lo, next_lo in zip(boundaries, boundaries[1:]):
            active = [r for r in active if r.hi >= lo] + opening.get(lo, [])
            if active:
                row[lo:next_lo] = self._successor([t for r in active for t in targets_by_range[r]])
        return row

    def _successor(self, targets: list[int]) -> int:
        key = frozenset(targets)
        state = self._successors.get(key)
        if state is None:
            state = self._successors[key] = self._intern(
                frozenset().union(*(self._closure(t) for t in key)))
        return state

    def _accepting(self, state: int) -> bool:
        return self._nfa.accept in self._sets[state]


def compile_regex(pattern: str) -> RegexAutomaton:
    """The automaton accepting the UTF-8 encodings of the strings `pattern` fully matches
    (syntax: this module's docstring). Raises ValueError ("regex: ...") for unsupported or
    malformed patterns and for ones whose expanded repeats exceed MAX_NFA_STATES."""
    return RegexAutomaton(_NfaBuilder().finish(_Parser(pattern).parse()))
