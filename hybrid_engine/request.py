"""A request's life inside the engine, and what the engine hands back for it."""
from dataclasses import dataclass, field
from enum import Enum

from hybrid_engine.detokenizer import IncrementalDetokenizer
from hybrid_engine.sampling_params import SamplingParams


class RequestStatus(Enum):
    """WAITING (queued or evicted) -> RUNNING <-> PAUSED -> FINISHED."""

    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestOutput:
    """One request's state as returned by `LLM.generate` / `LLMEngine.step`.

    `new_token_ids` / `new_text` hold what this step added (for streaming); the other
    fields are cumulative. `logprobs[i]` maps token id -> logprob for output token i.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    error: str | None = None


@dataclass(eq=False)  # identity semantics: requests live in queues and dicts
class Request:
    """Engine-side request: tokens, progress, and the resources it holds."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # sampling noise key: the user's seed or one derived from the engine seed
    eos_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer | None
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
    blocks: list[int] = field(default_factory=list)
    seq_slot: int = -1  # request slot in the Mamba pool (also its token-history row)
    state_parity: int = 0  # which of the slot's state copies is committed (ping-pong)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    # Streaming deltas accumulated since the last output was emitted.
    pending_token_ids: list[int] = field(default_factory=list)
    pending_text: str = ""

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        p = self.params
        # The per-step sampling fields, computed once (the runner copies them every step).
        # top_k >= vocab means "off"; the clamp keeps it exact in float32 and int32.
        self.sampling_row = (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                             p.frequency_penalty, float(min(p.top_k, 1 << 24)))
        self.greedy, self.uses_penalties = p.greedy, p.uses_penalties

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: everything whose KV/state must eventually exist."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def spec_num_tokens(self) -> int:
        """Tokens once every launched step retires (samples in flight counted)."""
        return self.num_tokens + self.pending_samples

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def make_output(self) -> RequestOutput:
        """Snapshot for the caller; takes (and clears) the pending streaming delta."""
        out = RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=list(self.output_token_ids),
            text=None if self.detokenizer is None else self.detokenizer.text,
            finished=self.finished,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            new_token_ids=self.pending_token_ids,
            new_text=self.pending_text,
            error=self.error,
        )
        self.pending_token_ids, self.pending_text = [], ""
        return out
