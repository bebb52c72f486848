"""Mamba state pool: conv + SSM state slots, and the only place that knows which slot a
request's launched row reads and writes.

A request owns a *row* (its index in the per-request tables: block table, sampling row,
token history) and a *ring* of state slots split into `banks` banks of `row_positions`
slots. A launched row reads one slot (the request's *head*: the state its newest live row
leaves, or the committed state) and writes the state after each of its positions into the
first slots of the bank that does not hold what it reads, so nothing is ever overwritten
that a rejected launch or a partial acceptance would need back:

- one bank of one slot (serial scheduling): the row updates its slot in place;
- two banks of one slot (launch-ahead, "ping-pong"): step N reads the committed copy and
  writes the other; step N+1, launched before N retires, reads N's copy and writes the
  first one (by then N has read it: the device runs steps in launch order). Retiring a
  row commits its copy; rejecting it commits nothing, which restores the state exactly
  with no copy;
- banks of K+1 slots (speculative decoding): a verify row of an input token and K drafts
  writes the state after each of its K+1 positions; retiring it with `a` drafts accepted
  commits the state after position `a`. A launch-ahead row reads the state after the last
  position (it assumes every draft is accepted) and writes the other bank, so the bank
  holding the accepted state survives when the launch-ahead row is rejected.

Slots are handed out from one flat pool, not by formula from the row. The pool also has
`checkpoint_slots` slots that only the prefix cache takes (read-only state checkpoints,
cache/prefix_cache.py): a request never waits for one, and a checkpoint never waits for
a request's slot. No state is copied either way:
- a request resumed from a checkpoint reads it in place: its first row reads the
  checkpoint slot and writes the request's first bank;
- a checkpoint of a request's committed state takes that very slot (`hand_over`): a free
  checkpoint slot takes its place in the request's ring, and the request reads its
  committed state from the checkpoint until its next row commits, as a resumed one does.
Until that row commits, a rejection falls back to the checkpoint, so the slot is not handed
out again while a request may still read it (`free_checkpoint_slot` defers it).
"""
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(eq=False, slots=True)
class RequestState:
    """The Mamba state one admitted request owns (only the allocator reads `ring`)."""

    row: int  # the request's row in [0, max_num_seqs) of every per-request table
    ring: tuple[int, ...]  # its state slots: bank b is ring[b * row_positions:(b + 1) * row_positions]
    committed: int  # the slot holding the committed state
    head: int  # the slot the newest live launched row leaves its last state in (else `committed`)
    # A checkpoint slot holding its committed state (it resumed from it, or handed its
    # committed slot to the cache), read in place until its next row commits; else -1.
    reads_checkpoint: int = -1


class MambaStateAllocator:
    """Fixed pool of request rows and state slots in every Mamba layer.

    Storage is one tensor per state kind across all layers -- conv `[layers, slots,
    conv_dim, K-1]` in the model dtype, ssm `[layers, slots, heads, head_dim, state]` in
    `ssm_dtype` (float32 unless `mamba_ssm_cache_dtype` says otherwise; the ops compute in
    float32 whatever it is) -- so zeroing the slots handed to new requests is one batched
    op per kind.
    Each admitted request takes one row and `banks * row_positions` slots
    (`copies_per_request`); prefix-cache checkpoints take one slot each from their own
    `checkpoint_slots`.
    """

    def __init__(self, max_num_seqs: int, num_layers: int, conv_dim: int, conv_width: int, heads: int,
                 head_dim: int, state_size: int, conv_dtype: torch.dtype, device: torch.device,
                 banks: int = 1, row_positions: int = 1, ssm_dtype: torch.dtype = torch.float32,
                 checkpoint_slots: int = 0):
        if max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
        if banks not in (1, 2):
            raise ValueError(f"banks must be 1 (serial) or 2 (launch-ahead), got {banks}")
        if row_positions <= 0:
            raise ValueError(f"row_positions must be positive, got {row_positions}")
        if checkpoint_slots < 0:
            raise ValueError(f"checkpoint_slots must be >= 0, got {checkpoint_slots}")
        self.max_num_seqs, self.banks, self.row_positions = max_num_seqs, banks, row_positions
        request_slots = max_num_seqs * self.copies_per_request
        num_slots = request_slots + checkpoint_slots
        self.conv_states = torch.zeros(num_layers, num_slots, conv_dim, conv_width, dtype=conv_dtype, device=device)
        self.ssm_states = torch.zeros(num_layers, num_slots, heads, head_dim, state_size, dtype=ssm_dtype,
                                      device=device)
        # Tensor parallelism: the driver's log of device copies for the workers to replay
        # (`hybrid_engine.parallel.channel.DeviceOpLog`, set by the runner); None otherwise.
        self.device_ops = None
        # Stacks: the lowest index is handed out first (and a freed one reused first).
        self._free_rows: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self._free_slots: list[int] = list(range(request_slots - 1, -1, -1))
        self._free_checkpoint_slots: list[int] = list(range(num_slots - 1, request_slots - 1, -1))
        self.checkpoint_slots = checkpoint_slots
        # Checkpoint slots that requests read in place (`reads_checkpoint`; how many read
        # each), and those of them the cache gave back meanwhile: free once nobody reads them.
        self._checkpoint_readers: Counter[int] = Counter()
        self._released_while_read: set[int] = set()
        # The bank a row reading slot s writes, and its first slot as an array: one table
        # lookup turns a one-position step's (src, dst) into the next step's.
        self._bank_after: list[tuple[int, ...]] = [()] * num_slots
        self._next_slot = np.arange(num_slots, dtype=np.int64)
        self._to_zero: list[int] = []

    @property
    def copies_per_request(self) -> int:
        """State slots each admitted request owns."""
        return self.banks * self.row_positions

    @property
    def num_free(self) -> int:
        """Requests that can still be admitted."""
        return len(self._free_rows)

    @property
    def num_slots(self) -> int:
        """State slots in the pool (every layer has this many of each kind)."""
        return len(self._next_slot)

    def allocate(self, resume_from: int | None = None) -> RequestState:
        """Take a row and a ring of slots. The request starts from zeros (its slots are
        zeroed by the next step, `take_new_slots`) or, with `resume_from`, from that
        checkpoint slot, which its first row reads in place (nothing is zeroed: every slot
        of the ring is written before it is read)."""
        if not self._free_rows:
            raise RuntimeError("Mamba state pool exhausted (scheduler bug: admission must check num_free)")
        ring = tuple(self._free_slots.pop() for _ in range(self.copies_per_request))
        self._link_banks(ring)
        if resume_from is None:
            self._to_zero.extend(ring)
            return RequestState(self._free_rows.pop(), ring, committed=ring[0], head=ring[0])
        self._checkpoint_readers[resume_from] += 1
        return RequestState(self._free_rows.pop(), ring, committed=resume_from, head=resume_from,
                            reads_checkpoint=resume_from)

    def _link_banks(self, ring: tuple[int, ...]) -> None:
        """Record, for each slot of a ring, the bank a row reading it writes."""
        width = self.row_positions
        bank_list = [ring[b * width:(b + 1) * width] for b in range(self.banks)]
        for i, slot in enumerate(ring):
            after = bank_list[(i // width + 1) % self.banks]
            self._bank_after[slot] = after
            self._next_slot[slot] = after[0]

    def free(self, state: RequestState) -> None:
        """Return a request's row and slots to the pool (slots not yet zeroed are dropped
        from the zeroing list: whoever takes them next queues them again)."""
        if state.reads_checkpoint >= 0:
            self._stop_reading_checkpoint(state)
        self._free_rows.append(state.row)
        self._free_slots.extend(reversed(state.ring))
        if self._to_zero:
            self._to_zero = [slot for slot in self._to_zero if slot not in state.ring]

    # ---- prefix-cache checkpoints -----------------------------------------------------
    def take_checkpoint_slot(self) -> int | None:
        """A free checkpoint slot, or None when all are taken (the cache evicts one)."""
        return self._free_checkpoint_slots.pop() if self._free_checkpoint_slots else None

    def free_checkpoint_slot(self, slot: int) -> None:
        """Give a checkpoint slot back: free now, or once no request reads it in place."""
        if self._checkpoint_readers[slot]:
            self._released_while_read.add(slot)
        else:
            self._free_checkpoint_slots.append(slot)

    def is_read(self, slot: int) -> bool:
        """Whether a request may still read this checkpoint slot in place (no row of it has
        committed since it started reading): the cache evicts other checkpoints first."""
        return self._checkpoint_readers[slot] > 0

    def _stop_reading_checkpoint(self, state: RequestState) -> None:
        """The request no longer needs its checkpoint (a row of it committed, or it is
        freed): release the slot if the cache gave it back meanwhile."""
        slot, state.reads_checkpoint = state.reads_checkpoint, -1
        self._checkpoint_readers[slot] -= 1
        if not self._checkpoint_readers[slot]:
            del self._checkpoint_readers[slot]
            if slot in self._released_while_read:
                self._released_while_read.remove(slot)
                self._free_checkpoint_slots.append(slot)

    def hand_over(self, state: RequestState, spare: int, goes_on: bool = True) -> int:
        """Make the request's committed state a checkpoint without copying it: `spare` (a
        free checkpoint slot) takes the committed slot's place in the request's ring. A
        request that `goes_on` reads its committed state from the checkpoint until its next
        row commits, as a resumed request does; one that ends launches nothing more (a row
        already in flight reads the slot before anything launched later can write it). No
        row writes a committed slot, so the checkpoint is never written again. Returns the
        checkpoint's slot: the committed one, or `spare` holding a copy when the committed
        state is itself a checkpoint the request reads (no row has committed since)."""
        slot = state.committed
        if state.reads_checkpoint >= 0:
            self.copy_state(slot, spare)
            return spare
        state.ring = tuple(spare if s == slot else s for s in state.ring)
        self._link_banks(state.ring)
        if goes_on:
            state.reads_checkpoint = slot
            self._checkpoint_readers[slot] += 1
        return slot

    def copy_state(self, src: int, dst: int) -> None:
        """Copy a slot's conv and SSM state in every layer, on the device, now: stream order
        puts it after every step launched so far (it reads what they committed) and before
        every later one (which may overwrite `src`). Views, so no host-to-device copy."""
        self.conv_states[:, dst].copy_(self.conv_states[:, src])
        self.ssm_states[:, dst].copy_(self.ssm_states[:, src])
        if self.device_ops is not None:
            self.device_ops.record("mamba", "copy_state", src, dst)

    # ---- which slots a launched row reads and writes ---------------------------------
    def launch(self, state: RequestState, num_positions: int = 1) -> tuple[int, tuple[int, ...]]:
        """(src, dsts) of a newly launched row of `num_positions` tokens: it reads the
        request's head and writes the state after each position into `dsts`; its last
        position's state becomes the head (what a following launch-ahead row reads). A row
        reading a checkpoint in place writes the first bank (nothing there is needed)."""
        src = state.head
        if src == state.reads_checkpoint:  # (the checkpoint is in no ring: no `_bank_after` entry)
            dsts = state.ring[:num_positions]
        else:
            dsts = self._bank_after[src][:num_positions]
        state.head = dsts[-1]
        return src, dsts

    def commit(self, state: RequestState, dsts: tuple[int, ...], num_accepted: int = 0) -> None:
        """The request's oldest in-flight row retired valid with `num_accepted` drafts
        accepted: the state after its position `num_accepted` is committed. If that row was
        the newest, the head falls back to it (positions past the accepted one are dead)."""
        last = state.head == dsts[-1]
        state.committed = dsts[num_accepted]
        if last:
            state.head = state.committed
        if state.reads_checkpoint >= 0:
            self._stop_reading_checkpoint(state)

    def reject(self, state: RequestState) -> None:
        """The request's newest launched row is rejected (its older rows have all retired):
        the committed state is the head again; nothing is copied."""
        state.head = state.committed

    def following_slots(self, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) of the next one-position rows of requests whose current rows write `dst`."""
        return dst, self._next_slot[dst]

    # ---- zeroing new slots -----------------------------------------------------------
    def has_new_slots(self) -> bool:
        """Whether slots handed out since the last `take_new_slots` await zeroing."""
        return bool(self._to_zero)

    def take_new_slots(self) -> list[int]:
        """Slots handed out since the last call: the next step must zero them."""
        taken, self._to_zero = self._to_zero, []
        return taken

    def zero_slots(self, index: torch.Tensor) -> None:
        """Zero the given slots (a device index tensor) in every layer: one op per kind.

        The index travels in the step buffer's single host-to-device copy.
        """
        self.conv_states.index_fill_(1, index, 0)
        self.ssm_states.index_fill_(1, index, 0)

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, ssm) state pools of one Mamba layer, `[slots, ...]` views."""
        return self.conv_states[layer], self.ssm_states[layer]

    @staticmethod
    def bytes_per_seq(num_layers: int, conv_dim: int, conv_width: int, heads: int, head_dim: int, state_size: int,
                      conv_dtype: torch.dtype, copies_per_request: int = 1,
                      ssm_dtype: torch.dtype = torch.float32) -> int:
        """Device bytes one admitted request takes across all Mamba layers."""
        conv = conv_dim * conv_width * torch.empty((), dtype=conv_dtype).element_size()
        ssm = heads * head_dim * state_size * torch.empty((), dtype=ssm_dtype).element_size()
        return copies_per_request * num_layers * (conv + ssm)
