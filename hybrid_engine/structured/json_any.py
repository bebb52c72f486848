r"""Any JSON (`response_format: {"type": "json_object"}`) as a lazily built byte automaton.

`JsonAutomaton` accepts exactly the JSON texts (RFC 8259) whose top-level value is an
object (any value with `top_level_object=False`), under these rules:

- Nesting: at most `MAX_DEPTH` containers open at once, the top-level one included; an
  opening bracket that would open one more is rejected (every other value still fits).
- Whitespace: runs of at most `MAX_WHITESPACE` bytes of ` \t\n\r` between tokens
  inside the top-level value, none at all with `any_whitespace=False`, and never before
  or after the top-level value. The bound is there because a model under greedy
  decoding can emit whitespace forever; with nothing after the top-level object, a text
  that ends at its closing brace accepts with no live continuation, which is what tells
  the engine to stop generating.
- Strings: any Unicode scalar value except `"`, `\` and U+0000..U+001F, as valid UTF-8
  checked byte by byte (no overlong forms, no surrogates U+D800..U+DFFF, nothing above
  U+10FFFF; a state between the bytes of one character is live), and the escapes
  `\" \\ \/ \b \f \n \r \t \uXXXX` (hex digits of any case). A `\u` escape of a
  surrogate comes only as a pair: `\uD800`-`\uDBFF` then at once `\uDC00`-`\uDFFF`. A
  lone one, which the JSON grammar allows syntactically and Python's json reads, is
  not Unicode, and strict readers (pydantic's jiter) refuse it; so the byte that would
  leave one is rejected (a low escape first, or anything but the low escape after a
  high one).
- Numbers: `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?` within the digit caps that
  `structured.number_range` states for every grammar: at most `MAX_INTEGER_DIGITS` (20)
  digits before the point, `MAX_FRACTION_DIGITS` (20) after it and `MAX_EXPONENT_DIGITS`
  (2) in the exponent. So |value| < 10^20 * 10^99: every number parses to a finite double
  (`1e400` would be `inf`, which `json.dumps` writes as `Infinity` and pydantic's
  `allow_inf_nan=False` refuses), every integer to an int far below Python's 4,300-digit
  limit, and no number runs forever. A number at top level (`top_level_object=False`)
  accepts yet can continue with a digit while a cap leaves room.
- Literals: `true`, `false`, `null`.

A state is a pushdown configuration interned as a hashable tuple whose first two fields
are a kind and the stack of open containers (a str of "o"/"a", innermost last):
`(_BETWEEN, stack, mode, whitespace_run)`, `(_STRING, stack, is_key, inside)`,
`(_NUMBER, stack, phase, digits)` and `(_LITERAL, stack, letters_left)`. Counters are
part of the tuple, so equal configurations intern to the same int and only configurations
a walk reaches are ever created.
"""
import numpy as np

from hybrid_engine.structured.automaton import DEAD, ByteAutomaton
from hybrid_engine.structured.number_range import MAX_EXPONENT_DIGITS, MAX_FRACTION_DIGITS, MAX_INTEGER_DIGITS

MAX_DEPTH = 128  # containers open at once, the top-level one included
MAX_WHITESPACE = 16  # bytes in one run of whitespace between two tokens


def _byte_set(chars: str) -> np.ndarray:
    """The byte values of ASCII `chars`, as an index array for a 256-entry row."""
    return np.frombuffer(chars.encode("ascii"), dtype=np.uint8).astype(np.intp)


_WHITESPACE = _byte_set(" \t\n\r")
_DIGITS = _byte_set("0123456789")
_NONZERO_DIGITS = _byte_set("123456789")
_HEX_DIGITS = _byte_set("0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = _byte_set('"\\/bfnrt')
# ASCII that stands for itself inside a string: controls are banned, `"` and `\` are syntax.
_PLAIN_ASCII = np.array([b for b in range(0x20, 0x80) if b not in b'"\\'], dtype=np.intp)
# UTF-8 lead bytes (Unicode Table 3-7) as (first lead, last lead, continuation bytes,
# lowest, highest first continuation byte): the narrowed ranges after E0, ED, F0 and F4
# are what exclude overlong forms, surrogates and code points above U+10FFFF.
_UTF8_LEADS = (
    (0xC2, 0xDF, 1, 0x80, 0xBF),
    (0xE0, 0xE0, 2, 0xA0, 0xBF),
    (0xE1, 0xEC, 2, 0x80, 0xBF),
    (0xED, 0xED, 2, 0x80, 0x9F),
    (0xEE, 0xEF, 2, 0x80, 0xBF),
    (0xF0, 0xF0, 3, 0x90, 0xBF),
    (0xF1, 0xF3, 3, 0x80, 0xBF),
    (0xF4, 0xF4, 3, 0x80, 0x8F),
)
_CLOSE = {"o": ord("}"), "a": ord("]")}
_LITERALS = ("true", "false", "null")

# State kinds (a tuple's first field).
_BETWEEN, _STRING, _NUMBER, _LITERAL = "between", "string", "number", "literal"
# What a _BETWEEN state expects next.
_VALUE = "value"  # at the top, after ':' and after ',' in an array
_VALUE_OR_CLOSE = "value or ]"  # right after '['
_KEY_OR_CLOSE = "key or }"  # right after '{'
_KEY = "key"  # after ',' in an object
_COLON = "colon"  # after a key
_AFTER_VALUE = ", or close"  # after a value inside a container
_DONE = "done"  # the top-level value is complete: nothing may follow
# Where a _STRING state is: "" in plain text, _ESCAPE right after a backslash, ("u", n) with
# n hex digits of a \u escape still to come (at n == 4 a `d` leads to _AFTER_D), _AFTER_D
# after a `\ud`, ("high", n) with n hex digits of a high surrogate escape to come,
# ("low", i) expecting byte i of `\uD[C-F]` that starts the low surrogate escape due
# after a high one, ("utf8", n, lo, hi) with n continuation bytes of a character still to
# come, the next one in lo..hi.
_ESCAPE = "\\"
_AFTER_D = ("after d",)
_D, _BELOW_8, _HIGH_SECOND = _byte_set("dD"), _byte_set("01234567"), _byte_set("89abAB")
_LOW_START = (_byte_set("\\"), _byte_set("u"), _D, _byte_set("cdefCDEF"))  # `\uD[C-F]`
# A _NUMBER state's phase; the ones after a digit end a complete number.
_MINUS, _ZERO, _INT, _DOT, _FRACTION, _EXP, _EXP_SIGN, _EXP_DIGITS = range(8)
_NUMBER_ENDS = (_ZERO, _INT, _FRACTION, _EXP_DIGITS)
# The phases that count their digits, and the cap on each (the `number_range` caps).
_DIGIT_CAPS = {_INT: MAX_INTEGER_DIGITS, _FRACTION: MAX_FRACTION_DIGITS, _EXP_DIGITS: MAX_EXPONENT_DIGITS}


class JsonAutomaton(ByteAutomaton):
    """The bytes of one JSON text whose top-level value is an object (any value when
    `top_level_object` is False); `any_whitespace=False` allows no whitespace at all. The
    module docstring states the exact rules and bounds."""

    def __init__(self, top_level_object: bool = True, any_whitespace: bool = True) -> None:
        super().__init__()
        self.top_level_object = top_level_object
        self.any_whitespace = any_whitespace
        self._ids: dict[tuple, int] = {}
        self._descriptions: dict[int, tuple] = {}
        self._start = self._intern((_BETWEEN, "", _VALUE, 0))

    @property
    def start(self) -> int:
        """The state before the first byte of the text."""
        return self._start

    def _intern(self, description: tuple) -> int:
        state = self._ids.get(description)
        if state is None:
            state = self._new_state()
            self._ids[description] = state
            self._descriptions[state] = description
        return state

    def _accepting(self, state: int) -> bool:
        kind, stack, detail = self._descriptions[state][:3]
        if kind == _BETWEEN:
            return detail == _DONE
        return kind == _NUMBER and not stack and detail in _NUMBER_ENDS

    def _transitions(self, state: int) -> np.ndarray:
        return self._row(self._descriptions[state])

    def _row(self, description: tuple) -> np.ndarray:
        """The successors of a configuration, whether or not it is interned itself."""
        row = np.full(256, DEAD, dtype=np.int32)
        kind, stack = description[:2]
        if kind == _BETWEEN:
            self._between_row(row, stack, *description[2:])
        elif kind == _STRING:
            self._string_row(row, stack, *description[2:])
        elif kind == _NUMBER:
            self._number_row(row, stack, *description[2:])
        else:
            letters_left = description[2]
            row[ord(letters_left[0])] = (
                self._after_value(stack) if len(letters_left) == 1 else self._intern((_LITERAL, stack, letters_left[1:]))
            )
        return row

    def _after_value(self, stack: str) -> int:
        """The state right after a value completes with `stack` still open."""
        return self._intern((_BETWEEN, stack, _AFTER_VALUE, 0) if stack else (_BETWEEN, "", _DONE, 0))

    def _between_row(self, row: np.ndarray, stack: str, mode: str, whitespace_run: int) -> None:
        # An empty stack means before or after the top-level value: no whitespace there.
        if stack and self.any_whitespace and whitespace_run < MAX_WHITESPACE:
            row[_WHITESPACE] = self._intern((_BETWEEN, stack, mode, whitespace_run + 1))
        if mode in (_VALUE, _VALUE_OR_CLOSE):
            self._value_starts(row, stack)
        elif mode in (_KEY, _KEY_OR_CLOSE):
            row[ord('"')] = self._intern((_STRING, stack, True, ""))
        elif mode == _COLON:
            row[ord(":")] = self._intern((_BETWEEN, stack, _VALUE, 0))
        elif mode == _AFTER_VALUE:
            row[ord(",")] = self._intern((_BETWEEN, stack, _KEY if stack[-1] == "o" else _VALUE, 0))
        if mode in (_VALUE_OR_CLOSE, _KEY_OR_CLOSE, _AFTER_VALUE):
            row[_CLOSE[stack[-1]]] = self._after_value(stack[:-1])

    def _value_starts(self, row: np.ndarray, stack: str) -> None:
        room = len(stack) < MAX_DEPTH
        if room:
            row[ord("{")] = self._intern((_BETWEEN, stack + "o", _KEY_OR_CLOSE, 0))
        if not stack and self.top_level_object:
            return
        if room:
            row[ord("[")] = self._intern((_BETWEEN, stack + "a", _VALUE_OR_CLOSE, 0))
        row[ord('"')] = self._intern((_STRING, stack, False, ""))
        row[ord("-")] = self._intern((_NUMBER, stack, _MINUS, 0))
        row[ord("0")] = self._intern((_NUMBER, stack, _ZERO, 0))
        row[_NONZERO_DIGITS] = self._intern((_NUMBER, stack, _INT, 1))
        for literal in _LITERALS:
            row[ord(literal[0])] = self._intern((_LITERAL, stack, literal[1:]))

    def _string_row(self, row: np.ndarray, stack: str, is_key: bool, inside: str | tuple) -> None:
        plain = self._intern((_STRING, stack, is_key, ""))
        if inside == "":
            row[_PLAIN_ASCII] = plain
            row[ord('"')] = self._intern((_BETWEEN, stack, _COLON, 0)) if is_key else self._after_value(stack)
            row[ord("\\")] = self._intern((_STRING, stack, is_key, _ESCAPE))
            for first, last, continuations, low, high in _UTF8_LEADS:
                row[first : last + 1] = self._intern((_STRING, stack, is_key, ("utf8", continuations, low, high)))
        elif inside == _ESCAPE:
            row[_SIMPLE_ESCAPES] = plain
            row[ord("u")] = self._intern((_STRING, stack, is_key, ("u", 4)))
        elif inside == _AFTER_D:  # `\ud`: 0-7 is no surrogate, 8-B a high one, C-F a lone low one
            row[_BELOW_8] = self._intern((_STRING, stack, is_key, ("u", 2)))
            row[_HIGH_SECOND] = self._intern((_STRING, stack, is_key, ("high", 2)))
        elif inside[0] == "u":
            hex_left = inside[1]
            row[_HEX_DIGITS] = plain if hex_left == 1 else self._intern((_STRING, stack, is_key, ("u", hex_left - 1)))
            if hex_left == 4:
                row[_D] = self._intern((_STRING, stack, is_key, _AFTER_D))
        elif inside[0] == "high":
            hex_left = inside[1]
            row[_HEX_DIGITS] = self._intern((_STRING, stack, is_key, ("high", hex_left - 1) if hex_left > 1 else ("low", 0)))
        elif inside[0] == "low":
            at = inside[1]
            row[_LOW_START[at]] = self._intern((_STRING, stack, is_key, ("low", at + 1) if at < 3 else ("u", 2)))
        else:
            _, continuations, low, high = inside
            row[low : high + 1] = (
                plain if continuations == 1 else self._intern((_STRING, stack, is_key, ("utf8", continuations - 1, 0x80, 0xBF)))
            )

    def _number_row(self, row: np.ndarray, stack: str, phase: int, digits: int) -> None:
        if phase in _NUMBER_ENDS and stack:
            # No byte both continues a number and follows a value (whitespace, ',', a
            # closing bracket), so a complete number ends at the next token's first byte.
            row[:] = self._row((_BETWEEN, stack, _AFTER_VALUE, 0))
        if phase == _MINUS:
            row[ord("0")] = self._intern((_NUMBER, stack, _ZERO, 0))
            row[_NONZERO_DIGITS] = self._intern((_NUMBER, stack, _INT, 1))
        elif phase in _DIGIT_CAPS and digits < _DIGIT_CAPS[phase]:
            row[_DIGITS] = self._intern((_NUMBER, stack, phase, digits + 1))
        elif phase == _DOT:
            row[_DIGITS] = self._intern((_NUMBER, stack, _FRACTION, 1))
        elif phase in (_EXP, _EXP_SIGN):
            row[_DIGITS] = self._intern((_NUMBER, stack, _EXP_DIGITS, 1))
        if phase in (_ZERO, _INT):
            row[ord(".")] = self._intern((_NUMBER, stack, _DOT, 0))
        if phase in (_ZERO, _INT, _FRACTION):
            row[[ord("e"), ord("E")]] = self._intern((_NUMBER, stack, _EXP, 0))
        if phase == _EXP:
            row[[ord("+"), ord("-")]] = self._intern((_NUMBER, stack, _EXP_SIGN, 0))
