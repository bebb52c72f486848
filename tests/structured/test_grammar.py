"""Tests for `hybrid_engine.structured.grammar`: token masks checked against a token-by-token
brute force, random generation checked by independent validators (json, re, membership),
compile errors, the compiled-grammar cache, and vocabularies that lack bytes."""
import copy
import json
import random
import re
import time

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from hybrid_engine.sampling_params import ParameterError, StructuredOutputsParams
from hybrid_engine.structured import automaton
from hybrid_engine.structured.automaton import DEAD, GrammarTooLarge
from hybrid_engine.structured.grammar import MAX_GRAMMARS, GrammarCompiler, GrammarState, check_grammar, choice_regex
from hybrid_engine.structured.regex import compile_regex
from hybrid_engine.structured.vocabulary import TokenVocabulary
from hybrid_engine.tokenizer import build_byte_tokenizer
from tests.structured.test_vocabulary import train_bpe_tokenizer

BPE_VOCAB_SIZE = 410  # the model's logits width: past the tokenizer's 400, not a multiple of 8

COLORS = ["red", "vert", "bleu", "été"]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": COLORS}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "zip": {"type": "integer", "minimum": 0, "exclusiveMaximum": 100},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
# "日本誝" is the trained BPE's longest token, "日本語", but for its last byte (E8 AA 9D, not
# E8 AA 9E): a walk that stops one byte short of a token's end would allow that token.
NON_ASCII_REGEX = "(café|naïve|日本[人誝]) [0-9]{2}"
# Shared prefixes ("a.b" is whole and may go on to "a.b.c"), regex punctuation, non-ASCII.
CHOICES = ["a.b", "a.b.c", "a(b)", "a+b", "é"]


def check_person(text: str) -> None:
    """`text` is a JSON value valid against PERSON_SCHEMA (keys in `properties` order, none
    repeated), checked by hand."""
    def no_repeats(pairs):
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), keys
        return dict(pairs)

    def check_keys(value, order, required):
        assert isinstance(value, dict)
        assert list(value) == [k for k in order if k in value] and set(required) <= set(value), value

    def is_int(value):
        return isinstance(value, int) and not isinstance(value, bool)

    person = json.loads(text, object_pairs_hook=no_repeats)
    check_keys(person, ["name", "age", "tags", "address"], ["name", "age", "tags"])
    assert isinstance(person["name"], str) and len(person["name"]) <= 8
    assert is_int(person["age"]) and 18 <= person["age"] <= 120
    assert isinstance(person["tags"], list) and len(person["tags"]) <= 3
    assert all(tag in COLORS for tag in person["tags"])
    if "address" in person:
        address = person["address"]
        check_keys(address, ["city", "zip"], ["city"])
        assert isinstance(address["city"], str) and len(address["city"]) <= 6
        if "zip" in address:
            assert is_int(address["zip"]) and 0 <= address["zip"] < 100


def check_compact_person(text: str) -> None:
    """PERSON_SCHEMA with no whitespace between JSON tokens (strings may hold some)."""
    check_person(text)
    assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)), text


def check_json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict) and text == text.strip(), text


def check_regex(text: str) -> None:
    assert re.fullmatch(NON_ASCII_REGEX, text), text


def check_choice(text: str) -> None:
    assert text in CHOICES, text


GRAMMARS = {  # name: (params, an independent check of a whole output)
    "schema": (StructuredOutputsParams(json=PERSON_SCHEMA), check_person),
    "schema_compact": (StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True), check_compact_person),
    "json_object": (StructuredOutputsParams(json_object=True), check_json_object),
    "regex": (StructuredOutputsParams(regex=NON_ASCII_REGEX), check_regex),
    "choice": (StructuredOutputsParams(choice=CHOICES), check_choice),
}
# Known-valid outputs, walked token by token as the tokenizer encodes them.
VALID_TEXTS = {
    "schema": ['{"name": "Zoë", "age": 42, "tags": ["été", "red"], "address": {"city": "Köln", "zip": 7}}',
               '{\n  "name": "日本",\n  "age": 120,\n  "tags": []\n}'],
    "schema_compact": ['{"name":"naïve","age":18,"tags":["bleu"],"address":{"city":"x"}}'],
    "json_object": ['{"a": [1, 2.5e-3, {"b": null}], "emoji": "😀🎉", "ok": true}'],
    "regex": ["café 42", "naïve 07", "日本人 99", "日本誝 00"],
    "choice": CHOICES,
}


@pytest.fixture(scope="module")
def bpe():
    return train_bpe_tokenizer()


@pytest.fixture(scope="module")
def compiler(bpe):
    return GrammarCompiler(TokenVocabulary.of_tokenizer(bpe, BPE_VOCAB_SIZE))


def mask_bits(state: GrammarState) -> list[bool]:
    """`state.write_mask`, unpacked by hand (token t is bit t % 8 of byte t // 8), into a
    buffer that starts all ones so that a bit the mask leaves unwritten shows."""
    out = np.full(state.grammar.vocabulary.mask_bytes, 0xFF, dtype=np.uint8)
    state.write_mask(out)
    return [bool(out[t // 8] >> (t % 8) & 1) for t in range(len(out) * 8)]


def check_mask_brute_force(state: GrammarState, tokenizer, eos: frozenset[int]) -> list[bool]:
    """Every bit of the mask against the automaton walked with that one token's bytes; EOS
    set exactly where the output is whole; nothing for ids the model's vocabulary lacks."""
    vocab, automaton = state.grammar.vocabulary, state.grammar.automaton
    accepting = automaton.is_accepting(state.state)
    assert state.accepting == accepting
    bits = mask_bits(state)
    for token_id, bit in enumerate(bits):
        if token_id in eos and token_id < vocab.vocab_size:
            assert bit == accepting, token_id
        elif token_id >= len(tokenizer):  # padding of the logits past the tokenizer, or of the last byte
            assert not bit, token_id
        else:
            data = vocab.bytes_of.get(token_id)
            assert bit == (data is not None and automaton.walk(state.state, data) != DEAD), token_id
    return bits


def random_walk(state: GrammarState, eos: frozenset[int], rng: random.Random, on_step=None,
                max_tokens: int = 3000) -> list[int]:
    """Sample uniformly among the tokens the mask allows (EOS, where allowed, with probability
    0.3) until the grammar terminates or EOS is drawn; returns the tokens, EOS excluded."""
    tokens = []
    while not state.terminated:
        assert len(tokens) < max_tokens, "the walk did not end"
        bits = on_step(state) if on_step else mask_bits(state)
        allowed = [t for t, bit in enumerate(bits) if bit]
        assert allowed, "a live state with an empty mask"
        allowed_eos = [t for t in allowed if t in eos]
        if allowed_eos and rng.random() < 0.3:
            assert state.accepting
            return tokens
        token = rng.choice([t for t in allowed if t not in eos])
        state.advance(token)
        tokens.append(token)
    return tokens


def decoded(tokenizer, vocab: TokenVocabulary, tokens: list[int]) -> str:
    """The output text: the tokens' vocabulary bytes (strict UTF-8), which must also be what
    the tokenizer decodes."""
    text = b"".join(vocab.bytes_of[t] for t in tokens).decode("utf-8")
    assert tokenizer.decode(tokens) == text
    return text


# ---- masks against brute force -------------------------------------------------------------
@pytest.mark.parametrize("name", GRAMMARS)
def test_masks_match_brute_force_along_valid_texts(bpe, compiler, name):
    params, check = GRAMMARS[name]
    eos = frozenset({bpe.eos_token_id})
    for text in VALID_TEXTS[name]:
        check(text)  # (the example itself is valid)
        state = compiler.start(params, eos)
        for token in bpe.encode(text, add_special_tokens=False):
            assert check_mask_brute_force(state, bpe, eos)[token]
            state.advance(token)
        assert state.accepting and check_mask_brute_force(state, bpe, eos)[bpe.eos_token_id]


@pytest.mark.parametrize("name", GRAMMARS)
def test_masks_match_brute_force_along_random_walks(bpe, compiler, name):
    """Random outputs (seeded), with the mask checked at every step; without EOS ids (as
    with ignore_eos) no EOS bit is ever set, and with an EOS id past the model's vocabulary
    that id is ignored."""
    params, check = GRAMMARS[name]
    for seed, eos in enumerate([frozenset({bpe.eos_token_id}), frozenset(), frozenset({bpe.eos_token_id, 999})] * 2):
        state = compiler.start(params, eos)
        tokens = random_walk(state, eos, random.Random(seed), lambda s: check_mask_brute_force(s, bpe, eos))
        check(decoded(bpe, compiler.vocabulary, tokens))


# ---- random generation ends, and is valid --------------------------------------------------
@pytest.mark.parametrize("name", GRAMMARS)
def test_random_generation_is_valid(bpe, compiler, name):
    params, check = GRAMMARS[name]
    eos = frozenset({bpe.eos_token_id})
    texts = set()
    for seed in range(50):
        state = compiler.start(params, eos)
        text = decoded(bpe, compiler.vocabulary, random_walk(state, eos, random.Random(seed)))
        check(text)
        texts.add(text)
    assert len(texts) >= len(CHOICES)  # (the walks differ: the seeds matter)


def test_choice_ends_at_eos_or_by_termination(bpe, compiler):
    """"a.b" is whole yet may go on to "a.b.c": with EOS both end; without EOS only "a.b.c"
    can (the mask never offers a way out of "a.b")."""
    params = StructuredOutputsParams(choice=CHOICES)
    with_eos, without_eos = set(), set()
    for seed in range(40):
        eos = frozenset({bpe.eos_token_id})
        with_eos.add(decoded(bpe, compiler.vocabulary, random_walk(compiler.start(params, eos), eos, random.Random(seed))))
        state = compiler.start(params, frozenset())
        without_eos.add(decoded(bpe, compiler.vocabulary, random_walk(state, frozenset(), random.Random(seed))))
        assert state.terminated
    assert with_eos == set(CHOICES)
    assert without_eos == set(CHOICES) - {"a.b"}


# ---- choice_regex --------------------------------------------------------------------------
METACHARACTERS = "\\.^$*+?{}[]()|-/"
META_CHOICES = list(METACHARACTERS) + [METACHARACTERS, "a\\b", "x.y", "a*", "a+", "a?", "a{2}", "[ab]", "(a)",
                                       "a|b", "a-z", "^a$", "1/2", "é.", " ", "a b"]


def near_misses(choice: str) -> set[str]:
    """Strings a wrongly escaped `choice` regex could match: shortened, with the last
    character doubled, with each character dropped or replaced by a letter, and what the
    choice means as a regex for a few classics."""
    misses = {choice[:-1], choice + choice[-1], "", "a", "b", "aa", "ab", "xzy", "a-b", "a\\", "\\b", "12"}
    for i in range(len(choice)):
        misses |= {choice[:i] + choice[i + 1:], choice[:i] + "a" + choice[i + 1:], choice[:i] + "z" + choice[i + 1:]}
    return misses


def test_choice_regex_takes_every_metacharacter_literally():
    pattern = choice_regex(META_CHOICES)
    automaton = compile_regex(pattern)

    def accepts(text):
        return automaton.is_accepting(automaton.walk(automaton.start, text.encode()))

    for choice in META_CHOICES:
        assert accepts(choice), choice
        # Python's re reads the pattern the same way (an independent reading of the escapes).
        assert re.fullmatch(pattern, choice), choice
        for miss in near_misses(choice) - set(META_CHOICES):
            assert not accepts(miss), (choice, miss)
            assert not re.fullmatch(pattern, miss), (choice, miss)


def test_choice_regex_single_choices():
    """Each metacharacter alone, as the only choice, is exactly itself."""
    for char in METACHARACTERS:
        automaton = compile_regex(choice_regex([char]))
        assert automaton.is_accepting(automaton.walk(automaton.start, char.encode()))
        for other in ["", "a", char * 2, "\\" + char]:
            if other != char:
                assert not automaton.is_accepting(automaton.walk(automaton.start, other.encode())), (char, other)


# ---- advance, errors -----------------------------------------------------------------------
def test_advance_refuses_a_token_the_mask_does_not_allow(bpe, compiler):
    eos = frozenset({bpe.eos_token_id})
    state = compiler.start(StructuredOutputsParams(regex=NON_ASCII_REGEX), eos)
    bits = mask_bits(state)
    start = state.state
    refused = [bpe.convert_tokens_to_ids("x"), bpe.eos_token_id, bpe.bos_token_id, 400, BPE_VOCAB_SIZE - 1]
    for token in refused:
        assert not bits[token]
        with pytest.raises(ValueError, match="not allowed"):
            state.advance(token)
        assert state.state == start  # (a refused token leaves the state as it was)
    state.advance(bpe.convert_tokens_to_ids("c"))
    assert state.state != start


@pytest.mark.parametrize("params, field", [
    (dict(json={"type": "object", "not": {}}), "structured_outputs.json"),
    (dict(json={"type": "string", "minLength": "3"}), "structured_outputs.json"),
    (dict(json={"type": "strin"}), "structured_outputs.json"),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "structured_outputs.json"),
    (dict(regex="(a"), "structured_outputs.regex"),
    (dict(regex="a(?=b)"), "structured_outputs.regex"),
    (dict(regex="[z-a]"), "structured_outputs.regex"),
])
def test_compile_errors_name_the_field(bpe, params, field):
    params = StructuredOutputsParams(**params)
    with pytest.raises(ParameterError) as error:
        GrammarCompiler(TokenVocabulary.of_tokenizer(bpe, BPE_VOCAB_SIZE)).start(params, frozenset({1}))
    assert error.value.param == field and str(error.value).startswith(field)
    with pytest.raises(ParameterError) as error:
        check_grammar(params)
    assert error.value.param == field and str(error.value).startswith(field)


@pytest.mark.parametrize("pattern", ["", "(?:)", "()", "|", "(?:)*"])
def test_grammar_of_only_the_empty_output_is_refused(compiler, pattern):
    """A request samples at least one token, so a grammar whose only text is "" cannot be met."""
    with pytest.raises(ParameterError) as error:
        compiler.start(StructuredOutputsParams(regex=pattern), frozenset({1}))
    assert error.value.param == "structured_outputs.regex"


def test_empty_output_allowed_but_not_only(bpe, compiler):
    """ "" or "ab": whole at once (EOS allowed first), but "a" may still start."""
    state = compiler.start(StructuredOutputsParams(regex="|ab"), frozenset({bpe.eos_token_id}))
    bits = check_mask_brute_force(state, bpe, frozenset({bpe.eos_token_id}))
    assert bits[bpe.eos_token_id] and bits[bpe.convert_tokens_to_ids("a")]


@pytest.mark.parametrize("params", [
    StructuredOutputsParams(json=PERSON_SCHEMA),
    StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}}, disable_any_whitespace=True),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex=NON_ASCII_REGEX),
    StructuredOutputsParams(choice=CHOICES),
])
def test_check_grammar_accepts_good_grammars(params):
    assert check_grammar(params) is None
    assert check_grammar(params) is None  # (again, from its cache)


# ---- the compiled-grammar cache ------------------------------------------------------------
def test_equal_params_share_one_compiled_grammar(bpe):
    compiler = GrammarCompiler(TokenVocabulary.of_tokenizer(bpe, BPE_VOCAB_SIZE))
    eos = frozenset({bpe.eos_token_id})
    first = compiler.start(StructuredOutputsParams(json=PERSON_SCHEMA), eos)
    # The same schema as a copy and as JSON text; other EOS ids do not make another grammar.
    for params in [StructuredOutputsParams(json=copy.deepcopy(PERSON_SCHEMA)),
                   StructuredOutputsParams(json=json.dumps(PERSON_SCHEMA))]:
        assert compiler.start(params, frozenset()).grammar is first.grammar
    compact = compiler.start(StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True), eos)
    assert compact.grammar is not first.grammar
    spaced = b'{ "name": "a", "age": 20, "tags": [] }'
    for state, accepts in [(first, True), (compact, False)]:
        automaton = state.grammar.automaton
        assert automaton.is_accepting(automaton.walk(automaton.start, spaced)) == accepts
    regex = compiler.start(StructuredOutputsParams(regex="a.b"), eos)
    choice = compiler.start(StructuredOutputsParams(choice=["a.b"]), eos)
    assert regex.grammar is not choice.grammar
    assert compiler.start(StructuredOutputsParams(regex="a.b"), eos).grammar is regex.grammar
    assert compiler.start(StructuredOutputsParams(choice=["a.b"]), eos).grammar is choice.grammar
    # Each request has its own place in the shared grammar.
    other = compiler.start(StructuredOutputsParams(regex="a.b"), eos)
    other.advance(bpe.convert_tokens_to_ids("a"))
    assert regex.state == regex.grammar.automaton.start != other.state


def test_cache_keeps_the_most_recently_used_grammars(bpe):
    compiler = GrammarCompiler(TokenVocabulary.of_tokenizer(bpe, BPE_VOCAB_SIZE))
    eos = frozenset({bpe.eos_token_id})

    def grammar(i):
        return compiler.start(StructuredOutputsParams(regex=f"x{i}"), eos).grammar

    first, second = grammar(0), grammar(1)
    for i in range(2, MAX_GRAMMARS):  # (the cache is now full)
        grammar(i)
    assert grammar(0) is first  # (a hit, which makes it the most recently used)
    grammar(MAX_GRAMMARS)  # (one more: the least recently used, "x1", goes)
    assert grammar(0) is first
    assert grammar(1) is not second


def test_schemas_differing_in_property_order_get_their_own_grammar(bpe):
    """The order of `properties` is the order the output follows (json_schema.py), so two
    schemas that differ only in it are two grammars (a cache key of sorted JSON made them
    one: the b-first schema was refused its own output '{"b":2,"a":1}')."""
    def schema(order):
        return {"type": "object", "properties": {k: {"type": "integer"} for k in order},
                "required": ["a", "b"], "additionalProperties": False}

    compiler = GrammarCompiler(TokenVocabulary.of_tokenizer(bpe, BPE_VOCAB_SIZE))
    eos = frozenset({bpe.eos_token_id})
    for order, text in [("ab", b'{"a":1,"b":2}'), ("ba", b'{"b":2,"a":1}')]:
        automaton = compiler.start(StructuredOutputsParams(json=schema(order)), eos).grammar.automaton
        assert automaton.is_accepting(automaton.walk(automaton.start, text)), order


def test_a_grammar_out_of_states_is_compiled_afresh_for_the_next_request(bpe, monkeypatch):
    """A grammar that ran out of automaton states fails the request that reached the limit
    (a ValueError from `advance`, which the scheduler turns into that request's error); the
    next request with it starts on a fresh copy, not on the full one."""
    compiler = GrammarCompiler(TokenVocabulary.of_tokenizer(bpe, BPE_VOCAB_SIZE))
    params = StructuredOutputsParams(regex="[a-z]{0,40}")
    state = compiler.start(params, frozenset())
    monkeypatch.setattr(automaton, "MAX_STATES", state.grammar.automaton._num_states + 3)
    with pytest.raises(GrammarTooLarge):
        for _ in range(40):
            state.advance(bpe.convert_tokens_to_ids("a"))
    assert state.grammar.exhausted
    monkeypatch.undo()
    fresh = compiler.start(params, frozenset())
    assert fresh.grammar is not state.grammar and not fresh.grammar.exhausted
    for _ in range(40):
        fresh.advance(bpe.convert_tokens_to_ids("a"))
    assert fresh.terminated


def test_writing_a_mask_never_grows_the_automaton(bpe):
    """The runner writes masks outside any one request's error handling, so every state a
    mask walk makes must already exist by then: `advance` (run in the scheduler, one
    request at a time) makes them, also where the output is whole and EOS allowed."""
    compiler = GrammarCompiler(TokenVocabulary.of_tokenizer(bpe, BPE_VOCAB_SIZE))
    eos = frozenset({bpe.eos_token_id})
    state = compiler.start(StructuredOutputsParams(regex="[a-z ]{0,60}"), eos)
    out = np.zeros(compiler.vocabulary.mask_bytes, dtype=np.uint8)
    for token in bpe.encode("the quick brown fox jumps over the lazy dog"):
        state.advance(token)
        assert state.accepting
        before = state.grammar.automaton._num_states
        state.write_mask(out)
        assert state.grammar.automaton._num_states == before


# ---- a vocabulary that lacks bytes ---------------------------------------------------------
@pytest.fixture(scope="module")
def narrow_compiler():
    """The byte tokenizer under a model of 100 logits: only bytes 0-99 are tokens ("z" = 122
    and "b" = 98: "b" is in, "z" is not)."""
    return GrammarCompiler(TokenVocabulary.of_tokenizer(build_byte_tokenizer(), 100))


@pytest.mark.parametrize("params, field", [
    (StructuredOutputsParams(regex="z"), "structured_outputs.regex"),
    (StructuredOutputsParams(regex="z+[0-9]"), "structured_outputs.regex"),
    (StructuredOutputsParams(choice=["zz", "{}"]), "structured_outputs.choice"),
])
def test_grammar_no_token_can_start_is_refused(narrow_compiler, params, field):
    """Every text of these grammars starts with a byte no token has ("z" is 122, "{" 123)."""
    with pytest.raises(ParameterError) as error:
        narrow_compiler.start(params, frozenset({258}))
    assert error.value.param == field


def test_mask_leaves_out_bytes_the_vocabulary_lacks(narrow_compiler):
    state = narrow_compiler.start(StructuredOutputsParams(regex="a(z|b)"), frozenset())
    assert [t for t, bit in enumerate(mask_bits(state)) if bit] == [ord("a")]
    state.advance(ord("a"))
    assert [t for t, bit in enumerate(mask_bits(state)) if bit] == [ord("b")]
    state.advance(ord("b"))
    assert state.terminated


def test_dead_end_after_a_token_is_refused_at_advance(narrow_compiler):
    """ "az": "a" can start, but no token can follow it. The mask is per step (it does not
    look ahead through the vocabulary), so this shows at `advance`, as a ValueError."""
    state = narrow_compiler.start(StructuredOutputsParams(regex="az"), frozenset({258}))
    with pytest.raises(ValueError, match="no token of the vocabulary can continue"):
        state.advance(ord("a"))


# ---- performance smoke ---------------------------------------------------------------------
def test_masks_of_a_30k_token_vocabulary():
    """Masks for a JSON schema over 30k random byte-string tokens (plus the 256 bytes, so
    every output can be written), along random valid outputs. Completes; timing with -s."""
    byte_chars = build_byte_tokenizer().convert_ids_to_tokens(list(range(256)))  # (GPT-2's byte alphabet)
    rng = np.random.default_rng(0)
    pieces = set(byte_chars)
    while len(pieces) < 30_000:
        data = rng.integers(0, 256, size=rng.integers(2, 17))
        pieces.add("".join(byte_chars[b] for b in data))
    # A few JSON-ish pieces, so that long tokens also get through the schema.
    pieces |= {"".join(byte_chars[b] for b in text.encode()) for text in ['{"', '":', '", "', '": "', ', "', "age", "tags"]}
    backend = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(sorted(pieces))}, merges=[]))
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    eos = frozenset({tokenizer.eos_token_id})

    started = time.perf_counter()
    vocab = TokenVocabulary.of_tokenizer(tokenizer, len(tokenizer) + 64)
    built = time.perf_counter()
    compiler = GrammarCompiler(vocab)
    token_ids, check = list(vocab.bytes_of), random.Random(1)
    steps, check_seconds = 0, 0.0
    for seed in range(3):
        state = compiler.start(StructuredOutputsParams(json=PERSON_SCHEMA), eos)

        def checked_mask(state):
            """The mask, with a random sample of its bits checked by walking the token (timed
            apart: the masks themselves are computed as the state advances)."""
            nonlocal steps, check_seconds
            out = np.empty(vocab.mask_bytes, dtype=np.uint8)
            state.write_mask(out)
            begin = time.perf_counter()
            steps += 1
            for token_id in check.sample(token_ids, 200):
                walked = state.grammar.automaton.walk(state.state, vocab.bytes_of[token_id])
                assert bool(out[token_id // 8] >> (token_id % 8) & 1) == (walked != DEAD), token_id
            bits = np.unpackbits(out, bitorder="little").astype(bool)
            check_seconds += time.perf_counter() - begin
            return bits

        tokens = random_walk(state, eos, random.Random(seed), checked_mask)
        check_person(b"".join(vocab.bytes_of[t] for t in tokens).decode())
    stepping = time.perf_counter() - built - check_seconds
    print(f"\n30k-token vocabulary: built in {built - started:.2f} s; {steps} steps (masks, advances, "
          f"sampling) in {stepping:.2f} s, {check_seconds:.2f} s more in the test's checks")
