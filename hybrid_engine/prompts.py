"""Checks of a request against the model that serves it.

`SamplingParams` checks what holds for any model (types, ranges). What needs the model is
checked here: the prompt (text or token ids) becomes token ids that are in the vocabulary
and leave room to generate; prompt + max_tokens fits the context length and the KV cache;
stop token ids are in the vocabulary; stop strings have a tokenizer to match on. The
engine's `add_request` and the HTTP server (on its event loop, before queueing) call the
same functions, so the server lets through exactly what the engine takes. Every failure
is a `ParameterError` naming the field; too long a request is a `ContextLengthExceeded`.
"""
from dataclasses import dataclass
from typing import Any, Sequence

from hybrid_engine.sampling_params import ParameterError, SamplingParams, check_unicode, is_integral

Prompt = str | Sequence[int]


class ContextLengthExceeded(ParameterError):
    """The prompt, or prompt + max_tokens, does not fit the context length or the KV cache."""


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit: the vocabulary, the context length and the whole KV cache."""

    vocab_size: int
    max_model_len: int
    kv_tokens: int  # KV blocks x block size: a request's KV must fit the cache on its own

    @property
    def max_request_tokens(self) -> int:
        """Largest prompt + output of one request."""
        return min(self.max_model_len, self.kv_tokens)

    def bound_text(self) -> str:
        """Which of the two bounds `max_request_tokens` is, in words (for error messages)."""
        if self.max_model_len <= self.kv_tokens:
            return f"this model's maximum context length ({self.max_model_len} tokens)"
        return f"the KV cache ({self.kv_tokens} tokens)"


def encode_prompt(prompt: Prompt, tokenizer: Any | None, field: str = "prompt", add_special_tokens: bool = True,
                  split_special_tokens: bool = False) -> list[int]:
    """The prompt's token ids: text is encoded with `tokenizer`, token ids are type-checked.
    `split_special_tokens`: special-token strings in the text are plain text, not control
    tokens (for chat message content)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ParameterError(field, f"{field}: this model has no tokenizer; pass token ids (a list of ints)")
        check_unicode(prompt, field)
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens, split_special_tokens=split_special_tokens)
    # (The set of element types first: C speed for the usual all-int list of thousands.)
    if isinstance(prompt, (list, tuple)):
        if set(map(type, prompt)) <= {int}:
            return list(prompt)
        if all(is_integral(t) for t in prompt):  # (a library caller's NumPy ints, say)
            return [int(t) for t in prompt]
    raise ParameterError(field, f"{field} must be a string or a list of token ids (ints)")


def check_prompt(token_ids: list[int], limits: RequestLimits, field: str = "prompt") -> None:
    """The prompt is non-empty, in the vocabulary, and leaves room for one generated token."""
    if not token_ids:
        raise ParameterError(field, f"{field} must not be empty")
    if min(token_ids) < 0 or max(token_ids) >= limits.vocab_size:
        bad = next(t for t in token_ids if not 0 <= t < limits.vocab_size)
        raise ParameterError(field, f"{field}: token id {bad} is out of vocabulary (vocab_size {limits.vocab_size})")
    if len(token_ids) >= limits.max_request_tokens:
        raise ContextLengthExceeded(field, f"{field} has {len(token_ids)} tokens; {limits.bound_text()} must also hold "
                                           f"at least one generated token")


def check_max_tokens(prompt_len: int, max_tokens: int, limits: RequestLimits, field: str = "max_tokens") -> None:
    """prompt + max_tokens fits the context length and the KV cache."""
    total = prompt_len + max_tokens
    if total > limits.max_request_tokens:
        raise ContextLengthExceeded(field, f"{field}: the prompt ({prompt_len} tokens) + {field} ({max_tokens}) = "
                                           f"{total} exceeds {limits.bound_text()}: lower {field} to at most "
                                           f"{limits.max_request_tokens - prompt_len}")


def check_params(params: SamplingParams, limits: RequestLimits, tokenizer: Any | None) -> None:
    """The sampling params the model constrains: stop token ids in the vocabulary, no more
    logprobs than the vocabulary has tokens, stop strings only with a tokenizer (they are
    matched on decoded text)."""
    bad = next((t for t in params.stop_token_ids or () if t >= limits.vocab_size), None)
    if bad is not None:
        raise ParameterError("stop_token_ids", f"stop_token_ids: token id {bad} is out of vocabulary "
                                               f"(vocab_size {limits.vocab_size})")
    if params.logprobs is not None and params.logprobs > limits.vocab_size:
        raise ParameterError("logprobs", f"logprobs: {params.logprobs} alternatives asked for, the vocabulary has "
                                         f"{limits.vocab_size} tokens")
    if params.stop and tokenizer is None:
        raise ParameterError("stop", "stop: stop strings need a tokenizer; this model has none (use stop_token_ids)")


def validate_request(prompt: Prompt, params: SamplingParams, limits: RequestLimits,
                     tokenizer: Any | None) -> list[int]:
    """Every model-dependent check of one request; returns the prompt's token ids.

    What `LLMEngine.add_request` runs; the server runs the same steps one by one (it
    names chat prompts "messages" and picks max_tokens from the room the prompt leaves).
    """
    token_ids = encode_prompt(prompt, tokenizer)
    check_prompt(token_ids, limits)
    check_max_tokens(len(token_ids), params.max_tokens, limits)
    check_params(params, limits, tokenizer)
    return token_ids
