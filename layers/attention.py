"""Self-attention over a paged KV cache (GQA, optional RoPE)."""
import torch
from torch import nn

from layers.forward_meta import ForwardMeta
from layers.kernels.ops import KernelOps
from layers.parallel import SINGLE, ColumnParallelLinear, ParallelContext, RowParallelLinear, block_shard
from layers.rotary import RotaryEmbedding


class PagedAttention(nn.Module):
    """q/k/v/o projections around paged causal attention, run with the op set `ops`; q, k
    and v run as one stacked projection.

    The runner binds `kv_cache = (k_cache, v_cache)` once; the tensors keep their address
    for the engine's lifetime (CUDA graphs replay against them).

    Tensor parallel (`tp`): each rank holds an even share of the query heads and the KV
    heads they read: a share of the KV heads when the world size divides their number,
    else the one KV head its query heads share (replicated over the ranks that use it).
    `num_heads` / `num_kv_heads` (and the KV cache) are this rank's; o_proj sums the ranks'
    outputs.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        bias: bool = False,
        rotary: RotaryEmbedding | None = None,
        *,
        ops: KernelOps,
        tp: ParallelContext = SINGLE,
    ):
        super().__init__()
        self.ops = ops
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})")
        kv_start, kv_stop = tp.split_or_replicate(num_kv_heads)
        kv_shard = block_shard(0, num_kv_heads * head_dim, [(0, head_dim, kv_start, kv_stop)])
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads // tp.world_size, kv_stop - kv_start, head_dim
        self.scale = scale
        self.q_proj = ColumnParallelLinear(hidden_size, tp.shard(0, num_heads, unit=head_dim), bias=bias, ops=ops)
        self.k_proj = ColumnParallelLinear(hidden_size, kv_shard, bias=bias, ops=ops)
        self.v_proj = ColumnParallelLinear(hidden_size, kv_shard, bias=bias, ops=ops)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=bias, ops=ops, tp=tp)
        self.rotary = rotary
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._stack_qkv()

    def _stack_qkv(self) -> None:
        """q, k and v read the same input, so they run as one projection over their stacked
        weights (one kernel, not three). The three parameters stay, since the checkpoint
        names them, as views into the stacked tensors: loading or initializing them fills
        those. The stacks are non-persistent buffers (no checkpoint entry of their own)."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_sizes = [p.out_features for p in projections]
        for name in ("weight", "bias"):
            params = [getattr(p, name) for p in projections]
            if params[0] is None:
                self.register_buffer(f"qkv_{name}", None, persistent=False)
                continue
            stacked = torch.cat([param.detach() for param in params])
            self.register_buffer(f"qkv_{name}", stacked, persistent=False)
            for param, view in zip(params, stacked.split(self.qkv_sizes)):
                param.data = view

    def _apply(self, fn, recurse: bool = True):
        """Module conversions (`.to(dtype)`, `.half()`, ...) convert the parameters and the
        stacks separately, which would leave the parameters views of nothing: the stacks
        are rebuilt from the converted parameters."""
        super()._apply(fn, recurse)
        self._stack_qkv()
        return self

    def forward(self, x: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        n = x.shape[0]
        k_cache, v_cache = self.kv_cache
        if self.rotary is None:  # keys go to the cache as projected: the projection's op writes them
            qkv = self.ops.linear_write_kv(x, self.qkv_weight, self.qkv_bias, self.qkv_sizes[0], k_cache, v_cache,
                                           meta.slot_mapping)
            q = qkv[:, :self.qkv_sizes[0]].view(n, self.num_heads, self.head_dim)
        else:
            q, k, v = self.ops.linear(x, self.qkv_weight, self.qkv_bias).split(self.qkv_sizes, dim=-1)
            q, k = self.rotary(meta.positions, q.view(n, self.num_heads, self.head_dim),
                               k.view(n, self.num_kv_heads, self.head_dim))
            self.ops.write_kv_cache(k, v.view(n, self.num_kv_heads, self.head_dim), k_cache, v_cache,
                                    meta.slot_mapping)
        # Verify rows have several queries: only one-token rows take the decode kernel.
        num_decode = meta.num_decode if meta.decode_width == 1 else 0
        out = self.ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
                                       self.scale, max_seqlen_q=meta.max_seqlen_q, num_decode=num_decode)
        return self.o_proj(out.reshape(n, -1))
