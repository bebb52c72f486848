"""Which requests run each step, and the one owner of every request's lifecycle.

Every status change and every cursor of a `Request` is written here and nowhere else:

| state          | event                                   | next             | effect                               |
|----------------|-----------------------------------------|------------------|--------------------------------------|
| (new)          | `add`                                   | WAITING          | queued, FCFS                         |
| WAITING        | `schedule`: admitted                    | RUNNING          | takes a Mamba state, KV blocks       |
| RUNNING        | `schedule`: row launched                | RUNNING          | launch cursors advance               |
| RUNNING        | `schedule`: next KV block not free      | PAUSED           | keeps its blocks and state           |
| PAUSED         | `schedule`: the block is free           | RUNNING          | row launched                         |
| RUNNING/PAUSED | `schedule`: nothing fits (evict)        | WAITING          | frees all; recomputes prompt+output  |
| RUNNING/PAUSED | `retire` a valid row                    | same/FINISHED    | state committed, sample appended,    |
|                |                                         |                  | stop/EOS/grammar/length checked      |
| RUNNING/PAUSED | `retire` a verify row, `a` of D drafts  | same/FINISHED    | state after draft `a` committed; a+1 |
|                | accepted                                |                  | samples appended one by one (stops   |
|                |                                         |                  | checked each); cursors roll back D-a |
| RUNNING        | `reject` a launch-ahead row             | RUNNING          | launch cursors roll back             |
| any but FINISHED | `finish` (abort)                      | FINISHED         | text flushed                         |
| any but FINISHED | `fail` (the step touching it raised)  | FINISHED         | reason "error" + message             |
| FINISHED       | its last in-flight row retires (or fails) | (released)     | blocks and state back to the pools   |

Scheduling policy, in order (each step):
1. Paused requests resume, oldest first, when the KV block they wait for is free.
2. Running requests in admission order: decoders take one token (a decoder that needs
   a new KV block and finds none is PAUSED); requests mid-prompt take the next chunk that
   the token budget and free blocks allow.
3. Waiting requests are admitted FCFS while a Mamba state, token budget and KV blocks for
   their first chunk are free -- but never while a request is paused (it has priority).
4. If nothing at all could be scheduled (and no step is in flight), the newest paused or
   stalled request is EVICTED: its blocks and state are freed and it goes back to the
   front of the queue, to be recomputed (prompt + tokens generated so far) when
   readmitted. Repeat until the step has work. A lone request always fits:
   `LLMEngine.add_request` rejects any request whose prompt + max_tokens cannot fit.

Speculative decoding (a `Drafter`): a decoder's row carries up to K draft tokens after
its input token (a *verify row*); K shrinks so that the drafts never pass max_tokens,
the context, the step's token budget or the free KV blocks (no one is paused for a draft).
Launch cursors advance as if every draft is accepted; `retire` rolls them back by the
rejected drafts and reports the request as mispredicted, so the engine rejects the row
that launch-ahead launched on top of the rejected drafts.

Launch-ahead: scheduling a chunk *is* launching it (the engine launches every scheduled
step). The scheduler plans from each request's launched cursors (`num_scheduled`,
`num_tokens_when_retired`), i.e. as if every in-flight row continues. A request whose
in-flight sample will surely end it (max_tokens / context reached) is not planned again,
nor is a constrained one (structured outputs) while its sample is in flight: its next
token mask depends on that sample. It takes every other launch-ahead step (every step
when it runs alone), and carries no drafts.
Pauses are decided here, before a launch, so no launched row belongs to a paused request;
eviction never touches a request with rows in flight.
"""
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from cache.kv_cache import KVBlockAllocator
from cache.mamba_cache import MambaStateAllocator
from cache.prefix_cache import NEVER, PendingSave, PrefixCache, PrefixHit
from hybrid_engine.request import Request, RequestStatus
from hybrid_engine.spec.drafter import Drafter, DraftRow

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `request` starting at position `start`; `samples`: the chunk
    reaches the request's last token, so its last logits draw the next token. `prev_row`:
    the request's row in the newest step it was launched in before this one (-1: none);
    used only when the chunk's input token is still in flight, i.e. sampled there.
    `drafts`: a verify row's draft tokens (positions start+1 ...; num_tokens = 1 + drafts).
    `state_src` / `state_dsts`: the Mamba slot the row reads and the slots it writes, one
    per position (from `MambaStateAllocator.launch`). `saves`: prefix-cache checkpoints the
    chunk writes from inside itself (`PrefixCache.reserve_saves`)."""

    request: Request
    start: int
    num_tokens: int
    samples: bool
    prev_row: int = -1
    drafts: Sequence[int] = ()  # immutable default: no list allocated per plain decode row
    state_src: int = -1
    state_dsts: tuple[int, ...] = ()
    saves: tuple[PendingSave, ...] = ()

    @property
    def num_samples(self) -> int:
        """Samples the row adds if every draft is accepted (what launch cursors assume)."""
        return 1 + len(self.drafts) if self.samples else 0


@dataclass(slots=True)
class VerifiedRow:
    """What verification kept of a verify row: `num_accepted` drafts, and the samples to
    append (the accepted drafts, then the target's own token), with their logprobs."""

    num_accepted: int
    token_ids: list[int]
    logprobs: list[list[tuple[int, float]]] | None


@dataclass(eq=False)  # identity semantics: the engine tracks unretired steps by object
class SchedulerOutput:
    """The step's batch: decode rows first (one token each), then prefill chunks."""

    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        """Every row in step order."""
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


@dataclass
class RetiredStep:
    """What retiring a step changed: requests with a new token or a finish (their outputs
    are due), requests that finished, requests whose verify row rejected a draft (a
    launch-ahead row built on the drafts must be rejected), rows dropped although
    launch-ahead kept them (their request was aborted while the row was in flight), and the
    drafts its verify rows proposed and accepted."""

    advanced: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    mispredicted: list[Request] = field(default_factory=list)
    num_dropped: int = 0
    num_proposed: int = 0
    num_accepted: int = 0


class Scheduler:
    """Owns the request queues, every request transition, and hands out KV blocks and
    Mamba states."""

    def __init__(self, kv: KVBlockAllocator, mamba: MambaStateAllocator, max_num_batched_tokens: int,
                 max_model_len: int, drafter: Drafter | None = None, prefix_cache: PrefixCache | None = None):
        self.kv, self.mamba, self.drafter, self.cache = kv, mamba, drafter, prefix_cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; includes paused requests
        self.num_pauses = 0
        self.num_evictions = 0
        self.num_cache_queries = 0  # tokens looked up in the prefix cache at admission
        self.num_cache_hits = 0  # of those, tokens resumed from the cache (not computed)
        self.num_dt_limited = 0  # requests whose generated content the cache may not take (`cache_limit`)

    @property
    def paused(self) -> list[Request]:
        return [r for r in self.running if r.status is RequestStatus.PAUSED]

    def add(self, request: Request) -> None:
        """A new request joins the back of the queue."""
        self.waiting.append(request)

    # ---- schedule (admit, launch, pause, evict) ------------------------------------------
    def schedule(self, allow_evict: bool = True) -> SchedulerOutput:
        """Pick this step's batch (see the module docstring) and launch its rows."""
        while True:
            out, budget = self._try_schedule()
            if not out.is_empty or not self.running or not allow_evict:
                break
            self._evict(next(r for r in reversed(self.running) if r.inflight == 0))
        if self.drafter is not None:
            self._launch_verify_rows(out.decodes, budget)
        num_decode = len(out.decodes)
        for j, chunk in enumerate(out.prefills):  # (decode rows launched in _try_schedule)
            request = chunk.request
            chunk.state_src, chunk.state_dsts = self.mamba.launch(request.state)
            if self.cache is not None:
                chunk.saves = self.cache.reserve_saves(request, chunk.start, chunk.num_tokens)
            request.num_scheduled += chunk.num_tokens
            request.pending_samples += chunk.samples
            request.inflight += 1
            request.launch_row = num_decode + j
        return out

    def _try_schedule(self) -> tuple[SchedulerOutput, int]:
        """One scheduling pass: the batch, and the token budget it leaves."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        block_size, running, paused = self.kv.block_size, RequestStatus.RUNNING, RequestStatus.PAUSED
        decodes = out.decodes
        for request in self.running:
            if budget == 0:
                break
            # Runs for every request every step: kept flat on purpose. A request whose
            # in-flight sample will surely end it is not planned past; a decoder (all but
            # its newest token launched) takes one token, reserving a block only at a
            # block boundary.
            scheduled = request.num_scheduled
            n_out = len(request.output_token_ids) + request.pending_samples
            n_tokens = len(request.prompt_token_ids) + n_out
            # (Nor is a constrained one: its next token mask depends on that sample.)
            if request.pending_samples and (n_out >= request.params.max_tokens or n_tokens >= self.max_model_len
                                            or request.grammar is not None):
                continue
            if n_out and scheduled == n_tokens - 1:
                if scheduled >= len(request.blocks) * block_size and not self._reserve(request, scheduled + 1):
                    if request.status is running:
                        request.status = paused
                        self.num_pauses += 1
                    continue
                request.status = running
                if self.drafter is not None:  # launched with its drafts once the step is planned
                    decodes.append(ScheduledChunk(request, scheduled, 1, True, request.launch_row))
                    request.launch_row = len(decodes) - 1
                    budget -= 1
                    continue
                src, dsts = self.mamba.launch(request.state)
                decodes.append(ScheduledChunk(request, scheduled, 1, True, request.launch_row, state_src=src,
                                              state_dsts=dsts))
                request.launch_row = len(decodes) - 1
                request.num_scheduled = scheduled + 1
                request.pending_samples += 1
                request.inflight += 1
                budget -= 1
            else:
                chunk = self._prefill_chunk(request, budget)
                if chunk is not None:
                    out.prefills.append(chunk)
                    budget -= chunk.num_tokens
        while self.waiting and budget > 0 and not self.paused and self.mamba.num_free > 0:
            request = self.waiting[0]
            hit = self._take_prefix_hit(request) if self.cache is not None else None
            chunk = self._prefill_chunk(request, budget)
            if chunk is None:
                if hit is not None:
                    self.cache.cancel(hit)
                    request.blocks, request.num_computed, request.num_scheduled = [], 0, 0
                break  # FCFS: the head waits for blocks; nobody overtakes it
            self.waiting.popleft()
            request.state = self.mamba.allocate(None if hit is None else hit.checkpoint.slot)
            if self.cache is not None:
                self._start_caching(request, hit)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.prefills.append(chunk)
            budget -= chunk.num_tokens
        return out, budget

    def _launch_verify_rows(self, decodes: list[ScheduledChunk], budget: int) -> None:
        """Give the step's decode rows their drafts and launch them. Drafts come last: they
        take only the token budget and KV blocks left after every decoder's token and every
        prefill chunk, and stay within max_tokens and the context, so K shrinks and no one
        waits for a draft. A large batch whose drafts are too sparse to pay for widening
        every row (`Drafter.worth_widening`) runs without them."""
        rows: list[DraftRow] = []
        proposals: list[list[int]] = []
        batch: list[int] = []  # rows drafted in one batched call (a draft model), after this loop
        for chunk in decodes:
            request, n_tokens = chunk.request, chunk.start + 1
            n_out = len(request.output_token_ids) + request.pending_samples
            room = max(0, min(self.drafter.num_speculative_tokens, budget, request.params.max_tokens - n_out - 1,
                              self.max_model_len - n_tokens - 1,
                              (len(request.blocks) + self.kv.num_free) * self.kv.block_size - n_tokens))
            if request.grammar is not None:  # (drafts would need a mask per position: not drafted)
                room = 0
            # The input token is in flight when launch-ahead has not retired its sample yet.
            in_flight = chunk.start >= len(request.prompt_token_ids) + len(request.output_token_ids)
            row = DraftRow(request, room, in_flight)
            rows.append(row)
            proposals.append([])
            if not room or not self.drafter.selects(row):
                continue
            if self.drafter.batched:
                # Drafted later: the row holds its whole room (what is not drafted is given back below).
                batch.append(len(rows) - 1)
                charge = room
            else:
                proposals[-1] = self.drafter.propose([row])[0]
                charge = len(proposals[-1])
            self._reserve(request, n_tokens + charge)
            budget -= charge
        # (A batch too sparse to widen the step even if every row drafted its room is not run.)
        if batch and self.drafter.worth_widening(len(decodes), sum(rows[i].max_drafts for i in batch)):
            for i, drafts in zip(batch, self.drafter.propose([rows[i] for i in batch])):
                proposals[i] = drafts
        num_drafts = sum(map(len, proposals))
        if num_drafts and not self.drafter.worth_widening(len(decodes), num_drafts):
            proposals = [[] for _ in decodes]
        for chunk, drafts, row in zip(decodes, proposals, rows):
            request = chunk.request
            if row.max_drafts:
                self._unreserve(request, chunk.start + 1 + len(drafts))
            chunk.drafts, chunk.num_tokens = drafts, 1 + len(drafts)
            chunk.state_src, chunk.state_dsts = self.mamba.launch(request.state, chunk.num_tokens)
            request.inflight_drafts = drafts
            request.num_scheduled = chunk.start + chunk.num_tokens
            request.pending_samples += chunk.num_tokens
            request.inflight += 1

    def _take_prefix_hit(self, request: Request) -> PrefixHit | None:
        """Resume a request about to be admitted from its deepest cached prefix: it holds
        the prefix's blocks and starts its cursors there (undone by `cache.cancel` if it is
        not admitted after all). A recomputed request resumes no deeper than its
        `cache_limit`: past it, its own (generated, unclamped) tokens are not what a cached
        prompt (clamped) computed for the same text."""
        hit = self.cache.acquire((request.prompt_token_ids + request.output_token_ids)[: request.cache_limit + 1])
        if hit is not None:
            request.blocks = hit.blocks
            request.num_computed = request.num_scheduled = hit.position
        return hit

    def _start_caching(self, request: Request, hit: PrefixHit | None) -> None:
        """An admitted request's cache bookkeeping: the hit's copies, the counters, and when
        its committed tokens are next registered."""
        position = 0 if hit is None else hit.position
        request.cache_commit_at = self.cache.start(request) if hit is None else self.cache.resume(request, hit)
        self.num_cache_queries += request.num_tokens
        self.num_cache_hits += position
        if request.num_cached_tokens is None:
            request.num_cached_tokens = position

    def _prefill_chunk(self, request: Request, budget: int) -> ScheduledChunk | None:
        """The next prefill chunk that fits the budget and the KV pool (blocks reserved),
        ending at the prompt-end checkpoint if tokens follow it (prefix caching)."""
        start, end = request.num_scheduled, request.num_tokens_when_retired
        held = len(request.blocks) * self.kv.block_size - start
        fits = held + self.kv.num_free * self.kv.block_size
        n = min(end - start, budget, fits)
        if n <= 0:
            return None
        if self.cache is not None:
            n = self.cache.chunk_limit(request, start, n)
        self._reserve(request, start + n)
        return ScheduledChunk(request, start, n, samples=start + n == end)

    def _reserve(self, request: Request, num_tokens: int) -> bool:
        """Make the request hold blocks for `num_tokens` tokens; False if the pool can't."""
        need = self.kv.blocks_for(num_tokens) - len(request.blocks)
        if need <= 0:
            return True
        if need > self.kv.num_free:
            return False
        request.blocks.extend(self.kv.allocate(need))
        return True

    def _unreserve(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks the request holds beyond `num_tokens` tokens (reserved for
        drafts that were then dropped; nothing was written there). A new list: the runner's
        block-table cache keys on it."""
        keep = self.kv.blocks_for(num_tokens)
        if len(request.blocks) > keep:
            self.kv.release(request.blocks[keep:])
            request.blocks = request.blocks[:keep]

    def _evict(self, request: Request) -> None:
        """Free everything the request holds and requeue it at the front for recompute
        (with prefix caching, its committed state is checkpointed first: it resumes there)."""
        self.running.remove(request)
        if self.cache is not None:
            self.cache.finish(request, request.num_computed)
        self._release(request)
        request.num_computed = request.num_scheduled = 0
        request.inflight_drafts = []
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_evictions += 1

    # ---- retire / reject ---------------------------------------------------------------
    def reject(self, chunk: ScheduledChunk) -> None:
        """A request's newest launched row is rejected: roll its launch cursors back. Its
        state writes are never committed and its KV writes lie past the committed length,
        so nothing else changes; `retire` later sees the row as invalid."""
        request = chunk.request
        request.num_scheduled -= chunk.num_tokens
        request.pending_samples -= chunk.num_samples
        request.inflight_drafts = []
        self.mamba.reject(request.state)
        if chunk.saves:
            self.cache.release_saves(request, chunk.saves)

    def retire(self, chunks: list[ScheduledChunk], valid: list[bool], token_ids: list[int],
               logprobs: list[list[tuple[int, float]]] | None,
               verified: list[VerifiedRow] | None = None,
               dt_limit_hits: list[bool] | None = None) -> RetiredStep:
        """A launched step's samples are on the host: commit its valid rows, append their
        tokens, check stops, and release what finished requests hold. `verified[i]`: what
        verification kept of row i when it carries drafts. `dt_limit_hits[i]`: a generated
        token of row i had a dt the prompt-only limit would have clamped, so the prefix
        cache takes nothing of the request from the row's first generated token on.

        Runs for every row every step, so the common case (a valid decode row) is kept
        flat: no helper calls but the stop check, unless the row is dropped, verifies
        drafts or has logprobs.
        """
        result = RetiredStep()
        finished, mamba = RequestStatus.FINISHED, self.mamba
        for i, chunk in enumerate(chunks):
            request = chunk.request
            request.inflight -= 1
            if not valid[i] or request.status is finished:
                # Rejected, or aborted while in flight: the row's writes are dead; the
                # request's resources were held for it until now.
                result.num_dropped += valid[i]
                self._release_if_idle(request)
                continue
            if dt_limit_hits is not None and dt_limit_hits[i]:
                self.num_dt_limited += request.cache_limit == NEVER
                request.cache_limit = min(request.cache_limit, max(chunk.start, len(request.prompt_token_ids)))
            if chunk.drafts:
                self._retire_verify_row(chunk, verified[i], result)
                continue
            request.num_computed = chunk.start + chunk.num_tokens
            mamba.commit(request.state, chunk.state_dsts)
            if request.num_computed >= request.cache_commit_at:
                self._cache_commit(request)
            if not chunk.samples:
                continue
            request.pending_samples -= 1
            self._append_sample(request, token_ids[i], None if logprobs is None else logprobs[i], result)
            result.advanced.append(request)
        return result

    def _retire_verify_row(self, chunk: ScheduledChunk, verified: VerifiedRow, result: RetiredStep) -> None:
        """Commit the state after the last accepted draft, roll the launch cursors back by
        the rejected drafts, and append the kept samples one by one until one stops."""
        request, accepted, num_drafts = chunk.request, verified.num_accepted, len(chunk.drafts)
        request.num_computed = chunk.start + 1 + accepted
        self.mamba.commit(request.state, chunk.state_dsts, accepted)
        request.pending_samples -= chunk.num_samples
        if request.inflight == 0:
            request.inflight_drafts = []
        if accepted < num_drafts:
            request.num_scheduled -= num_drafts - accepted
            result.mispredicted.append(request)
        self.drafter.record(request, num_drafts, accepted)
        for j, token in enumerate(verified.token_ids):
            self._append_sample(request, token, None if verified.logprobs is None else verified.logprobs[j], result)
            if request.finished:
                break
        # (After the appends: the cache reads the accepted drafts' tokens from the output.)
        if not request.finished and request.num_computed >= request.cache_commit_at:
            self._cache_commit(request)
        # Counted: the drafts verified, and those accepted before a stop ended the request.
        result.num_proposed += num_drafts
        result.num_accepted += min(accepted, j + 1)
        result.advanced.append(request)

    def _cache_commit(self, request: Request) -> None:
        """Hand the request's newly committed tokens to the prefix cache."""
        request.cache_commit_at = self.cache.commit(request, request.num_computed)

    def _append_sample(self, request: Request, token: int, logprobs: list[tuple[int, float]] | None,
                       result: RetiredStep) -> None:
        """Append one sampled token (and its logprobs), then finish the request if it stops."""
        request.output_token_ids.append(token)
        request.pending_token_ids.append(token)
        try:
            if request.logprobs is not None:
                self._append_logprobs(request, logprobs)
            reason = self._stop_reason(request, token)
            if reason is not None:
                self.finish(request, reason)
                result.finished.append(request)
        except Exception as e:  # one request's failure (e.g. its detokenizer) ends only it
            logger.exception("request %s failed while appending its token", request.request_id)
            self.finish(request, "error", f"{type(e).__name__}: {e}")
            result.finished.append(request)

    @staticmethod
    def _append_logprobs(request: Request, row: list[tuple[int, float]]) -> None:
        entry: dict[int, float] = {}
        for token_id, logprob in row[: 1 + request.params.logprobs]:
            entry.setdefault(token_id, logprob)  # sampled token first, then the top-n
        request.logprobs.append(entry)

    def _stop_reason(self, request: Request, token: int) -> str | None:
        """Append the token's text and decide whether the request is done. A stop token (EOS
        or one of stop_token_ids) ends it without its text, unless include_stop_str_in_output
        (vLLM's rule: the text then takes part in stop-string matching too); its id stays
        in the output's tokens."""
        params = request.params
        stop_token = token in request.stop_token_ids or token in request.eos_token_ids
        if request.detokenizer is not None and (not stop_token or params.include_stop_str_in_output):
            request.pending_text += request.detokenizer.add_tokens([token])
            if request.detokenizer.stop_reason is not None:
                request.stop_reason = request.detokenizer.stop_reason
                return "stop"
        if token in request.stop_token_ids:
            request.stop_reason = token
            return "stop"
        if stop_token:  # EOS
            return "stop"
        if request.grammar is not None:
            request.grammar.advance(token)
            if request.grammar.terminated:  # the output is whole and nothing may follow
                return "stop"
        n_out = len(request.output_token_ids)
        if n_out >= params.max_tokens or len(request.prompt_token_ids) + n_out >= self.max_model_len:
            return "length"
        return None

    # ---- finish / fail -----------------------------------------------------------------
    def finish(self, request: Request, reason: str, error: str | None = None) -> None:
        """End a request (`stop`, `length`, `abort`, or `error` with its message). Its
        resources return to the pools once no launched row can touch them."""
        detok = request.detokenizer
        # (Not after an error: it may have come from the detokenizer itself. `make_output`
        # then leaves the held-back text out of `text` too.)
        if reason != "error" and detok is not None and detok.stop_reason is None:
            request.pending_text += detok.flush()
            if detok.stop_reason is not None and reason != "abort":
                # The stop string completed only in text held back until now (e.g. a
                # trailing incomplete UTF-8 sequence that flushes as U+FFFD).
                reason, request.stop_reason = "stop", detok.stop_reason
        request.finish_reason, request.error = reason, error
        if self.cache is not None and request.state is not None:
            # A failed step may have left the state half-written: only other ends are cached.
            self.cache.finish(request, request.num_computed, save_state=reason != "error")
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        request.status = RequestStatus.FINISHED
        self._release_if_idle(request)

    def fail(self, requests: list[Request], error: str) -> list[Request]:
        """A step raised: end every live request it touched with reason "error", and
        release all of them (a failed step's rows never retire). Returns the requests that
        this call finished."""
        failed = []
        for request in dict.fromkeys(requests):  # a request can have a row in two steps
            if not request.finished:
                self.finish(request, "error", error)
                failed.append(request)
            request.inflight = 0
            self._release_if_idle(request)
        return failed

    def _release_if_idle(self, request: Request) -> None:
        """Free a finished request's blocks and state once no launched row can touch them."""
        if request.finished and request.inflight == 0:
            self._release(request)

    def _release(self, request: Request) -> None:
        """Return a request's blocks and Mamba state to the pools, then its drafting state."""
        if request.blocks:
            self.kv.release(reversed(request.blocks))  # (its deepest cached blocks evict first)
            request.blocks = []  # a new list: the runner's block-table cache keys on it
        if request.state is not None:
            self.mamba.free(request.state)
            request.state = None
        if self.drafter is not None:
            self.drafter.release(request)
