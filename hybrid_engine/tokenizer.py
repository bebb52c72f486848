"""Tokenizer construction and loading for the engine.

Two sources of tokenizers exist:

* ``build_byte_tokenizer`` builds, in process, the byte-level tokenizer that goes
  with the engine's embedded tiny default model, so that model can serve text
  prompts without any files or network access.
* ``load_tokenizer`` loads the tokenizer shipped inside a local checkpoint
  directory, or reports that there is none (such checkpoints take token-id prompts
  only).
"""

from __future__ import annotations

import os
import re

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"

# Byte tokens occupy ids 0..255 (id == byte value); the special tokens follow in
# this order, so their ids are fixed and the embedded model can rely on them.
PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
IM_START_ID = 259
IM_END_ID = 260
BYTE_TOKENIZER_VOCAB_SIZE = 261

# ChatML: "<|im_start|>role\ncontent<|im_end|>\n" per message. Content may also be
# an OpenAI-style list of parts, of which only the text parts are rendered. An assistant
# message's tool calls follow its content as <tool_call> JSON blocks (Qwen/Hermes style).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% for call in message.get('tool_calls', []) %}"
    "{{ '\n<tool_call>\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Files whose presence means a checkpoint directory ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """Return GPT-2's byte -> printable unicode character table.

    This is the alphabet the ``tokenizers`` ByteLevel pre-tokenizer/decoder use;
    it is rebuilt here (rather than taken from ``ByteLevel.alphabet()``, which is
    unordered) because token id i must be byte i.
    """
    # Printable Latin-1 bytes map to themselves; the rest are shifted past 255 so
    # that every token is a visible, non-whitespace character.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Build the deterministic byte-level tokenizer of the embedded default model.

    Every UTF-8 byte is one token (id == byte value, no merges), followed by the
    special tokens ``<|pad|>``, ``<|bos|>``, ``<|eos|>``, ``<|im_start|>`` and
    ``<|im_end|>`` (ids 256..260). Encoding never adds a BOS token; the tokenizer
    carries a ChatML chat template.
    """
    byte_to_char = _gpt2_bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex splitting: with no merges, pre-token boundaries cannot change the
    # output, so splitting would only cost time.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    # Added in id order, so they land at PAD_ID..IM_END_ID.
    backend.add_special_tokens([PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        add_bos_token=False,
        add_eos_token=False,
        # Byte tokens decode exactly; the default clean-up would rewrite " ." etc.
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece byte-fallback pieces
_BYTE_LEVEL_CHAR_TO_BYTE = {c: b for b, c in _gpt2_bytes_to_unicode().items()}


class TokenBytes:
    """token id -> the bytes the token stands for, even when they are not valid UTF-8 on
    their own (part of a character): byte-level BPE tokens map back through GPT-2's byte
    alphabet, sentencepiece byte-fallback pieces ("<0xE2>") are their byte; other pieces are
    their text as decoded after other text (a sentencepiece word start "▁hello" is
    " hello": decoded alone, its space would be stripped as a text's first); special tokens
    are their decoded text; ids past the tokenizer (a padded vocabulary) are b"". What it
    needs of the tokenizer is looked up once: transformers rebuilds `all_special_ids` on
    every access."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self._tokenizer = tokenizer
        self._num_known = len(tokenizer)
        self._special_ids = frozenset(tokenizer.all_special_ids)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
        self._context = tokenizer.encode("a", add_special_tokens=False)
        self._context_text = tokenizer.decode(self._context)

    def __call__(self, token_id: int) -> bytes:
        if token_id >= self._num_known:
            return b""
        if token_id not in self._special_ids:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if self._byte_level and all(c in _BYTE_LEVEL_CHAR_TO_BYTE for c in piece):
                return bytes(_BYTE_LEVEL_CHAR_TO_BYTE[c] for c in piece)
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            if fallback is not None:
                return bytes([int(fallback.group(1), 16)])
            text = self._tokenizer.decode(self._context + [token_id])
            if text.startswith(self._context_text):
                return text[len(self._context_text):].encode("utf-8")
        return self._tokenizer.decode([token_id]).encode("utf-8")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    """Load the tokenizer of the local checkpoint directory ``path``.

    Returns None when the directory holds none of the tokenizer files
    (``TOKENIZER_FILES``): such checkpoints are served with token-id prompts only.
    Never touches the network. Raises ``NotADirectoryError`` if ``path`` is not a
    directory and ``ValueError`` (bad input, like a bad config) naming the directory and
    its tokenizer files if they exist but cannot be loaded.
    """
    if not os.path.isdir(path):
        raise NotADirectoryError(f"checkpoint path is not a directory: {path!r}")
    present = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(path, name))]
    if not present:
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        # Re-raise with the path: transformers' errors often only name a file or a
        # hub repo id, which is misleading for a local checkpoint.
        raise ValueError(f"failed to load the tokenizer in {path!r} ({', '.join(present)}): {exc}") from exc


def special_token_pattern(tokenizer: PreTrainedTokenizerBase) -> re.Pattern[str]:
    """A pattern that finds, in one pass, the text of any token that markup (text tokenized
    with special tokens parsed) turns into a special token and plain text (tokenized with
    `split_special_tokens`) does not: every added token marked special, not only the named
    ones of `all_special_tokens` (Llama 3's <|start_header_id|> is special in
    `added_tokens_decoder` and named nowhere). One pass, because such a tokenizer has
    hundreds (Llama 3 reserves 250): with 255, a `t in text` per token took 10.6 s over a
    million one-character strings and a 7 MB one (a tool call's parsed arguments), the
    pattern 0.1 s."""
    texts = _special_token_texts(tokenizer)
    if not texts:
        return re.compile("(?!)")  # (matches nothing; an empty alternation would match everywhere)
    return re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True))))


def special_token_starts(tokenizer: PreTrainedTokenizerBase) -> str:
    """The characters that begin the texts `special_token_pattern` finds."""
    return "".join(sorted({text[0] for text in _special_token_texts(tokenizer) if text}))


def _special_token_texts(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """The texts of the tokens that only markup may yield (`special_token_pattern`)."""
    texts = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    return texts | set(tokenizer.all_special_tokens)
