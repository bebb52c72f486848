"""compile_regex against Python's `re` (full match, re.ASCII) on text and on raw bytes,
the liveness of every state (prefixes that can still be completed, and only those), the
UTF-8 handling at the byte level (exhaustively over all code points for some classes),
the vectorised vocabulary walk, and the refusal of unsupported syntax."""
import functools
import random
import re
from collections import deque

import numpy as np
import pytest

from hybrid_engine.structured.automaton import DEAD, ByteAutomaton
from hybrid_engine.structured.regex import MAX_NFA_STATES, compile_regex

# Patterns whose meaning under re.fullmatch(..., re.ASCII) is the one compile_regex gives.
PATTERNS = [
    "abc", "a|b|", "a||b", "(ab|ac)*x", "a*b+c?", r"\d{2,4}", "x{3}", "(ab){2,}", "(a|bc){0,3}d",
    r"[a-z]+@[a-z]+\.(com|org)", "[^a-z]*", ".", ".*", ".+x", r"\w+\s\W\S\D", r"[\d\s]*",
    r"[^\d\s]+", "[]a-]+", "[-a]", r"[a\-z]", r"[\]\\]+", "é+", "[éè]x", "[^é]", "😀|😃+",
    "[😀-🙏]{1,3}", r"[\u0100-\u07ff]+", r"[\u0800-\uffff]", r"[\U00010000-\U0010ffff]",
    r"\x41\u00e9\U0001F600", r"\n\t\r\f\v\0", r"\.\*\+\?\(\)\[\]\{\}\|\^\$\\\/", r"[\b]",
    "a{,2}", "a{2,}?b", "a*?", "a{1,3}?", "(?:ab)+", "(?P<n>a|b)c", "^ab$", "^", "$",
    "a|b$", "^a|b", "a{", "a{}b", "a{,}b", "x{1}{", "a{x}", "a{1,2", "}]", "中文?", "(a*)*b",
    "(|a)+", "()", r"[\s\S]", r"[^\x00-\U0010ffff]", r"ab[^\x00-\U0010ffff]|ac",
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
    r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4}){0,5}"', r"[^\n]{2}\n?",
    r"ab[^\x00-\U0010ffff]|c", r"([a-c]x|[c-e]y|c+z|[^b-d]w)*", "(é|[è-ê]ß|[ê-ñ]+)?!",
]
MATCHES_NOTHING = r"[^\x00-\U0010ffff]"
EXTRA_CHARS = ["a", "b", "c", "x", "0", "9", " ", "\n", "\t", "\x00", "\x08", "\x7f", "é", "è",
               "\x80", "\u07ff", "\u0800", "中", "\ud7ff", "\ue000", "\uffff", "😀", "😃",
               "\U00010000", "\U0010ffff", '"', "\\", "u", "-", "]"]


def accepts(automaton: ByteAutomaton, data: bytes) -> bool:
    return automaton.is_accepting(automaton.walk(automaton.start, data))


def python_accepts(pattern: str, data: bytes) -> bool:
    """Whether `data` is valid UTF-8 (Python's strict decoder: no overlongs, surrogates or
    code points above U+10FFFF) whose text `pattern` fully matches."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return re.fullmatch(pattern, text, re.ASCII) is not None


def alphabet(pattern: str) -> list[str]:
    return sorted(set(pattern) - {"\\"} | set(EXTRA_CHARS))


SINGLE_BYTES, ONES = np.arange(256, dtype=np.uint8)[:, None], np.ones(256, dtype=np.int64)


def successors(automaton: ByteAutomaton, state: int) -> np.ndarray:
    """[256] the state after each byte (all bytes at once, through walk_tokens)."""
    return automaton.walk_tokens(state, SINGLE_BYTES, ONES)


def random_walk(automaton: ByteAutomaton, rng: random.Random, max_len: int = 30) -> bytes:
    """Bytes along a random path of live states (stopping at random accepting states),
    completed by the shortest way to acceptance: a string the automaton accepts, if any."""
    state, out = automaton.start, bytearray()
    while state != DEAD and len(out) < max_len:
        if automaton.is_accepting(state) and rng.random() < 0.3:
            return bytes(out)
        live = np.flatnonzero(successors(automaton, state) != DEAD).tolist()
        if not live:
            break
        out.append(rng.choice(live))
        state = automaton.next_state(state, out[-1])
    rest = completion(automaton, state) if state != DEAD else b""
    assert rest is not None, f"live state {state} after {bytes(out)!r} cannot accept"
    return bytes(out) + rest


def completion(automaton: ByteAutomaton, state: int) -> bytes | None:
    """The shortest bytes leading from `state` to acceptance (breadth-first), if any."""
    paths, queue = {state: b""}, deque([state])
    while queue:
        s = queue.popleft()
        if automaton.is_accepting(s):
            return paths[s]
        nxt = successors(automaton, s)
        targets, first_bytes = np.unique(nxt, return_index=True)
        for t, b in zip(targets.tolist(), first_bytes.tolist()):
            if t != DEAD and t not in paths:
                paths[t] = paths[s] + bytes([b])
                queue.append(t)
    return None


def mutations(text: str, chars: list[str], rng: random.Random) -> list[str]:
    out = []
    for _ in range(4):
        i = rng.randrange(len(text) + 1)
        out.append(text[:i] + rng.choice(chars) + text[i:])
        if text:
            j = rng.randrange(len(text))
            out.append(text[:j] + text[j + 1:])
            out.append(text[:j] + rng.choice(chars) + text[j + 1:])
    return out


@pytest.mark.parametrize("pattern", PATTERNS)
def test_agrees_with_python_re(pattern: str) -> None:
    automaton = compile_regex(pattern)
    rng = random.Random(pattern)
    chars = alphabet(pattern)
    texts = ["", "a", "ab", "abc", "é", "😀", "\n", "x" * 40]
    texts += ["".join(rng.choice(chars) for _ in range(rng.randrange(8))) for _ in range(300)]
    for _ in range(40):
        data = random_walk(automaton, rng)
        if automaton.start != DEAD:
            assert accepts(automaton, data) and python_accepts(pattern, data), (pattern, data)
            texts.append(data.decode())
            texts += mutations(texts[-1], chars, rng)
    for text in texts:
        data = text.encode()
        assert accepts(automaton, data) == python_accepts(pattern, data), (pattern, text)
    # (and the texts hold matches, unless there are none)
    assert any(python_accepts(pattern, t.encode()) for t in texts) == (pattern != MATCHES_NOTHING)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_agrees_with_python_on_raw_bytes(pattern: str) -> None:
    """Random byte strings, valid UTF-8 or not (stray continuation bytes, cut characters,
    overlong forms, surrogates, lead bytes above U+10FFFF)."""
    automaton = compile_regex(pattern)
    rng = random.Random(pattern)
    pieces = [c.encode() for c in alphabet(pattern)]
    pieces += [bytes([b]) for b in (0x80, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xED, 0xEF, 0xF0,
                                    0xF4, 0xF5, 0xFF)]
    pieces += [b"\xc0\x80", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
               b"\xf0\x80\x80\x80", "😀".encode()[:2], "中".encode()[:2]]
    for _ in range(400):
        data = b"".join(rng.choice(pieces) for _ in range(rng.randrange(7)))
        assert accepts(automaton, data) == python_accepts(pattern, data), (pattern, data)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_reached_state_is_live(pattern: str) -> None:
    """Each non-DEAD state met on random walks and random byte strings has a completion
    that Python accepts; each prefix of an accepted string is non-DEAD."""
    automaton = compile_regex(pattern)
    rng = random.Random(pattern)
    prefixes = set()
    for _ in range(20):
        data = random_walk(automaton, rng)
        assert automaton.start == DEAD or python_accepts(pattern, data), (pattern, data)
        prefixes.update(data[:i] for i in range(len(data) + 1))
    for _ in range(100):
        prefixes.add(bytes(rng.choice([0x61, 0x62, 0x22, 0x5C, 0x30, 0xC3, 0xA9, 0xF0, 0x9F, 0x98])
                           for _ in range(rng.randrange(6))))
    for prefix in prefixes:
        state = automaton.walk(automaton.start, prefix)
        if state != DEAD:
            rest = completion(automaton, state)
            assert rest is not None and python_accepts(pattern, prefix + rest), (pattern, prefix)
        elif python_accepts(pattern, prefix):
            pytest.fail(f"{pattern!r}: accepted {prefix!r} walks into DEAD")


@pytest.mark.parametrize(("pattern", "data", "live", "accepting"), [
    ("ab|ac", b"a", True, False),
    ("ab|ac", b"ad", False, False),
    ("ab|ac", b"ac", True, True),
    ("[é]", b"\xc3", True, False),
    ("[é]", "è".encode(), False, False),
    ("[é]", "é".encode(), True, True),
    (".", b"\xc0", False, False),
    (".", b"\xc0\x80", False, False),
    (".", b"\xe0\x80", False, False),  # overlong 3-byte form
    (".", b"\xed", True, False),
    (".", b"\xed\xa0", False, False),  # a surrogate's lead
    (".", b"\xed\xa0\x80", False, False),
    (".", b"\xf4\x8f\xbf", True, False),
    (".", b"\xf4\x90", False, False),  # above U+10FFFF
    (".", b"\xf5", False, False),
    (".", b"\n", False, False),
    (r"ab[^\x00-\U0010ffff]|ac", b"ab", False, False),  # can never be completed
    (r"ab[^\x00-\U0010ffff]|ac", b"a", True, False),
    (r"ab[^\x00-\U0010ffff]|c", b"a", False, False),
    (r"a[^\x00-\U0010ffff]", b"", False, False),
    (r"[^\x00-\U0010ffff]", b"", False, False),
    (r"x(y[^\x00-\U0010ffff])*", b"xy", False, False),
    ("😀{2}", "😀".encode() + b"\xf0\x9f", True, False),
    ("😀{2}", "😀".encode() + b"\xf0\x9e", False, False),
])
def test_constructed_liveness(pattern: str, data: bytes, live: bool, accepting: bool) -> None:
    automaton = compile_regex(pattern)
    state = automaton.walk(automaton.start, data)
    assert (state != DEAD) == live
    assert automaton.is_accepting(state) == accepting


ALL_CODE_POINTS = np.array([c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF])


@functools.cache
def all_characters() -> str:
    return "".join(map(chr, ALL_CODE_POINTS))


@functools.cache
def utf8_table() -> tuple[np.ndarray, np.ndarray]:
    """[N, 4] uint8 left-aligned UTF-8 encodings of ALL_CODE_POINTS and their [N] lengths,
    computed arithmetically (independently of the module under test)."""
    c = ALL_CODE_POINTS.astype(np.int64)
    lengths = 1 + (c > 0x7F) + (c > 0x7FF) + (c > 0xFFFF)
    table = np.zeros((len(c), 4), dtype=np.uint8)
    for n, lead in ((1, 0x00), (2, 0xC0), (3, 0xE0), (4, 0xF0)):
        rows = lengths == n
        table[rows, 0] = lead | (c[rows] >> (6 * (n - 1)))
        for k in range(1, n):
            table[rows, k] = 0x80 | ((c[rows] >> (6 * (n - 1 - k))) & 0x3F)
    return table, lengths


# Every 1- and 2-byte string, and the 3-byte ones after the lead bytes where UTF-8's rules
# differ (overlongs after E0/F0, surrogates after ED, the U+10FFFF limit after F4).
LEAD_BYTES = {1: tuple(range(256)), 2: tuple(range(256)),
              3: (0xC3, 0xE0, 0xE1, 0xED, 0xEE, 0xEF, 0xF0, 0xF3, 0xF4, 0xF5)}


@functools.cache
def all_strings(width: int) -> np.ndarray:
    """[N, width] uint8: every byte string of `width` bytes led by LEAD_BYTES[width]."""
    axes = [np.array(LEAD_BYTES[width])] + [np.arange(256)] * (width - 1)
    return np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, width).astype(np.uint8)


def prefix_keys(rows: np.ndarray) -> np.ndarray:
    return (rows.astype(np.int64) << (8 * np.arange(rows.shape[1])[::-1])).sum(axis=1)


def class_members(pattern: str) -> np.ndarray:
    """[N] bool: which of ALL_CODE_POINTS Python's one-character `pattern` matches."""
    text = all_characters()
    # Each match is one character, so replacing each by NUL keeps the positions.
    marked = re.sub(pattern, "\0", text, flags=re.ASCII)
    assert len(marked) == len(text)
    members = np.frombuffer(marked.encode("utf-32-le"), dtype=np.uint32) == 0
    members[0] = re.fullmatch(pattern, "\0", re.ASCII) is not None
    return members


@pytest.mark.parametrize("pattern", [
    ".", r"[^a-z\u00e9]", r"[\u0080-\u0800\uffff]", r"[\x7f-\u07ff\ud7ff\ue000-\ufffd]",
    r"[\U0001f600-\U0001f64f\U0010fffe\U00010000-\U0001003f]", r"[\u0fff-\u1001\u3fff\u4000]",
    r"[\x80-\U0010ffff]", r"[\U00040000-\U0010ffff]", r"[^\x00-\U0001003f\U00100000]",
])
def test_single_character_classes_exhaustively(pattern: str) -> None:
    """Every code point's encoding is accepted exactly when Python's class has the code
    point, and every short byte string (all_strings) is live exactly when it begins the
    encoding of a member."""
    automaton = compile_regex(pattern)
    members = class_members(pattern)
    table, lengths = utf8_table()
    # (code points in decreasing order: their encodings' lengths decrease, as walk_tokens needs)
    states = automaton.walk_tokens(automaton.start, table[::-1], lengths[::-1])
    accepting_states = [s for s in np.unique(states).tolist() if automaton.is_accepting(s)]
    np.testing.assert_array_equal(np.isin(states, accepting_states), members[::-1])
    for width in LEAD_BYTES:
        strings = all_strings(width)
        completable = members & (lengths >= width)
        expected_live = np.isin(prefix_keys(strings), prefix_keys(table[completable, :width]))
        states = automaton.walk_tokens(automaton.start, strings, np.full(len(strings), width))
        np.testing.assert_array_equal(states != DEAD, expected_live, err_msg=f"{pattern} {width}")


@pytest.mark.parametrize("pattern", [
    r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4}){0,50}"', "[éè中😀]+x|ab*", ".*",
])
def test_walk_tokens_matches_walk(pattern: str) -> None:
    """The vectorised vocabulary walk equals token-by-token walks, from several states, for
    random tokens that include pieces of multi-byte characters."""
    rng = random.Random(pattern)
    source = ('"ab\\u00e9\\n"xé中😀è' * 3).encode()
    vocab = {source[i:i + rng.randint(1, 8)]
             for i in (rng.randrange(len(source)) for _ in range(900))}
    vocab |= {bytes(rng.randrange(256) for _ in range(rng.randint(1, 4))) for _ in range(300)}
    tokens = sorted(vocab, key=len, reverse=True)
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    token_bytes = np.zeros((len(tokens), int(lengths.max())), dtype=np.uint8)
    for i, t in enumerate(tokens):
        token_bytes[i, :len(t)] = list(t)
    automaton = compile_regex(pattern)
    from_start = automaton.walk_tokens(automaton.start, token_bytes, lengths)  # (expands lazily)
    # A second automaton walked token by token numbers its states differently; compare outcomes.
    reference = compile_regex(pattern)
    outcomes = [(s != DEAD, automaton.is_accepting(s)) for s in from_start.tolist()]
    expected = [(s != DEAD, reference.is_accepting(s))
                for s in (reference.walk(reference.start, t) for t in tokens)]
    assert outcomes == expected
    assert 0 < sum(live for live, _ in outcomes) < len(tokens)
    starts = {automaton.walk(automaton.start, random_walk(automaton, rng)[:k]) for k in range(12)}
    for state in sorted(starts - {DEAD}):
        vectorised = automaton.walk_tokens(state, token_bytes, lengths)
        assert vectorised.tolist() == [automaton.walk(state, t) for t in tokens]


@pytest.mark.parametrize(("pattern", "python_pattern"), [
    ("(?<word>[a-z]+)-(?<n>\\d)", "(?P<word>[a-z]+)-(?P<n>\\d)"),
    ("\\uD83D\\uDE00+|\\ud83d\\ude03", "😀+|😃"),
    ("[\\uD83D\\uDE00-\\uD83D\\uDE4F]x", "[😀-🙏]x"),
    ("a{0}b{1}c{2,2}", "bcc"),
    ("(a|b){2}?c*?", "(a|b){2}c*"),
])
def test_syntax_beyond_python(pattern: str, python_pattern: str) -> None:
    """Forms Python's `re` lacks (or spells differently) against a Python equivalent."""
    automaton = compile_regex(pattern)
    rng = random.Random(pattern)
    chars = alphabet(python_pattern) + ["😀", "😃", "🙏", "🙐", "a", "-", "7"]
    texts = ["".join(rng.choice(chars) for _ in range(rng.randrange(6))) for _ in range(400)]
    texts += [random_walk(automaton, rng).decode() for _ in range(30)]
    outcomes = [accepts(automaton, t.encode()) for t in texts]
    assert outcomes == [python_accepts(python_pattern, t.encode()) for t in texts]
    assert any(outcomes) and not all(outcomes)


@pytest.mark.parametrize(("pattern", "message"), [
    (r"(a)\1", r"backreference \1 is not supported at position 3"),
    (r"(?P<x>a)(?P=x)", "backreference (?P=name) is not supported at position 8"),
    (r"(?<x>a)\k<x>", r"backreference \k is not supported at position 7"),
    ("a(?=b)", "lookahead (?=...) is not supported at position 1"),
    ("a(?!b)", "lookahead (?!...) is not supported at position 1"),
    ("(?<=a)b", "lookbehind (?<=...) is not supported at position 0"),
    ("(?<!a)b", "lookbehind (?<!...) is not supported at position 0"),
    (r"\bfoo", r"assertion \b is not supported at position 0"),
    (r"a\B", r"assertion \B is not supported at position 1"),
    (r"\Aa", r"assertion \A is not supported at position 0"),
    (r"a\Z", r"assertion \Z is not supported at position 1"),
    (r"a\z", r"assertion \z is not supported at position 1"),
    ("(?i)abc", "inline flags (?...) are not supported at position 0"),
    ("x(?i:abc)", "inline flags (?...) are not supported at position 1"),
    ("(?>a)", "atomic group (?>...) is not supported at position 0"),
    ("(?#note)a", "comment group (?#...) is not supported at position 0"),
    ("a*+", "possessive quantifier is not supported at position 2"),
    ("a{1,2}+", "possessive quantifier is not supported at position 6"),
    (r"\p{L}", r"Unicode property class \p is not supported at position 0"),
    (r"[\P{L}]", r"Unicode property class \P is not supported at position 1"),
    ("a{3,2}", "repeat {3,2} has max < min at position 1"),
    ("a^", "'^' is only supported as the first character at position 1"),
    ("a$b", "'$' is only supported as the last character at position 1"),
    ("(a$)", "'$' is only supported as the last character at position 2"),
    ("(ab", "missing ')' for the group opened at position 0"),
    ("ab)", "unbalanced ')' at position 2"),
    ("[abc", "missing ']' for the class opened at position 0"),
    ("x[]", "missing ']' for the class opened at position 1"),
    ("[z-a]", "character range out of order at position 1"),
    (r"[\d-z]", "bad character range (a class as an end) at position 1"),
    ("*a", "nothing to repeat at position 0"),
    ("a|+", "nothing to repeat at position 2"),
    ("^*", "nothing to repeat at position 1"),
    ("{2}", "nothing to repeat at position 0"),
    ("a**", "multiple repeat at position 2"),
    ("a{2}{3}", "multiple repeat at position 4"),
    ("a*??", "multiple repeat at position 3"),
    ("ab\\", "trailing backslash at position 2"),
    (r"\q", r"unknown escape \q at position 0"),
    (r"\x4", r"\x needs 2 hex digits at position 0"),
    (r"\u12g4", r"\u needs 4 hex digits at position 0"),
    (r"\U00110000", "code point 0x110000 is above U+10FFFF at position 0"),
    (r"a\ud800", "lone surrogate U+D800 at position 1"),
    (r"[\uDE00]", "lone surrogate U+DE00 at position 1"),
    ("a\ud800", "lone surrogate U+D800 at position 1"),
    (r"\01", "octal escapes are not supported at position 0"),
    ("(?P<1a>x)", "bad group name at position 4"),
    ("(?<n x)", "bad group name at position 3"),
    ("(" * 120 + ")" * 120, "groups nested deeper than 100 at position 100"),
])
def test_unsupported_or_malformed_syntax_is_refused(pattern: str, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        compile_regex(pattern)
    assert str(raised.value) == f"regex: {message}"


@pytest.mark.parametrize("pattern", ["(a{1000}){1000}", "a{1000000}", "[a-z]{0,250000}",
                                     "(x{2,}){99999999999999999999}"])
def test_too_large_patterns_are_refused(pattern: str) -> None:
    with pytest.raises(ValueError, match=r"^regex: the pattern is too large \(more than "
                                         f"{MAX_NFA_STATES} NFA states"):
        compile_regex(pattern)


def test_large_bounded_repeat_under_the_cap_compiles() -> None:
    automaton = compile_regex("(ab){1000,2000}")
    assert accepts(automaton, b"ab" * 1500) and accepts(automaton, b"ab" * 2000)
    assert not accepts(automaton, b"ab" * 999) and not accepts(automaton, b"ab" * 2001)


def json_like_pattern() -> str:
    """A pattern shaped like a JSON-schema-derived one, about 10k characters."""
    ws = "[ \\n]{0,2}"
    string = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
    number = r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,10})?([eE][+-]?[0-9]{1,3})?"

    def obj(values: list[str]) -> str:
        fields = [f'"key_{i}"{ws}:{ws}{v}' for i, v in enumerate(values)]
        return r"\{" + ws + f"{ws},{ws}".join(fields) + ws + r"\}"

    def array_of(item: str, more: int) -> str:
        return rf"\[{ws}({item}({ws},{ws}{item}){{0,{more}}})?{ws}\]"

    inner = obj([string, number, "(true|false)", '"(red|green|blue)"'] * 3)
    return obj([string, number, array_of(string, 5), inner, "null", array_of(inner, 2)] * 3)


def test_large_pattern_agrees_with_python() -> None:
    pattern = json_like_pattern()
    assert len(pattern) > 8000
    automaton = compile_regex(pattern)
    rng = random.Random(0)
    chars = alphabet(pattern)
    for _ in range(5):
        data = random_walk(automaton, rng, max_len=400)
        assert accepts(automaton, data) and python_accepts(pattern, data)
        for text in mutations(data.decode(), chars, rng):
            assert accepts(automaton, text.encode()) == python_accepts(pattern, text.encode())


def test_nesting_up_to_the_limit_compiles() -> None:
    automaton = compile_regex("(" * 100 + "a|b" + ")*" * 100)
    assert accepts(automaton, b"abba") and accepts(automaton, b"")
    assert not accepts(automaton, b"abc")
