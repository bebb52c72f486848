"""Mamba-2 chunked SSD scan over packed prefill chunks, through fla-core's `chunk_simple_gla`.

Mamba-2's SSD is simple gated linear attention with one scalar decay per head and token:
    state_t = exp(g_t) * state_{t-1} + k_t (outer) v_t,   o_t = q_t . state_t
with q = C, k = dt * B, v = x, g = dt * A (scale 1), plus the D * x skip added here.
fla keeps one initial state per packed sequence (cu_seqlens) and, with
`state_v_first=True`, uses mamba's [H, P, N] state layout, so slots map 1:1.
Importing this module fails without fla-core; `fast.available_ops` then keeps the reference.
"""
import torch
import triton
import triton.language as tl
from fla.ops.simple_gla import chunk_simple_gla

from layers.kernels.triton.slots import scatter_slots, token_to_seq


@triton.jit
def _expand_qk_kernel(
    b_ptr, c_ptr, dt_ptr, q_ptr, k_ptr, state_size, heads_per_group,
    stride_bt, stride_bg, stride_ct, stride_cg, stride_dtt,
    BR: tl.constexpr, BN: tl.constexpr,
):
    # Per (token, group): q[t, h] = C[t, g], k[t, h] = dt[t, h] * B[t, g] for the group's heads.
    t = tl.program_id(0)
    g = tl.program_id(1)
    r = tl.arange(0, BR)
    n = tl.arange(0, BN)
    r_in = r < heads_per_group
    n_in = n < state_size
    b = tl.load(b_ptr + t * stride_bt + g * stride_bg + n, mask=n_in, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + t * stride_ct + g * stride_cg + n, mask=n_in, other=0.0)
    heads = g * heads_per_group + r
    dt = tl.load(dt_ptr + t * stride_dtt + heads, mask=r_in, other=0.0).to(tl.float32)
    num_heads = tl.num_programs(1) * heads_per_group
    out = (t.to(tl.int64) * num_heads + heads)[:, None] * state_size + n[None, :]
    mask = r_in[:, None] & n_in[None, :]
    tl.store(q_ptr + out, tl.broadcast_to(c[None, :], (BR, BN)).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(k_ptr + out, (dt[:, None] * b[None, :]).to(k_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _skip_kernel(o_ptr, x_ptr, d_ptr, y_ptr, tok_seq_ptr, src_ptr, num_seqs, head_dim, width, BLOCK: tl.constexpr):
    # y = o + D * x in one pass over contiguous [T, H*P] rows; rows of padding sequences
    # (src -1) and tokens past the last sequence become zeros.
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    seq = tl.load(tok_seq_ptr + t)
    src = tl.load(src_ptr + seq, mask=seq < num_seqs, other=-1)
    row = t.to(tl.int64) * width + cols
    o = tl.load(o_ptr + row, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + cols // head_dim, mask=mask, other=0.0).to(tl.float32)
    y = tl.where(src >= 0, o + d * x, 0.0)
    tl.store(y_ptr + row, y.to(y_ptr.dtype.element_ty), mask=mask)


def ssd_chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_states: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    chunk_size: int,
) -> torch.Tensor:
    """Chunked SSD over packed variable-length sequences (prefill chunks).

    x: [T, H, P]; dt: [T, H] float32 (processed); A, D: [H]; B, C: [T, G, N]; cu_seqlens:
    [S+1]; ssm_states: [slots, H, P, N] float32, read at src_slots[s], written at
    dst_slots[s] after all reads. Returns y: [T, H, P] in x's dtype (D skip included);
    rows of padding sequences (src -1) and tokens past cu_seqlens[-1] are zeros.
    `chunk_size` only changes how the exact scan is blocked; fla blocks by 64 itself.
    fla runs float32 inputs through TF32 matmuls (relative error ~1e-3, not 1e-4).
    """
    del chunk_size  # same function for any chunking; fla picks its own block size
    num_tokens, heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    num_seqs = src_slots.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return torch.zeros_like(x)
    x = x.contiguous()  # fla would copy it anyway; the D-skip kernel reads it as [T, H*P]
    if B.stride(-1) != 1 or C.stride(-1) != 1:
        B, C = B.contiguous(), C.contiguous()
    dt = dt if dt.stride(-1) == 1 else dt.contiguous()
    q = torch.empty((1, num_tokens, heads, state_size), dtype=x.dtype, device=x.device)
    k = torch.empty_like(q)
    rep = heads // groups
    _expand_qk_kernel[(num_tokens, groups)](
        B, C, dt, q, k, state_size, rep, B.stride(0), B.stride(1), C.stride(0), C.stride(1), dt.stride(0),
        BR=triton.next_power_of_2(rep), BN=triton.next_power_of_2(state_size), num_warps=4,
    )
    g = (dt.float() * A.float()).unsqueeze(0)
    initial = ssm_states.index_select(0, src_slots.clamp(min=0))  # padding rows start from slot 0, never written
    o, final = chunk_simple_gla(
        q, k, x.unsqueeze(0), g, scale=1.0, initial_state=initial, output_final_state=True,
        state_v_first=True, cu_seqlens=cu_seqlens.long(),
    )
    scatter_slots(ssm_states, final, src_slots, dst_slots)
    y = torch.empty_like(x)
    width, block = heads * head_dim, 1024
    _skip_kernel[(num_tokens, triton.cdiv(width, block))](
        o, x, D, y, token_to_seq(cu_seqlens, num_tokens), src_slots, num_seqs, head_dim, width, BLOCK=block, num_warps=4,
    )
    return y
