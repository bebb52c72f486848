"""Tests for `hybrid_engine.structured.vocabulary.TokenVocabulary` (and the `TokenBytes` it
is built on): the bytes a grammar sees for each token must be exactly the text the token
adds to the output, which is what the detokenizer streams: a token decoded in context."""
import json

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hybrid_engine.structured.vocabulary import TokenVocabulary
from hybrid_engine.tokenizer import BYTE_TOKENIZER_VOCAB_SIZE, build_byte_tokenizer

# JSON-ish and multilingual text (accents, Cyrillic, CJK, emoji), so that the trained BPE has
# tokens that hold whole multi-byte characters and tokens that end inside one.
CORPUS = [
    json.dumps({"name": "Zoë", "age": 42, "tags": ["naïve", "café", "日本語"],
                "address": {"city": "Köln", "zip": 50667}}, ensure_ascii=False),
    json.dumps([{"id": 1, "ok": True, "score": -3.5e-2}, {"id": 2, "ok": False, "note": None}], indent=2),
    "The quick brown fox jumps over the lazy dog; the dog sleeps.",
    "Ünïcödé text with emoji 😀🎉👍 and symbols → ≤ ≥ ∞ €",
    "Привет, мир! Как дела? Всё хорошо.",
    "日本語のテキストと中文文本，还有한국어 문장.",
    "Ελληνικά: καλημέρα κόσμε. Español: ¿qué tal? señor, niño.",
    "def f(x):\n    return {'a': [x, x + 1]}\n",
]
BPE_SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]


def train_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style) of 400 ids trained on `CORPUS`: ids 0-2
    special, then the 256 byte symbols, then merges. Fresh on every call (tests add tokens)."""
    backend = Tokenizer(models.BPE())
    # No prefix space: encode(text) then stands for exactly `text`.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=BPE_SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 4, trainer)
    # (clean_up_tokenization_spaces would rewrite " ." in decoded text: not the tokens' text.)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   clean_up_tokenization_spaces=False)


def decoded_in_context(tokenizer: PreTrainedTokenizerFast, token_id: int) -> str:
    """The text `token_id` adds between two fixed ASCII tokens ("x" before, "y" after), as the
    tokenizer decodes it: how the detokenizer sees a token in the middle of an output."""
    before, after = tokenizer.convert_tokens_to_ids(["x", "y"])
    text = tokenizer.decode([before, token_id, after])
    prefix, suffix = tokenizer.decode([before]), tokenizer.decode([after])
    assert (prefix, suffix) == ("x", "y") and text.startswith(prefix) and text.endswith(suffix), text
    return text[len(prefix): len(text) - len(suffix)]


def is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def check_layout(vocab: TokenVocabulary) -> None:
    """The padded array, the lengths, the ids and `bytes_of` describe the same tokens, longest
    first (what `ByteAutomaton.walk_tokens` relies on)."""
    assert len(vocab.token_ids) == len(vocab.lengths) == len(vocab.token_bytes) == len(vocab.bytes_of)
    assert len(set(vocab.token_ids.tolist())) == len(vocab.token_ids)
    assert np.all(np.diff(vocab.lengths) <= 0)
    assert vocab.token_bytes.shape[1] == vocab.lengths.max()
    for row, token_id in enumerate(vocab.token_ids.tolist()):
        data = vocab.bytes_of[token_id]
        assert len(data) == vocab.lengths[row] > 0
        assert vocab.token_bytes[row, : len(data)].tobytes() == data
        assert not vocab.token_bytes[row, len(data):].any()  # (padding is zeros)


# ---- the engine's byte tokenizer -----------------------------------------------------------
def test_byte_tokenizer_vocabulary():
    """Ids 0-255 are the bytes; the special tokens (256-260) and the model's padding up to 272
    are not tokens a grammar can use."""
    tokenizer = build_byte_tokenizer()
    assert len(tokenizer) == BYTE_TOKENIZER_VOCAB_SIZE == 261
    vocab = TokenVocabulary.of_tokenizer(tokenizer, 272)
    assert vocab.vocab_size == 272 and vocab.mask_bytes == 34
    assert vocab.bytes_of == {i: bytes([i]) for i in range(256)}
    assert not set(vocab.token_ids.tolist()) & set(range(256, 272))
    check_layout(vocab)


def test_byte_tokenizer_vocab_size_below_tokenizer():
    """A model whose logits are narrower than the tokenizer only has the ids below its width."""
    vocab = TokenVocabulary.of_tokenizer(build_byte_tokenizer(), 100)
    assert vocab.bytes_of == {i: bytes([i]) for i in range(100)}
    assert vocab.mask_bytes == 13
    check_layout(vocab)


# ---- a trained byte-level BPE --------------------------------------------------------------
@pytest.fixture(scope="module")
def bpe():
    tokenizer = train_bpe_tokenizer()
    assert len(tokenizer) == 400  # (the corpus is rich enough for every merge asked for)
    return tokenizer


def test_bpe_bytes_are_the_decoded_text(bpe):
    """Every non-special token's bytes are the text it decodes to in context, for each token
    that is valid UTF-8 on its own (the rest, parts of a character, decode to U+FFFD)."""
    vocab = TokenVocabulary.of_tokenizer(bpe, 416)  # (padded past the tokenizer, as checkpoints are)
    check_layout(vocab)
    special = {bpe.convert_tokens_to_ids(t) for t in BPE_SPECIAL_TOKENS}
    assert set(vocab.bytes_of) == set(range(400)) - special
    partial = 0
    for token_id in sorted(vocab.bytes_of):
        data = vocab.bytes_of[token_id]
        if is_utf8(data):
            assert data == decoded_in_context(bpe, token_id).encode(), (token_id, bpe.convert_ids_to_tokens(token_id))
        else:
            partial += 1
    # The multilingual corpus must yield tokens that end inside a character (else this test
    # would not cover them) but most tokens are whole text.
    assert 0 < partial < len(vocab.bytes_of) // 2
    assert max(vocab.lengths) >= 4


@pytest.mark.parametrize("text", [
    '{"name": "Zoë", "tags": ["naïve"]}',
    "Привет, мир! 😀🎉",
    "日本語のテキスト → ∞",
    "mixed: café 👍 Ελληνικά ¿qué?",
])
def test_bpe_encoded_text_round_trips(bpe, text):
    """The vocabulary bytes of a text's tokens (some split inside a character) concatenate
    back to the text's UTF-8."""
    vocab = TokenVocabulary.of_tokenizer(bpe, 400)
    ids = bpe.encode(text, add_special_tokens=False)
    assert any(len(vocab.bytes_of[i]) > 1 for i in ids)  # (merged tokens, not only bytes)
    assert b"".join(vocab.bytes_of[i] for i in ids) == text.encode()


def test_bpe_added_tokens():
    """Special tokens (named ones, an added special token and an added token only flagged
    special) are left out; added plain tokens are in, with their text's bytes."""
    tokenizer = train_bpe_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tokenizer.add_tokens([AddedToken("<|flagged|>", special=True), "<tag>", " <b>"])
    ids = dict(zip(["<|tool|>", "<|flagged|>", "<tag>", " <b>"],
                   tokenizer.convert_tokens_to_ids(["<|tool|>", "<|flagged|>", "<tag>", " <b>"])))
    assert sorted(ids.values()) == list(range(400, 404))
    vocab = TokenVocabulary.of_tokenizer(tokenizer, 408)
    check_layout(vocab)
    assert ids["<|tool|>"] not in vocab.bytes_of and ids["<|flagged|>"] not in vocab.bytes_of
    assert vocab.bytes_of[ids["<tag>"]] == b"<tag>" == decoded_in_context(tokenizer, ids["<tag>"]).encode()
    assert vocab.bytes_of[ids[" <b>"]] == b" <b>" == decoded_in_context(tokenizer, ids[" <b>"]).encode()
    text = "a<tag>b <b>c"
    encoded = tokenizer.encode(text, add_special_tokens=False)
    assert ids["<tag>"] in encoded and ids[" <b>"] in encoded
    assert b"".join(vocab.bytes_of[i] for i in encoded) == text.encode()


# ---- sentencepiece-style tokenizers (Metaspace "▁" for a space, byte fallback) -------------
SP_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "x", "y", "é", "▁hello", "▁world", "hello", "▁café", "caf", "▁x"]


def sentencepiece_tokenizer(style: str) -> PreTrainedTokenizerFast:
    """A tiny Unigram model with byte fallback (<0x00>..<0xFF>), decoded like T5-style
    Metaspace tokenizers ("metaspace") or like Llama 2's converted tokenizer ("llama": "▁"
    replaced by a space, the leading space of the decoded text stripped)."""
    pieces = ([("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", -20.0) for b in range(256)]
              + [(piece, -1.0 - 0.01 * len(piece)) for piece in SP_PIECES])
    backend = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    if style == "metaspace":
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    else:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("style", ["metaspace", "llama"])
def test_sentencepiece_byte_fallback_pieces(style):
    """Byte-fallback pieces are their byte, even one that is part of a character."""
    tokenizer = sentencepiece_tokenizer(style)
    vocab = TokenVocabulary.of_tokenizer(tokenizer, 288)
    check_layout(vocab)
    for byte in range(256):
        assert vocab.bytes_of[tokenizer.convert_tokens_to_ids(f"<0x{byte:02X}>")] == bytes([byte])
    for piece in ("<unk>", "<s>", "</s>"):
        assert tokenizer.convert_tokens_to_ids(piece) not in vocab.bytes_of


@pytest.mark.parametrize("style", ["metaspace", "llama"])
def test_sentencepiece_word_start_keeps_its_space(style):
    """BUG (exposes one in `TokenBytes`, hybrid_engine/tokenizer.py): a "▁" piece stands for
    a space before the word, which is in the output whenever the token follows other text
    (the detokenizer decodes with context for that reason). `TokenBytes` decodes the token
    alone, and these decoders drop the leading space of a decoded text, so "▁hello" gets
    b"hello" (the same bytes as "hello") and "▁" gets b"" (left out of the vocabulary): a
    grammar then believes "▁hello▁world" writes "helloworld", and can never write a space
    through "▁". Expected: b" hello", b" ", b" café"."""
    tokenizer = sentencepiece_tokenizer(style)
    vocab = TokenVocabulary.of_tokenizer(tokenizer, 288)
    token = dict(zip(SP_PIECES, tokenizer.convert_tokens_to_ids(SP_PIECES)))
    assert vocab.bytes_of[token["hello"]] == b"hello"
    assert vocab.bytes_of[token["é"]] == "é".encode()
    assert vocab.bytes_of.get(token["▁hello"]) == b" hello"
    assert vocab.bytes_of.get(token["▁café"]) == " café".encode()
    assert vocab.bytes_of.get(token["▁"]) == b" "


@pytest.mark.parametrize("style", ["metaspace", "llama"])
def test_sentencepiece_bytes_are_the_decoded_text(style):
    """BUG (same as `test_sentencepiece_word_start_keeps_its_space`): every whole-text piece's
    bytes are the text it decodes to in context, "▁" pieces included."""
    tokenizer = sentencepiece_tokenizer(style)
    vocab = TokenVocabulary.of_tokenizer(tokenizer, 288)
    for piece in SP_PIECES:
        token_id = tokenizer.convert_tokens_to_ids(piece)
        assert vocab.bytes_of.get(token_id) == decoded_in_context(tokenizer, token_id).encode(), piece
