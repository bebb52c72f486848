"""`DraftModel`: drafts from a second, smaller model (speculative_config method "draft_model").

The draft model runs in an engine of its own (an `LLMEngine` the target engine builds
beside itself, on the same device and out of the same memory budget). Each step, every
verify row's request becomes one *proposal*: a request of the draft engine whose prompt
is the target request's prompt and whose already-generated output is the target's output
(plus, under launch-ahead, the drafts still in flight), asked for the row's drafts. All of
a step's proposals run as one batch.

**Coupled drafting**: a proposal samples with the target request's own sampling
parameters and seed, and -- because its output continues the target's -- at the same
output positions, with penalties over the same history. The sampling noise is a pure
function of (seed, output position), so a draft model equal to the target proposes the
target's own tokens, greedy or sampled, and every draft is accepted.

**Rollback**: a proposal's state never outlives it. The draft engine's prefix cache keeps
a checkpoint of the draft model's KV and Mamba state at the end of the target's committed
tokens (`Request.checkpoint_at`), and the next proposal of the request resumes there: it
computes only the tokens committed since (at most K+1) and its in-flight drafts, whatever
was accepted. Proposals are never requests of the target: they change no token, only how
many steps the target takes.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybrid_engine.config import EngineConfig
from hybrid_engine.request import Request
from hybrid_engine.spec.config import SpeculativeConfig

if TYPE_CHECKING:  # (the engine imports this module)
    from hybrid_engine.engine import LLMEngine

# Prefix-cache checkpoints of the draft engine per request. A proposal leaves one (at the
# target's committed end, where the next one resumes; no interval and no finish
# checkpoints), so least-recently-used eviction keeps every request's last two.
DRAFT_CHECKPOINTS_PER_SEQ = 2
# The draft engine's checkpoint interval: past any context, so no prompt is split for one.
NO_INTERVAL_BLOCKS = 1 << 40


def draft_engine_config(target: EngineConfig, spec: SpeculativeConfig) -> EngineConfig:
    """The draft engine's settings: the target's device, dtype, scheduling, CUDA graphs,
    token budget, KV block size, context length and seed; the draft checkpoint's own
    `mamba_ssm_cache_dtype`; prefix caching on (proposals resume from it) without interval
    checkpoints; no speculation and no injected rejections. The target engine sets its
    pool sizes."""
    return dataclasses.replace(target, model=spec.model, speculative_config=None, mamba_ssm_cache_dtype="auto",
                               enable_prefix_caching=True, prefix_cache_max_checkpoints=None,
                               prefix_cache_checkpoint_interval=target.kv_block_size * NO_INTERVAL_BLOCKS,
                               inject_rejection_rate=0.0)


@dataclass(slots=True)
class DraftQuery:
    """`num_tokens` drafts wanted after `request`'s context: its prompt, its output, then
    `extra` (its drafts still in flight)."""

    request: Request
    extra: list[int]
    num_tokens: int


class DraftModel:
    """Runs each step's proposals as one batch on the draft engine."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._ids = itertools.count()

    def propose(self, queries: list[DraftQuery]) -> list[list[int]]:
        """The drafts of each query (fewer than asked near the draft engine's context or
        KV capacity, or after an EOS / stop token the draft sampled)."""
        engine = self.engine
        proposals: dict[str, int] = {}  # proposal id -> its query's index
        prefix_lens: list[int] = []
        for i, query in enumerate(queries):
            target = query.request
            output = target.output_token_ids + query.extra
            context = len(target.prompt_token_ids) + len(output)
            prefix_lens.append(len(output))
            room = min(query.num_tokens, engine.max_model_len - context, engine.limits.kv_tokens - context)
            if room <= 0:
                continue
            params = dataclasses.replace(target.params, max_tokens=len(output) + room, seed=target.seed, stop=None,
                                         logprobs=None)
            proposal = Request(f"draft-{next(self._ids)}", None, target.prompt_token_ids, params, target.seed,
                               target.eos_token_ids, None, output_token_ids=output,
                               checkpoint_at=len(target.prompt_token_ids) + len(target.output_token_ids))
            engine.enqueue(proposal)
            proposals[proposal.request_id] = i
        drafts: list[list[int]] = [[] for _ in queries]
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    i = proposals.get(out.request_id)
                    if out.finished and i is not None and out.finish_reason != "error":
                        drafts[i] = out.output_token_ids[prefix_lens[i]:]
        finally:
            # An error escaped a step (the caller logs it): end what is left, so nothing
            # stays in the draft engine or holds its memory.
            for request_id in list(engine.requests):
                engine.abort_request(request_id)
        return drafts
