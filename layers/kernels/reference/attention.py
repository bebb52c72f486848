"""Attention of packed queries against a paged KV cache (reference).

KV cache layout per attention layer: k_cache / v_cache `[num_blocks, block_size, kv_heads,
head_dim]`. A token's cache slot is `block * block_size + offset`; -1 means "do not write"
(padding rows). A sequence's keys are the first `seq_len` slots of its block table row.
"""
import torch

from layers.kernels.reference.linear import linear


def kv_width(n: int, kv_start: int, k_cache: torch.Tensor) -> int:
    """W = kv_heads * head_dim (the cache's last two dims), checked: the keys and values of a
    stacked q/k/v projection's N = n columns are the W from kv_start and the W after them."""
    width = k_cache.shape[2] * k_cache.shape[3]
    if not 0 <= kv_start <= n - 2 * width:
        raise ValueError(f"kv_start: the keys and values ({2 * width} columns from kv_start={kv_start}) must lie "
                         f"within the projection's {n} columns")
    return width


def kv_columns(y: torch.Tensor, kv_start: int, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values inside a stacked q/k/v projection's output y [rows, N] (`kv_width`),
    as [rows, kv_heads, head_dim] views."""
    width, shape = kv_width(y.shape[1], kv_start, k_cache), (y.shape[0], *k_cache.shape[2:])
    return y[:, kv_start:kv_start + width].view(shape), y[:, kv_start + width:kv_start + 2 * width].view(shape)


def linear_write_kv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kv_start: int,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """The projection, then `write_kv_cache` of its key and value columns (see
    `KernelOps.linear_write_kv`)."""
    y = linear(x, weight, bias)
    write_kv_cache(*kv_columns(y, kv_start, k_cache), k_cache, v_cache, slot_mapping)
    return y


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's keys/values ([T, kv_heads, head_dim]) into their cache slots."""
    rows = (slot_mapping >= 0).nonzero().flatten()
    slots = slot_mapping[rows]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[rows].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[rows].to(v_cache.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    num_decode: int = 0,
) -> torch.Tensor:
    """Causal attention; query i of sequence s sits at position seq_len - q_len + i.

    `max_seqlen_q` (longest query chunk) and `num_decode` (leading one-token sequences)
    are host-known shape hints that fast kernels size their grids with; this reference
    derives everything from the tensors and ignores them.

    q: [T, H, Dh]; block_tables: [S, max_blocks]; seq_lens: [S] keys per sequence after this
    step's tokens were written; cu_seqlens_q: [S+1]. Covers decode (q_len 1), prefill and
    chunked prefill over a cached prefix. Sequences with seq_len 0 are padding (zeros out).
    Returns [T, H, Dh] in q's dtype.
    """
    out = torch.zeros_like(q)
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    rep = q.shape[1] // kv_heads
    bounds, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for s in range(len(lens)):
        lo, hi, length = bounds[s], bounds[s + 1], lens[s]
        if length == 0 or hi == lo:
            continue
        n_blocks = -(-length // block_size)
        blocks = block_tables[s, :n_blocks].long()
        k = k_cache[blocks].reshape(-1, kv_heads, k_cache.shape[-1])[:length].to(q.dtype)
        v = v_cache[blocks].reshape(-1, kv_heads, v_cache.shape[-1])[:length].to(q.dtype)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        qs = q[lo:hi].transpose(0, 1)  # [H, q_len, Dh]
        scores = torch.matmul(qs, k.permute(1, 2, 0)) * scale  # [H, q_len, L]
        q_pos = torch.arange(length - (hi - lo), length, device=q.device)
        k_pos = torch.arange(length, device=q.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[lo:hi] = torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1)
    return out
