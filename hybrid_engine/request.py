"""A request's life inside the engine, and what the engine hands back for it."""
from dataclasses import dataclass, field
from enum import Enum

from cache.mamba_cache import RequestState
from cache.prefix_cache import NEVER
from hybrid_engine.detokenizer import IncrementalDetokenizer
from hybrid_engine.sampling_params import SamplingParams
from hybrid_engine.structured.grammar import GrammarState


class RequestStatus(Enum):
    """Where a request is in its life; `Scheduler` (hybrid_engine/scheduler.py) owns every
    transition (its module docstring has the table): WAITING (queued or evicted) ->
    RUNNING <-> PAUSED; RUNNING or PAUSED -> WAITING (evicted); any -> FINISHED."""

    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's per-completion view of an output (`RequestOutput.outputs[0]`), for code
    written against vLLM's `out.outputs[0].text`. One request is one completion here, so
    `index` is 0; `cumulative_logprob` sums the sampled tokens' logprobs (None unless
    logprobs were requested)."""

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: str | int | None


class RequestOutput:
    """One request's state as returned by `LLM.generate` / `LLMEngine.step`.

    `new_token_ids` / `new_text` hold what this step added (for streaming); the other
    fields are cumulative. `logprobs[i]` maps token id -> logprob for output token i.
    `num_cached_tokens`: prompt tokens served from the prefix cache (not computed).

    The cumulative fields cost O(1) per step to produce: a request's token, logprob and
    text-piece lists only ever grow, so an output keeps a reference plus the length at
    its step, and builds the list (or string) when it is read.
    """

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "finished", "finish_reason", "stop_reason",
                 "new_token_ids", "new_text", "error", "num_cached_tokens", "_output_ids", "_num_output", "_logprobs",
                 "_text_parts", "_num_text_parts", "_text_tail")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], output_ids: list[int],
                 logprobs: list[dict[int, float]] | None, text_parts: list[str] | None, text_tail: str,
                 finished: bool, finish_reason: str | None, stop_reason: str | int | None,
                 new_token_ids: list[int], new_text: str, error: str | None, num_cached_tokens: int = 0):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.num_cached_tokens = num_cached_tokens
        self.finished, self.finish_reason, self.stop_reason = finished, finish_reason, stop_reason
        self.new_token_ids, self.new_text, self.error = new_token_ids, new_text, error
        self._output_ids, self._num_output, self._logprobs = output_ids, len(output_ids), logprobs
        self._text_parts, self._text_tail = text_parts, text_tail
        self._num_text_parts = 0 if text_parts is None else len(text_parts)

    @property
    def output_token_ids(self) -> list[int]:
        """Every token generated up to this output's step."""
        return self._output_ids[: self._num_output]

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        """Per output token: token id -> logprob (sampled token first), when requested."""
        return None if self._logprobs is None else self._logprobs[: self._num_output]

    @property
    def new_logprobs(self) -> list[dict[int, float]] | None:
        """The logprobs rows of `new_token_ids` (the last of the output's tokens)."""
        if self._logprobs is None:
            return None
        return self._logprobs[self._num_output - len(self.new_token_ids): self._num_output]

    @property
    def held_text(self) -> str:
        """Decoded text not streamed yet because it may start a stop string (ends `text`)."""
        return self._text_tail

    @property
    def text(self) -> str | None:
        """The output text up to this output's step (None without a tokenizer)."""
        if self._text_parts is None:
            return None
        return "".join(self._text_parts[: self._num_text_parts]) + self._text_tail

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The same output in vLLM's shape: a list of one `CompletionOutput` (built on read)."""
        logprobs, token_ids = self.logprobs, self.output_token_ids
        cumulative = None if logprobs is None else sum(row[t] for t, row in zip(token_ids, logprobs))
        return [CompletionOutput(0, self.text, token_ids, cumulative, logprobs, self.finish_reason, self.stop_reason)]

    def merge_earlier(self, earlier: list["RequestOutput"]) -> None:
        """Fold earlier outputs of the same request (oldest first) that nobody consumed into
        this later one: `new_token_ids` and `new_text` then cover all their steps (the
        cumulative fields are this output's already), so a streaming consumer that fell
        behind catches up in one chunk."""
        outputs = [*earlier, self]
        self.new_token_ids = [token for out in outputs for token in out.new_token_ids]
        self.new_text = "".join(out.new_text for out in outputs)

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, output_token_ids={self.output_token_ids!r}, "
                f"text={self.text!r}, finished={self.finished}, finish_reason={self.finish_reason!r})")


@dataclass(eq=False, slots=True)  # identity semantics: requests live in queues and dicts
class Request:
    """Engine-side request: tokens, progress, and the resources it holds.

    The fields after `detokenizer` are lifecycle state: only the `Scheduler` writes them
    (and `make_output`, which hands the streaming delta over); the runner and the engine
    only read them.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # sampling noise key: the user's seed or one derived from the engine seed
    eos_token_ids: frozenset[int]  # empty with ignore_eos
    detokenizer: IncrementalDetokenizer | None
    # Structured outputs: where the output stands in its grammar (None: unconstrained).
    # The scheduler advances it as it appends tokens; the runner reads its token mask.
    grammar: GrammarState | None = None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose KV / Mamba state is committed.
    num_computed: int = 0
    # Launch-ahead bookkeeping: tokens launched (committed + in flight), samples expected
    # from launched steps not yet retired, and launched rows still on the device.
    num_scheduled: int = 0
    pending_samples: int = 0
    inflight: int = 0
    launch_row: int = -1  # the request's row in the newest launched step
    # Drafts of its newest launched row while that row is in flight (speculative decoding):
    # the tokens the next launch-ahead row's drafts follow.
    inflight_drafts: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    state: RequestState | None = None  # Mamba state row and slots while admitted
    # Prefix caching: prompt tokens served from the cache at its first admission (None
    # until admitted), and the committed length at which the cache registers it next.
    num_cached_tokens: int | None = None
    cache_commit_at: int = NEVER
    # Where the cache keeps the request's prompt-end checkpoint when that is not the
    # prompt's end: a draft model's proposal sets the end of the target's committed tokens,
    # where its next proposal resumes, and leaves no finish checkpoint (spec/draft_model.py).
    checkpoint_at: int | None = None
    # How far its committed content may be cached: content computed with a dt that a
    # prefill of the same tokens as a prompt would have clamped (a generated token's, on
    # a model with a prompt-only dt limit) is not what an uncached request would compute,
    # so the cache keeps nothing of it or after it (docs/cache.md, "Exactness").
    cache_limit: int = NEVER
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    # Streaming deltas accumulated since the last output was emitted.
    pending_token_ids: list[int] = field(default_factory=list)
    pending_text: str = ""
    # The params' stop_token_ids as a set (checked for every token; a list of a million ids
    # slowed every step), derived here so that it cannot disagree with them.
    stop_token_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        self.stop_token_ids = frozenset(self.params.stop_token_ids or ())

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: everything whose KV/state must eventually exist."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prompt_checkpoint(self) -> int:
        """Position of the request's prompt-end checkpoint (prefix caching): prefill chunks
        end there, and at interval positions before it."""
        return len(self.prompt_token_ids) if self.checkpoint_at is None else self.checkpoint_at

    @property
    def num_tokens_when_retired(self) -> int:
        """Tokens once every launched step retires (samples in flight counted)."""
        return self.num_tokens + self.pending_samples

    @property
    def finished(self) -> bool:
        """Whether the request has its finish reason (its resources may still be in flight)."""
        return self.status is RequestStatus.FINISHED

    def make_output(self) -> RequestOutput:
        """Snapshot for the caller (O(1)); takes (and clears) the pending streaming delta."""
        detok = self.detokenizer
        # Text held back for a possible stop string is flushed into the stream at every other
        # finish; a failed request's detokenizer is not run again, so its text ends where its
        # stream did.
        held = "" if detok is None or self.finish_reason == "error" else detok.held_text
        out = RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.output_token_ids, self.logprobs,
                            None if detok is None else detok.text_pieces, held,
                            self.status is RequestStatus.FINISHED, self.finish_reason, self.stop_reason,
                            self.pending_token_ids, self.pending_text, self.error, self.num_cached_tokens or 0)
        self.pending_token_ids, self.pending_text = [], ""
        return out
