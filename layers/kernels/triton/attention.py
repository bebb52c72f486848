"""Paged KV cache write and causal paged attention (own Triton kernels).

Cache layout as in `layers.kernels.reference.attention`: [num_blocks, block_size, kv_heads,
head_dim]; key j of sequence s lives in block block_tables[s, j // block_size] at offset
j % block_size. Two attention kernels:
- decode (the first `num_decode` sequences, one query each): split-KV. Each program takes
  one (sequence, kv head, split), keeps all the kv head's query heads in one tile (GQA: the
  keys are read once for them), and a second small kernel merges the splits by their
  log-sum-exp. Grid sizes come from host ints only, so it captures in a CUDA graph.
- prefill / chunked prefill (the rest): flash-attention style, one program per (query
  tile, query head, sequence), causal against the cached prefix.
"""
import torch
import triton
import triton.language as tl

from layers.kernels.triton.device import pdl, sm_count, wait_for_previous_kernel

_LOG2E = 1.4426950408889634
# Prefill kernel (BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit / float32 inputs;
# float32 tiles are twice the bytes, so smaller ones stay in registers and shared memory.
PREFILL_TILES = {False: (128, 128, 8, 2), True: (32, 32, 4, 2)}  # 16-bit: best of 6 measured on H100


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, kv_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch, stride_vcb, stride_vco, stride_vch,
    BH: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, BH)[:, None]
    d = tl.arange(0, BD)[None, :]
    mask = (h < kv_heads) & (d < head_dim)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + block * stride_cb + offset * stride_co + h * stride_ch + d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vco + h * stride_vch + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's keys/values ([T, kv_heads, head_dim]) into their cache slots (-1: skip)."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, kv_heads, head_dim, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BH=triton.next_power_of_2(kv_heads), BD=triton.next_power_of_2(head_dim), num_warps=4, **pdl(k),
    )


@triton.jit
def _load_kv_tile(cache_ptr, table_row_ptr, kpos, kmask, d, d_in, block_size, kv_head,
                  stride_cb, stride_co, stride_ch):
    # Gather BLOCK_N keys (or values) of one kv head through the block table: [BLOCK_N, BD].
    block = tl.load(table_row_ptr + kpos // block_size, mask=kmask, other=0).to(tl.int64)
    rows = block * stride_cb + (kpos % block_size) * stride_co + kv_head * stride_ch
    return tl.load(cache_ptr + rows[:, None] + d[None, :], mask=kmask[:, None] & d_in[None, :], other=0.0)


@triton.jit
def _attn_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_o_ptr, part_lse_ptr, block_tables_ptr, seq_lens_ptr, cu_q_ptr,
    scale_log2, num_splits, rep, head_dim, block_size,
    stride_qt, stride_qh, stride_bt,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    REP_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * rep
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(cu_q_ptr + seq).to(tl.int64)
    r = tl.arange(0, REP_PAD)
    r_in = r < rep
    heads = kv_head * rep + r
    d = tl.arange(0, BD)
    d_in = d < head_dim
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=r_in[:, None] & d_in[None, :], other=0.0)
    # Splits cover whole BLOCK_N tiles; trailing splits of short sequences are empty.
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(seq_len, lo + per_split)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full((REP_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((REP_PAD,), dtype=tl.float32)
    acc = tl.zeros((REP_PAD, BD), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):  # a decode query sees every cached key: no causal mask
        acc, m_i, l_i = _attn_tile(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, start, hi, hi, d, d_in,
                                   block_size, kv_head, scale_log2, stride_kb, stride_ko, stride_kh, stride_vb,
                                   stride_vo, stride_vh, BLOCK_N, True, False, PRECISION)
    has_keys = l_i > 0.0
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    part = (seq * num_heads + heads).to(tl.int64) * num_splits + split
    tl.store(part_lse_ptr + part, lse, mask=r_in)
    tl.store(part_o_ptr + part[:, None] * BD + d[None, :], out, mask=r_in[:, None])


@triton.jit
def _attn_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, cu_q_ptr, num_splits, head_dim, stride_ot, stride_oh,
    SPLITS_PAD: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    sp = tl.arange(0, SPLITS_PAD)
    sp_in = sp < num_splits
    d = tl.arange(0, BD)
    part = (seq * num_heads + head).to(tl.int64) * num_splits + sp
    lse = tl.load(part_lse_ptr + part, mask=sp_in, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no keys at all (seq_len 0): weights 0, output 0
    w = tl.exp2(lse - m)
    o = tl.load(part_o_ptr + part[:, None] * BD + d[None, :], mask=sp_in[:, None], other=0.0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
    token = tl.load(cu_q_ptr + seq).to(tl.int64)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


@triton.jit
def _attn_tile(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, start, kv_end, q_pos, d, d_in, block_size, kv_head,
               scale_log2, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
               BLOCK_N: tl.constexpr, MASK_KEYS: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    # One online-softmax step over keys [start, start + BLOCK_N): MASK_KEYS drops keys past
    # kv_end, CAUSAL keys after each query's position (q_pos); whole visible tiles skip both.
    kpos = start + tl.arange(0, BLOCK_N)
    kmask = kpos < kv_end
    k = _load_kv_tile(k_cache_ptr, table_row, kpos, kmask, d, d_in, block_size, kv_head, stride_kb, stride_ko, stride_kh)
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale_log2
    if MASK_KEYS:
        scores = tl.where(kmask[None, :], scores, float("-inf"))
    if CAUSAL:
        scores = tl.where(kpos[None, :] <= q_pos[:, None], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _load_kv_tile(v_cache_ptr, table_row, kpos, kmask, d, d_in, block_size, kv_head, stride_vb, stride_vo, stride_vh)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["seq_offset"])  # per-step sizes: no recompiles
def _attn_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, cu_q_ptr,
    seq_offset, scale_log2, rep, head_dim, block_size,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # Query tiles run last-first: under the causal mask the late tiles carry the most keys.
    m_start = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    head = tl.program_id(1)
    seq = tl.program_id(2) + seq_offset
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if (m_start >= q_len) | (seq_len == 0):
        return  # the output was zero-filled: padding sequences stay zeros
    kv_head = head // rep
    rows = m_start + tl.arange(0, BLOCK_M)
    r_in = rows < q_len
    d = tl.arange(0, BD)
    d_in = d < head_dim
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=r_in[:, None] & d_in[None, :], other=0.0)
    first_pos = seq_len - q_len + m_start  # absolute position of the tile's first query
    q_pos = first_pos + tl.arange(0, BLOCK_M)
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_M)  # causal: keys up to the last query
    # Keys up to first_pos are visible to every query of the tile: those whole tiles skip
    # the mask; the rest (the diagonal) applies it. Key 0 is in the first tile, so every
    # row has a finite running max from the first step on.
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BD), dtype=tl.float32)
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attn_tile(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, start, kv_end, q_pos, d, d_in,
                                   block_size, kv_head, scale_log2, stride_kb, stride_ko, stride_kh, stride_vb,
                                   stride_vo, stride_vh, BLOCK_N, False, False, PRECISION)
    for start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attn_tile(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, start, kv_end, q_pos, d, d_in,
                                   block_size, kv_head, scale_log2, stride_kb, stride_ko, stride_kh, stride_vb,
                                   stride_vo, stride_vh, BLOCK_N, True, True, PRECISION)
    out = acc / l_i[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=r_in[:, None] & d_in[None, :])


def _num_splits(q: torch.Tensor, num_decode: int, kv_heads: int) -> int:
    """Enough (sequence, kv head, split) programs to fill the GPU about four times over.

    Sized from the batch rounded up to a power of two -- the CUDA-graph batch sizes -- so
    a decode batch splits its keys (and rounds its sums) the same way whether it runs
    eager or padded into a graph.
    """
    sms = sm_count(q.device) if q.is_cuda else 16
    return max(1, min(64, triton.cdiv(4 * sms, triton.next_power_of_2(num_decode) * kv_heads)))


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
    """Causal attention of packed queries against the paged cache; query i of sequence s
    sits at position seq_len - q_len + i.

    q: [T, H, Dh]; block_tables: [S, max_blocks]; seq_lens: [S] (0 = padding row, zeros
    out); cu_seqlens_q: [S+1]. The first `num_decode` sequences must have exactly one
    query each (split-KV decode kernel); `max_seqlen_q` sizes the prefill grid (derived
    with a host sync when None). A decode-only step (num_decode == S) never syncs and
    captures in a CUDA graph. Returns [T, H, Dh] in q's dtype.
    """
    num_tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    rep = heads // kv_heads
    block_size = k_cache.shape[1]
    num_seqs = seq_lens.shape[0]
    q = q if q.stride(-1) == 1 else q.contiguous()
    # The merge writes every decode row (zeros for a padding sequence), so a decode-only
    # step, whose query i is row i, needs no zero fill (one kernel fewer per layer).
    decode_only = num_decode == num_seqs == num_tokens
    out = torch.empty_like(q) if decode_only else torch.zeros_like(q)
    # The head dim in tiles of a power of two, at least 16 (tl.dot's least; the tail is masked).
    bd = max(16, triton.next_power_of_2(head_dim))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 stays exact; ignored for bf16/fp16
    scale_log2 = scale * _LOG2E
    cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    if num_decode:
        splits = _num_splits(q, num_decode, kv_heads)
        part_o = torch.empty((num_decode, heads, splits, bd), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_decode, heads, splits), dtype=torch.float32, device=q.device)
        _attn_decode_kernel[(num_decode, kv_heads, splits)](
            q, k_cache, v_cache, part_o, part_lse, block_tables, seq_lens, cu_seqlens_q,
            scale_log2, splits, rep, head_dim, block_size,
            q.stride(0), q.stride(1), block_tables.stride(0), *cache_strides,
            REP_PAD=max(16, triton.next_power_of_2(rep)), BLOCK_N=64, BD=bd, PRECISION=precision,
            num_warps=4, num_stages=3, **pdl(q),
        )
        _attn_merge_kernel[(num_decode, heads)](
            part_o, part_lse, out, cu_seqlens_q, splits, head_dim, out.stride(0), out.stride(1),
            SPLITS_PAD=triton.next_power_of_2(splits), BD=bd, num_warps=4, **pdl(out),
        )
    num_rest = num_seqs - num_decode
    if num_rest > 0:
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[num_decode + 1:] - cu_seqlens_q[num_decode:-1]).max())
        block_m, block_n, warps, stages = PREFILL_TILES[q.dtype == torch.float32]
        grid = (triton.cdiv(max(max_seqlen_q, 1), block_m), heads, num_rest)
        _attn_prefill_kernel[grid](
            q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q,
            num_decode, scale_log2, rep, head_dim, block_size,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), *cache_strides,
            BLOCK_M=block_m, BLOCK_N=block_n, BD=bd, PRECISION=precision, num_warps=warps, num_stages=stages, **pdl(q),
        )
    return out
