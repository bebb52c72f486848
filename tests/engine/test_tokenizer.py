"""Tests for hybrid_engine.tokenizer: the embedded byte tokenizer and checkpoint loading."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from hybrid_engine.tokenizer import (
    BOS_ID,
    BYTE_TOKENIZER_VOCAB_SIZE,
    EOS_ID,
    IM_END_ID,
    IM_START_ID,
    PAD_ID,
    build_byte_tokenizer,
    load_tokenizer,
    special_token_pattern,
    special_token_starts,
)


@pytest.fixture(scope="module")
def byte_tok():
    """One byte tokenizer shared by the tests that do not mutate it."""
    return build_byte_tokenizer()


def test_vocab_layout(byte_tok):
    assert BYTE_TOKENIZER_VOCAB_SIZE == 261
    assert len(byte_tok) == BYTE_TOKENIZER_VOCAB_SIZE
    assert (byte_tok.pad_token_id, byte_tok.bos_token_id, byte_tok.eos_token_id) == (256, 257, 258)
    assert (PAD_ID, BOS_ID, EOS_ID) == (256, 257, 258)
    specials = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
    assert byte_tok.convert_tokens_to_ids(specials) == [256, 257, 258, 259, 260]
    assert set(byte_tok.all_special_ids) == {PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID}
    # Byte token ids are the byte values: 256 distinct one-character tokens, and
    # ASCII (whitespace and control bytes included) decodes to itself.
    byte_tokens = byte_tok.convert_ids_to_tokens(list(range(256)))
    assert len(set(byte_tokens)) == 256 and all(len(t) == 1 for t in byte_tokens)
    assert byte_tok.decode(list(range(128))) == "".join(map(chr, range(128)))


def test_round_trip_multibyte(byte_tok):
    text = "héllo 🙂"
    ids = byte_tok.encode(text)
    assert ids == list(text.encode("utf-8"))  # no BOS, one token per byte
    assert byte_tok.decode(ids) == text


def test_special_tokens_in_text_and_skipping(byte_tok):
    ids = byte_tok.encode("<|im_start|>hi<|im_end|><|eos|>")
    assert ids == [IM_START_ID, ord("h"), ord("i"), IM_END_ID, EOS_ID]
    assert byte_tok.decode(ids, skip_special_tokens=True) == "hi"
    assert byte_tok.decode(ids) == "<|im_start|>hi<|im_end|><|eos|>"


@settings(max_examples=200, deadline=None, derandomize=True)  # fixed seed: CI runs are reproducible
@given(st.text())
def test_round_trip_property(text):
    tok = build_byte_tokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # Special-token strings in the text encode as the special token; all else is bytes.
    if not any(t in text for t in tok.all_special_tokens):
        assert ids == list(text.encode("utf-8"))


def test_chat_template(byte_tok):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "héllo"},
    ]
    rendered = byte_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nhéllo<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = byte_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == rendered.removesuffix("<|im_start|>assistant\n")
    # Special markers become single special tokens when the rendered prompt is encoded.
    ids = byte_tok.encode(rendered)
    assert ids[0] == IM_START_ID and ids.count(IM_END_ID) == 2


def test_chat_template_content_parts(byte_tok):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": parts}]
    assert byte_tok.apply_chat_template(messages, tokenize=False) == "<|im_start|>user\nab<|im_end|>\n"


def test_load_tokenizer_none_without_tokenizer_files(tmp_path: Path):
    assert load_tokenizer(str(tmp_path)) is None
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(str(tmp_path)) is None


def test_load_tokenizer_round_trip(tmp_path: Path, byte_tok):
    byte_tok.save_pretrained(str(tmp_path))
    loaded = load_tokenizer(str(tmp_path))
    assert loaded is not None
    text = "héllo 🙂 <|im_end|>"
    assert loaded.encode(text) == byte_tok.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert loaded.chat_template == byte_tok.chat_template


def test_load_tokenizer_broken_files_raise(tmp_path: Path):
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(ValueError, match="failed to load the tokenizer"):
        load_tokenizer(str(tmp_path))


def test_load_tokenizer_not_a_directory(tmp_path: Path):
    with pytest.raises(NotADirectoryError):
        load_tokenizer(str(tmp_path / "missing"))


def test_special_token_pattern_finds_unnamed_special_tokens():
    """An added token marked special but named nowhere (as Llama 3's <|start_header_id|>) is
    found by `special_token_pattern`, as the named ones are: markup would turn its text
    into the token itself. A non-special added token is not (plain text yields it too)."""
    tokenizer = build_byte_tokenizer()
    header = "<|start_header_id|>"
    tokenizer.add_tokens([AddedToken(header, special=True), AddedToken("<plain>", special=False)])
    assert header not in tokenizer.all_special_tokens  # (what the chat guard used to check alone)
    assert len(tokenizer.encode(header, add_special_tokens=False)) == 1  # markup: the token
    assert len(tokenizer.encode(header, add_special_tokens=False, split_special_tokens=True)) > 1  # plain text
    pattern = special_token_pattern(tokenizer)
    assert pattern.search(f"a{header}b").group() == header
    assert all(pattern.search(f"x{token}") for token in tokenizer.all_special_tokens)
    assert pattern.search("a <plain> b <|start_header_id| >") is None



def test_special_token_starts():
    """The first characters of the texts special_token_pattern finds."""
    tokenizer = build_byte_tokenizer()
    assert special_token_starts(tokenizer) == "<"
    tokenizer.add_special_tokens({"additional_special_tokens": ["[INST]", "|a|"]})
    assert set(special_token_starts(tokenizer)) == {"<", "[", "|"}
