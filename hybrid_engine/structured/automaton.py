"""The one interface every structured-output grammar compiles to: a deterministic
automaton over bytes, built lazily, with a vectorised walk of a whole vocabulary.

A grammar (a regex, a JSON schema, any JSON) becomes a `ByteAutomaton`: states are small
ints, state 0 (`DEAD`) rejects everything and every other state is a live prefix of some
accepted string. Subclasses say what a state's 256 successors are (`_transitions`) and
whether it accepts (`_accepting`); states are made only when a walk reaches them, so a
grammar with a huge (or unbounded) state space costs only what generation visits.

Why bytes: tokens are byte strings (a byte-level BPE token can hold part of a UTF-8
character), so the automaton must be able to stop between the bytes of a character.
"""
from abc import ABC, abstractmethod

import numpy as np

DEAD = 0  # the rejecting state: every transition from it leads back to it
UNKNOWN = -1  # a table entry whose state's successors are not computed yet
MAX_STATES = 1 << 16  # a grammar that needs more states than this is refused while it is walked (64 MiB of table)


class GrammarTooLarge(ValueError):
    """The automaton needed more than `MAX_STATES` states (a pathological regex or schema)."""


class ByteAutomaton(ABC):
    """A lazily built DFA over bytes. Subclasses intern their states as ints from 1 up
    (`_new_state` hands them out) and implement `_transitions` and `_accepting`."""

    def __init__(self) -> None:
        # Row s: the successor of state s for each byte, or UNKNOWN until s is expanded.
        # Row DEAD is all DEAD, so a dead walk stays dead without a branch.
        self._table = np.full((64, 256), UNKNOWN, dtype=np.int32)
        self._table[DEAD] = DEAD
        self._num_states = 1
        self._accepts: dict[int, bool] = {DEAD: False}

    # ---- what a subclass provides ------------------------------------------------------
    @property
    @abstractmethod
    def start(self) -> int:
        """The state before any byte."""

    @abstractmethod
    def _transitions(self, state: int) -> np.ndarray:
        """The 256 successors of live `state` (int32; DEAD where the byte is rejected)."""

    @abstractmethod
    def _accepting(self, state: int) -> bool:
        """Whether the bytes that led to live `state` form a whole accepted string."""

    def _new_state(self) -> int:
        """A fresh state id for a subclass to intern (its row starts UNKNOWN)."""
        if self._num_states >= MAX_STATES:
            raise GrammarTooLarge(f"the grammar needs more than {MAX_STATES} automaton states")
        if self._num_states == len(self._table):
            grown = np.full((2 * len(self._table), 256), UNKNOWN, dtype=np.int32)
            grown[: len(self._table)] = self._table
            self._table = grown
        self._num_states += 1
        return self._num_states - 1

    # ---- what callers use --------------------------------------------------------------
    def next_state(self, state: int, byte: int) -> int:
        """The state after `byte` (DEAD if rejected)."""
        nxt = int(self._table[state, byte])
        if nxt == UNKNOWN:
            self._expand(np.array([state]))
            nxt = int(self._table[state, byte])
        return nxt

    def walk(self, state: int, data: bytes) -> int:
        """The state after all of `data`."""
        for byte in data:
            state = self.next_state(state, byte)
            if state == DEAD:
                break
        return state

    def is_accepting(self, state: int) -> bool:
        """Whether `state` ends a whole accepted string."""
        if state not in self._accepts:
            self._accepts[state] = bool(self._accepting(state))
        return self._accepts[state]

    def can_continue(self, state: int) -> bool:
        """Whether some byte keeps `state` alive."""
        if state == DEAD:
            return False
        self.next_state(state, 0)  # (expands the row)
        return bool((self._table[state] != DEAD).any())

    def walk_tokens(self, state: int, token_bytes: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The state after each token, all tokens at once: `token_bytes` [V, L] uint8 holds
        the tokens' bytes left-aligned, `lengths` [V] their lengths, sorted in decreasing
        order (so the tokens still walking at byte j lead the ones still alive). Returns [V]
        int32."""
        neg_lengths = -np.asarray(lengths, dtype=np.int64)  # (an unsigned dtype would wrap)
        states = np.full(len(neg_lengths), state, dtype=np.int32)
        # Tokens still walking: a dead one stays dead, so it leaves the set (most tokens die
        # at their first byte outside strings: 1.7x faster masks for a JSON schema).
        live = np.arange(int(np.searchsorted(neg_lengths, 0, side="left")))
        for j in range(token_bytes.shape[1]):
            live = live[: int(np.searchsorted(neg_lengths[live], -j, side="left"))]  # longer than j
            if live.size == 0:
                break
            current, column = states[live], token_bytes[live, j]
            nxt = self._table[current, column]
            unknown = nxt == UNKNOWN
            if unknown.any():
                self._expand(np.unique(current[unknown]))
                nxt = self._table[current, column]
            states[live] = nxt
            live = live[nxt != DEAD]
        return states

    def _expand(self, states: np.ndarray) -> None:
        for s in states.tolist():
            if self._table[s, 0] == UNKNOWN:  # (a row is written whole, never in part)
                row = np.asarray(self._transitions(s), dtype=np.int32)
                self._table[s] = row
