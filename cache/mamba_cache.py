"""Mamba state pool: conv + SSM state slots, and the only place that knows which slot a
request's launched row reads and writes.

A request owns a *row* (its index in the per-request tables: block table, sampling row,
token history) and a *ring* of state slots. Every launched row of the request reads one
slot of the ring and writes the next one, so nothing is ever overwritten that a rejected
launch would need back:

- ring of 1 (serial scheduling): the row updates its slot in place;
- ring of 2 (launch-ahead, "ping-pong"): step N reads the committed copy and writes the
  other; step N+1, launched before N retires, reads N's copy and writes the first one
  (by then N has read it: the device runs steps in launch order). Retiring a row commits
  its copy; rejecting it commits nothing, which restores the state exactly with no copy.

Slots are handed out from one flat pool, not by formula from the row, so a request can own
any number of copies (speculative decoding: one per draft position) and slots can later
hold read-only prefix-cache checkpoints.
"""
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(eq=False, slots=True)
class RequestState:
    """The Mamba state one admitted request owns (only the allocator reads `ring`)."""

    row: int  # the request's row in [0, max_num_seqs) of every per-request table
    ring: tuple[int, ...]  # its state slots, in the order consecutive launched rows write them
    committed: int = 0  # position in `ring` of the committed state


class MambaStateAllocator:
    """Fixed pool of request rows and state slots in every Mamba layer.

    Storage is one tensor per state kind across all layers -- conv `[layers, slots,
    conv_dim, K-1]` in the model dtype, ssm `[layers, slots, heads, head_dim, state]` in
    float32 -- so zeroing the slots handed to new requests is one batched op per kind.
    Each admitted request takes one row and `copies_per_request` slots.
    """

    def __init__(self, max_num_seqs: int, num_layers: int, conv_dim: int, conv_width: int, heads: int,
                 head_dim: int, state_size: int, conv_dtype: torch.dtype, device: torch.device,
                 copies_per_request: int = 1):
        if max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
        if copies_per_request <= 0:
            raise ValueError(f"copies_per_request must be positive, got {copies_per_request}")
        self.max_num_seqs, self.copies_per_request = max_num_seqs, copies_per_request
        num_slots = max_num_seqs * copies_per_request
        self.conv_states = torch.zeros(num_layers, num_slots, conv_dim, conv_width, dtype=conv_dtype, device=device)
        self.ssm_states = torch.zeros(num_layers, num_slots, heads, head_dim, state_size, dtype=torch.float32,
                                      device=device)
        # Stacks: the lowest index is handed out first (and a freed one reused first).
        self._free_rows: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self._free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        # The slot each slot's writer row hands on to: a row reading slot s writes
        # `_next_slot[s]`. One table lookup turns a step's (src, dst) into the next step's.
        self._next_slot = np.arange(num_slots, dtype=np.int64)
        self._to_zero: list[int] = []

    @property
    def num_free(self) -> int:
        """Requests that can still be admitted."""
        return len(self._free_rows)

    @property
    def num_slots(self) -> int:
        """State slots in the pool (every layer has this many of each kind)."""
        return len(self._next_slot)

    def allocate(self) -> RequestState:
        """Take a row and a ring of slots; the slots are zeroed by the next step (`take_new_slots`)."""
        if not self._free_rows:
            raise RuntimeError("Mamba state pool exhausted (scheduler bug: admission must check num_free)")
        ring = tuple(self._free_slots.pop() for _ in range(self.copies_per_request))
        for i, slot in enumerate(ring):
            self._next_slot[slot] = ring[(i + 1) % len(ring)]
        self._to_zero.extend(ring)
        return RequestState(self._free_rows.pop(), ring)

    def free(self, state: RequestState) -> None:
        """Return a request's row and slots to the pool (slots not yet zeroed are dropped
        from the zeroing list: whoever takes them next queues them again)."""
        self._free_rows.append(state.row)
        self._free_slots.extend(reversed(state.ring))
        if self._to_zero:
            self._to_zero = [slot for slot in self._to_zero if slot not in state.ring]

    # ---- which slots a launched row reads and writes ---------------------------------
    def row_slots(self, state: RequestState, rows_before: int) -> tuple[int, int]:
        """(src, dst) of a row launched while `rows_before` earlier rows of the request are
        still in flight: it reads the copy the newest of them writes (the committed copy if
        none) and writes the next copy of the ring."""
        ring = state.ring
        read = (state.committed + rows_before) % len(ring)
        return ring[read], ring[(read + 1) % len(ring)]

    def committed_slot(self, state: RequestState) -> int:
        """The slot holding the request's committed state."""
        return state.ring[state.committed]

    def following_slots(self, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) of the next launched rows of requests whose current rows write `dst`."""
        return dst, self._next_slot[dst]

    def commit(self, state: RequestState) -> None:
        """The request's oldest in-flight row retired valid: the copy it wrote is committed."""
        state.committed = (state.committed + 1) % len(state.ring)

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
                      conv_dtype: torch.dtype, copies_per_request: int = 1) -> int:
        """Device bytes one admitted request takes across all Mamba layers."""
        conv = conv_dim * conv_width * torch.empty((), dtype=conv_dtype).element_size()
        ssm = heads * head_dim * state_size * 4
        return copies_per_request * num_layers * (conv + ssm)
