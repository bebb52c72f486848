"""Mamba-2 chunked SSD scan over packed prefill chunks: one fused Triton kernel.

One program per (sequence, head, block of head channels) walks its sequence chunk by
chunk, keeping the running SSM state in registers. Per chunk of L tokens (cum = the
running sum of dt*A inside the chunk):

    y     = (C @ state^T) * exp(cum)                               state entering the chunk
          + ((C @ B^T) * exp(cum_t - cum_s) * dt_s, s <= t) @ x   inside the chunk
          + D * x
    state = state * exp(cum_L) + x^T @ (B * exp(cum_L - cum) * dt)

Sequence bounds are read from `cu_seqlens` on the device, so nothing here synchronizes
with the host (fla-core's and mamba-ssm's varlen scans build chunk indices on the host)
and a prefill step stays asynchronous. Parallelism is sequences x heads x channel blocks,
with the chunks of one sequence sequential: short prompts in a batch fill the GPU, a
single very long prompt uses H x (P / block) programs.
"""
import math

import torch
import triton
import triton.language as tl

# The SSD's block size, shared with the reference scan so both round alike. Measured on an
# H100 over (8B shapes: 1 x 4096 and 32 x 128 tokens; peer shapes: 32 x 256 and 1 x 4096)
# against chunks 32/64/128, blocks 16/32/64, 4/8 warps: whole heads per program (B and C
# are read once per head, not per channel block) with 32-token chunks won.
from layers.kernels.ops import StateSaves
from layers.kernels.reference.ssd import CHUNK, clamps_dt
from layers.kernels.triton.device import pdl, wait_for_previous_kernel
from layers.kernels.triton.ssm_update import softplus

BLOCK_P = 64  # head channels per program: the state tile is BLOCK_P x state_size float32
NUM_WARPS = 4


# Per-step sizes, and pointers into slices that start at the step's decode count (the prefill
# rows' slots, prompt mask and dt), whose 16-byte alignment can change from step to step: no
# recompiles while serving (each new combination cost a ~1 s compile mid-run). x, B and C
# come from the conv's fresh output, so their alignment is fixed.
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "src_ptr", "dst_ptr", "limit_mask_ptr", "dt_ptr", "hits_ptr"])
def _ssd_varlen_kernel(
    x_ptr, dt_ptr, dt_bias_ptr, limit_mask_ptr, a_ptr, b_ptr, c_ptr, d_ptr, cu_ptr, states_ptr, src_ptr, dst_ptr,
    y_ptr, save_cu_ptr, save_offset_ptr, save_slot_ptr, hits_ptr, num_seqs, num_tokens, head_dim, state_size,
    heads_per_group,
    dt_min, dt_max, stride_xt, stride_xh, stride_dtt, stride_bt, stride_bg, stride_ct, stride_cg,
    stride_ss, stride_sh, stride_sp, stride_yt, stride_yh,
    CHUNK: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr, HAS_LIMIT_MASK: tl.constexpr, HAS_SAVES: tl.constexpr,
    CHECK_DT_LIMIT: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    group = head // heads_per_group
    # Program `num_seqs` covers the tokens past the last sequence (written as zeros).
    is_seq = seq < num_seqs
    last = tl.minimum(seq, num_seqs - 1)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.where(is_seq, tl.load(cu_ptr + last + 1).to(tl.int64), num_tokens)
    src = tl.where(is_seq, tl.load(src_ptr + last).to(tl.int64), -1)
    dst = tl.where(is_seq, tl.load(dst_ptr + last).to(tl.int64), -1)
    valid = src >= 0  # padding sequences (slot -1) read and write no state, output zeros

    p = tl.program_id(2) * BP + tl.arange(0, BP)
    n = tl.arange(0, BN)
    l = tl.arange(0, CHUNK)
    p_in = p < head_dim
    n_in = n < state_size
    state_offs = head * stride_sh + p[:, None] * stride_sp + n[None, :]
    state_mask = p_in[:, None] & n_in[None, :]
    state = tl.load(states_ptr + src * stride_ss + state_offs, mask=valid & state_mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + head).to(tl.float32)
    dt_bias = 0.0
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    d_skip = tl.load(d_ptr + head).to(tl.float32)
    causal = l[:, None] >= l[None, :]
    dot_type = x_ptr.dtype.element_ty  # bf16/fp16 run on tensor cores as is; fp32 in IEEE

    # The next save (`StateSaves`): its token, where the current block is cut short.
    save = 0
    save_end = 0
    next_save = end
    if HAS_SAVES:
        save = tl.load(save_cu_ptr + last, mask=is_seq, other=0)
        save_end = tl.load(save_cu_ptr + last + 1, mask=is_seq, other=0)
        next_save = tl.where(save < save_end,
                             start + tl.load(save_offset_ptr + save, mask=save < save_end, other=0).to(tl.int64), end)
    chunk_start = start
    while chunk_start < end:  # (a while loop: Triton's interpreter cannot range() over loaded bounds)
        t = chunk_start + l
        chunk_end = tl.minimum(chunk_start + CHUNK, next_save)
        t_in = t < chunk_end
        dt = tl.load(dt_ptr + t * stride_dtt + head, mask=t_in, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:  # raw dt: softplus(dt + dt_bias) here, not in separate elementwise kernels
            dt = softplus(dt + dt_bias)
        if HAS_DT_LIMIT:
            limited = t_in
            if HAS_LIMIT_MASK:
                limited = tl.load(limit_mask_ptr + t, mask=t_in, other=0) != 0
                if CHECK_DT_LIMIT:  # an unclamped (generated) token the limit would have changed
                    outside = t_in & (~limited) & ((dt < dt_min) | (dt > dt_max))
                    if valid & (tl.max(outside.to(tl.int32), axis=0) > 0):
                        tl.store(hits_ptr + last, 1)
            dt = tl.where(limited, tl.minimum(tl.maximum(dt, dt_min), dt_max), dt)
        dt = tl.where(t_in, dt, 0.0)
        da = dt * a  # tokens past the end have dt 0: no decay, no input
        cum = tl.cumsum(da, axis=0)
        total = tl.sum(da, axis=0)
        x = tl.load(x_ptr + t[:, None] * stride_xt + head * stride_xh + p[None, :],
                    mask=t_in[:, None] & p_in[None, :], other=0.0)
        b = tl.load(b_ptr + t[:, None] * stride_bt + group * stride_bg + n[None, :],
                    mask=t_in[:, None] & n_in[None, :], other=0.0)
        c = tl.load(c_ptr + t[:, None] * stride_ct + group * stride_cg + n[None, :],
                    mask=t_in[:, None] & n_in[None, :], other=0.0)

        y = tl.dot(c, tl.trans(state.to(dot_type)), input_precision=PRECISION) * tl.exp(cum)[:, None]
        scores = tl.dot(c, tl.trans(b), input_precision=PRECISION)
        # exp of -inf above the diagonal: a masked entry never overflows before masking.
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        scores = scores * decay * dt[None, :]
        y += tl.dot(scores.to(dot_type), x, input_precision=PRECISION)
        y += d_skip * x.to(tl.float32)
        y = tl.where(valid, y, 0.0)
        tl.store(y_ptr + t[:, None] * stride_yt + head * stride_yh + p[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=t_in[:, None] & p_in[None, :])

        weight = tl.exp(total - cum) * dt
        b_weighted = (b.to(tl.float32) * weight[:, None]).to(dot_type)
        state = state * tl.exp(total) + tl.dot(tl.trans(x), b_weighted, input_precision=PRECISION)
        if HAS_SAVES:
            if (chunk_end == next_save) & (save < save_end):
                slot = tl.load(save_slot_ptr + save).to(tl.int64)
                tl.store(states_ptr + slot * stride_ss + state_offs, state.to(states_ptr.dtype.element_ty),
                         mask=valid & state_mask)
                save += 1
                next_save = tl.where(save < save_end, start + tl.load(save_offset_ptr + save, mask=save < save_end,
                                                                      other=0).to(tl.int64), end)
        chunk_start = chunk_end

    tl.store(states_ptr + dst * stride_ss + state_offs, state.to(states_ptr.dtype.element_ty),
             mask=valid & (dst >= 0) & state_mask)


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
    dt_bias: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    dt_limit_mask: torch.Tensor | None = None,
    saves: StateSaves | None = None,
    dt_limit_hits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunked SSD over packed variable-length sequences (prefill chunks).

    x: [T, H, P]; dt: [T, H] (any row stride; with `dt_bias` the raw projection, see
    `KernelOps.ssd_chunk_scan_varlen`); A, D: [H]; B, C: [T, G, N]; cu_seqlens: [S+1];
    ssm_states: [slots, H, P, N] float32, read at src_slots[s] and written at
    dst_slots[s]; `saves` (`StateSaves`): states also written from inside the sequences,
    where a block is cut short; `dt_limit_hits` [S] int32: set to 1 for a sequence with a
    token outside `dt_limit_mask` whose dt lies outside `dt_limit` (checked only with a
    mask and a limit that clamps). Returns y: [T, H, P] in x's dtype (D skip included); rows of
    padding sequences (src -1) and tokens past cu_seqlens[-1] are zeros.

    A sequence's dst slot must not be another sequence's src slot (each request owns its
    slots): a program writes its final state without waiting for the other programs.
    The scan is blocked by CHUNK tokens (the result does not depend on the blocking).
    """
    y = torch.empty_like(x)
    if x.shape[0] == 0:
        return y
    if x.stride(-1) != 1 or B.stride(-1) != 1 or C.stride(-1) != 1:
        x, B, C = x.contiguous(), B.contiguous(), C.contiguous()
    if dt.stride(-1) != 1:
        dt = dt.contiguous()
    if dt_limit_mask is not None:
        if dt_limit_mask.shape != (x.shape[0],):
            raise ValueError(f"dt_limit_mask must have one entry per token ({x.shape[0]}), "
                             f"got shape {tuple(dt_limit_mask.shape)}")
        dt_limit_mask = dt_limit_mask.contiguous()
    if ssm_states.stride(-1) != 1:
        raise ValueError("ssm_states must be contiguous in its last dimension")
    num_tokens, heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    num_seqs = src_slots.shape[0]
    block_p = min(BLOCK_P, triton.next_power_of_2(head_dim))
    grid = (num_seqs + 1, heads, triton.cdiv(head_dim, block_p))
    dt_min, dt_max = dt_limit
    _ssd_varlen_kernel[grid](
        x, dt, dt_bias if dt_bias is not None else A, dt_limit_mask if dt_limit_mask is not None else dt,
        A, B, C, D, cu_seqlens, ssm_states, src_slots, dst_slots, y, *(saves if saves is not None else (y, y, y)),
        dt_limit_hits if dt_limit_hits is not None else y, num_seqs, num_tokens, head_dim, state_size, heads // groups, float(dt_min), float(dt_max),
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), y.stride(0), y.stride(1),
        CHUNK=CHUNK, BP=block_p, BN=max(16, triton.next_power_of_2(state_size)),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=NUM_WARPS,
        HAS_DT_BIAS=dt_bias is not None, HAS_DT_LIMIT=clamps_dt(dt_limit), HAS_LIMIT_MASK=dt_limit_mask is not None,
        HAS_SAVES=saves is not None, CHECK_DT_LIMIT=dt_limit_hits is not None, **pdl(x),
    )
    return y
