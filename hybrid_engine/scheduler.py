"""Which requests run this step, and with how many tokens.

Policy, in order (each step):
1. Paused requests resume, oldest first, when the KV block they wait for is free.
2. Running requests in admission order: decoders take one token (a decoder that needs
   a new KV block and finds none is PAUSED: it keeps its blocks and Mamba slot);
   requests mid-prompt take the next chunk that the token budget and free blocks allow.
3. Waiting requests are admitted FCFS while a Mamba slot, token budget and KV blocks for
   their first chunk are free -- but never while a request is paused (it has priority).
4. If nothing at all could be scheduled, the newest paused or stalled request is EVICTED:
   its blocks and slot are freed and it goes back to the front of the queue, to be
   recomputed (prompt + tokens generated so far) when readmitted. Repeat until the step
   has work. A lone request always fits: `LLMEngine.add_request` rejects any request
   whose prompt + max_tokens cannot fit in the whole pool.
"""
from collections import deque
from dataclasses import dataclass, field

from cache.kv_cache import KVBlockAllocator
from cache.mamba_cache import MambaSlotAllocator
from hybrid_engine.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `request` starting at position `start`."""

    request: Request
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token, so its last logits draw the next token."""
        return self.start + self.num_tokens == self.request.num_tokens


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

    def __init__(self, kv: KVBlockAllocator, mamba: MambaSlotAllocator, max_num_batched_tokens: int):
        self.kv, self.mamba = kv, mamba
        self.max_num_batched_tokens = max_num_batched_tokens
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

    def release(self, request: Request) -> None:
        """Return a request's blocks and slot to the pools and drop it from the queues."""
        if request.blocks:
            self.kv.free(request.blocks)
            request.blocks = []
        if request.seq_slot >= 0:
            self.mamba.free(request.seq_slot)
            request.seq_slot = -1
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    # ---- the step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch (see the module docstring for the policy)."""
        while True:
            out = self._try_schedule()
            if not out.is_empty or not self.running:
                return out
            self._evict(self.running[-1])

    def _try_schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for request in self.running:
            if budget == 0:
                break
            if request.is_decoding:
                if not self._reserve(request, request.num_computed + 1):
                    if request.status is RequestStatus.RUNNING:
                        request.status = RequestStatus.PAUSED
                        self.num_pauses += 1
                    continue
                request.status = RequestStatus.RUNNING
                out.decodes.append(ScheduledChunk(request, request.num_computed, 1))
                budget -= 1
            else:
                n = self._prefill_chunk(request, budget)
                if n:
                    out.prefills.append(ScheduledChunk(request, request.num_computed, n))
                    budget -= n
        while self.waiting and budget > 0 and not self.paused and self.mamba.num_free > 0:
            request = self.waiting[0]
            n = self._prefill_chunk(request, budget)
            if n == 0:
                break  # FCFS: the head waits for blocks; nobody overtakes it
            self.waiting.popleft()
            request.seq_slot = self.mamba.allocate()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.prefills.append(ScheduledChunk(request, request.num_computed, n))
            budget -= n
        return out

    def _prefill_chunk(self, request: Request, budget: int) -> int:
        """Tokens of the next prefill chunk that fit the budget and the KV pool (blocks reserved)."""
        remaining = request.num_tokens - request.num_computed
        held = len(request.blocks) * self.kv.block_size - request.num_computed
        fits = held + self.kv.num_free * self.kv.block_size
        n = min(remaining, budget, fits)
        if n > 0:
            self._reserve(request, request.num_computed + n)
        return max(n, 0)

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
        self.release(request)
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_evictions += 1
