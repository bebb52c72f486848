"""Which requests run this step, and with how many tokens.

Policy, in order (each step):
1. Paused requests resume, oldest first, when the KV block they wait for is free.
2. Running requests in admission order: decoders take one token (a decoder that needs
   a new KV block and finds none is PAUSED: it keeps its blocks and Mamba slot);
   requests mid-prompt take the next chunk that the token budget and free blocks allow.
3. Waiting requests are admitted FCFS while a Mamba slot, token budget and KV blocks for
   their first chunk are free -- but never while a request is paused (it has priority).
4. If nothing at all could be scheduled (and no step is in flight), the newest paused or
   stalled request is EVICTED:
   its blocks and slot are freed and it goes back to the front of the queue, to be
   recomputed (prompt + tokens generated so far) when readmitted. Repeat until the step
   has work. A lone request always fits: `LLMEngine.add_request` rejects any request
   whose prompt + max_tokens cannot fit in the whole pool.

Launch-ahead: the scheduler plans from each request's *launched* cursor (`num_scheduled`,
`spec_num_tokens`), i.e. as if every in-flight step's rows continue. A request whose
in-flight sample will surely end it (max_tokens / context reached) is not planned again.
Pauses are decided here, before a launch, so no launched row belongs to a paused
request; eviction never touches a request with rows in flight.
"""
from collections import deque
from dataclasses import dataclass, field

from cache.kv_cache import KVBlockAllocator
from cache.mamba_cache import MambaSlotAllocator
from hybrid_engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `request` starting at position `start`; `samples`: the chunk
    reaches the request's last token, so its last logits draw the next token."""

    request: Request
    start: int
    num_tokens: int
    samples: bool


@dataclass
class SchedulerOutput:
    """The step's batch: decode rows first (one token each), then prefill chunks."""

    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """Owns the request queues and hands out KV blocks and Mamba slots."""

    def __init__(self, kv: KVBlockAllocator, mamba: MambaSlotAllocator, max_num_batched_tokens: int,
                 max_model_len: int):
        self.kv, self.mamba = kv, mamba
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; includes paused requests
        self.num_pauses = 0
        self.num_evictions = 0

    # ---- queue management -------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def paused(self) -> list[Request]:
        return [r for r in self.running if r.status is RequestStatus.PAUSED]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Drop a request from the queues (it keeps its resources until `free`)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def free(self, request: Request) -> None:
        """Return a request's blocks and Mamba slot to the pools."""
        if request.blocks:
            self.kv.free(request.blocks)
            request.blocks = []
        if request.seq_slot >= 0:
            self.mamba.free(request.seq_slot)
            request.seq_slot = -1

    # ---- the step ---------------------------------------------------------------------
    def schedule(self, allow_evict: bool = True) -> SchedulerOutput:
        """Pick this step's batch (see the module docstring) and advance the launch cursors."""
        while True:
            out = self._try_schedule()
            if not out.is_empty or not self.running or not allow_evict:
                break
            self._evict(next(r for r in reversed(self.running) if r.inflight == 0))
        for chunk in out.prefills:  # (decode rows advanced their cursors in _try_schedule)
            request = chunk.request
            request.num_scheduled += chunk.num_tokens
            request.pending_samples += chunk.samples
        return out

    def unschedule(self, chunk: ScheduledChunk) -> None:
        """Roll a rejected launch's cursors back (its effects on state are discarded)."""
        chunk.request.num_scheduled = chunk.start
        chunk.request.pending_samples -= chunk.samples

    def _try_schedule(self) -> SchedulerOutput:
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
            if request.pending_samples and (n_out >= request.params.max_tokens or n_tokens >= self.max_model_len):
                continue
            if n_out and scheduled == n_tokens - 1:
                if scheduled >= len(request.blocks) * block_size and not self._reserve(request, scheduled + 1):
                    if request.status is running:
                        request.status = paused
                        self.num_pauses += 1
                    continue
                request.status = running
                decodes.append(ScheduledChunk(request, scheduled, 1, True))
                request.num_scheduled = scheduled + 1
                request.pending_samples += 1
                budget -= 1
            else:
                chunk = self._prefill_chunk(request, budget)
                if chunk is not None:
                    out.prefills.append(chunk)
                    budget -= chunk.num_tokens
        while self.waiting and budget > 0 and not self.paused and self.mamba.num_free > 0:
            request = self.waiting[0]
            chunk = self._prefill_chunk(request, budget)
            if chunk is None:
                break  # FCFS: the head waits for blocks; nobody overtakes it
            self.waiting.popleft()
            request.seq_slot = self.mamba.allocate()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.prefills.append(chunk)
            budget -= chunk.num_tokens
        return out

    def _prefill_chunk(self, request: Request, budget: int) -> ScheduledChunk | None:
        """The next prefill chunk that fits the budget and the KV pool (blocks reserved)."""
        start, end = request.num_scheduled, request.spec_num_tokens
        held = len(request.blocks) * self.kv.block_size - start
        fits = held + self.kv.num_free * self.kv.block_size
        n = min(end - start, budget, fits)
        if n <= 0:
            return None
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

    def _evict(self, request: Request) -> None:
        """Free everything the request holds and requeue it at the front for recompute."""
        self.remove(request)
        self.free(request)
        request.num_computed = request.num_scheduled = 0
        request.state_parity = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_evictions += 1
