"""Mamba-2 single-token SSM state update for decode (own Triton kernel).

Separate src and dst slots (ping-pong rollback keeps the old state intact), slot -1 rows
are padding, no host sync and no data-dependent shapes, so it captures in a CUDA graph.
The op is bound by reading and writing the float32 state ([H, P, N] per row), so the grid
splits every (row, head) over blocks of head channels to keep enough loads in flight.
"""
import math

import torch
import triton
import triton.language as tl

from layers.kernels.triton.device import pdl, wait_for_previous_kernel


@triton.jit
def softplus(x):
    """log(1 + e^x) in float32 (the SSD scan uses it too)."""
    # As max(x, 0) + log1p(e^-|x|); log1p(u) = log(w) * u / (w - 1), w = 1 + u (Goldberg),
    # exact to float32 rounding where log(1 + u) alone would lose u's digits.
    u = tl.exp(-tl.abs(x))
    w = 1.0 + u
    log1p = tl.where(w == 1.0, u, tl.log(w) * u / (w - 1.0))
    return tl.maximum(x, 0.0) + log1p


@triton.jit
def _ssm_update_kernel(
    state_ptr, x_ptr, dt_ptr, dt_bias_ptr, a_ptr, b_ptr, c_ptr, d_ptr, y_ptr, src_ptr, dst_ptr, hits_ptr,
    head_dim, state_size, heads_per_group, dt_min, dt_max,
    stride_slot, stride_sh, stride_sp, stride_sn,
    stride_xb, stride_xh, stride_xp,
    stride_dtb, stride_dth,
    stride_bb, stride_bg, stride_bn,
    stride_cb, stride_cg, stride_cn,
    stride_yb, stride_yh, stride_yp,
    BP: tl.constexpr, BN: tl.constexpr, HAS_DT_BIAS: tl.constexpr, CHECK_DT_LIMIT: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.program_id(2) * BP + tl.arange(0, BP)
    n = tl.arange(0, BN)
    p_in = p < head_dim
    n_in = n < state_size
    y_ptrs = y_ptr + row * stride_yb + head * stride_yh + p * stride_yp
    src = tl.load(src_ptr + row)
    if src < 0:
        tl.store(y_ptrs, tl.zeros((BP,), dtype=y_ptr.dtype.element_ty), mask=p_in)
        return
    dst = tl.load(dst_ptr + row)
    group = head // heads_per_group
    tile = head * stride_sh + p[:, None] * stride_sp + n[None, :] * stride_sn
    tile_in = p_in[:, None] & n_in[None, :]
    state = tl.load(state_ptr + src.to(tl.int64) * stride_slot + tile, mask=tile_in, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_xb + head * stride_xh + p * stride_xp, mask=p_in, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + row * stride_dtb + head * stride_dth).to(tl.float32)
    if HAS_DT_BIAS:  # raw dt: softplus(dt + dt_bias) here, saving the separate elementwise kernels
        dt = softplus(dt + tl.load(dt_bias_ptr + head).to(tl.float32))
    if CHECK_DT_LIMIT:
        if (dt < dt_min) | (dt > dt_max):  # every program of the row stores the same 1
            tl.store(hits_ptr + row, 1)
    a = tl.load(a_ptr + head).to(tl.float32)
    b = tl.load(b_ptr + row * stride_bb + group * stride_bg + n * stride_bn, mask=n_in, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + row * stride_cb + group * stride_cg + n * stride_cn, mask=n_in, other=0.0).to(tl.float32)
    d_skip = tl.load(d_ptr + head).to(tl.float32)
    state = state * tl.exp(dt * a) + (dt * x)[:, None] * b[None, :]
    tl.store(state_ptr + dst.to(tl.int64) * stride_slot + tile, state.to(state_ptr.dtype.element_ty), mask=tile_in)
    y = tl.sum(state * c[None, :], axis=1) + d_skip * x
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=p_in)


def ssm_state_update(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    dt_limit_hits: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per row: read the state at src slot, write the new state at dst slot.

    x: [B, H, P]; dt: [B, H], processed, or raw when `dt_bias` [H] is given (then
    softplus(dt + dt_bias) is applied here); A, D: [H]; B, C: [B, G, N];
    ssm_states: [slots, H, P, N]. Rows with src slot -1 are padding (output zeros, no state
    read or written). A row's dst slot must not be another row's src slot (each row owns
    its slots; src == dst of the same row is fine). `dt_limit` is checked, not applied:
    a row with a dt outside it sets its `dt_limit_hits` [B] int32 entry to 1.
    Returns y: [B, H, P] in x's dtype.
    """
    batch, heads, head_dim = x.shape
    state_size = ssm_states.shape[-1]
    y = torch.empty((batch, heads, head_dim), dtype=x.dtype, device=x.device)
    if batch == 0:
        return y
    bp = min(16, triton.next_power_of_2(head_dim))
    grid = (batch, heads, triton.cdiv(head_dim, bp))
    _ssm_update_kernel[grid](
        ssm_states, x, dt, dt if dt_bias is None else dt_bias, A, B, C, D, y, src_slots, dst_slots,
        src_slots if dt_limit_hits is None else dt_limit_hits, head_dim, state_size, heads // B.shape[1], *map(float, dt_limit),
        *ssm_states.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *y.stride(),
        BP=bp, BN=triton.next_power_of_2(state_size), HAS_DT_BIAS=dt_bias is not None,
        CHECK_DT_LIMIT=dt_limit_hits is not None, num_warps=4,
        # No FMA contraction: the verify and single-token kernels then round alike, bit for bit.
        enable_fp_fusion=False, **pdl(x),
    )
    return y


@triton.jit
def _ssm_verify_kernel(
    state_ptr, x_ptr, dt_ptr, dt_bias_ptr, a_ptr, b_ptr, c_ptr, d_ptr, y_ptr, src_ptr, dst_ptr, hits_ptr,
    width, head_dim, state_size, heads_per_group, dt_min, dt_max,
    stride_slot, stride_sh, stride_sp, stride_sn,
    stride_xb, stride_xw, stride_xh, stride_xp,
    stride_dtb, stride_dtw, stride_dth,
    stride_bb, stride_bw, stride_bg, stride_bn,
    stride_cb, stride_cw, stride_cg, stride_cn,
    stride_yb, stride_yw, stride_yh, stride_yp,
    stride_dst_w,
    BP: tl.constexpr, BN: tl.constexpr, HAS_DT_BIAS: tl.constexpr, CHECK_DT_LIMIT: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # The single-token update of `_ssm_update_kernel`, applied to `width` positions with the
    # state kept in registers: read once, written after every position to its own slot.
    row = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.program_id(2) * BP + tl.arange(0, BP)
    n = tl.arange(0, BN)
    p_in = p < head_dim
    n_in = n < state_size
    src = tl.load(src_ptr + row)
    group = head // heads_per_group
    tile = head * stride_sh + p[:, None] * stride_sp + n[None, :] * stride_sn
    tile_in = p_in[:, None] & n_in[None, :]
    # Row flags are kept as [BP] vectors (p * 0 + scalar): masks stay vector-shaped.
    live = (p * 0 + src) >= 0
    row_live = src >= 0  # the same as a scalar (the dt limit check's condition)
    state = tl.load(state_ptr + tl.maximum(src, 0).to(tl.int64) * stride_slot + tile,
                    mask=tile_in & live[:, None], other=0.0).to(tl.float32)
    a = tl.load(a_ptr + head).to(tl.float32)
    d_skip = tl.load(d_ptr + head).to(tl.float32)
    for j in range(width):
        dst = tl.load(dst_ptr + j * stride_dst_w + row)
        live = live & ((p * 0 + dst) >= 0)  # a padding position ends the row
        row_live = row_live & (dst >= 0)
        x = tl.load(x_ptr + row * stride_xb + j * stride_xw + head * stride_xh + p * stride_xp, mask=p_in & live,
                    other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + row * stride_dtb + j * stride_dtw + head * stride_dth).to(tl.float32)
        if HAS_DT_BIAS:
            dt = softplus(dt + tl.load(dt_bias_ptr + head).to(tl.float32))
        if CHECK_DT_LIMIT:
            if row_live & ((dt < dt_min) | (dt > dt_max)):
                tl.store(hits_ptr + row, 1)
        b = tl.load(b_ptr + row * stride_bb + j * stride_bw + group * stride_bg + n * stride_bn, mask=n_in,
                    other=0.0).to(tl.float32)
        c = tl.load(c_ptr + row * stride_cb + j * stride_cw + group * stride_cg + n * stride_cn, mask=n_in,
                    other=0.0).to(tl.float32)
        state = state * tl.exp(dt * a) + (dt * x)[:, None] * b[None, :]
        stored = state.to(state_ptr.dtype.element_ty)
        tl.store(state_ptr + tl.maximum(dst, 0).to(tl.int64) * stride_slot + tile, stored,
                 mask=tile_in & live[:, None])
        y = tl.sum(state * c[None, :], axis=1) + d_skip * x
        y = tl.where(live, y, 0.0)
        # The next position starts from the state as stored (rounded to a bf16/fp16 pool's
        # dtype), as a single-token step reading this slot would: both paths stay bitwise equal.
        state = stored.to(tl.float32)
        tl.store(y_ptr + row * stride_yb + j * stride_yw + head * stride_yh + p * stride_yp,
                 y.to(y_ptr.dtype.element_ty), mask=p_in)


def ssm_state_verify(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    dt_limit_hits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Verify rows: `width` tokens per row through the single-token update, one kernel: the
    state is read once from the row's src slot and written after every position j to
    dst_slots[j] ([W, B], -1: padding position, output zeros). x: [B, W, H, P]; dt:
    [B, W, H] (raw with `dt_bias`); B, C: [B, W, G, N]; `dt_limit` / `dt_limit_hits` as in
    `ssm_state_update`, over the live positions. Returns y: [B, W, H, P]."""
    batch, width, heads, head_dim = x.shape
    state_size = ssm_states.shape[-1]
    y = torch.empty((batch, width, heads, head_dim), dtype=x.dtype, device=x.device)
    if batch == 0:
        return y
    bp = min(16, triton.next_power_of_2(head_dim))
    grid = (batch, heads, triton.cdiv(head_dim, bp))
    _ssm_verify_kernel[grid](
        ssm_states, x, dt, dt if dt_bias is None else dt_bias, A, B, C, D, y, src_slots, dst_slots,
        src_slots if dt_limit_hits is None else dt_limit_hits, width, head_dim, state_size, heads // B.shape[2],
        *map(float, dt_limit),
        *ssm_states.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *y.stride(), dst_slots.stride(0),
        BP=bp, BN=triton.next_power_of_2(state_size), HAS_DT_BIAS=dt_bias is not None,
        CHECK_DT_LIMIT=dt_limit_hits is not None, num_warps=4,
        # No FMA contraction: the verify and single-token kernels then round alike, bit for bit.
        enable_fp_fusion=False, **pdl(x),
    )
    return y
