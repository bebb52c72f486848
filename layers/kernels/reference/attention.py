"""Attention of packed queries against a paged KV cache (reference).

KV cache layout per attention layer: k_cache / v_cache `[num_blocks, block_size, kv_heads,
head_dim]`. A token's cache slot is `block * block_size + offset`; -1 means "do not write"
(padding rows). A sequence's keys are the first `seq_len` slots of its block table row.
"""
import torch


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
