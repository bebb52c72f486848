"""Mamba state pool: per-request conv and SSM state slots for every Mamba layer."""
import torch


class MambaSlotAllocator:
    """Fixed pool of request slots, each owning `copies` state slots in every Mamba layer.

    Storage is one tensor per state kind across all layers -- conv `[layers, slots,
    conv_dim, K-1]` in the model dtype, ssm `[layers, slots, heads, head_dim, state]` in
    float32 -- so zeroing the slots handed to new requests is one batched op per kind.
    With `copies=2` (launch-ahead rollback) request slot r owns state slots 2r and 2r+1.
    """

    def __init__(self, max_num_seqs: int, num_layers: int, conv_dim: int, conv_width: int, heads: int,
                 head_dim: int, state_size: int, conv_dtype: torch.dtype, device: torch.device, copies: int = 1):
        if max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
        self.max_num_seqs, self.copies = max_num_seqs, copies
        n_state = max_num_seqs * copies
        self.conv_states = torch.zeros(num_layers, n_state, conv_dim, conv_width, dtype=conv_dtype, device=device)
        self.ssm_states = torch.zeros(num_layers, n_state, heads, head_dim, state_size, dtype=torch.float32, device=device)
        self._free: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self._to_zero: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take a request slot; its state slots are zeroed by the next step (`take_new_slots`)."""
        if not self._free:
            raise RuntimeError("Mamba slot pool exhausted (scheduler bug: admission must check num_free)")
        slot = self._free.pop()
        self._to_zero.extend(self.state_slots(slot))
        return slot

    def free(self, slot: int) -> None:
        """Return a request slot to the pool."""
        self._free.append(slot)

    def state_slots(self, slot: int) -> list[int]:
        """The state-slot indices (one per copy) owned by request slot `slot`."""
        return [slot * self.copies + i for i in range(self.copies)]

    def has_new_slots(self) -> bool:
        """Whether state slots handed out since the last `take_new_slots` await zeroing."""
        return bool(self._to_zero)

    def take_new_slots(self) -> list[int]:
        """State slots handed out since the last call: the next step must zero them."""
        taken, self._to_zero = self._to_zero, []
        return taken

    def zero_slots(self, index: torch.Tensor) -> None:
        """Zero the given state slots (a device index tensor) in every layer: one op per kind.

        The index travels in the step buffer's single host-to-device copy.
        """
        self.conv_states.index_fill_(1, index, 0)
        self.ssm_states.index_fill_(1, index, 0)

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, ssm) state pools of one Mamba layer, `[slots, ...]` views."""
        return self.conv_states[layer], self.ssm_states[layer]

    @staticmethod
    def bytes_per_seq(num_layers: int, conv_dim: int, conv_width: int, heads: int, head_dim: int, state_size: int,
                      conv_dtype: torch.dtype, copies: int = 1) -> int:
        """Device bytes one request slot takes across all Mamba layers."""
        conv = conv_dim * conv_width * torch.empty((), dtype=conv_dtype).element_size()
        ssm = heads * head_dim * state_size * 4
        return copies * num_layers * (conv + ssm)
