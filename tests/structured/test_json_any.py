"""JsonAutomaton against an oracle: Python's `json.loads` plus the bounds the automaton adds,
refusing strings with a lone surrogate as pydantic's parser (jiter, `pydantic_core.from_json`)
does; accepted texts are checked against jiter too."""
import json
import random
import re
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np
import pydantic
import pytest
from pydantic_core import from_json

from hybrid_engine.structured.automaton import DEAD
from hybrid_engine.structured.json_any import MAX_DEPTH, MAX_WHITESPACE, JsonAutomaton
from hybrid_engine.structured.number_range import MAX_EXPONENT_DIGITS, MAX_FRACTION_DIGITS, MAX_INTEGER_DIGITS
from tests.structured.test_number_range import AT_THE_CAPS, check_number, greedy_walks, numbers_in, parts

# (top_level_object, any_whitespace)
CONFIGS = [(True, True), (False, True), (True, False)]
_WHITESPACE = " \t\n\r"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_STRING_OR_PUNCTUATION = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\],:]')
_NUMBER = re.compile(r"-?([0-9]+)(?:\.([0-9]+))?(?:[eE][+-]?([0-9]+))?")
# The digit caps of a number's integer, fraction and exponent parts (`number_range`'s).
CAPS = {"integer": MAX_INTEGER_DIGITS, "fraction": MAX_FRACTION_DIGITS, "exponent": MAX_EXPONENT_DIGITS}


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")  # json.loads would accept NaN and Infinity


def obeys_bounds(text: str, value: object, top_level_object: bool, any_whitespace: bool) -> bool:
    """The rules JsonAutomaton adds to a text json.loads accepted: the top-level value is an
    object (if asked), no whitespace before or after it, no whitespace run over
    MAX_WHITESPACE (none at all without any_whitespace), no number with more digits in a
    part than its cap in CAPS, and no more than MAX_DEPTH containers open at once."""
    if top_level_object and not isinstance(value, dict):
        return False
    if text[0] in _WHITESPACE or text[-1] in _WHITESPACE:
        return False
    # The text is valid JSON, so this removes exactly the strings: whatever whitespace and
    # digits remain lie between tokens and in numbers.
    skeleton = _STRING.sub('""', text)
    runs = [len(run) for run in re.findall(r"[ \t\n\r]+", skeleton)]
    if runs and (not any_whitespace or max(runs) > MAX_WHITESPACE):
        return False
    for number in _NUMBER.finditer(skeleton):
        if any(len(digits or "") > cap for digits, cap in zip(number.groups(), CAPS.values())):
            return False
    opened = np.cumsum([(c in "[{") - (c in "]}") for c in skeleton])
    return int(opened.max()) <= MAX_DEPTH


def has_lone_surrogate(value: object) -> bool:
    """Whether a string in `value` (a key too) holds a surrogate code point: json.loads makes
    a pair of surrogate escapes one character, so a surrogate left is a lone escape."""
    if isinstance(value, str):
        return any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, dict):
        return any(has_lone_surrogate(k) or has_lone_surrogate(v) for k, v in value.items())
    return isinstance(value, list) and any(map(has_lone_surrogate, value))


def jiter_accepts(data: bytes) -> bool:
    """Whether pydantic's own JSON parser reads `data` (NaN and Infinity refused)."""
    try:
        from_json(data, allow_inf_nan=False)
    except ValueError:
        return False
    return True


def oracle(data: bytes, top_level_object: bool = True, any_whitespace: bool = True) -> bool:
    """Whether `data` is one JSON text (strict UTF-8, no lone surrogate escape) within the
    automaton's bounds."""
    try:
        text = data.decode("utf-8")
        value = json.loads(text, parse_constant=_reject_constant)
    except ValueError:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        return False
    return not has_lone_surrogate(value) and obeys_bounds(text, value, top_level_object, any_whitespace)


def accepts(automaton: JsonAutomaton, data: bytes) -> bool:
    """The automaton's verdict on a whole text."""
    return automaton.is_accepting(automaton.walk(automaton.start, data))


# ---- random documents ------------------------------------------------------------------
_PIECES = ["a", "key", " ", '"', "\\", "/", "\n", "\t", "\b", "\f", "\r", "\x00", "\x1f", "\x7f",
           "é", "ß", "中文", "\u2028", "\ud7ff", "\ue000", "\uffff", "😀", "𝄞", "\U0010ffff"]
_PLACEHOLDER = re.compile(r'"\\u0001(\d+)"')  # how json.dumps writes a placeholder string


# Surrogates as Python code points: json.dumps escapes them (ASCII output; two in a row form
# a pair), or writes them raw, which "surrogatepass" encodes as invalid UTF-8.
_SURROGATES = ["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d\ude00", "\ud83d\ude00", "\ud800\ud800\udc00"]


def random_string(rng: random.Random) -> str:
    """A short string mixing ASCII, escapes-to-be, controls and 2- to 4-byte characters, now
    and then a surrogate."""
    text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 5)))
    return text + rng.choice(_SURROGATES) if rng.random() < 0.04 else text


def random_number(rng: random.Random) -> str:
    """Number text of any JSON shape; a part's digit count sometimes sits at its cap or one
    past it (an exponent past it at times makes json.loads return inf)."""
    def digits(part: str, first: str = "0123456789") -> str:
        cap = CAPS[part]
        n = rng.choice([1, 1, 1, 2, 3, 6, cap, cap] + [cap, cap + 1, cap + 1, cap + 2])
        return rng.choice(first) + "".join(rng.choice("0123456789") for _ in range(n - 1))

    text = rng.choice(["", "-"]) + rng.choice(["0", digits("integer", "123456789")])
    if rng.random() < 0.4:
        text += "." + digits("fraction")
    if rng.random() < 0.4:
        text += rng.choice("eE") + rng.choice(["", "+", "-"]) + digits("exponent")
    return text


def random_value(rng: random.Random, numbers: list[str], depth: int = 0) -> object:
    """A random JSON value; raw number texts go to `numbers`, a placeholder in their place."""
    r = rng.random()
    if depth < 4 and r < 0.3:
        return {random_string(rng): random_value(rng, numbers, depth + 1) for _ in range(rng.randint(0, 5))}
    if depth < 4 and r < 0.5:
        return [random_value(rng, numbers, depth + 1) for _ in range(rng.randint(0, 5))]
    if r < 0.65:
        return random_string(rng)
    if r < 0.75:
        numbers.append(random_number(rng))
        return f"\x01{len(numbers) - 1}"
    return rng.choice([True, False, None, 0, -7, 10**20, 1.5, -2.5e-300, 1e22, 0.1])


def sprinkle_whitespace(rng: random.Random, text: str) -> str:
    """Random whitespace runs (now and then one byte over the bound) around the
    punctuation of compact JSON `text`, never inside strings."""
    def pad(match: re.Match) -> str:
        if match.group().startswith('"'):
            return match.group()
        n = rng.choice([0, 0, 1, 2, 5, MAX_WHITESPACE, MAX_WHITESPACE + 1] if rng.random() < 0.1 else [0, 1, 2])
        return match.group() + "".join(rng.choice(_WHITESPACE) for _ in range(n))
    return _STRING_OR_PUNCTUATION.sub(pad, text)


def random_document(rng: random.Random, top_level_object: bool, any_whitespace: bool) -> bytes:
    """A random JSON text: compact, indented or sprinkled with whitespace (mostly compact
    without `any_whitespace`), ASCII-escaped or not."""
    numbers: list[str] = []
    value = random_value(rng, numbers)
    if top_level_object and rng.random() < 0.9 and not isinstance(value, dict):
        value = {random_string(rng): value}
    ensure_ascii = rng.random() < 0.5
    style = rng.randrange(3) if any_whitespace or rng.random() < 0.3 else 1
    if style == 0:
        text = json.dumps(value, ensure_ascii=ensure_ascii, indent=rng.choice([1, 2, 4]))
    else:
        text = json.dumps(value, ensure_ascii=ensure_ascii, separators=(",", ":"))
    text = _PLACEHOLDER.sub(lambda m: numbers[int(m.group(1))], text)
    if style == 2:
        text = sprinkle_whitespace(rng, text)
    return text.encode("utf-8", "surrogatepass")


_INTERESTING = b'{}[]:,"\\ \t\n\r0123456789-+.eEtfnulrasux\x00\x1f\x7f\x80\xbf\xc0\xc3\xe0\xed\xf0\xf4\xf5\xff'


def mutate(rng: random.Random, data: bytes) -> bytes:
    """`data` with one byte deleted, inserted or replaced, or cut short."""
    op = rng.randrange(4)
    i = rng.randrange(len(data) + (op == 1))
    byte = bytes([rng.choice(_INTERESTING) if rng.random() < 0.7 else rng.randrange(256)])
    return [data[:i] + data[i + 1:], data[:i] + byte + data[i:], data[:i] + byte + data[i + 1:], data[:i]][op]


def corpus(seed: int, top_level_object: bool, any_whitespace: bool, documents: int) -> list[bytes]:
    """Random documents, each followed by three random mutations of it."""
    rng = random.Random(seed)
    texts = []
    for _ in range(documents):
        document = random_document(rng, top_level_object, any_whitespace)
        texts += [document] + [mutate(rng, document) for _ in range(3)]
    return texts


# ---- liveness ----------------------------------------------------------------------------
# Bytes that can finish any JSON prefix: closers, a quote, a digit, the colon, the letters of
# the literals and of a one-letter escape, the `\` and `d` of a low surrogate escape due, one
# continuation byte from each UTF-8 range, and last (so that it is tried only where nothing
# else will do) the brace a text must open with.
_FINISHERS = b'}]":0' + b"nulraes" + b"\\d" + bytes([0x80, 0x90, 0xA0]) + b"{"


def completion(automaton: JsonAutomaton, state: int, memo: dict[int, bytes]) -> bytes | None:
    """Bytes that take `state` to an accepting state (a depth-first search over
    `_FINISHERS`), or None if there are none; `memo` caches the answers by state."""
    states, suffix, choices, seen = [state], [], [iter(_FINISHERS)], {state}
    while states:
        current = states[-1]
        if current in memo or automaton.is_accepting(current):
            tail = memo.get(current, b"")
            for i, on_path in enumerate(states):
                memo[on_path] = bytes(suffix[i:]) + tail
            return memo[state]
        for byte in choices[-1]:
            nxt = automaton.next_state(current, byte)
            if nxt != DEAD and nxt not in seen:
                seen.add(nxt)
                states.append(nxt)
                suffix.append(byte)
                choices.append(iter(_FINISHERS))
                break
        else:
            states.pop()
            choices.pop()
            if suffix:
                suffix.pop()
    return None


# ---- tests -------------------------------------------------------------------------------
@pytest.mark.parametrize("top_level_object,any_whitespace", CONFIGS)
def test_random_texts_match_oracle(top_level_object: bool, any_whitespace: bool) -> None:
    """Random documents and their mutations: accepted exactly when the oracle accepts; an
    accepted top-level object ends in a state with no live continuation."""
    automaton = JsonAutomaton(top_level_object, any_whitespace)
    verdicts, lone_surrogates = [], 0
    for text in corpus(7 + top_level_object + 2 * any_whitespace, top_level_object, any_whitespace, 400):
        expected = oracle(text, top_level_object, any_whitespace)
        end = automaton.walk(automaton.start, text)
        assert automaton.is_accepting(end) == expected, text
        if expected:
            assert jiter_accepts(text), text
        if expected and top_level_object:
            assert not automaton.can_continue(end), text
        try:
            lone = has_lone_surrogate(json.loads(text))
        except ValueError:
            lone = False
        if lone:  # what json.loads reads and jiter refuses
            lone_surrogates += 1
            assert not jiter_accepts(text), text
        verdicts.append(expected)
    # Both verdicts must be common, or the comparison says little.
    assert 200 < sum(verdicts) < len(verdicts) - 200
    assert lone_surrogates > 20


@pytest.mark.parametrize("top_level_object,any_whitespace", CONFIGS)
def test_every_live_prefix_can_be_completed(top_level_object: bool, any_whitespace: bool) -> None:
    """Every byte prefix of every text: it accepts exactly when the oracle accepts it, and
    if its state is not DEAD, some bytes finish it into a text the oracle accepts; every
    prefix of an accepted text is not DEAD."""
    automaton, memo = JsonAutomaton(top_level_object, any_whitespace), {}
    texts = corpus(100 + top_level_object + 2 * any_whitespace, top_level_object, any_whitespace, 40)
    for text in [t for t in texts if len(t) < 600]:  # (the test is quadratic in length)
        whole = oracle(text, top_level_object, any_whitespace)
        state = automaton.start
        for n in range(len(text) + 1):
            if n:
                state = automaton.next_state(state, text[n - 1])
            if state == DEAD:
                assert not whole, text[:n]
                break
            prefix = text[:n]
            assert automaton.is_accepting(state) == oracle(prefix, top_level_object, any_whitespace), prefix
            finish = completion(automaton, state, memo)
            assert finish is not None, prefix
            assert oracle(prefix + finish, top_level_object, any_whitespace), prefix + finish


@pytest.mark.parametrize("top_level_object,any_whitespace", CONFIGS)
def test_no_wrong_byte_stays_live(top_level_object: bool, any_whitespace: bool) -> None:
    """After every prefix of a few documents, each of the 256 bytes that the automaton keeps
    live can be finished into a text the oracle accepts."""
    automaton, memo = JsonAutomaton(top_level_object, any_whitespace), {}
    texts = corpus(200 + top_level_object + 2 * any_whitespace, top_level_object, any_whitespace, 16)
    documents = [d for d in texts[::4] if len(d) < 300]  # (the test is quadratic in length)
    documents.append(b'{"k\\u00e9\xc3\xa9":[-0.5E+1,1e2,0,true,false,null,"\\n\xf0\x9f\x98\x80",{},[]],"":{"x":1}}')
    for document in documents:
        state = automaton.start
        for n in range(len(document) + 1):
            for byte in range(256):
                nxt = automaton.next_state(state, byte)
                if nxt != DEAD:
                    text = document[:n] + bytes([byte]) + completion(automaton, nxt, memo)
                    assert oracle(text, top_level_object, any_whitespace), text
            if n == len(document) or state == DEAD:
                break
            state = automaton.next_state(state, document[n])


def test_truncated_document_is_live_but_not_accepting() -> None:
    """A document cut anywhere before its last byte is not DEAD and does not accept; whole,
    it accepts and cannot continue."""
    automaton = JsonAutomaton()
    document = json.dumps({"a": [1, -2.5e-3, {"b": None}], "é😀": "x\\y\u0001", "t": True}, indent=2,
                          ensure_ascii=False).encode()
    assert oracle(document)
    for n in range(len(document)):
        state = automaton.walk(automaton.start, document[:n])
        assert state != DEAD and not automaton.is_accepting(state), document[:n]
    end = automaton.walk(automaton.start, document)
    assert automaton.is_accepting(end) and not automaton.can_continue(end)


def is_character(data: bytes) -> bool:
    """Whether `data` is the UTF-8 of exactly one Unicode scalar value."""
    try:
        return len(data.decode("utf-8")) == 1
    except UnicodeDecodeError:
        return False


def test_utf8_in_strings_is_validated_byte_by_byte() -> None:
    """Inside a string, every byte sequence that starts with a non-ASCII byte (exhaustively
    up to 3 bytes, sampled at 4) is live exactly when it is a prefix of some valid UTF-8
    character, and is back in plain string text exactly when it is a whole character."""
    valid_prefixes = set()  # of the characters' encodings, except whole 4-byte ones
    for code_point in [*range(0x80, 0xD800), *range(0xE000, 0x10000), *range(0x10000, 0x110000, 64)]:
        encoded = chr(code_point).encode()  # (4-byte forms: the last byte holds the low 6 bits)
        valid_prefixes.update(encoded[:k] for k in range(1, min(len(encoded), 3) + 1))
    rng = random.Random(3)
    four_byte_heads = rng.sample(sorted(p for p in valid_prefixes if len(p) == 3 and p[0] >= 0xF0), 300)
    tokens = [head + bytes([b]) for head in four_byte_heads for b in range(256)]
    tokens += [bytes([a, b, c]) for a in range(0xE0, 0xF5) for b in range(0x80, 0xC0) for c in range(256)]
    tokens += [bytes([a, b]) for a in range(0x80, 0x100) for b in range(256)]
    tokens += [bytes([a]) for a in range(0x80, 0x100)]
    automaton = JsonAutomaton()
    in_string = automaton.walk(automaton.start, b'{"a":"x')
    lengths = np.array([len(t) for t in tokens])
    table = np.zeros((len(tokens), 4), dtype=np.uint8)
    for i, token in enumerate(tokens):
        table[i, : len(token)] = list(token)
    ends = automaton.walk_tokens(in_string, table, lengths)
    whole = np.array([is_character(t) for t in tokens])
    live = whole | np.array([t in valid_prefixes for t in tokens])
    assert live.sum() > 100_000 and whole.sum() > 60_000
    assert np.array_equal(ends != DEAD, live)
    assert np.array_equal(ends == in_string, whole)


@pytest.mark.parametrize("bad,offending", [
    (b"\xc0\x80", 0),  # overlong NUL: C0 is never a lead byte
    (b"\xc1\xbf", 0),
    (b"\xe0\x80\x80", 1),  # overlong 3-byte form
    (b"\xf0\x8f\xbf\xbf", 1),  # overlong 4-byte form
    (b"\xed\xa0\x80", 1),  # surrogate U+D800
    (b"\xed\xbf\xbf", 1),  # surrogate U+DFFF
    (b"\xf4\x90\x80\x80", 1),  # U+110000
    (b"\xf5\x80\x80\x80", 0),
    (b"\xff", 0),
    (b"\x80", 0),  # lone continuation byte
    (b"\xc3\xa9\xa9", 2),  # continuation byte after a whole character
    (b"\xe4\xb8\"", 2),  # character cut short by the closing quote
    (b"\xf0\x9f\x98A", 3),
])
def test_invalid_utf8_is_dead_at_the_offending_byte(bad: bytes, offending: int) -> None:
    """In a key and in a value, the walk is live up to the offending byte and DEAD on it."""
    automaton = JsonAutomaton()
    for head in (b'{"', b'{"k":"ok'):
        before = automaton.walk(automaton.start, head + bad[:offending])
        assert before != DEAD
        assert automaton.next_state(before, bad[offending]) == DEAD
        assert not oracle(head + bad + b'":1}') and not oracle(head + bad + b'"}')


def test_string_bytes_and_escapes_match_oracle() -> None:
    """Each byte as string text, after a backslash, at each hex digit of a \\u escape (of
    a plain code point, of a high surrogate, of the low one after it) and at each byte of
    the `\\uD` that must follow a high surrogate escape."""
    automaton = JsonAutomaton()
    texts = []
    for b in range(256):
        byte = bytes([b])
        texts += [b'{"a":"x' + byte + b'"}', b'{"a":"\\' + byte + b'0000"}']
        for escape in (b"\\u0000", b"\\ud800", b"\\uDbFf\\udc00", b"\\ud83d\\uDE00"):
            texts += [b'{"a":"' + escape[:i] + byte + escape[i + 1:] + b'"}' for i in range(1, len(escape))]
        texts += [b'{"a":"\\ud800' + byte + b'"}', b'{"\\udbff' + byte + b'x":1}']
    texts += [b'{"a":"\\ud800"}', b'{"\\uDBFF\\uDfFf":"\\uDC00\\uD800"}', b'{"\\udc00":1}']  # lone ones
    texts += [b'{"\\uDBFF\\uDfFf":"\\uD800\\uDC00\\ud7ff\\ue000"}']  # pairs and their neighbours
    verdicts = [oracle(t) for t in texts]
    assert [accepts(automaton, t) for t in texts] == verdicts
    assert [jiter_accepts(t) for t in texts if t.isascii()] == [v for t, v in zip(texts, verdicts) if t.isascii()]
    assert sum(verdicts) > 300 and verdicts[-1] and not any(verdicts[-4:-1])


def test_surrogate_escapes_only_as_pairs_exhaustively() -> None:
    """Every `\\uXXXX` escape (both cases of hex letters) is accepted alone exactly when it
    is no surrogate; after a high surrogate escape exactly the low ones are."""
    automaton = JsonAutomaton()
    in_string = automaton.walk(automaton.start, b'{"a":"')

    def accepted(escapes: list[bytes]) -> np.ndarray:
        tokens = [e + b'"}' for e in escapes]
        table = np.array([list(t) for t in tokens], dtype=np.uint8)  # (all of one length)
        ends = automaton.walk_tokens(in_string, table, np.full(len(tokens), table.shape[1]))
        return np.array([automaton.is_accepting(int(e)) for e in ends])

    units = np.arange(0x10000)
    for spell in ("\\u%04x", "\\u%04X"):
        singles = accepted([(spell % u).encode() for u in units])
        assert np.array_equal(singles, (units < 0xD800) | (units > 0xDFFF))
        for high in (0xD800, 0xD83D, 0xDBFF):
            pairs = accepted([(spell % high + spell % u).encode() for u in units])
            assert np.array_equal(pairs, (units >= 0xDC00) & (units <= 0xDFFF))
    rng = random.Random(5)
    for first, second in [(rng.randrange(0x10000), rng.randrange(0xD800, 0xE000)) for _ in range(300)]:
        text = b'{"a":"\\u%04x\\u%04x"}' % (first, second)
        assert accepts(automaton, text) == oracle(text) == jiter_accepts(text), text


def random_walk(automaton: JsonAutomaton, rng: random.Random, steps: int, memo: dict[int, bytes]) -> bytes:
    """Up to `steps` random live bytes from the start, each step choosing uniformly among
    the distinct successor states (so that a closing quote is as likely as the 90-odd
    ASCII bytes that stay in the string) and then a byte leading there; then the shortest
    way `completion` finds to an accepting state."""
    byte_tokens = np.arange(256, dtype=np.uint8).reshape(256, 1)
    ones = np.ones(256, dtype=np.int64)
    state, text = automaton.start, bytearray()
    for _ in range(steps):
        successors = automaton.walk_tokens(state, byte_tokens, ones)
        choices = sorted(set(successors.tolist()) - {DEAD})
        if not choices:
            break
        state = rng.choice(choices)
        text.append(rng.choice(np.flatnonzero(successors == state).tolist()))
    return bytes(text) + completion(automaton, state, memo)


@pytest.mark.parametrize("top_level_object", [True, False])
def test_random_walks_are_valid_for_strict_parsers(top_level_object: bool) -> None:
    """Texts from random walks through the automaton (thousands, seeded): each one is valid
    UTF-8 that json.loads reads without a lone surrogate, that jiter reads, and that a
    pydantic model of any JSON (any object) validates; every number in it is within the
    caps and finite."""
    automaton, memo, rng = JsonAutomaton(top_level_object), {}, random.Random(23 + top_level_object)
    model = pydantic.TypeAdapter(dict[str, Any] if top_level_object else Any)
    pairs = 0
    for _ in range(1500):
        text = random_walk(automaton, rng, rng.choice([5, 20, 60, 200, 400]), memo)
        assert automaton.is_accepting(automaton.walk(automaton.start, text)), text
        assert oracle(text, top_level_object), text
        assert jiter_accepts(text), text
        model.validate_json(text)
        for number in numbers_in(text):
            check_number(number)
        pairs += re.search(rb"\\u[dD][89abAB]", text) is not None
    assert pairs > 15  # (the walks do reach surrogate pair escapes)


def test_walk_tokens_matches_walk() -> None:
    """walk_tokens over a random vocabulary equals walk token by token, from start states
    reached by walking prefixes of real documents (and from DEAD)."""
    rng = random.Random(11)
    documents = corpus(5, True, True, 20)[::4]
    vocabulary = {bytes([b]) for b in range(256)}
    for _ in range(800):
        document = rng.choice(documents)
        i = rng.randrange(len(document))
        vocabulary.add(document[i: i + rng.randint(2, 12)])
    vocabulary.update(bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))) for _ in range(200))
    tokens = sorted(vocabulary, key=len, reverse=True)
    lengths = np.array([len(t) for t in tokens])
    table = np.zeros((len(tokens), int(lengths.max())), dtype=np.uint8)
    for i, token in enumerate(tokens):
        table[i, : len(token)] = list(token)
    automaton = JsonAutomaton()
    starts = [DEAD] + [automaton.walk(automaton.start, d[: rng.randrange(len(d))]) for d in documents for _ in range(4)]
    for start in starts:
        together = automaton.walk_tokens(start, table, lengths)
        assert together.tolist() == [automaton.walk(start, t) for t in tokens]
    assert sum(s != DEAD for s in starts) > 10


@pytest.mark.parametrize("top_level_object", [True, False])
@pytest.mark.parametrize("opener,closer", [(b"[", b"]"), (b'{"k":', b"}")])
def test_depth_bound_is_exact(top_level_object: bool, opener: bytes, closer: bytes) -> None:
    """MAX_DEPTH containers may be open at once: one more opening bracket is DEAD, while
    other values still fit at the deepest level."""
    automaton = JsonAutomaton(top_level_object)
    outer, inner = (b'{"k":', b"}") if top_level_object else (opener, closer)
    deepest = outer + opener * (MAX_DEPTH - 1)
    state = automaton.walk(automaton.start, deepest)
    assert state != DEAD
    assert automaton.next_state(state, ord(opener[:1])) == DEAD and automaton.next_state(state, ord("{")) == DEAD
    for value in (b"1", b'"s"', b"null"):
        text = deepest + value + closer * (MAX_DEPTH - 1) + inner
        assert accepts(automaton, text) and oracle(text, top_level_object)
    too_deep = deepest + opener + b"1" + closer * MAX_DEPTH + inner
    assert not accepts(automaton, too_deep) and not oracle(too_deep, top_level_object)
    assert json.loads(too_deep)  # (only the depth bound rejects it)


def test_whitespace_bound_is_exact() -> None:
    """Runs of up to MAX_WHITESPACE bytes between tokens; one more is DEAD; none before or
    after the top-level value; none at all without any_whitespace."""
    automaton = JsonAutomaton()
    run = (_WHITESPACE * MAX_WHITESPACE)[:MAX_WHITESPACE].encode()
    for head, tail in [(b"{", b'"a":1}'), (b'{"a"', b":1}"), (b'{"a":', b"1}"), (b'{"a":1', b"}"),
                       (b'{"a":[1', b"]}"), (b'{"a":[', b"]}"), (b'{"a":1', b',"b":2}')]:
        assert accepts(automaton, head + run + tail) and oracle(head + run + tail)
        state = automaton.walk(automaton.start, head + run)
        assert state != DEAD and automaton.next_state(state, ord(" ")) == DEAD
        assert not oracle(head + run + b" " + tail)
    assert automaton.next_state(automaton.start, ord(" ")) == DEAD
    end = automaton.walk(automaton.start, b'{"a":1}')
    assert automaton.is_accepting(end) and all(automaton.next_state(end, b) == DEAD for b in b" \t\n\r")
    strict = JsonAutomaton(any_whitespace=False)
    assert accepts(strict, b'{"a":[1,{"b":null}]}') and not accepts(strict, b'{"a": 1}')
    assert strict.walk(strict.start, b'{"a":') != DEAD and strict.walk(strict.start, b'{"a": ') == DEAD


@pytest.mark.parametrize("part, make", [
    ("integer", lambda d: d), ("integer", lambda d: b"-" + d), ("integer", lambda d: d + b".5e-3"),
    ("fraction", lambda d: b"-0." + d), ("fraction", lambda d: b"1." + d + b"E+1"),
    ("exponent", lambda d: b"1e" + d), ("exponent", lambda d: b"1.5E-" + d), ("exponent", lambda d: b"-0e+" + d),
])
def test_number_digit_caps_are_exact(part: str, make: Callable[[bytes], bytes]) -> None:
    """Each part of a number holds up to its cap of digits; one more is DEAD, in an object
    and alone (where at the cap a number accepts and cannot go on with a digit)."""
    automaton, anything = JsonAutomaton(), JsonAutomaton(top_level_object=False)
    number = make(b"9" * CAPS[part])
    text = b'{"n":' + number + b"}"
    assert accepts(automaton, text) and oracle(text)
    check_number(number.decode())
    cut = len(b'{"n":') + number.rindex(b"9") + 1  # right after the cap's last digit
    state = automaton.walk(automaton.start, text[:cut])
    assert state != DEAD and automaton.next_state(state, ord("0")) == DEAD
    past = text[:cut] + b"0" + text[cut:]
    assert not accepts(automaton, past) and not oracle(past) and json.loads(past)
    alone = anything.walk(anything.start, text[len(b'{"n":'):cut])
    assert anything.is_accepting(alone) and not any(anything.next_state(alone, b) != DEAD for b in b"0123456789")


def test_numbers_at_and_past_the_caps() -> None:
    """The texts at and just past each cap (`1e400`, `9e99999999`, a 21-digit integer part,
    ...) are accepted exactly when they are within the caps, alone and in an object."""
    anything, objects = JsonAutomaton(top_level_object=False), JsonAutomaton()
    for text, capped in AT_THE_CAPS:
        assert accepts(anything, text.encode()) == capped, text
        assert accepts(objects, b'{"n":[' + text.encode() + b"]}") == capped, text


@pytest.mark.parametrize("top_level_object", [True, False])
def test_greedy_walks_write_only_numbers_consumers_read_exactly(top_level_object: bool) -> None:
    """Random walks that favour digits, as greedy decoding may, reach every cap, and every
    number they write is a finite float to json.loads, jiter and pydantic (an integer
    exact); the whole text validates as pydantic's finite floats where it holds floats."""
    automaton = JsonAutomaton(top_level_object)
    longest = dict.fromkeys(CAPS, 0)
    for text in greedy_walks(automaton, seed=31 + top_level_object, count=800, max_bytes=300):
        assert jiter_accepts(text.encode()), text
        for number in numbers_in(text):
            check_number(number)
            longest = {part: max(longest[part], len(digits)) for part, digits in zip(longest, parts(number))}
    assert longest == CAPS, longest


def test_top_level_values() -> None:
    """With top_level_object=False any value stands alone, and a number accepts yet can go
    on; with it, only an object may start."""
    anything = JsonAutomaton(top_level_object=False)
    for text in [b"12", b"-0", b"1.5e+7", b"0E0", b'"s\xc3\xa9"', b"true", b"false", b"null", b"[]", b"{}"]:
        end = anything.walk(anything.start, text)
        assert anything.is_accepting(end) and oracle(text, top_level_object=False), text
        assert anything.can_continue(end) == text[-1:].isdigit(), text
    for text in [b"-", b"1.", b"1e", b"1e+", b"tru", b'"s', b"01", b"+1", b".5", b"1 ", b"NaN", b"Infinity"]:
        assert not accepts(anything, text) and not oracle(text, top_level_object=False), text
    objects = JsonAutomaton()
    assert [b for b in range(256) if objects.next_state(objects.start, b) != DEAD] == [ord("{")]


def test_equal_configurations_share_a_state() -> None:
    """What was consumed does not matter, only the configuration it leaves."""
    automaton = JsonAutomaton()

    def state(text: bytes) -> int:
        return automaton.walk(automaton.start, text)

    assert state(b'{"a":1,') == state(b'{"bcd":"x\\n\xc3\xa9\\u00e9",') == state(b'{"z":[[],{}],')
    assert state(b'{"a":[1, ') == state(b'{"b":[null, ') != state(b'{"b":[null,  ')
    assert state(b'{"a":[1,1,1,') == state(b'{"a":[1,')
    assert state(b'{"a":"xyz') == state(b'{"a":"') != state(b'{"a') != state(b'{"a":[{"a":"')
    assert state(b'{"a":12') != state(b'{"a":123')
