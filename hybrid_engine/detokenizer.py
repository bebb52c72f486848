"""Incremental (streaming) detokenization of generated tokens, with stop strings.

Decoding follows vLLM's prefix/read-offset scheme: only a short window of recent
tokens is turned back into text at each step (``convert_ids_to_tokens`` +
``convert_tokens_to_string``), and the text of the window's already-emitted part is
subtracted. Decoding a window instead of the single new token is what makes this
correct for byte-level BPE (a character's bytes may span several tokens) and for
sentencepiece tokenizers (whose decoders drop the leading space of the first token
of a string, so a token must be decoded after some context to keep its space).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# Prompt tokens that seed the decode window, so that the first generated token is
# decoded in context (e.g. keeps its sentencepiece leading space).
PROMPT_SEED_TOKENS = 5

# What the decoders produce for bytes that are not (yet) valid UTF-8.
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated token ids into streamed text deltas.

    Feed ids with ``add_tokens``; each call returns the text that became final.
    Text is withheld while it ends in an incomplete UTF-8 character, and while it
    ends in something that could be the beginning of a stop string (so a client
    never sees text that a later stop match would trim). When a stop string
    matches, the output is truncated before it (or after it, with
    ``include_stop_str_in_output``) and ``stop_reason`` names it; later tokens are
    ignored. When the request ends for another reason, ``flush`` releases what
    was withheld. The concatenated deltas always equal a prefix of ``text``.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skipped_ids = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        # Checkpoints pad their embeddings past the tokenizer (e.g. to a multiple of 128):
        # ids from there have no text. They decode to "" rather than being masked from
        # sampling, so the tokens stay exactly the model's (and HF's).
        self._num_known = len(tokenizer)
        # An empty stop string would match everywhere; treat it as absent.
        self._stop = [s for s in stop or [] if s]
        self._include_stop_str_in_output = include_stop_str_in_output

        # Decode window: tokens[:read_offset] were already turned into emitted
        # text (their text is prefix_text); tokens[read_offset:] are pending,
        # usually because they end in an incomplete character. Tokens before the
        # window are dropped, which keeps every step O(window).
        self._tokens: list[str] = self._to_tokens(prompt_token_ids[-PROMPT_SEED_TOKENS:])
        self._read_offset = len(self._tokens)
        self._prefix_text = self._tokenizer.convert_tokens_to_string(self._tokens)

        # Decoded text is split into the part already returned as deltas
        # (_emitted, a list to avoid quadratic string concatenation) and the part
        # held back because it may start a stop string (_held, shorter than the
        # longest stop string).
        self._emitted: list[str] = []
        self._held = ""
        self._stop_reason: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """The full output text decoded so far, including held-back text.

        After a stop match this is the final, truncated text. Costs
        O(len(text)); stream with the deltas instead of polling this.
        """
        return "".join(self._emitted) + self._held

    @property
    def text_pieces(self) -> list[str]:
        """The emitted text so far, in pieces; the list only ever grows (callers must not
        modify it), so a length remembers the text at any earlier point."""
        return self._emitted

    @property
    def held_text(self) -> str:
        """Decoded text held back because it may start a stop string (follows `text_pieces`)."""
        return self._held

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the output, or None if none matched."""
        return self._stop_reason

    def add_tokens(self, new_ids: list[int]) -> str:
        """Append generated token ids; return the newly finalized text delta.

        Returns "" while the new text is withheld (incomplete character, possible
        stop-string start) and after the output has finished.
        """
        if self._finished:
            return ""
        new_text = "".join(self._decode_next(token_id) for token_id in new_ids)
        return self._append_text(new_text, final=False)

    def flush(self) -> str:
        """Finish the output and return everything still withheld.

        For requests that end for a reason other than a stop string (EOS, length,
        abort). Undecodable trailing bytes come out as U+FFFD, as in
        ``tokenizer.decode``. Returns "" if the output already finished.
        """
        if self._finished:
            return ""
        pending_text = ""
        if len(self._tokens) > self._read_offset:
            window_text = self._tokenizer.convert_tokens_to_string(self._tokens)
            pending_text = window_text[len(self._prefix_text) :]
        delta = self._append_text(pending_text, final=True)
        self._finished = True
        return delta

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        """Map ids to token strings, dropping special tokens if asked to and ids the
        tokenizer does not have (the model's padded vocabulary).

        Special ids are filtered against a set computed once: transformers rebuilds its
        special-token list on every `convert_ids_to_tokens(skip_special_tokens=True)` call,
        which dominated per-token bookkeeping.
        """
        kept = [t for t in token_ids if t < self._num_known and t not in self._skipped_ids]
        return self._tokenizer.convert_ids_to_tokens(kept) if kept else []

    def _decode_next(self, token_id: int) -> str:
        """Add one token to the decode window; return the text it completes."""
        new_tokens = self._to_tokens([token_id])
        if not new_tokens:  # a skipped special token
            return ""
        self._tokens.extend(new_tokens)
        window_text = self._tokenizer.convert_tokens_to_string(self._tokens)
        # A trailing U+FFFD means the last character's bytes are incomplete (or
        # not yet provably invalid): wait for more tokens rather than emit it.
        # A token may also add no text yet (e.g. a lone byte-fallback piece).
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = window_text[len(self._prefix_text) :]
        # Slide the window: the tokens just decoded become the context prefix.
        del self._tokens[: self._read_offset]
        self._read_offset = len(self._tokens)
        self._prefix_text = self._tokenizer.convert_tokens_to_string(self._tokens)
        return delta

    def _append_text(self, new_text: str, final: bool) -> str:
        """Add decoded text, apply stop strings and hold-back; return the delta."""
        # Only held text and new text can contain a new match: a match starting
        # in already-emitted text would have had its beginning held back.
        candidate = self._held + new_text
        match = self._find_stop(candidate, len(new_text))
        if match is not None:
            stop_str, start = match
            end = start + len(stop_str) if self._include_stop_str_in_output else start
            delta, self._held = candidate[:end], ""
            self._stop_reason = stop_str
            self._finished = True
        else:
            keep = len(candidate) - (0 if final else self._hold_back_len(candidate))
            delta, self._held = candidate[:keep], candidate[keep:]
        self._emitted.append(delta)
        return delta

    def _find_stop(self, candidate: str, new_len: int) -> tuple[str, int] | None:
        """Find the stop string that completes first in ``candidate``.

        Only matches ending inside its last ``new_len`` characters are new. The
        earliest-ending match wins (ties: the earliest-starting one), so the
        result does not depend on how the tokens were batched into calls.
        Returns (stop string, start index) or None.
        """
        best: tuple[int, int, str] | None = None
        for stop_str in self._stop:
            start = candidate.find(stop_str, max(0, len(candidate) - new_len - len(stop_str) + 1))
            if start != -1:
                key = (start + len(stop_str), start, stop_str)
                if best is None or key < best:
                    best = key
        return None if best is None else (best[2], best[1])

    def _hold_back_len(self, candidate: str) -> int:
        """Length of the longest suffix of ``candidate`` that begins a stop string."""
        longest = 0
        for stop_str in self._stop:
            for length in range(min(len(stop_str) - 1, len(candidate)), longest, -1):
                if candidate.endswith(stop_str[:length]):
                    longest = length
                    break
        return longest
