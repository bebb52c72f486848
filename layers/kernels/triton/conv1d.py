"""Depthwise causal conv1d of the Mamba-2 mixer over conv-state slots (own Triton kernels).

Same contract as `layers.kernels.reference.conv1d`: conv_states[slot] = [D, K-1] holds the
last K-1 inputs (oldest first); each sequence reads `src_slots[s]` and writes
`dst_slots[s]`; slot -1 marks a padding row (output zeros, no state touched).
"""
import torch
import triton
import triton.language as tl

from layers.kernels.ops import StateSaves
from layers.kernels.triton.device import pdl, wait_for_previous_kernel


def check_activation(activation: str | None) -> bool:
    """Whether the conv applies SiLU (`activation` "silu" / "swish"; None: no activation)."""
    if activation is None:
        return False
    if activation in ("silu", "swish"):
        return True
    raise ValueError(f"unsupported conv activation: {activation!r}")


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the channel / tap dim with unit stride; copy only when it is not."""
    return t if t.stride(-1) == 1 else t.contiguous()


@triton.jit
def _sequence_of(cu_ptr, t, num_seqs, search_steps):
    """The sequence holding each packed token t: the number of sequence ends <= t (num_seqs
    for tokens past the last one), by a binary search over cu_seqlens[1:] in
    `search_steps` = num_seqs.bit_length() halvings. Done in the kernel, so the step needs
    no token -> sequence tensor of its own."""
    lo = tl.zeros_like(t)
    hi = lo + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        open_range = lo < hi
        right = tl.load(cu_ptr + mid + 1, mask=open_range, other=0) <= t
        lo = tl.where(open_range & right, mid + 1, lo)
        hi = tl.where(open_range & ~right, mid, hi)
    return lo


# Per-step sizes, and the prefill rows' slots (a slice at the step's decode count, so its
# alignment changes from step to step; see ssd.py): no recompiles while serving. x (the
# prefill rows of the in_proj output) keeps its alignment specialization for its tile
# loads: its row stride is a multiple of 16 bytes for every preset at one GPU (a rank's
# odd width under tensor parallelism adds one variant, compiled once).
@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "search_steps", "src_ptr"])
def _conv_varlen_kernel(
    x_ptr, w_ptr, bias_ptr, states_ptr, y_ptr, cu_ptr, src_ptr,
    num_tokens, dim, num_seqs, search_steps,
    stride_xt, stride_wd, stride_slot, stride_sd, stride_sk, stride_yt,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    t_in = t < num_tokens
    d_in = d < dim
    seq = tl.where(t_in, _sequence_of(cu_ptr, t, num_seqs, search_steps), num_seqs)
    in_seq = t_in & (seq < num_seqs)
    start = tl.load(cu_ptr + seq, mask=in_seq, other=0)
    src = tl.load(src_ptr + seq, mask=in_seq, other=-1)
    valid = in_seq & (src >= 0)
    pos = t - start  # position inside the sequence
    # Only the first K-1 tokens of a sequence read the saved state; most tiles have none.
    reads_state = tl.min(tl.where(valid, pos, K - 1), axis=0) < K - 1
    state_row = src.to(tl.int64) * stride_slot
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    for j in tl.static_range(K):
        # Tap j sees input position pos-(K-1)+j: a packed token when >= 0, else the saved state.
        p = pos - (K - 1) + j
        w = tl.load(w_ptr + d * stride_wd + j, mask=d_in, other=0.0).to(tl.float32)
        from_x = valid & (p >= 0)
        xv = tl.load(x_ptr + (t + j - (K - 1))[:, None] * stride_xt + d[None, :],
                     mask=from_x[:, None] & d_in[None, :], other=0.0).to(tl.float32)
        if reads_state:
            from_state = valid & (p < 0)
            xv += tl.load(states_ptr + state_row[:, None] + d[None, :] * stride_sd + (p + K - 1)[:, None] * stride_sk,
                          mask=from_state[:, None] & d_in[None, :], other=0.0).to(tl.float32)
        acc += xv * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_in, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    acc = tl.where(valid[:, None], acc, 0.0)
    tl.store(y_ptr + t[:, None] * stride_yt + d[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=t_in[:, None] & d_in[None, :])


@triton.jit
def _conv_window(x_ptr, states_ptr, start, length, src, d, d_in, c, col_in, stride_xt, stride_slot, stride_sd,
                 stride_sk, K: tl.constexpr):
    """The conv state after a sequence's first `length` tokens, [BD, BK] float32: column c
    holds input position length-(K-1)+c, from x or, before the sequence, from its old state."""
    p = length - (K - 1) + c
    xv = tl.load(x_ptr + (start + p)[None, :] * stride_xt + d[:, None],
                 mask=d_in[:, None] & (col_in & (p >= 0))[None, :], other=0.0).to(tl.float32)
    old = states_ptr + src.to(tl.int64) * stride_slot + d[:, None] * stride_sd
    sv = tl.load(old + (p + K - 1)[None, :] * stride_sk, mask=d_in[:, None] & (col_in & (p < 0))[None, :],
                 other=0.0).to(tl.float32)
    return xv + sv


@triton.jit(do_not_specialize=["src_ptr", "dst_ptr"])  # slices at the step's decode count (above)
def _conv_final_state_kernel(
    x_ptr, states_ptr, cu_ptr, src_ptr, dst_ptr, save_cu_ptr, save_offset_ptr, save_slot_ptr, dim,
    stride_xt, stride_slot, stride_sd, stride_sk,
    K: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, HAS_SAVES: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # A launch after the conv kernel, whose programs read the src slots: it may then write
    # the dst slots directly (a program reads its own src values before it writes, and no
    # sequence's dst is another's src: the op contract).
    seq = tl.program_id(0)
    src = tl.load(src_ptr + seq)
    dst = tl.load(dst_ptr + seq)
    if (src < 0) | (dst < 0):
        return
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    d_in = d < dim
    start = tl.load(cu_ptr + seq)
    length = tl.load(cu_ptr + seq + 1) - start
    c = tl.arange(0, BK)
    col_in = c < K - 1
    cols = d[:, None] * stride_sd + c[None, :] * stride_sk
    if HAS_SAVES:  # states from inside the sequence (`StateSaves`), to slots nobody reads here
        save = tl.load(save_cu_ptr + seq)
        save_end = tl.load(save_cu_ptr + seq + 1)
        while save < save_end:
            window = _conv_window(x_ptr, states_ptr, start, tl.load(save_offset_ptr + save), src, d, d_in, c, col_in,
                                  stride_xt, stride_slot, stride_sd, stride_sk, K)
            slot = tl.load(save_slot_ptr + save).to(tl.int64)
            tl.store(states_ptr + slot * stride_slot + cols, window.to(states_ptr.dtype.element_ty),
                     mask=d_in[:, None] & col_in[None, :])
            save += 1
    window = _conv_window(x_ptr, states_ptr, start, length, src, d, d_in, c, col_in, stride_xt, stride_slot, stride_sd,
                          stride_sk, K)
    # In place (src == dst) a short sequence's new column c is old column length+c, which
    # another thread of this program may hold: every load above completes before any store.
    tl.debug_barrier()
    tl.store(states_ptr + dst.to(tl.int64) * stride_slot + cols, window.to(states_ptr.dtype.element_ty),
             mask=d_in[:, None] & col_in[None, :])


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    activation: str | None = "silu",
    saves: StateSaves | None = None,
) -> torch.Tensor:
    """Causal conv over packed prefill chunks continuing from saved state (no host sync).

    x: [T, D] (row stride free, unit channel stride); weight: [D, K]; conv_states:
    [slots, D, K-1]; cu_seqlens: [S+1]; src_slots / dst_slots: [S]. Returns y: [T, D] in
    x's dtype; rows of padding sequences and tokens past cu_seqlens[-1] are zeros.

    A sequence's dst slot must not be another sequence's src slot (each request owns its
    slots; src == dst of one sequence is fine): final states go straight to the dst slots.
    `saves` (`StateSaves`): states also written from inside the sequences.
    """
    silu = check_activation(activation)
    num_tokens, dim = x.shape
    k = weight.shape[1]
    num_seqs = src_slots.shape[0]
    y = torch.empty((num_tokens, dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return y
    x, weight = unit_last_stride(x), unit_last_stride(weight)
    bt, bd = 32, 128
    grid = (triton.cdiv(num_tokens, bt), triton.cdiv(dim, bd))
    _conv_varlen_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_states, y, cu_seqlens, src_slots,
        num_tokens, dim, num_seqs, num_seqs.bit_length(),
        x.stride(0), weight.stride(0), conv_states.stride(0), conv_states.stride(1), conv_states.stride(2), y.stride(0),
        K=k, HAS_BIAS=bias is not None, SILU=silu, BT=bt, BD=bd, num_warps=4, **pdl(x),
    )
    if num_seqs:
        _conv_final_state_kernel[(num_seqs, triton.cdiv(dim, bd))](
            x, conv_states, cu_seqlens, src_slots, dst_slots, *(saves if saves is not None else (x, x, x)), dim,
            x.stride(0), conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
            K=k, BK=triton.next_power_of_2(k - 1), BD=bd, HAS_SAVES=saves is not None, num_warps=4, **pdl(x),
        )
    return y


@triton.jit
def conv_update_channels(x, w_ptrs, bias_ptrs, src_ptrs, dst_ptrs, stride_sk, mask,
                         K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """The single-token conv update of the channels where `mask` holds, any shape ([D], or
    [rows, D] in the in_proj kernel): returns silu(sum_t w_t * window_t + bias) in float32
    over the window state[src] ++ x, and writes state[dst] <- the window's last K-1 inputs.

    `w_ptrs` / `bias_ptrs` point at each channel's taps / bias, `src_ptrs` / `dst_ptrs` at
    its state column 0 (src == dst: in place). The taps are summed oldest first, each product
    rounded before its add (callers compile with enable_fp_fusion=False): every kernel that
    calls this rounds alike, bit for bit, whatever its layout, so a decode row, a verify
    position and the fused in_proj agree exactly."""
    acc = tl.zeros_like(x.to(tl.float32))
    for t in tl.static_range(K - 1):
        h = tl.load(src_ptrs + t * stride_sk, mask=mask, other=0.0)
        acc = acc + h.to(tl.float32) * tl.load(w_ptrs + t, mask=mask, other=0.0).to(tl.float32)
        if t > 0:  # column t moves to t-1; column t+1, not read yet, is not overwritten
            tl.store(dst_ptrs + (t - 1) * stride_sk, h, mask=mask)
    acc = acc + x.to(tl.float32) * tl.load(w_ptrs + (K - 1), mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptrs + (K - 2) * stride_sk, x.to(dst_ptrs.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptrs, mask=mask, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    return acc


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, bias_ptr, states_ptr, y_ptr, src_ptr, dst_ptr, dim,
    stride_xb, stride_wd, stride_slot, stride_sd, stride_sk, stride_yb,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    d_in = d < dim
    src = tl.load(src_ptr + row)
    if src < 0:
        tl.store(y_ptr + row * stride_yb + d, tl.zeros((BD,), dtype=y_ptr.dtype.element_ty), mask=d_in)
        return
    dst = tl.load(dst_ptr + row)
    x = tl.load(x_ptr + row * stride_xb + d, mask=d_in, other=0.0)
    channel = d * stride_sd
    y = conv_update_channels(x, w_ptr + d * stride_wd, bias_ptr + d, states_ptr + src.to(tl.int64) * stride_slot + channel,
                             states_ptr + dst.to(tl.int64) * stride_slot + channel, stride_sk, d_in, K, HAS_BIAS, SILU)
    tl.store(y_ptr + row * stride_yb + d, y.to(y_ptr.dtype.element_ty), mask=d_in)


def conv_update_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
                     src_slots: torch.Tensor, dst_slots: torch.Tensor, silu: bool, out: torch.Tensor) -> None:
    """`causal_conv1d_update` writing into `out` [B, D] (unit channel stride), which may be
    x itself: a program reads each element of x before it writes that element of out."""
    batch, dim = x.shape
    if batch == 0:
        return
    x, weight = unit_last_stride(x), unit_last_stride(weight)
    bd = 256
    _conv_update_kernel[(batch, triton.cdiv(dim, bd))](
        x, weight, bias if bias is not None else weight, conv_states, out, src_slots, dst_slots, dim,
        x.stride(0), weight.stride(0), conv_states.stride(0), conv_states.stride(1), conv_states.stride(2), out.stride(0),
        K=weight.shape[1], HAS_BIAS=bias is not None, SILU=silu, BD=bd, num_warps=4,
        # No FMA contraction: every conv_update_channels caller rounds alike, bit for bit.
        enable_fp_fusion=False, **pdl(x),
    )


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode token per row: y = conv(state ++ x), state[dst] <- last K-1 inputs.

    x: [B, D]; rows whose src slot is -1 are padding (output zeros, no state touched).
    CUDA-graph capturable. A row's dst slot must not be another row's src slot (each row
    owns its slots; src == dst of the same row is fine).
    """
    silu = check_activation(activation)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    conv_update_into(x, weight, bias, conv_states, src_slots, dst_slots, silu, y)
    return y


@triton.jit
def _conv_verify_kernel(
    x_ptr, w_ptr, bias_ptr, states_ptr, y_ptr, src_ptr, dst_ptr, dim, width,
    stride_xb, stride_xw, stride_wd, stride_slot, stride_sd, stride_sk, stride_yb, stride_yw, stride_dst_w,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # `_conv_update_kernel` chained over `width` positions of a row: position j reads the
    # state position j-1 wrote (the row's src for j = 0) and writes dst_slots[j]. The same
    # threads write and then read each state element, so the chain needs no barrier, and a
    # dst slot may be the row's src slot (serial rings): only position 0 reads src.
    row = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    d_in = d < dim
    channel = d * stride_sd
    slot = tl.load(src_ptr + row)
    for j in range(width):
        dst = tl.load(dst_ptr + j * stride_dst_w + row)
        live = (slot >= 0) & (dst >= 0)  # a padding row or position ends the row
        if live:
            x = tl.load(x_ptr + row * stride_xb + j * stride_xw + d, mask=d_in, other=0.0)
            y = conv_update_channels(x, w_ptr + d * stride_wd, bias_ptr + d,
                                     states_ptr + slot.to(tl.int64) * stride_slot + channel,
                                     states_ptr + dst.to(tl.int64) * stride_slot + channel, stride_sk, d_in, K,
                                     HAS_BIAS, SILU)
        else:
            y = tl.zeros((BD,), dtype=tl.float32)
        tl.store(y_ptr + row * stride_yb + j * stride_yw + d, y.to(y_ptr.dtype.element_ty), mask=d_in)
        slot = tl.where(live, dst, -1)


def causal_conv1d_verify(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Verify rows: `width` tokens per row through the single-token conv update, one
    kernel; the state after position j goes to dst_slots[j] ([W, B], -1: padding).
    x: [B, W, D] (unit channel stride). Returns [B, W, D] in x's dtype."""
    silu = check_activation(activation)
    batch, width, dim = x.shape
    k = weight.shape[1]
    y = torch.empty((batch, width, dim), dtype=x.dtype, device=x.device)
    if batch == 0:
        return y
    x, weight = unit_last_stride(x), unit_last_stride(weight)
    bd = 256
    _conv_verify_kernel[(batch, triton.cdiv(dim, bd))](
        x, weight, bias if bias is not None else weight, conv_states, y, src_slots, dst_slots, dim, width,
        x.stride(0), x.stride(1), weight.stride(0), conv_states.stride(0), conv_states.stride(1),
        conv_states.stride(2), y.stride(0), y.stride(1), dst_slots.stride(0),
        K=k, HAS_BIAS=bias is not None, SILU=silu, BD=bd, num_warps=4,
        # No FMA contraction: every conv_update_channels caller rounds alike, bit for bit.
        # One stage: position j+1 reads what position j stored, so no load is issued early.
        enable_fp_fusion=False, num_stages=1, **pdl(x),
    )
    return y
