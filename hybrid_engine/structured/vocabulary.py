"""A model's vocabulary as the grammars walk it: every token's bytes in one padded array."""
import numpy as np
from transformers import PreTrainedTokenizerBase

from hybrid_engine.tokenizer import TokenBytes


class TokenVocabulary:
    """The tokens a constrained request may sample, as byte strings the automata walk.

    Special tokens (BOS, chat markers, ...) and tokens that stand for no bytes are never
    allowed by a grammar: a special token's text is not what it means to the model, and a
    token of no bytes would leave the grammar where it is forever. EOS is allowed apart,
    by the request, where its grammar accepts (`GrammarState`); so EOS ids (`stop_ids`) are
    never walked, even where a tokenizer does not mark them special: sampled inside a text,
    one would end the output unfinished.

    Tokens are kept in order of decreasing length (`ByteAutomaton.walk_tokens` walks the
    still-unfinished ones as a leading slice); `token_ids` maps that order back to ids.
    """

    def __init__(self, pieces: dict[int, bytes], vocab_size: int):
        """`pieces`: token id -> bytes of the tokens a grammar may allow (ids < vocab_size,
        none empty); `vocab_size`: the model's logits width (may pad past the tokenizer)."""
        self.vocab_size = vocab_size
        ordered = sorted(pieces.items(), key=lambda p: -len(p[1]))
        longest = len(ordered[0][1]) if ordered else 0
        self.token_ids = np.array([token for token, _ in ordered], dtype=np.int64)
        self.lengths = np.array([len(data) for _, data in ordered], dtype=np.int64)
        self.token_bytes = np.zeros((len(ordered), max(longest, 1)), dtype=np.uint8)
        for row, (_, data) in enumerate(ordered):
            self.token_bytes[row, : len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.bytes_of = dict(pieces)

    @classmethod
    def of_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                     stop_ids: frozenset[int] = frozenset()) -> "TokenVocabulary":
        """A model's vocabulary: every token of `tokenizer` below `vocab_size` but the
        special ones, EOS (`stop_ids`) and those of no bytes."""
        to_bytes = TokenBytes(tokenizer)
        special = set(tokenizer.all_special_ids) | stop_ids
        special.update(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
        pieces = {}
        for token_id in range(min(len(tokenizer), vocab_size)):
            if token_id not in special:
                data = to_bytes(token_id)
                if data:
                    pieces[token_id] = data
        return cls(pieces, vocab_size)

    @property
    def mask_bytes(self) -> int:
        """Bytes of one packed token mask (a bit per token id of the model's vocabulary)."""
        return (self.vocab_size + 7) // 8
