"""Fused MoE experts: alignment, two grouped GEMMs and a combine, four kernels in all (two or three at one token).

1. `align_pairs` (moe_align.py) sorts the T x slots (token, slot) pairs into per-expert row
   segments padded to the row tile BLOCK_M. A token's slots are its k routed choices, then
   the chunks of the shared expert when one is given (see below).
2. Up GEMM: each program takes BLOCK_M rows of one expert and BLOCK_N output columns, gathers
   the rows' tokens from x, multiplies by that expert's up (SwiGLU: gate and up) weights and
   applies the activation in registers. Only the experts that have rows are read; blocks past
   the last real one exit at once.
3. Down GEMM: the same over the activations, each row written to its (token, slot) place.
4. Combine: per token, the k routed rows times their weights plus the shared rows, summed in
   slot order in float32 (deterministic; no floating-point atomics anywhere).

One token (batch-1 decode, where every kernel boundary costs a few microseconds) takes two
kernels: its pairs are already one per block (the aligned layout of one token has the same
blocks, in expert order), so the GEMMs read the expert of block b from the routes and skip
alignment; and the down GEMM's last program to finish a column tile (an arrival counter
per tile, as in the split-K projections) combines that tile in slot order, as the combine
kernel does (a hidden size with more column tiles than arrival counters keeps the combine
kernel: three). The same products and sums as the four-kernel path, bit for bit.

The shared expert (same activation, no biases) runs inside the same kernels: its
intermediate width S is cut into cdiv(S, I) chunks of the routed width I, pseudo-experts
E, E+1, ... with weight 1 that every token visits (for relu2 and SwiGLU the chunks' down
projections add up to the whole MLP's). So a MoE layer with a shared expert costs the
router op (`moe_routing.py`: one or two kernels, or three with cuBLAS's split-K reduce) and
these four kernels (two or three at one token).

Numerics follow the reference: float32 accumulation, each projection rounded to x's dtype
before the activation, the down projection rounded to x's dtype before it is weighted,
result in x's dtype. No host sync, and every shape depends only on (T, k, E, the tile), so
the whole path captures in a CUDA graph.
"""
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from layers.kernels.triton.device import MAX_ARRIVAL_COUNTERS, arrival_counters, pdl, sm_count, wait_for_previous_kernel
from layers.kernels.triton.moe_align import ExpertRows, align_pairs, max_row_blocks, pair_experts

_ACTIVATIONS = {"relu2": 1, "swiglu": 2}


@dataclass(frozen=True)
class GemmTiles:
    """One grouped GEMM's column and K tiles, pipeline depth and product order."""

    block_n: int
    block_k: int
    num_stages: int
    # The weight tile as the first operand of the tensor-core product ([BN, BM] sums,
    # transposed once after the K loop; the same bits), as the few-row projection kernel
    # takes it for some shapes (linear.Tiling).
    weight_major: bool = False


@dataclass(frozen=True)
class MoeTiles:
    """Tiles of one fused MoE call: the row tile (shared by alignment and both GEMMs), each
    GEMM's own, and the warps per program."""

    block_m: int
    up: GemmTiles
    down: GemmTiles
    num_warps: int


# By row tile, chosen from the expected rows per expert (`moe_tiles`). Decode-sized calls
# (a few rows per expert) stream weights: 16-row tiles, long K tiles, several stages in
# flight. Prefill-sized calls are tensor-core bound: 128-row tiles. The 16-row down GEMM is
# weight-major in 3 stages: 1-2.5% faster experts on granite-4.0-h-tiny at 8-128 tokens,
# within 0.3% on nemotron-3-nano (H200, session 32 in docs/benchmarks.md). Tune here.
MOE_TILES: dict[int, MoeTiles] = {
    16: MoeTiles(16, up=GemmTiles(64, 128, 4), down=GemmTiles(64, 128, 3, weight_major=True), num_warps=4),
    32: MoeTiles(32, up=GemmTiles(64, 128, 4), down=GemmTiles(64, 128, 4), num_warps=4),
    64: MoeTiles(64, up=GemmTiles(64, 64, 3), down=GemmTiles(64, 64, 3), num_warps=4),
    128: MoeTiles(128, up=GemmTiles(64, 64, 3), down=GemmTiles(128, 64, 3), num_warps=8),
}
# One token (batch-1 decode, the two-kernel path) of an activation with one weight tile per
# K step (relu2): the up GEMM in 256-deep K steps. With them nemotron-3-nano's experts at
# one token took 45 us against 53 (graph chains of the experts alone); at 8-128 tokens they
# were 2-4% slower there, so only one token has them. SwiGLU keeps the 16-row up tiles: its
# two weight tiles per step would need 221 KB of shared memory in 64-column tiles (an
# A100 has 163 KB), and granite-4.0-h-tiny's experts gained nothing from the deeper steps
# (15.13 against 15.01 us; H200, session 32).
ONE_TOKEN_UP_TILES = GemmTiles(64, 256, 4)
# float32 runs the IEEE dot (the 1e-4 contract): twice the bytes per element, smaller tiles.
FLOAT32_GEMM_TILES = GemmTiles(32, 32, 2)
MIN_BLOCK_N = 32
# Column tiles narrow while a GEMM has fewer programs than this many per SM. One, not two:
# granite-4.0-h-tiny's down GEMM at one token took 64-column tiles (192 programs) 0.4 us
# faster than 32-column ones (H200, session 32).
PROGRAMS_PER_SM = 1


def moe_tiles(num_pairs: int, num_experts: int, n_up: int, n_down: int, dtype: torch.dtype,
              num_sms: int = 132, one_token: bool = False, gated: bool = False) -> MoeTiles:
    """Tiles for `num_pairs` (token, slot) rows over `num_experts` experts (shared chunks
    included) with up / down GEMMs `n_up` / `n_down` columns wide; `one_token` for the
    one-token path, `gated` for an activation with two weight tiles per K step (SwiGLU).

    The row tile is the smallest in MOE_TILES that holds the expected rows per expert
    (num_pairs / num_experts), else the largest; one ungated token's up GEMM takes
    ONE_TOKEN_UP_TILES. Where the grid would leave SMs idle (decode, narrow experts) the
    column tiles narrow down to MIN_BLOCK_N, towards PROGRAMS_PER_SM programs per SM
    streaming weights.
    """
    row_tiles = sorted(MOE_TILES)
    tiles = MOE_TILES[next((bm for bm in row_tiles if num_pairs / num_experts <= bm), row_tiles[-1])]
    if one_token and not gated:
        tiles = replace(tiles, up=ONE_TOKEN_UP_TILES)
    if dtype == torch.float32:
        tiles = replace(tiles, up=FLOAT32_GEMM_TILES, down=FLOAT32_GEMM_TILES)
    blocks = max_row_blocks(num_pairs, num_experts, tiles.block_m)

    def fit(gemm: GemmTiles, n: int) -> GemmTiles:
        block_n = gemm.block_n
        while block_n > MIN_BLOCK_N and blocks * triton.cdiv(n, block_n) < PROGRAMS_PER_SM * num_sms:
            block_n //= 2
        return replace(gemm, block_n=block_n)

    return replace(tiles, up=fit(tiles.up, n_up), down=fit(tiles.down, n_down))


@triton.jit
def _combined_row(y_ptr, weights_ptr, t, cols, c_in, stride_y, TOP_K: tl.constexpr, SLOTS: tl.constexpr):
    """Token t's output at `cols`: sum_s w[t, s] * y[t * SLOTS + s] in slot order (shared
    slots: weight 1), in float32. y is read from L2 (other programs may have just written it)."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for s in tl.static_range(SLOTS):
        v = tl.load(y_ptr + (t * SLOTS + s) * stride_y + cols, mask=c_in, other=0.0, cache_modifier=".cg")
        v = v.to(tl.float32)
        if s < TOP_K:
            v = v * tl.load(weights_ptr + t * TOP_K + s).to(tl.float32)
        acc += v
    return acc


@triton.jit
def _product_step(acc, a, w_ptrs, kk, k_in, c_in, WEIGHT_MAJOR: tl.constexpr, PRECISION: tl.constexpr):
    """`acc` plus one K step's product of the rows `a` [BM, BK] and the weight rows at
    `w_ptrs` (pointers to column kk = 0): [BM, BN] sums row-major (w_ptrs [1, BN]), [BN, BM]
    weight-major (w_ptrs [BN, 1]: the weight tile first in the tensor-core product)."""
    if WEIGHT_MAJOR:
        w = tl.load(w_ptrs + kk[None, :], mask=c_in[:, None] & k_in[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
    else:
        w = tl.load(w_ptrs + kk[:, None], mask=c_in[None, :] & k_in[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, ws_ptr, out_ptr, pairs_ptr, block_expert_ptr, expert_end_ptr, ids_ptr, weights_ptr, final_ptr,
    arrivals_ptr, n_dim, k_dim, num_routed, shared_width, stride_am, stride_om, stride_we, stride_wn, stride_sn,
    shared_step, routed_half, shared_half,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, UP: tl.constexpr, ACT: tl.constexpr, PRECISION: tl.constexpr,
    DIRECT: tl.constexpr, COMBINE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    WEIGHT_MAJOR: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # One (row block of one expert, column block). UP: out[row] = act(x[token(row)] @ W_e^T),
    # rows in sorted order. Down: out[pair(row)] = h[row] @ W_e^T, rows in pair order.
    block = tl.program_id(0)
    lanes = tl.arange(0, BM)
    rows = block * BM + lanes
    if DIRECT:
        # One token: block b holds the token's pair b alone, found from the routes without
        # an alignment kernel. The aligned layout of one token has the same blocks in expert
        # order, so every product is the same.
        expert = pair_experts(ids_ptr, block, True, num_routed, TOP_K, SLOTS)
        r_in = lanes == 0
        pairs = block + lanes * 0
    else:
        expert = tl.load(block_expert_ptr + block)
        if expert < 0:
            return  # blocks past the last real one (the grid is a static bound)
        r_in = rows < tl.load(expert_end_ptr + expert)
        pairs = tl.load(pairs_ptr + rows, mask=r_in, other=0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    # Shared chunk j covers intermediate columns [j*I, min((j+1)*I, S)): the up GEMM's
    # output columns, the down GEMM's K columns.
    inter = n_dim if UP else k_dim
    chunk = expert - num_routed
    width = tl.where(chunk < 0, inter, tl.minimum(inter, shared_width - chunk * inter))
    n_limit = width if UP else n_dim
    k_limit = k_dim if UP else width
    a_rows = pairs // SLOTS if UP else rows
    # Selected base and strides rather than two code paths (two would double the pipeline's
    # shared memory); selects keep the strides' divisibility: weight loads stay 16-byte cp.async.
    shared = chunk >= 0
    w_base = tl.where(shared, ws_ptr + chunk.to(tl.int64) * shared_step, w_ptr + expert.to(tl.int64) * stride_we)
    w_cols = w_base + cols[None, :] * tl.where(shared, stride_sn, stride_wn)  # K is contiguous
    up_offset = tl.where(shared, shared_half, routed_half)  # SwiGLU: gate rows -> up rows
    a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am
    c_in = cols < n_limit
    # Weight-major: [BN, BM] sums, transposed once after the K loop (the same bits).
    if WEIGHT_MAJOR:
        w_ptrs = tl.trans(w_cols)  # [BN, 1]: K runs along the weight tile's second axis
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        acc_up = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        w_ptrs = w_cols
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k_limit, BK):
        kk = k0 + tl.arange(0, BK)
        k_in = kk < k_limit
        # Rows and K columns past the limits are masked, so unwritten inputs are never read.
        a = tl.load(a_base + kk[None, :], mask=r_in[:, None] & k_in[None, :], other=0.0)
        acc = _product_step(acc, a, w_ptrs, kk, k_in, c_in, WEIGHT_MAJOR, PRECISION)
        if ACT == 2:
            acc_up = _product_step(acc_up, a, w_ptrs + up_offset, kk, k_in, c_in, WEIGHT_MAJOR, PRECISION)
    if WEIGHT_MAJOR:
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    # The reference rounds each projection to the activation dtype before the activation.
    acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    if ACT == 1:
        acc = tl.maximum(acc, 0.0)
        acc = acc * acc
    elif ACT == 2:
        acc = acc * tl.sigmoid(acc) * acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
    out_rows = rows if UP else pairs
    tl.store(out_ptr + out_rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=r_in[:, None] & c_in[None, :])
    if COMBINE:
        # One token's down GEMM: the last of the column tile's SLOTS programs to arrive (an
        # arrival counter per column tile, reset by that program) combines the tile, as the
        # combine kernel would.
        tl.debug_barrier()  # every thread's rows are stored before the arrival releases them
        if tl.atomic_add(arrivals_ptr + tl.program_id(1), 1, sem="acq_rel") == SLOTS - 1:
            combined = _combined_row(out_ptr, weights_ptr, 0, cols, c_in, stride_om, TOP_K, SLOTS)
            tl.store(final_ptr + cols, combined.to(final_ptr.dtype.element_ty), mask=c_in)
            tl.atomic_xchg(arrivals_ptr + tl.program_id(1), 0)  # ready for the next call


@triton.jit
def _combine_kernel(y_ptr, weights_ptr, out_ptr, n_dim, stride_y, stride_o,
                    TOP_K: tl.constexpr, SLOTS: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    c_in = cols < n_dim
    acc = _combined_row(y_ptr, weights_ptr, t, cols, c_in, stride_y, TOP_K, SLOTS)
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=c_in)


@dataclass(frozen=True)
class _Weights:
    """One GEMM's routed weights [E, N(, x2 for SwiGLU), K] and its shared expert's
    [N-or-K-wide, ...] (or the routed ones again, unused, when there is none)."""

    routed: torch.Tensor
    shared: torch.Tensor
    stride_sn: int  # row stride of the shared weight
    shared_step: int  # elements between shared chunks
    routed_half: int  # SwiGLU: elements from the gate rows to the up rows
    shared_half: int


def _gemm(a: torch.Tensor, weights: _Weights, out: torch.Tensor, rows: ExpertRows | None, blocks: int,
          topk_ids: torch.Tensor, tile: GemmTiles, tiles: MoeTiles, up: bool, act: int, num_routed: int,
          shared_width: int, slots: int, combine: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """One grouped GEMM over `blocks` row blocks. `rows` None: one token, whose pairs are the
    blocks (no alignment). `combine` (the routes' weights, the output): the down GEMM of one
    token combines too."""
    n_dim = out.shape[1]
    # Arguments a mode does not read get topk_ids as a placeholder pointer.
    aligned = (topk_ids,) * 3 if rows is None else (rows.pairs, rows.block_expert, rows.expert_end)
    topk_weights, final = (topk_ids, topk_ids) if combine is None else combine
    arrivals = topk_ids if combine is None else arrival_counters(a.device)
    _moe_gemm_kernel[(blocks, triton.cdiv(n_dim, tile.block_n))](
        a, weights.routed, weights.shared, out, *aligned, topk_ids, topk_weights, final, arrivals,
        n_dim, a.shape[1], num_routed, shared_width, a.stride(0), out.stride(0), weights.routed.stride(0),
        weights.routed.stride(1), weights.stride_sn, weights.shared_step, weights.routed_half, weights.shared_half,
        TOP_K=topk_ids.shape[1], SLOTS=slots, UP=up, ACT=act, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        DIRECT=rows is None, COMBINE=combine is not None, BM=tiles.block_m, BN=tile.block_n, BK=tile.block_k,
        WEIGHT_MAJOR=tile.weight_major, num_warps=tiles.num_warps, num_stages=tile.num_stages, **pdl(a),
    )


def _check_shapes(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor, act: int,
                  shared_up: torch.Tensor | None, shared_down: torch.Tensor | None) -> None:
    num_experts, hidden, inter = w_down.shape
    if w_up.shape != (num_experts, act * inter, hidden) or x.shape[1] != hidden:
        raise ValueError(f"w_up {tuple(w_up.shape)}, w_down {tuple(w_down.shape)} and x {tuple(x.shape)} disagree")
    if (shared_up is None) != (shared_down is None):
        raise ValueError("shared_up and shared_down go together")
    if shared_down is not None and (shared_down.shape[0] != hidden
                                    or shared_up.shape != (act * shared_down.shape[1], hidden)):
        raise ValueError(f"shared_up {tuple(shared_up.shape)} and shared_down {tuple(shared_down.shape)} disagree "
                         f"with hidden size {hidden}")
    weights = [w for w in (w_up, w_down, shared_up, shared_down) if w is not None]
    if any(w.stride(-1) != 1 or w.dtype != x.dtype for w in weights):
        raise ValueError("expert weights must have contiguous rows and x's dtype")
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} does not match {x.shape[0]} tokens")


def moe_experts(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    shared_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted sum of each token's chosen experts: sum_k w_k * down_e(act(up_e(x))), plus
    the shared expert down_s(act(up_s(x))) when its weights are given.

    x: [T, H]; w_up: [E, I or 2I (swiglu: gate then up), H]; w_down: [E, H, I];
    topk_weights / topk_ids: [T, k]; shared_up: [S or 2S, H]; shared_down: [H, S].
    Four kernels (two at one token: no alignment, the combine in the down GEMM), no host
    sync, shapes depend only on T, k, E (CUDA-graph capturable); experts without tokens are
    not read.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unsupported expert activation: {activation!r}")
    act = _ACTIVATIONS[activation]
    _check_shapes(x, w_up, w_down, topk_ids, act, shared_up, shared_down)
    num_tokens, hidden = x.shape
    num_experts, _, inter = w_down.shape
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    shared_width = 0 if shared_down is None else shared_down.shape[1]
    chunks = triton.cdiv(shared_width, inter)
    top_k = topk_ids.shape[1]
    slots = top_k + chunks
    tiles = moe_tiles(num_tokens * slots, num_experts + chunks, inter, hidden, x.dtype, sm_count(x.device),
                      one_token=num_tokens == 1, gated=activation == "swiglu")
    topk_ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    weights = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    # One token (batch-1 decode) skips the alignment kernel, and its down GEMM combines
    # when each column tile has an arrival counter: two kernels fewer.
    rows = None if num_tokens == 1 else align_pairs(topk_ids, num_experts, chunks, tiles.block_m)
    blocks = slots if rows is None else rows.max_blocks
    combine_in_down = rows is None and triton.cdiv(hidden, tiles.down.block_n) <= MAX_ARRIVAL_COUNTERS

    if shared_up is None:
        up_w = _Weights(w_up, w_up, w_up.stride(1), 0, inter * w_up.stride(1), 0)
        down_w = _Weights(w_down, w_down, w_down.stride(1), 0, 0, 0)
    else:
        up_w = _Weights(w_up, shared_up, shared_up.stride(0), inter * shared_up.stride(0), inter * w_up.stride(1),
                        shared_width * shared_up.stride(0))
        down_w = _Weights(w_down, shared_down, shared_down.stride(0), inter, 0, 0)
    h = torch.empty((blocks * tiles.block_m, inter), dtype=x.dtype, device=x.device)
    _gemm(x, up_w, h, rows, blocks, topk_ids, tiles.up, tiles, True, act, num_experts, shared_width, slots)
    y = torch.empty((num_tokens * slots, hidden), dtype=x.dtype, device=x.device)
    _gemm(h, down_w, y, rows, blocks, topk_ids, tiles.down, tiles, False, 0, num_experts, shared_width, slots,
          combine=(weights, out) if combine_in_down else None)
    if combine_in_down:
        return out

    block_n = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_n))](
        y, weights, out, hidden, y.stride(0), out.stride(0), TOP_K=top_k, SLOTS=slots, BN=block_n, num_warps=4,
        **pdl(y))
    return out
