"""Paged KV cache: one pool of fixed-size blocks shared by every attention layer."""
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch


class KVBlockAllocator:
    """Fixed pool of KV blocks with reference counts and exact free counts.

    Storage per attention layer: k and v tensors `[num_blocks, block_size, kv_heads,
    head_dim]`. A block id indexes the same block in every layer, so a request holds one
    list of block ids for the whole model.

    A block is *held* by every request whose block list has it (prefix caching shares
    full blocks read-only between requests). A block no request holds is either free or
    *cached*: the prefix cache (cache/prefix_cache.py) marked its content reusable. Cached
    blocks count as free -- `allocate` evicts them, least recently released first, only
    when the free list runs short, telling the cache through `on_evict` -- so the cache
    never makes a live request wait for a block.
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
        self._holders = [0] * num_blocks
        self._is_cached = [False] * num_blocks
        # Cached blocks no request holds, least recently released first (evicted first).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Called with a cached block that `allocate` is about to reuse: the cache forgets
        # what the block held (and may uncache blocks that depended on it). A weak
        # reference: the cache holds this pool, and a cycle would keep the pool's memory
        # alive after the engine is dropped, until a garbage collection.
        self._on_evict: weakref.WeakMethod | None = None
        # Tensor parallelism: the driver's log of device copies for the workers to replay
        # (`hybrid_engine.parallel.channel.DeviceOpLog`, set by the runner); None otherwise.
        self.device_ops = None

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free ones plus cached ones no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Cached blocks no request holds (reusable by a prefix-cache hit, or evictable)."""
        return len(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks, each held once; the caller checks `num_free` first (running out
        is a scheduler bug). Evicts cached blocks when the free list is short."""
        if n > self.num_free:
            raise RuntimeError(f"KV pool exhausted: asked for {n} blocks, {self.num_free} free")
        while len(self._free) < n:
            block, _ = self._evictable.popitem(last=False)
            self._is_cached[block] = False
            self._free.append(block)
            self._on_evict()(block)
        taken = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        for block in taken:
            self._holders[block] = 1
        return taken[::-1]

    def set_evict_callback(self, callback: Callable[[int], None]) -> None:
        """Register the prefix cache's bound method that forgets an evicted block."""
        self._on_evict = weakref.WeakMethod(callback)

    def hold(self, blocks: Iterable[int]) -> None:
        """One more holder for each block (held, or cached and not yet evicted)."""
        for block in blocks:
            if self._holders[block] == 0:
                del self._evictable[block]
            self._holders[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """One holder fewer for each block, in order: a block nobody holds becomes free, or
        evictable if cached (the later a block is released, the later it is evicted)."""
        for block in blocks:
            self._holders[block] -= 1
            if self._holders[block] == 0:
                if self._is_cached[block]:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def set_cached(self, block: int, cached: bool) -> None:
        """The prefix cache marks a block's content reusable (or no longer); an uncached
        block that no request holds is free at once."""
        if self._is_cached[block] == cached:
            return
        self._is_cached[block] = cached
        if self._holders[block] == 0:
            if cached:
                self._evictable[block] = None
            else:
                del self._evictable[block]
                self._free.append(block)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy a block's keys and values in every layer, on the device, now (stream order
        puts it after every step launched so far and before every later one)."""
        for k, v in self.kv_caches:
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])
        if self.device_ops is not None:
            self.device_ops.record("kv", "copy_block", src, dst)

    @staticmethod
    def bytes_per_block(block_size: int, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Device bytes one block takes across all attention layers (k and v)."""
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
