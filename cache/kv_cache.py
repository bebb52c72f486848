"""Paged KV cache: one pool of fixed-size blocks shared by every attention layer."""
import torch


class KVBlockAllocator:
    """Fixed pool of KV blocks with O(1) allocate / free and exact free counts.

    Storage per attention layer: k and v tensors `[num_blocks, block_size, kv_heads,
    head_dim]`. A block id indexes the same block in every layer, so a request holds one
    list of block ids for the whole model.
    """

    def __init__(self, num_blocks: int, block_size: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_kv_blocks ({num_blocks}) and kv_block_size ({block_size}) must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(num_layers)]
        # A stack: the most recently freed block is reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks; the caller checks `num_free` first (running out is a scheduler bug)."""
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked for {n} blocks, {len(self._free)} free")
        taken = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        return taken[::-1]

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the pool."""
        self._free.extend(reversed(blocks))

    @staticmethod
    def bytes_per_block(block_size: int, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Device bytes one block takes across all attention layers (k and v)."""
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
