"""Linear projections of a few rows (decode), in one Triton pass per projection.

A decode step multiplies 1 to 32 activation rows by each weight matrix, so it is bound by
reading the weights. A program owns BLOCK_N output columns for all rows and streams its
[BLOCK_N, K] slab of the weight (or one of SPLIT_K slices of it along K) once, BLOCK_K
columns at a time; the rows go through the tensor cores in 16-row tiles, which costs
nothing when the weights are the traffic. A narrow matrix has too few column tiles to
keep every SM reading, so its K is split: each program stores its float32 partial sums,
and the last program of a column tile to arrive (an arrival counter, reset by that program)
adds the slices in slice order and writes the result. The order is fixed, so results are
deterministic, and among the calls the kernel takes a row's result does not depend on the
other rows (16-row tiles, a tiling chosen from the weight's shape alone).

Why not cuBLAS: on its own cuBLAS reads these matrices about as fast (docs/kernels.md), but
a kernel of ours is a programmatic dependent launch (`device.pdl`) that starts while the
kernel before it drains, where a cuBLAS kernel waits for a full completion. Float32, more
rows (a prompt step) and anything unusual go to `F.linear`.
"""
import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from layers.kernels.reference.attention import kv_columns, kv_width
from layers.kernels.triton.activation import relu_square
from layers.kernels.triton.attention import write_kv_cache
from layers.kernels.triton.conv1d import check_activation, conv_update_channels, conv_update_into, unit_last_stride
from layers.kernels.triton.device import MAX_ARRIVAL_COUNTERS, arrival_counters, pdl, wait_for_previous_kernel

ROW_TILE = 16  # the tensor-core tile the rows are padded to
MAX_ROWS = 2 * ROW_TILE  # past a decode step's 32 rows cuBLAS's tiled GEMMs take over
MAX_SPLIT_PROGRAMS = 128  # K slices are doubled only while the grid stays within this many programs ...
MIN_SLICE = 256  # ... and each slice keeps at least this many K columns
# A deep weight (N < K <= 4,096) is cut into 32-column tiles and, past the doubling, into
# as many slices as bring its grid to about this many programs (1.75 per SM of an H100 /
# H200), each slice keeping DEEP_MIN_SLICE columns or more.
DEEP_TARGET_PROGRAMS = 232
DEEP_MIN_SLICE = 512
# A short-rowed weight no deeper than it is wide (K <= SHORT_K, K <= N) that 64-column
# tiles would cut into fewer than MIN_COLUMN_TILES is read unsplit in 32- or 16-column
# tiles instead: its slab fits in one or two rounds of loads in flight, and the split's
# fix-up (partials stored, an arrival, partials read back) costs more than that.
SHORT_K = 1536
MIN_COLUMN_TILES = 80
# Which 64-column tilings take the weight-major product (`Tiling`) and which take
# 64-column K steps: an empirical fit on the H200 (132 SMs, like the H100), measured at the
# presets' shapes and over N at K = 1,536 / 2,688 / 4,096 (docs/kernels.md, "Few-row
# projections"). With 128-column K steps weight-major won at up to 1, at 2 and at 4 or more
# column tiles per SM and lost at 1.2, 1.5 and 3; with 256-column steps it won at every N
# measured. 64-column K steps won only for deep weights of 290 and 336 column tiles.
SM_COUNT = 132
MANY_COLUMN_TILES = 512
DEEP_WIDE_K = 4096
DEEP_WIDE_MIN_TILES = 256
_DTYPES = (torch.bfloat16, torch.float16)
# The conv epilogue runs for one row tile: with two, the kernel reached 255 registers and a
# granite-4.0-h-tiny step at batch 32 took 7.58 ms against 7.41 with the separate conv kernel.
CONV_EPILOGUE_ROWS = ROW_TILE


@dataclass(frozen=True)
class Tiling:
    """How the skinny kernel cuts an [N, K] weight: BLOCK_N output columns per program, K
    read BLOCK_K columns at a time, in `split` slices (1: no partial sums); `weight_major`
    puts the weight tile first in the tensor-core product ([BLOCK_N, 16] sums, transposed
    once at the end; the product's rows are then the weight's, which suits the wide tiles
    of some shapes: `tiling`)."""

    block_n: int
    block_k: int
    split: int
    weight_major: bool = False

    @property
    def whole_wide_slabs(self) -> bool:
        """Unsplit 64-column slabs: the tiling in which a program's rows, past one row tile,
        still cost little next to its weight slab (`takes_kernel`)."""
        return self.split == 1 and self.block_n == 64


@triton.jit
def bfloat16_pieces(w):
    """A float32 tile as three bfloat16 pieces, high + middle + low == w (24 = 3 x 8
    significand bits: exact for |w| above about 2^-110, where the low piece still fits,
    bfloat16 subnormals included); high + middle is exact in float32 too, so adding them in
    that order rebuilds w."""
    high = w.to(tl.bfloat16)
    rest = w - high.to(tl.float32)  # exact: what rounding to bfloat16 dropped
    middle = rest.to(tl.bfloat16)
    return high, middle, (rest - middle.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _bfloat16_pieces_kernel(w_ptr, pieces_ptr, numel, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    high, middle, low = bfloat16_pieces(tl.load(w_ptr + offs, mask=mask, other=0.0))
    tl.store(pieces_ptr + offs, high, mask=mask)
    tl.store(pieces_ptr + (offs + numel), middle, mask=mask)
    tl.store(pieces_ptr + (offs + numel + numel), low, mask=mask)  # (2 * numel could pass int32)


def split_bfloat16_pieces(weight: torch.Tensor) -> torch.Tensor:
    """A contiguous float32 [N, K] weight as its three bfloat16 pieces stacked along N
    ([3N, K]: high, middle, low rows), so that one bfloat16 GEMM with float32 output
    against x gives x @ piece^T for each piece (`bfloat16_pieces`): exact products, each
    piece's sum rounded to float32."""
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"split_bfloat16_pieces takes a contiguous float32 weight, got {weight.dtype} "
                         f"(contiguous: {weight.is_contiguous()})")
    pieces = torch.empty((3 * weight.shape[0], weight.shape[1]), dtype=torch.bfloat16, device=weight.device)
    block = 1024
    _bfloat16_pieces_kernel[(triton.cdiv(weight.numel(), block),)](weight, pieces, weight.numel(), BLOCK=block,
                                                                     **pdl(weight))
    return pieces


@triton.jit
def row_tile_product(acc, x_ptr, w, rows, k, M, K, stride_xm, PRECISION: tl.constexpr,
                     WEIGHT_MAJOR: tl.constexpr = False):
    """acc + x[rows, k] @ w^T for a [BLOCK_N, BLOCK_K] weight tile (rows past M and columns
    past K read as zeros); PRECISION is tl.dot's for float32 inputs (half-precision ones
    ignore it). WEIGHT_MAJOR: acc is [BLOCK_N, rows] and gains w @ x[rows, k]^T instead.

    A bfloat16 x against a float32 weight (NemotronH's router; row-major only) takes the
    weight as the sum of its three bfloat16 pieces (`bfloat16_pieces`), each product exact
    in float32: three tensor-core dots in place of a float32 one, which runs on the CUDA
    cores (a 2.6x slower router kernel, measured).
    Any other mix converts x to w's dtype (exact for a half-precision x)."""
    x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K),
                other=0.0)
    # (one return at the end: Triton generates the code after a return in a constexpr branch too)
    if x.dtype == tl.bfloat16 and w.dtype == tl.float32:
        tl.static_assert(not WEIGHT_MAJOR, "a float32 weight takes the row-major product (skinny_linear)")
        high, middle, low = bfloat16_pieces(w)
        acc = tl.dot(x, tl.trans(high), acc)
        acc = tl.dot(x, tl.trans(middle), acc)
        acc = tl.dot(x, tl.trans(low), acc)
    elif WEIGHT_MAJOR:
        acc = acc + tl.dot(w, tl.trans(x.to(w.dtype)), input_precision=PRECISION)
    else:
        acc = acc + tl.dot(x.to(w.dtype), tl.trans(w), input_precision=PRECISION)
    return acc


@triton.jit
def _store_kv(y, rows, cols, M, kv_start, kv_width, head_dim, k_cache_ptr, v_cache_ptr, slot_ptr, block_size,
              stride_cb, stride_co, stride_ch):
    """The key and value columns of the rounded projection y at each row's cache slot, as
    `write_kv_cache` stores them: the kv_width columns from kv_start are the keys, the next
    kv_width the values (head by head); rows past M or with slot -1 write nothing."""
    slot = tl.load(slot_ptr + rows, mask=rows < M, other=-1).to(tl.int64)
    j = cols - kv_start
    is_k = (j >= 0) & (j < kv_width)
    is_v = (j >= kv_width) & (j < 2 * kv_width)
    j = tl.where(is_v, j - kv_width, tl.where(is_k, j, 0))
    live = (slot >= 0)[:, None]
    slot = tl.maximum(slot, 0)
    where = ((slot // block_size) * stride_cb + (slot % block_size) * stride_co)[:, None] \
        + ((j // head_dim) * stride_ch + j % head_dim)[None, :]
    tl.store(k_cache_ptr + where, y.to(k_cache_ptr.dtype.element_ty), mask=live & is_k[None, :])
    tl.store(v_cache_ptr + where, y.to(v_cache_ptr.dtype.element_ty), mask=live & is_v[None, :])


@triton.jit
def _store_rows(acc, b_ptr, y_ptr, rows, cols, M, N, stride_ym, HAS_BIAS: tl.constexpr,
                conv_start, conv_dim, conv_w_ptr, conv_b_ptr, states_ptr, src_ptr, dst_ptr,
                stride_cw, stride_slot, stride_sd, stride_sk,
                kv_start, kv_width, head_dim, k_cache_ptr, v_cache_ptr, slot_ptr, block_size,
                stride_cb, stride_co, stride_ch,
                CONV: tl.constexpr, CONV_K: tl.constexpr, CONV_BIAS: tl.constexpr, SILU: tl.constexpr,
                RELU_SQUARE: tl.constexpr, KV: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    if RELU_SQUARE:  # from the rounded projection, as the separate relu_square kernel reads it
        h = y.to(tl.float32)
        h = tl.where(h < 0, 0.0, h)  # (not maximum: a NaN stays NaN, as in torch.relu)
        y = (h * h).to(y_ptr.dtype.element_ty)
    if CONV:
        # The conv channels (columns conv_start ..) through the single-token conv update, from
        # the projection as stored, as the separate conv op reads it; padding rows (src slot
        # -1) get zeros there and touch no state. Other columns pass unchanged.
        src = tl.load(src_ptr + rows, mask=rows < M, other=-1)
        dst = tl.load(dst_ptr + rows, mask=rows < M, other=-1)
        d = cols - conv_start
        is_conv = (d >= 0) & (d < conv_dim)
        d = tl.where(is_conv, d, 0)
        live = ((src >= 0) & (dst >= 0))[:, None] & is_conv[None, :]
        zero_rows = rows[:, None] * 0  # pointers as [rows, columns] tensors, the mask's shape
        channel = d.to(tl.int64)[None, :] * stride_sd
        convolved = conv_update_channels(
            y, conv_w_ptr + d[None, :] * stride_cw + zero_rows, conv_b_ptr + d[None, :] + zero_rows,
            states_ptr + tl.maximum(src, 0).to(tl.int64)[:, None] * stride_slot + channel,
            states_ptr + tl.maximum(dst, 0).to(tl.int64)[:, None] * stride_slot + channel,
            stride_sk, live, CONV_K, CONV_BIAS, SILU)
        y = tl.where(is_conv[None, :], tl.where(live, convolved, 0.0).to(y.dtype), y)
    if KV:
        _store_kv(y, rows, cols, M, kv_start, kv_width, head_dim, k_cache_ptr, v_cache_ptr, slot_ptr, block_size,
                  stride_cb, stride_co, stride_ch)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def sum_slices(partial_ptr, rows, cols, M, N, ROWS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Split-K partial sums ([SPLIT_K, ROWS, N] float32) at rows < M and cols < N: slice 0
    plus slices 1.. in order (read from L2: other programs wrote them); zeros elsewhere."""
    ptrs = partial_ptr + rows[:, None] * N + cols[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    acc = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in range(1, SPLIT_K):
        acc += tl.load(ptrs + s * ROWS * N, mask=mask, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit(do_not_specialize=["M"])  # the row count changes every step: no recompiles
def _skinny_linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, partial_ptr, arrivals_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    conv_start, conv_dim, conv_w_ptr, conv_b_ptr, states_ptr, src_ptr, dst_ptr,
    stride_cw, stride_slot, stride_sd, stride_sk,
    kv_start, kv_width, head_dim, k_cache_ptr, v_cache_ptr, slot_ptr, block_size, stride_cb, stride_co, stride_ch,
    HAS_BIAS: tl.constexpr, ROW_TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, CONV: tl.constexpr, CONV_K: tl.constexpr, CONV_BIAS: tl.constexpr, SILU: tl.constexpr,
    RELU_SQUARE: tl.constexpr, KV: tl.constexpr, WEIGHT_MAJOR: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    col_tile = tl.program_id(0)
    rows = tl.arange(0, 16)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn  # (a vocabulary x hidden weight can pass 2^31 elements)
    ks = tl.arange(0, BLOCK_K)
    k_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = tl.program_id(1) * k_len
    k_stop = tl.minimum(k_start + k_len, K)
    if WEIGHT_MAJOR:
        acc0 = tl.zeros((BLOCK_N, 16), tl.float32)
        acc1 = tl.zeros((BLOCK_N, 16), tl.float32)
    else:
        acc0 = tl.zeros((16, BLOCK_N), tl.float32)
        acc1 = tl.zeros((16, BLOCK_N), tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        k = k0 + ks
        w = tl.load(w_rows + k[None, :], mask=(cols[:, None] < N) & (k[None, :] < k_stop), other=0.0)
        acc0 = row_tile_product(acc0, x_ptr, w, rows, k, M, k_stop, stride_xm, "tf32", WEIGHT_MAJOR)
        if ROW_TILES == 2:
            acc1 = row_tile_product(acc1, x_ptr, w, rows + 16, k, M, k_stop, stride_xm, "tf32", WEIGHT_MAJOR)
    if WEIGHT_MAJOR:
        acc0 = tl.trans(acc0)
        acc1 = tl.trans(acc1)
    last = True  # this program stores its column tile: the only one, or the last of its slices to arrive
    if SPLIT_K > 1:
        ROWS: tl.constexpr = 16 * ROW_TILES
        mine = partial_ptr + tl.program_id(1) * ROWS * N
        tl.store(mine + rows[:, None] * N + cols[None, :], acc0, mask=cols[None, :] < N)
        if ROW_TILES == 2:
            tl.store(mine + (rows + 16)[:, None] * N + cols[None, :], acc1, mask=cols[None, :] < N)
        tl.debug_barrier()  # every thread's partial is stored before the arrival releases them
        last = tl.atomic_add(arrivals_ptr + col_tile, 1, sem="acq_rel") == SPLIT_K - 1
        if last:
            acc0 = sum_slices(partial_ptr, rows, cols, M, N, ROWS, SPLIT_K)
            if ROW_TILES == 2:
                acc1 = sum_slices(partial_ptr, rows + 16, cols, M, N, ROWS, SPLIT_K)
    if last:
        for tile in tl.static_range(ROW_TILES):
            _store_rows(acc0 if tile == 0 else acc1, b_ptr, y_ptr, rows + 16 * tile, cols, M, N, stride_ym, HAS_BIAS,
                        conv_start, conv_dim, conv_w_ptr, conv_b_ptr, states_ptr, src_ptr, dst_ptr, stride_cw,
                        stride_slot, stride_sd, stride_sk, kv_start, kv_width, head_dim, k_cache_ptr, v_cache_ptr,
                        slot_ptr, block_size, stride_cb, stride_co, stride_ch, CONV, CONV_K, CONV_BIAS, SILU,
                        RELU_SQUARE, KV)
        if SPLIT_K > 1:
            tl.atomic_xchg(arrivals_ptr + col_tile, 0)  # ready for the next call


@functools.lru_cache(maxsize=None)
def tiling(n: int, k: int) -> Tiling:
    """The tiling of an [n, k] weight, from its shape alone (so a row's result does not
    depend on how many rows come with it). A short weight no deeper than wide (k <= SHORT_K,
    k <= n) with fewer than MIN_COLUMN_TILES tiles of 64 columns: unsplit, in 32-column tiles
    if that makes MIN_COLUMN_TILES, else in 16-column tiles with 256-column K steps.
    Otherwise 32-column tiles up to 1,024 columns or for a deep
    weight (n < k <= 4,096), else 64; K slices doubled while the grid stays within
    MAX_SPLIT_PROGRAMS programs and K / slices stays at MIN_SLICE columns or more (the
    kernel rounds each slice up to whole K steps, so the last one can be shorter, even
    empty); a deep weight with fewer than 96 column tiles then takes more slices if that
    brings its grid nearer DEEP_TARGET_PROGRAMS (any count, not only powers of two, each of
    DEEP_MIN_SLICE columns or more); 256-column K steps where K / slices is 4,096 or more
    columns in whole steps, else 128. A 64-column weight of K >= DEEP_WIDE_K with
    DEEP_WIDE_MIN_TILES to MANY_COLUMN_TILES column tiles reads K in 64-column steps
    instead; other 64-column weights take the weight-major product where their K steps are
    256 columns, or, unsplit, where they have at most SM_COUNT or at least MANY_COLUMN_TILES
    column tiles.
    Fitted on the presets' projections at 1 and 32 rows (H100 graph chains; the deep, short,
    weight-major and 64-column-step rules on the H200; docs/kernels.md, "Few-row
    projections")."""
    if k <= min(n, SHORT_K) and triton.cdiv(n, 64) < MIN_COLUMN_TILES:
        if triton.cdiv(n, 32) >= MIN_COLUMN_TILES:
            return Tiling(32, 128, 1)
        return Tiling(16, 256, 1)
    deep = n < k <= 4096
    block_n = 32 if n <= 1024 or deep else 64
    col_tiles = triton.cdiv(n, block_n)
    split = 1
    while 2 * split * col_tiles <= MAX_SPLIT_PROGRAMS and k // (2 * split) >= MIN_SLICE:
        split *= 2
    if deep and col_tiles < 96:
        split = max(split, min(triton.cdiv(DEEP_TARGET_PROGRAMS, col_tiles), k // DEEP_MIN_SLICE))
    slice_k = k // split
    block_k = 256 if slice_k % 256 == 0 and slice_k >= 4096 else 128
    if block_n == 64 and k >= DEEP_WIDE_K and DEEP_WIDE_MIN_TILES <= col_tiles < MANY_COLUMN_TILES:
        return Tiling(64, 64, 1)  # (unsplit: past 128 tiles nothing splits)
    weight_major = block_n == 64 and (block_k == 256 or split == 1 and (col_tiles <= SM_COUNT
                                                                         or col_tiles >= MANY_COLUMN_TILES))
    return Tiling(block_n, block_k, split, weight_major)


def takes_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear` runs the skinny kernel: 1 to MAX_ROWS rows of bf16/fp16 activations
    whose width is the weight's K, a row-major weight of their dtype, and no bias or a
    contiguous [N] one of their dtype (anything else, errors included, is `F.linear`'s).
    Past one row tile, a weight no deeper than it is wide (K <= N) stays with cuBLAS unless
    it is read in whole 64-column slabs: with K split, or narrower tiles, each program
    re-reads the rows about as many bytes as its weight, and cuBLAS measured faster."""
    if weight.dim() != 2 or x.dim() == 0 or not 0 < x.numel() <= MAX_ROWS * x.shape[-1]:
        return False  # (first: a prompt step's many rows are turned away at once)
    n, k = weight.shape
    bias_ok = bias is None or (bias.dtype == x.dtype and bias.shape == (n,) and bias.stride(0) == 1)
    if not (x.dtype in _DTYPES and weight.dtype == x.dtype and x.shape[-1] == k and weight.stride(-1) == 1
            and bias_ok):
        return False
    return x.numel() <= ROW_TILE * k or k > n or tiling(n, k).whole_wide_slabs


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) (see `KernelOps.linear`): the skinny kernel with `tiling`'s
    tiles where `takes_kernel`, else `F.linear`."""
    return _linear_in(x, weight, bias, tiling(*weight.shape))


def _linear_in(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: Tiling) -> torch.Tensor:
    """`linear` with the given tiles for the rows the kernel takes."""
    if not takes_kernel(x, weight, bias):
        return F.linear(x, weight, bias)
    return skinny_linear(x, weight, bias, tiles)


def linear_relu_square(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """relu(x @ weight^T (+ bias))^2 (see `KernelOps.linear_relu_square`): the skinny kernel
    squares in its store where `takes_kernel`, else `F.linear` and then the relu^2 kernel;
    both round alike, bit for bit."""
    if not takes_kernel(x, weight, bias):
        return relu_square(F.linear(x, weight, bias))
    return skinny_linear(x, weight, bias, tiling(*weight.shape), relu_squared=True)


@dataclass(frozen=True)
class ConvUpdate:
    """The conv update `skinny_linear` applies to output columns [start, start + D) of each
    row (`KernelOps.linear_conv_update`): conv weight [D, K] (unit tap stride), bias [D] or
    None, the state pool and each row's src / dst slot."""

    start: int
    weight: torch.Tensor
    bias: torch.Tensor | None
    states: torch.Tensor
    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    silu: bool


def linear_conv_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_start: int,
                       conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, conv_states: torch.Tensor,
                       src_slots: torch.Tensor, dst_slots: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    """The projection and the conv update of its conv columns (see `KernelOps.linear_conv_update`):
    one kernel for up to CONV_EPILOGUE_ROWS rows that `takes_kernel` (the program that writes
    an output column convolves it), else `linear` followed by the conv update kernel writing
    in place. Both round alike, bit for bit."""
    silu = check_activation(activation)
    if x.dim() != 2:
        raise ValueError(f"linear_conv_update: x must be [rows, K] (one decode token per row), got {tuple(x.shape)}")
    # The row-major product at every row count: with the conv epilogue the weight-major one
    # was slower (granite-4.0-h-tiny's in_proj 8.89 against 8.78 us; docs/benchmarks.md,
    # session 31), and one product order for all batch sizes keeps a row's bits independent
    # of its batch by construction.
    tiles = replace(tiling(*weight.shape), weight_major=False)
    if x.shape[0] > CONV_EPILOGUE_ROWS or not takes_kernel(x, weight, bias):
        y = _linear_in(x, weight, bias, tiles)
        columns = y[:, conv_start:conv_start + conv_weight.shape[0]]
        conv_update_into(columns, conv_weight, conv_bias, conv_states, src_slots, dst_slots, silu, columns)
        return y
    conv = ConvUpdate(conv_start, unit_last_stride(conv_weight), conv_bias, conv_states, src_slots, dst_slots, silu)
    return skinny_linear(x, weight, bias, tiles, conv)


@dataclass(frozen=True)
class KVWrite:
    """The KV cache write `skinny_linear` applies to output columns [start, start + 2W) of
    each row, W = kv_heads * head_dim (`KernelOps.linear_write_kv`): the caches
    ([blocks, block_size, kv_heads, head_dim], one layout, unit last stride) and each row's
    slot."""

    start: int
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor


def linear_write_kv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kv_start: int,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """The stacked q/k/v projection and the KV cache write of its key and value columns (see
    `KernelOps.linear_write_kv`): one kernel for the rows `takes_kernel` takes into caches of
    one layout (the program that stores a key or value column stores it at its slot too),
    else `linear`, then the write kernel. Both write the same bits."""
    if x.dim() != 2:
        raise ValueError(f"linear_write_kv: x must be [rows, K], got {tuple(x.shape)}")
    kv_width(weight.shape[0], kv_start, k_cache)
    if not takes_kernel(x, weight, bias) or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        y = linear(x, weight, bias)
        write_kv_cache(*kv_columns(y, kv_start, k_cache), k_cache, v_cache, slot_mapping)
        return y
    return skinny_linear(x, weight, bias, tiling(*weight.shape), kv=KVWrite(kv_start, k_cache, v_cache, slot_mapping))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: Tiling,
                  conv: ConvUpdate | None = None, relu_squared: bool = False,
                  out_dtype: torch.dtype | None = None, kv: KVWrite | None = None) -> torch.Tensor:
    """The skinny kernel with the given tiles, for inputs `takes_kernel` accepts (benchmarks
    and tests sweep tilings through it) and for a bfloat16 x against a float32 weight
    (NemotronH's router: exact products, `row_tile_product`), with `conv`'s update of the
    conv columns if given, `kv`'s cache write of the key and value columns if given, and
    relu^2 of every output if `relu_squared`. The output is in `out_dtype` (default x's):
    float32 keeps the float32 sums unrounded."""
    n, k = weight.shape
    if weight.dtype != x.dtype and not (x.dtype == torch.bfloat16 and weight.dtype == torch.float32):
        # (the kernel's dots are tf32 for float32 operands: an fp16 x would round the weight)
        raise ValueError(f"skinny_linear: a {weight.dtype} weight takes a bfloat16 x or its own dtype, "
                         f"not {x.dtype}")
    if tiles.weight_major and weight.dtype != x.dtype:
        raise ValueError(f"skinny_linear: a {weight.dtype} weight against a {x.dtype} x takes the row-major "
                         f"product (tiles.weight_major False; {tiles})")
    if x.numel() == 0 or (tiles.split > 1 and triton.cdiv(n, tiles.block_n) > MAX_ARRIVAL_COUNTERS):
        raise ValueError(f"skinny_linear: no rows, or a split weight of more than {MAX_ARRIVAL_COUNTERS} column "
                         f"tiles (one arrival counter each; {tiles})")
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    row_tiles = triton.cdiv(rows, ROW_TILE)
    out = torch.empty((rows, n), dtype=out_dtype or x.dtype, device=x.device)
    split = tiles.split > 1  # unsplit: no partials (`out` stands in for the unused pointer)
    partials = torch.empty((tiles.split, row_tiles * ROW_TILE, n), dtype=torch.float32, device=x.device) if split else out
    if conv is None:  # (`out` stands in for the unused pointers)
        conv_args = (0, 0, out, out, out, out, out, 0, 0, 0, 0)
        conv_k, conv_bias = 2, False
    else:
        conv_args = (conv.start, conv.weight.shape[0], conv.weight, conv.bias if conv.bias is not None else conv.weight,
                     conv.states, conv.src_slots, conv.dst_slots, conv.weight.stride(0), *conv.states.stride())
        conv_k, conv_bias = conv.weight.shape[1], conv.bias is not None
    if kv is None:  # (likewise)
        kv_args = (0, 0, 1, out, out, out, 1, 0, 0, 0)
    else:
        _, block_size, kv_heads, head_dim = kv.k_cache.shape
        kv_args = (kv.start, kv_heads * head_dim, head_dim, kv.k_cache, kv.v_cache, kv.slot_mapping, block_size,
                   *kv.k_cache.stride()[:3])
    _skinny_linear_kernel[(triton.cdiv(n, tiles.block_n), tiles.split)](
        flat, weight, bias if bias is not None else weight, out, partials, arrival_counters(x.device), rows, n, k,
        flat.stride(0), weight.stride(0), out.stride(0), *conv_args, *kv_args,
        HAS_BIAS=bias is not None, ROW_TILES=row_tiles, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        SPLIT_K=tiles.split, CONV=conv is not None, CONV_K=conv_k, CONV_BIAS=conv_bias,
        SILU=conv is not None and conv.silu, RELU_SQUARE=relu_squared, KV=kv is not None,
        WEIGHT_MAJOR=tiles.weight_major, num_warps=4, num_stages=4,
        # No FMA contraction (only the epilogues have products to contract): they round as
        # the conv and relu^2 kernels do, bit for bit.
        enable_fp_fusion=False, **pdl(flat),
    )
    return out.view(*x.shape[:-1], n)
