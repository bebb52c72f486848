"""Tests for hybrid_engine.detokenizer.IncrementalDetokenizer."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hybrid_engine.detokenizer import IncrementalDetokenizer
from hybrid_engine.tokenizer import EOS_ID, build_byte_tokenizer

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! Streaming text should never stutter.",
    "Café crème brûlée, naïve façade, and 日本語のテキスト with 🙂🚀 emoji.",
    "Detokenization must handle multi-byte characters split across tokens.",
]

# Text alphabet for property tests: ASCII, 2-, 3- and 4-byte UTF-8 characters.
ALPHABET = "ab \nSTOP!éç日本🙂🚀"


@pytest.fixture(scope="module")
def byte_tok():
    """The engine's byte tokenizer: every multi-byte character spans several tokens."""
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def bpe_tok():
    """A tiny GPT-2 style byte-level BPE trained on SENTENCES."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|eos|>"],
        show_progress=False,
    )
    backend.train_from_iterator(SENTENCES, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|eos|>", clean_up_tokenization_spaces=False
    )


@pytest.fixture(scope="module")
def sp_tok():
    """A sentencepiece-style tokenizer: '▁' marks spaces, the decoder drops the first one."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    backend.train_from_iterator(SENTENCES, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", clean_up_tokenization_spaces=False
    )


def stream(
    detok: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None, flush: bool = True
) -> list[str]:
    """Feed ids in chunks (default: one by one); return every delta, flush last.

    Checks the streaming invariant along the way: the deltas so far always form
    a prefix of the detokenizer's text.
    """
    deltas: list[str] = []
    pos = 0
    for size in chunks or [1] * len(ids):
        deltas.append(detok.add_tokens(ids[pos : pos + size]))
        pos += size
        assert detok.text.startswith("".join(deltas))
    if pos < len(ids):
        deltas.append(detok.add_tokens(ids[pos:]))
    if flush:
        deltas.append(detok.flush())
    return deltas


def random_chunks(rng: random.Random, n: int) -> list[int]:
    """Split n tokens into random call sizes of 1..4, as a scheduler might batch them."""
    chunks = []
    while n > 0:
        chunks.append(min(n, rng.randint(1, 4)))
        n -= chunks[-1]
    return chunks


# ---------------------------------------------------------------- plain decoding


def test_multibyte_char_withheld_until_complete(byte_tok):
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode("hi "))
    emoji = list("🙂".encode())
    assert [detok.add_tokens([b]) for b in emoji[:3]] == ["", "", ""]
    assert detok.add_tokens([emoji[3]]) == "🙂"
    assert detok.add_tokens(list("é".encode())) == "é"
    assert detok.text == "🙂é"


def test_invalid_bytes_emit_replacement_once_known(byte_tok):
    detok = IncrementalDetokenizer(byte_tok, [])
    assert detok.add_tokens([0xFF]) == ""  # could still be followed by anything
    assert detok.add_tokens([ord("a")]) == "\ufffda"  # now it provably never completes
    assert detok.add_tokens([0xF0, 0x9F]) == ""  # truncated 4-byte sequence...
    assert detok.flush() == "\ufffd"  # ...is flushed as U+FFFD at the end
    assert detok.text == byte_tok.decode([0xFF, ord("a"), 0xF0, 0x9F])


def test_special_tokens_skipped_or_kept(byte_tok):
    ids = byte_tok.encode("ok") + [EOS_ID]
    skipped = "".join(stream(IncrementalDetokenizer(byte_tok, [], skip_special_tokens=True), ids))
    assert skipped == "ok"
    kept = "".join(stream(IncrementalDetokenizer(byte_tok, [], skip_special_tokens=False), ids))
    assert kept == "ok<|eos|>"


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    prompt=st.text(alphabet=ALPHABET, max_size=10),
    seed=st.integers(0, 2**16),
)
def test_byte_tokenizer_deltas_match_decode(byte_tok, text, prompt, seed):
    ids = byte_tok.encode(text)
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode(prompt))
    deltas = stream(detok, ids, random_chunks(random.Random(seed), len(ids)))
    assert "".join(deltas) == byte_tok.decode(ids) == detok.text
    assert all("\ufffd" not in d for d in deltas)  # valid UTF-8 never shows U+FFFD


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=ALPHABET + "Hello wrdCafé", max_size=60), seed=st.integers(0, 2**16))
def test_bpe_tokenizer_deltas_match_decode(bpe_tok, text, seed):
    ids = bpe_tok.encode(text)
    detok = IncrementalDetokenizer(bpe_tok, bpe_tok.encode("Hello world"))
    deltas = stream(detok, ids, random_chunks(random.Random(seed), len(ids)))
    assert "".join(deltas) == bpe_tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_bpe_tokens_split_multibyte_chars(bpe_tok):
    # Sanity check that the BPE case exercises characters split across tokens.
    tokens = bpe_tok.convert_ids_to_tokens(bpe_tok.encode("🙂 日本語"))
    text_per_token = [bpe_tok.convert_tokens_to_string([t]) for t in tokens]
    assert any("\ufffd" in t for t in text_per_token)
    for sentence in SENTENCES:
        ids = bpe_tok.encode(sentence)
        assert "".join(stream(IncrementalDetokenizer(bpe_tok, []), ids)) == sentence


def test_sentencepiece_leading_space_from_prompt_context(sp_tok):
    prompt = sp_tok.encode("Hello")
    ids = sp_tok.encode("world hello")  # '▁world', '▁hello': each token carries its space
    assert sp_tok.decode(ids) == "world hello"  # standalone decode drops the first space
    # Seeded with the prompt, the first output token keeps its leading space.
    assert "".join(stream(IncrementalDetokenizer(sp_tok, prompt), ids)) == " world hello"
    # Without prompt context it is the start of the text, as in decode().
    assert "".join(stream(IncrementalDetokenizer(sp_tok, []), ids)) == "world hello"


def test_work_per_step_is_bounded(byte_tok):
    """Each step decodes a short window, not the whole output so far."""
    window_sizes: list[int] = []
    real = byte_tok.convert_tokens_to_string

    class Spy:
        def __getattr__(self, name):
            return getattr(byte_tok, name)

        def __len__(self):  # dunder lookups skip __getattr__
            return len(byte_tok)

        def convert_tokens_to_string(self, tokens):
            window_sizes.append(len(tokens))
            return real(tokens)

    text = "héllo wörld 🙂 " * 200
    ids = byte_tok.encode(text)
    detok = IncrementalDetokenizer(Spy(), byte_tok.encode("prompt"))
    assert "".join(stream(detok, ids)) == text
    assert max(window_sizes) <= 8


# ---------------------------------------------------------------- stop strings


def test_stop_spanning_token_boundaries(byte_tok):
    ids = byte_tok.encode("Hello world STOP more text")
    detok = IncrementalDetokenizer(byte_tok, [], stop=["STOP"])
    deltas = stream(detok, ids, flush=False)
    assert detok.stop_reason == "STOP"
    assert "".join(deltas) == detok.text == "Hello world "
    assert detok.add_tokens(byte_tok.encode("after")) == "" and detok.flush() == ""


def test_stop_spanning_bpe_tokens(bpe_tok):
    ids = bpe_tok.encode("The quick brown fox jumps over the lazy dog.")
    detok = IncrementalDetokenizer(bpe_tok, [], stop=["fox jum"])
    assert "".join(stream(detok, ids, flush=False)) == "The quick brown "
    assert detok.stop_reason == "fox jum"


def test_stop_inside_one_call(byte_tok):
    detok = IncrementalDetokenizer(byte_tok, [], stop=["STOP"])
    assert detok.add_tokens(byte_tok.encode("abSTOPcd")) == "ab"
    assert detok.stop_reason == "STOP" and detok.text == "ab"


def test_include_stop_str_in_output(byte_tok):
    ids = byte_tok.encode("Hello STOP more")
    detok = IncrementalDetokenizer(byte_tok, [], stop=["STOP"], include_stop_str_in_output=True)
    assert "".join(stream(detok, ids, flush=False)) == detok.text == "Hello STOP"
    assert detok.stop_reason == "STOP"


def test_stop_is_multibyte_char(byte_tok):
    ids = byte_tok.encode("hi 🙂 there")
    detok = IncrementalDetokenizer(byte_tok, [], stop=["🙂"])
    deltas = stream(detok, ids, flush=False)
    assert "".join(deltas) == detok.text == "hi "
    assert detok.stop_reason == "🙂"


def test_stop_after_multibyte_char(byte_tok):
    ids = byte_tok.encode("café!stop")
    detok = IncrementalDetokenizer(byte_tok, [], stop=["é!"])
    assert "".join(stream(detok, ids, flush=False)) == "caf"
    detok = IncrementalDetokenizer(byte_tok, [], stop=["é!"], include_stop_str_in_output=True)
    assert "".join(stream(detok, ids, flush=False)) == "café!"


def test_partial_stop_prefix_released_when_it_cannot_match(byte_tok):
    detok = IncrementalDetokenizer(byte_tok, [], stop=["éa"])
    assert detok.add_tokens(byte_tok.encode("xé")) == "x"  # "é" may start "éa"
    assert detok.text == "xé"
    assert detok.add_tokens(byte_tok.encode("b")) == "éb"  # it did not
    assert detok.stop_reason is None


def test_hold_back_released_by_flush(byte_tok):
    ids = byte_tok.encode("abc ST")
    detok = IncrementalDetokenizer(byte_tok, [], stop=["STOP"])
    deltas = stream(detok, ids, flush=False)
    assert "".join(deltas) == "abc "
    assert detok.text == "abc ST"
    assert detok.flush() == "ST"
    assert detok.stop_reason is None
    assert detok.add_tokens(byte_tok.encode("OP")) == ""  # finished


def test_earliest_completed_stop_wins(byte_tok):
    ids = byte_tok.encode("hello world")
    for chunks in ([1] * len(ids), [len(ids)]):
        detok = IncrementalDetokenizer(byte_tok, [], stop=["world", "lo w"])
        assert "".join(stream(detok, ids, chunks, flush=False)) == "hel"
        assert detok.stop_reason == "lo w"


def test_empty_stop_strings_ignored(byte_tok):
    ids = byte_tok.encode("abc")
    assert "".join(stream(IncrementalDetokenizer(byte_tok, [], stop=[""]), ids)) == "abc"


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Expected (final text, stop reason): the stop completed earliest in text wins."""
    for end in range(1, len(text) + 1):
        matches = [s for s in stops if s and text[:end].endswith(s)]
        if matches:
            stop = max(matches, key=len)  # same end: the earliest start
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3),
    include=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_stop_strings_property(byte_tok, text, stops, include, seed):
    ids = byte_tok.encode(text)
    detok = IncrementalDetokenizer(byte_tok, [], stop=stops, include_stop_str_in_output=include)
    chunks = random_chunks(random.Random(seed), len(ids))
    # All deltas together equal the final text, so every streamed prefix was a
    # prefix of it: no delta ever showed text that a stop match trimmed later.
    deltas = stream(detok, ids, chunks)
    expected_text, expected_stop = reference_stop(text, stops, include)
    assert "".join(deltas) == detok.text == expected_text
    assert detok.stop_reason == expected_stop


def test_ids_past_the_tokenizer_decode_to_nothing(byte_tok):
    """A model's padded vocabulary (ids the tokenizer does not have) adds no text, in the
    prompt seed and in the output, and the text around them is unchanged."""
    past = len(byte_tok) + 7
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode("hi") + [past])
    pieces = [detok.add_tokens([t]) for t in [*byte_tok.encode("ab"), past, *byte_tok.encode("c")]]
    assert "".join(pieces) + detok.flush() == "abc"
