r"""Regular expressions as byte automata: `compile_regex` turns a pattern into a
`ByteAutomaton` that accepts exactly the UTF-8 encodings of the strings the pattern fully
matches (like `re.fullmatch`), for constrained decoding. The supported syntax, and how a
pattern is read into sets of characters and their UTF-8 byte ranges: `regex_syntax`.

Only valid UTF-8 is accepted (no overlong forms, no surrogates, nothing above U+10FFFF), and
a byte prefix that ends inside a character is live exactly when some allowed character
completes it.

Compiling builds a Thompson NFA over byte ranges (bounded repeats expanded, at most
MAX_NFA_STATES states); DFA states, sets of NFA states, are made lazily as walks reach them.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from hybrid_engine.structured.automaton import DEAD, ByteAutomaton
from hybrid_engine.structured.regex_syntax import (
    MAX_NFA_STATES, Alternation, CharSet, Concat, Node, Repeat, Span, parse, too_large,
    utf8_sequences)

__all__ = ["compile_regex", "RegexAutomaton", "MAX_NFA_STATES"]


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
            raise too_large()
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
            raise too_large()

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
    (syntax: `regex_syntax`'s docstring). Raises ValueError ("regex: ...") for unsupported or
    malformed patterns and for ones whose expanded repeats exceed MAX_NFA_STATES."""
    return RegexAutomaton(_NfaBuilder().finish(parse(pattern)))
