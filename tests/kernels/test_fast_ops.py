"""Fast (Triton) ops against the reference ops, on seeded random inputs.

Run on a GPU: `python -m pytest tests/kernels -m gpu -q`. Without CUDA these tests skip,
unless TRITON_INTERPRET=1, which runs the own Triton kernels on the CPU through Triton's
interpreter (slow; float16 stands in for bfloat16 there because the interpreter's bf16
dot is wrong).

State pools are poisoned with NaN at the slots an op must write, and every slot the op
must not write is compared bit for bit afterwards. The MoE ops (routers, fused experts) have
their own file, test_fused_moe.py; the decode-step capture below includes them.
"""
import os
import zlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from layers.kernels import OP_NAMES
from layers.kernels import reference as ref
from layers.kernels.ops import StateSaves
from layers.kernels.reference.attention import kv_columns

pytestmark = pytest.mark.gpu
RUNS_IN_TRITON_INTERPRETER = True  # conftest: TRITON_INTERPRET=1 runs these on the CPU

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if torch.cuda.is_available():
    DEVICE = "cuda"
elif INTERPRET:
    DEVICE = "cpu"
else:
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1 for a slow CPU run)", allow_module_level=True)

import triton  # noqa: E402

from layers.kernels.triton import (activation, attention, conv1d, device, linear, moe, moe_routing, norm,  # noqa: E402
                                  sampling, ssm_update)

LOW = torch.float16 if INTERPRET else torch.bfloat16
DTYPES = [LOW, torch.float32]
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}


@pytest.fixture(autouse=True)
def fixed_seed(request: pytest.FixtureRequest) -> None:
    """A fixed seed per test case (from its id): every run sees the same inputs, and the
    cases differ from each other."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.double(), expected.double()
    return ((out - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert out.shape == expected.shape
    assert not torch.isnan(out).any(), "NaN in output: an element was not written or read poison"
    err = rel_err(out, expected)
    assert err < tol, f"relative error {err:.3g} >= {tol}"


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def exact_logits(logits: torch.Tensor, hidden: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [T, hidden], router weight [E, hidden]) whose product is exactly `logits` [T, E]
    in any summation order: x's rows are one-hot, so each logit is one product and zeros.
    Row t's one is at the middle of the t-th of T equal column ranges, so the rows' logits
    lie in different K slices of a split-K router GEMM (a slice left out changes them)."""
    tokens, experts = logits.shape
    hidden = max(hidden, tokens)
    columns = (torch.arange(tokens, device=logits.device) * 2 + 1) * hidden // (2 * tokens)
    x = torch.zeros(tokens, hidden, device=logits.device, dtype=logits.dtype)
    x[torch.arange(tokens, device=logits.device), columns] = 1
    weight = torch.zeros(experts, hidden, device=logits.device, dtype=logits.dtype)
    weight[:, columns] = logits.t()
    return x, weight


def slot_plan(padded: list[bool], in_place: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(src, dst, valid, num_slots): distinct slots per row (dst == src when in place), -1 for padding rows."""
    rows = len(padded)
    num_slots = 2 * rows + 3
    perm = torch.randperm(num_slots, device=DEVICE)
    src, dst = perm[:rows].clone(), (perm[:rows] if in_place else perm[rows:2 * rows]).clone()
    valid = ~torch.tensor(padded, dtype=torch.bool, device=DEVICE)
    src[~valid] = -1
    dst[~valid] = -1
    return src, dst, valid, num_slots


def every_third_padded(rows: int) -> list[bool]:
    return [i % 3 == 1 for i in range(rows)]


def check_pool(pool: torch.Tensor, expected_pool: torch.Tensor, written: torch.Tensor, tol: float) -> None:
    """Written slots close to the reference, all other slots untouched (bit-exact)."""
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    untouched[written] = False
    assert torch.equal(pool[untouched], expected_pool[untouched]), "a slot not named was modified"
    assert_close(pool[written], expected_pool[written], tol)


# ---------------------------------------------------------------- norms


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,dim,group", [(1, 512, 128), (7, 288, 96), (64, 1024, 1024)])
def test_gated_rms_norm(dtype: torch.dtype, tokens: int, dim: int, group: int) -> None:
    x = randn(tokens, dim, dtype=dtype)
    z = randn(tokens, 2 * dim, dtype=dtype)[:, dim:]  # strided view, as the mixer passes it
    for weight in (randn(dim, dtype=dtype), randn(dim)):
        out = norm.gated_rms_norm(x, z, weight, 1e-5, group)
        expected = ref.gated_rms_norm(x, z, weight, 1e-5, group)
        assert out.dtype == expected.dtype
        assert_close(out, expected, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_in_fp32", [True, False])
@pytest.mark.parametrize("shape", [(1, 4096), (3, 5, 100)])
def test_rms_norm(dtype: torch.dtype, weight_in_fp32: bool, shape: tuple[int, ...]) -> None:
    x = randn(*shape, dtype=dtype)
    weight = randn(shape[-1])
    out = norm.rms_norm(x, weight, 1e-6, weight_in_fp32)
    expected = ref.rms_norm(x, weight, 1e-6, weight_in_fp32)
    assert out.dtype == expected.dtype
    assert_close(out, expected, TOL[dtype])


# ---------------------------------------------------------------- activation


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (3, 4096), (33, 1000)])  # (the last spans several blocks, ragged)
def test_relu_square(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    x = randn(*shape, dtype=dtype, scale=3.0)
    x[0, 0] = float("nan")  # relu keeps a NaN (a clamp to 0 would hide it)
    expected = torch.square(F.relu(x))
    out = activation.relu_square(x)
    assert out.data_ptr() == x.data_ptr()  # in place
    assert torch.equal(out.isnan(), expected.isnan()) and out.isnan().sum() == 1
    assert torch.equal(out.nan_to_num(), expected.nan_to_num())  # squared in float32, rounded once: bit-exact
    assert (x < 0).sum() == 0 and (expected == 0).any()
    with pytest.raises(ValueError, match="contiguous"):
        activation.relu_square(randn(8, 8, dtype=dtype).t())


# ---------------------------------------------------------------- sampling

# Divisors whose quotient torch rounds alike on the CPU (true division) and on the GPU
# (times the float32 reciprocal, which the kernel copies): powers of two under the
# interpreter; on the GPU also Granite's 6 and an inexact one.
DIVISORS = [None, 0.5, 4, -2] if INTERPRET else [None, 0.5, 6, 0.37, -3]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("divisor", DIVISORS)
@pytest.mark.parametrize("rows, vocab", [(1, 1000), (5, 3001), (33, 2500), (70, 1500), (3, 131072), (4097, 40)])
def test_logits_argmax(dtype: torch.dtype, divisor: float | None, rows: int, vocab: int) -> None:
    """Bit-exact torch.argmax of the scaled float logits: many ties (values rounded to
    integers), a row with NaNs (the first one wins), a row of -inf (index 0), a row of equal
    values, a row whose maximum (minimum, for a negative divisor) sits in its last entry; a
    row-strided view; a ragged last chunk, several chunks per row, several row tiles (each
    reduced by its own last program) and, at 4097 rows, past MAX_ROWS (the reference)."""
    wide = (randn(rows, vocab + 7, scale=4.0).round()).to(dtype)
    logits = wide[:, :vocab]
    logits[0, vocab - 1] = 1e4 if divisor is None or divisor > 0 else -1e4
    if rows > 2:
        logits[1, [vocab // 2, 17, vocab - 3]] = float("nan")
        logits[2] = float("-inf")
        logits[rows - 1] = 3.0
    out = sampling.logits_argmax(logits, divisor)
    expected = ref.logits_argmax(logits, divisor)
    assert out.dtype == torch.int64 and torch.equal(out, expected)
    assert out[0] == vocab - 1
    if rows > 2:
        assert out[1] == 17 and out[2] == 0 and out[rows - 1] == 0
    assert not device.arrival_counters(logits.device).any()  # left zero for the next kernel


def test_logits_argmax_falls_back_to_the_reference() -> None:
    """Shapes the kernel does not take (1-D, no rows, an integer dtype) give the reference's
    answer."""
    for logits in (randn(50, dtype=LOW), randn(0, 40, dtype=LOW), torch.randint(0, 9, (3, 40), device=DEVICE)):
        assert torch.equal(sampling.logits_argmax(logits), ref.logits_argmax(logits))


# ---------------------------------------------------------------- linear


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33])  # 33: past MAX_ROWS, F.linear
@pytest.mark.parametrize("shape", [(40000, 300), (100, 300), (64, 1536), (1536, 3072), (1664, 1600), (2600, 1024),
                                   (640, 512)])  # (N, K)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(rows: int, shape: tuple[int, int], with_bias: bool) -> None:
    """Every tiling kind (wide, narrow with one slice, deep and square ones with K split,
    short ones unsplit in 32- and 16-column tiles) with and without bias, ragged tiles
    included, against float32; 17-32 rows of a weight with K <= N not read in whole
    64-column slabs (1664 x 1600 split, 2600 x 1024 and 640 x 512 narrow) stay with F.linear."""
    n, k = shape
    x = randn(rows, k, dtype=LOW)
    weight = randn(n, k, dtype=LOW, scale=k ** -0.5)
    bias = randn(n, dtype=LOW) if with_bias else None
    cublas_past_one_tile = k <= n and not linear.tiling(n, k).whole_wide_slabs
    assert linear.takes_kernel(x, weight, bias) == (rows <= 16 or (rows <= linear.MAX_ROWS and not cublas_past_one_tile))
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    out = linear.linear(x, weight, bias)
    assert out.dtype == LOW
    assert_close(out.float(), expected, TOL[LOW])
    # Leading dims and a strided row view keep their meaning.
    batched = randn(2, rows, 2 * k, dtype=LOW)[..., :k]
    assert_close(linear.linear(batched, weight, bias).float(),
                 F.linear(batched.float(), weight.float(), None if bias is None else bias.float()), TOL[LOW])


def test_linear_tiling() -> None:
    """Narrow weights split K (into slices of at least MIN_SLICE columns, within
    MAX_SPLIT_PROGRAMS programs), wide ones never do; a deep weight (N < K <= 4,096) of few
    column tiles takes more slices, toward DEEP_TARGET_PROGRAMS programs; 256-column K steps
    only for slices of 4,096 columns or more in whole steps, 64-column ones for 64-column
    weights of K >= 4,096 with 256 to 511 column tiles; a short weight no deeper than wide
    that 64-column tiles cut into few tiles is read unsplit in narrower ones; 64-column
    tilings take the weight-major product with 256-column K steps, or unsplit with at most
    one column tile per SM or very many (MANY_COLUMN_TILES)."""
    assert linear.tiling(100352, 1536) == linear.Tiling(64, 128, 1, weight_major=True)  # 1,568 tiles: many
    assert linear.tiling(4096, 1024) == linear.Tiling(32, 128, 1)  # 64 tiles of 64 columns, 128 of 32
    assert linear.tiling(2560, 1536) == linear.Tiling(32, 128, 1)
    assert linear.tiling(1536, 1024) == linear.Tiling(16, 256, 1)  # 48 tiles of 32 columns: 16 wide
    assert linear.tiling(1024, 1024) == linear.Tiling(16, 256, 1)
    assert linear.tiling(6176, 1024) == linear.Tiling(64, 128, 1, weight_major=True)  # 97 tiles: one per SM at most
    assert linear.tiling(10304, 2688) == linear.Tiling(64, 128, 1)  # 161 tiles: more than the SMs, not many
    assert linear.tiling(2048, 2048) == linear.Tiling(64, 128, 4)  # longer than SHORT_K: split as before
    assert [t.whole_wide_slabs for t in (linear.Tiling(64, 128, 1), linear.Tiling(64, 64, 1, weight_major=True),
                                         linear.Tiling(64, 128, 4), linear.Tiling(32, 128, 1),
                                         linear.Tiling(16, 256, 1))] == [True, True, False, False, False]
    assert linear.tiling(256, 2688) == linear.Tiling(32, 128, 8)
    assert linear.tiling(18560, 4096) == linear.Tiling(64, 64, 1)  # 290 tiles, K 4,096: 64-column K steps
    assert linear.tiling(21504, 4096) == linear.Tiling(64, 64, 1)  # 336 tiles
    assert linear.tiling(131072, 4096) == linear.Tiling(64, 256, 1, weight_major=True)  # 2,048 tiles: many
    assert linear.tiling(6144, 4096) == linear.Tiling(64, 256, 1, weight_major=True)  # 96 tiles: 256-column steps
    assert linear.tiling(4096, 8192) == linear.Tiling(64, 256, 2, weight_major=True)  # deeper than 4,096: not deep
    assert linear.tiling(100, 300) == linear.Tiling(32, 128, 1)  # a slice would be under MIN_SLICE
    # Deep: 48 and 84 column tiles of 32 in 5 and 3 slices (240 and 252 programs), 32 tiles in 8.
    assert linear.tiling(1536, 3072) == linear.Tiling(32, 128, 5)
    assert linear.tiling(2688, 4096) == linear.Tiling(32, 128, 3)
    assert linear.tiling(1024, 4096) == linear.Tiling(32, 128, 8)
    assert linear.tiling(1664, 1600) == linear.Tiling(64, 128, 4)  # square: not deep
    for n, k in ((1024, 1024), (4096, 21504), (6448, 1536), (64, 1536), (1536, 3072), (2688, 4096), (200, 1000)):
        tiles = linear.tiling(n, k)
        grid = triton.cdiv(n, tiles.block_n) * tiles.split
        assert k // tiles.split >= linear.MIN_SLICE
        assert tiles.split == 1 or triton.cdiv(n, tiles.block_n) <= device.MAX_ARRIVAL_COUNTERS
        assert tiles.split == 1 or grid <= max(linear.MAX_SPLIT_PROGRAMS,
                                               linear.DEEP_TARGET_PROGRAMS + triton.cdiv(n, tiles.block_n))


@pytest.mark.parametrize("tiles", [linear.Tiling(32, 64, split) for split in (1, 2, 3, 8)]
                         + [linear.Tiling(32, 64, 3, weight_major=True), linear.Tiling(64, 128, 1, weight_major=True),
                            linear.Tiling(64, 256, 2, weight_major=True), linear.Tiling(64, 64, 1)])
def test_linear_split_is_deterministic_and_leaves_counters_zero(tiles: linear.Tiling) -> None:
    """Any slice count (3: a ragged last slice), either product order and 64-column tiles
    with 64- and 256-column K steps give the float32 result, the same bits on a second call,
    and arrival counters back at zero for the next call. On the GPU a row's result is also
    the same bits alone as among 32 rows, and a weight-major tiling's result the same bits as
    the row-major one's (the interpreter's matmul is the host BLAS, whose rounding may depend
    on the row's place and the order)."""
    x = randn(32, 1000, dtype=LOW)
    weight = randn(200, 1000, dtype=LOW, scale=1000 ** -0.5)
    out = linear.skinny_linear(x, weight, None, tiles)
    assert_close(out.float(), F.linear(x.float(), weight.float()), TOL[LOW])
    assert torch.equal(linear.skinny_linear(x, weight, None, tiles), out)
    assert not device.arrival_counters(x.device).any()
    if not INTERPRET:
        for row in (0, 15, 16, 31):
            assert torch.equal(linear.skinny_linear(x[row:row + 1], weight, None, tiles)[0], out[row])
        if tiles.weight_major:
            row_major = replace(tiles, weight_major=False)
            for rows in (1, 16, 32):
                assert torch.equal(linear.skinny_linear(x[:rows], weight, None, row_major), out[:rows])


def test_skinny_linear_refuses_more_split_column_tiles_than_counters() -> None:
    """A split weight needs one arrival counter per column tile: 129 tiles of 32 are refused
    with the reason, and the same weight unsplit runs."""
    x, weight = randn(1, 512, dtype=LOW), randn(32 * (device.MAX_ARRIVAL_COUNTERS + 1), 512, dtype=LOW)
    with pytest.raises(ValueError, match="arrival counter"):
        linear.skinny_linear(x, weight, None, linear.Tiling(32, 128, 2))
    assert_close(linear.skinny_linear(x, weight, None, linear.Tiling(32, 128, 1)).float(),
                 F.linear(x.float(), weight.float()), TOL[LOW])


def test_linear_leaves_other_inputs_to_torch() -> None:
    """float32, a weight of another dtype, a bias that is strided or broadcast, and a width
    mismatch go to F.linear: its results bit for bit, its errors."""
    x, weight = randn(4, 64), randn(40000, 64)
    assert not linear.takes_kernel(x, weight, None)
    assert torch.equal(linear.linear(x, weight), F.linear(x, weight))
    low_x, low_w = x.to(LOW), weight.to(LOW)
    assert not linear.takes_kernel(low_x, weight, None)
    for bias in (randn(80000, dtype=LOW)[::2], randn(1, dtype=LOW)):
        assert not linear.takes_kernel(low_x, low_w, bias)
        assert torch.equal(linear.linear(low_x, low_w, bias), F.linear(low_x, low_w, bias))
    wrong_width = randn(4, 32, dtype=LOW)
    assert not linear.takes_kernel(wrong_width, low_w, None)
    with pytest.raises(RuntimeError):
        linear.linear(wrong_width, low_w)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33])  # 33: past MAX_ROWS, F.linear then the relu^2 kernel
@pytest.mark.parametrize("shape", [(4096, 1024), (700, 256), (1536, 3072)])  # (N, K): unsplit, ragged tile, split
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_relu_square(rows: int, shape: tuple[int, int], with_bias: bool) -> None:
    """The up projection with relu^2 in the kernel's store: bit for bit the projection and
    then the separate relu^2 kernel, and close to the reference; negative pre-activations
    come out as exact zeros."""
    n, k = shape
    x = randn(rows, k, dtype=LOW)
    weight = randn(n, k, dtype=LOW, scale=k ** -0.5)
    bias = randn(n, dtype=LOW) if with_bias else None
    out = linear.linear_relu_square(x, weight, bias)
    separate = activation.relu_square(linear.linear(x, weight, bias))
    assert out.dtype == LOW and out.shape == (rows, n)
    assert torch.equal(out, separate)
    expected = ref.linear_relu_square(x.float(), weight.float(), None if bias is None else bias.float())
    assert_close(out.float(), expected, TOL[LOW])
    assert (out[linear.linear(x, weight, bias) < 0] == 0).all()


def test_linear_relu_square_float32_and_nan() -> None:
    """Float32 takes `F.linear` and the relu^2 kernel: the reference's bits. A NaN input row
    stays NaN through the kernel's store (relu keeps NaN, as torch.relu does)."""
    x, weight = randn(3, 256), randn(512, 256, scale=256 ** -0.5)
    assert torch.equal(linear.linear_relu_square(x, weight), ref.linear_relu_square(x, weight))
    low_x = x.to(LOW)
    low_x[1] = float("nan")
    out = linear.linear_relu_square(low_x, weight.to(LOW))
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33])  # 17-32: F.linear or `linear`, then the conv kernel in place
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("shape,conv_start,conv_dim,silu", [((700, 256), 150, 400, True), ((200, 1000), 30, 130, False)])
def test_linear_conv_update(dtype: torch.dtype, rows: int, in_place: bool, shape: tuple[int, int], conv_start: int,
                            conv_dim: int, silu: bool) -> None:
    """The fused in_proj + conv update (an unsplit tiling with conv bias and SiLU, a split one
    with neither, the conv columns inside ragged column tiles) against the reference, and
    bit for bit the separate fast ops: the projection, then `causal_conv1d_update` of its
    conv columns. Padding rows get zeros in the conv columns and touch no state; the other
    columns are the projection's."""
    n, k = shape
    width = 4
    activation = "silu" if silu else None
    src, dst, valid, num_slots = slot_plan(every_third_padded(rows), in_place)
    states = randn(num_slots, conv_dim, width - 1, dtype=dtype)
    if not in_place:
        states[dst[valid]] = float("nan")
    x = randn(rows, k, dtype=dtype)
    weight, bias = randn(n, k, dtype=dtype, scale=k ** -0.5), randn(n, dtype=dtype)
    conv_w, conv_b = randn(conv_dim, width, dtype=dtype), (randn(conv_dim, dtype=dtype) if silu else None)
    initial = states.clone()
    expected_states, separate_states = states.clone(), states.clone()
    out = linear.linear_conv_update(x, weight, bias, conv_start, conv_w, conv_b, states, src, dst, activation)
    expected = ref.linear_conv_update(x, weight, bias, conv_start, conv_w, conv_b, expected_states, src, dst,
                                      activation)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert_close(out[valid].float(), expected[valid].float(), TOL[dtype])
    columns = slice(conv_start, conv_start + conv_dim)
    assert (out[~valid, columns] == 0).all()
    check_pool(states, expected_states, dst[valid], TOL[dtype])
    separate = linear.linear(x, weight, bias)
    separate[:, columns] = conv1d.causal_conv1d_update(separate[:, columns], conv_w, conv_b, separate_states, src,
                                                       dst, activation)
    assert torch.equal(out, separate)
    assert torch.equal(states[dst[valid]], separate_states[dst[valid]])
    if dtype != torch.float32 and linear.CONV_EPILOGUE_ROWS < rows <= linear.MAX_ROWS:  # the epilogue at two row tiles
        # Against the kernel's own projection at the same tiling (past 16 rows `linear` may
        # hand this weight to cuBLAS), then the conv update kernel.
        tiles = linear.tiling(n, k)
        epilogue_states, kernel_states = initial.clone(), initial.clone()
        kernel_separate = linear.skinny_linear(x, weight, bias, tiles)
        kernel_separate[:, columns] = conv1d.causal_conv1d_update(kernel_separate[:, columns], conv_w, conv_b,
                                                                  kernel_states, src, dst, activation)
        conv = linear.ConvUpdate(conv_start, conv_w, conv_b, epilogue_states, src, dst, silu)
        assert torch.equal(linear.skinny_linear(x, weight, bias, tiles, conv), kernel_separate)
        assert torch.equal(epilogue_states[dst[valid]], kernel_states[dst[valid]])


def test_linear_conv_update_takes_decode_rows_only() -> None:
    """x must be [rows, K]: one decode token per row."""
    with pytest.raises(ValueError, match="rows, K"):
        linear.linear_conv_update(randn(1, 2, 64, dtype=LOW), randn(96, 64, dtype=LOW), None, 0, randn(32, 4, dtype=LOW),
                                  None, randn(3, 32, 3, dtype=LOW), torch.zeros(2, dtype=torch.int64, device=DEVICE),
                                  torch.ones(2, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33])  # past 16 or 32 rows: F.linear, then the write kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim,k", [(4, 2, 32, 128), (3, 1, 24, 512)])
def test_linear_write_kv(dtype: torch.dtype, rows: int, heads: int, kv_heads: int, head_dim: int, k: int) -> None:
    """The q/k/v projection writing its keys and values to the cache (unsplit 16-column tiles;
    a deep split weight whose 24-wide heads straddle column tiles, with bias) against the
    reference, and bit for bit the separate fast ops: the projection, then `write_kv_cache`
    of its key and value columns, also in the weight-major product and in 64-column tiles.
    Rows with slot -1 write nothing; no other slot changes."""
    block_size, num_blocks = 16, 5
    n = (heads + 2 * kv_heads) * head_dim
    x = randn(rows, k, dtype=dtype)
    weight = randn(n, k, dtype=dtype, scale=k ** -0.5)
    bias = randn(n, dtype=dtype) if heads == 3 else None
    k_cache, v_cache = (randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:rows]
    slots[torch.tensor(every_third_padded(rows), device=DEVICE)] = -1
    kv_start = heads * head_dim
    caches = {name: (k_cache.clone(), v_cache.clone()) for name in ("fused", "reference", "separate")}
    out = linear.linear_write_kv(x, weight, bias, kv_start, *caches["fused"], slots)
    expected = ref.linear_write_kv(x, weight, bias, kv_start, *caches["reference"], slots)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert_close(out.float(), expected.float(), TOL[dtype])
    for cache, expected_cache, initial in zip(caches["fused"], caches["reference"], (k_cache, v_cache)):
        written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
        written[slots[slots >= 0]] = True
        flat, expected_flat = cache.view(-1, kv_heads, head_dim), expected_cache.view(-1, kv_heads, head_dim)
        assert torch.equal(flat[~written], initial.view(-1, kv_heads, head_dim)[~written])
        assert_close(flat[written].float(), expected_flat[written].float(), TOL[dtype])
    separate = linear.linear(x, weight, bias)
    attention.write_kv_cache(*kv_columns(separate, kv_start, k_cache), *caches["separate"], slots)
    assert torch.equal(out, separate)
    assert all(torch.equal(a, b) for a, b in zip(caches["fused"], caches["separate"]))
    if dtype != torch.float32 and rows <= linear.MAX_ROWS:  # the epilogue at one and two row tiles, other tilings
        # Against the kernel's own projection at the same tiling (past 16 rows `linear` may
        # hand this weight to cuBLAS), then the write kernel.
        rule = linear.tiling(n, k)
        for tiles in (replace(rule, weight_major=False), replace(rule, weight_major=True),
                      linear.Tiling(64, 128, 1, weight_major=True)):
            epilogue, kernel = (k_cache.clone(), v_cache.clone()), (k_cache.clone(), v_cache.clone())
            kernel_separate = linear.skinny_linear(x, weight, bias, tiles)
            attention.write_kv_cache(*kv_columns(kernel_separate, kv_start, k_cache), *kernel, slots)
            fused = linear.skinny_linear(x, weight, bias, tiles, kv=linear.KVWrite(kv_start, *epilogue, slots))
            assert torch.equal(fused, kernel_separate)
            assert all(torch.equal(a, b) for a, b in zip(epilogue, kernel))


def test_linear_write_kv_checks_its_columns() -> None:
    """x must be [rows, K], and the key and value columns must lie inside the projection."""
    x, weight = randn(2, 64, dtype=LOW), randn(128, 64, dtype=LOW)
    cache, slots = randn(2, 16, 1, 32, dtype=LOW), torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="rows, K"):
        linear.linear_write_kv(x[None], weight, None, 64, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="kv_start"):
        linear.linear_write_kv(x, weight, None, 72, cache, cache.clone(), slots)


# ---------------------------------------------------------------- conv1d


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 5, 64])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("with_bias", [True, False])
def test_causal_conv1d_update(dtype: torch.dtype, batch: int, in_place: bool, with_bias: bool) -> None:
    dim, width = 300, 4
    src, dst, valid, num_slots = slot_plan(every_third_padded(batch), in_place)
    states = randn(num_slots, dim, width - 1, dtype=dtype)
    if not in_place:
        states[dst[valid]] = float("nan")
    x = randn(batch, 2 * dim, dtype=dtype)[:, :dim]
    weight, bias = randn(dim, width, dtype=dtype), (randn(dim, dtype=dtype) if with_bias else None)
    expected_states = states.clone()
    expected = ref.causal_conv1d_update(x, weight, bias, expected_states, src, dst)
    out = conv1d.causal_conv1d_update(x, weight, bias, states, src, dst)
    assert_close(out[valid], expected[valid], TOL[dtype])
    assert (out[~valid] == 0).all()
    check_pool(states, expected_states, dst[valid], TOL[dtype])


def _varlen_plan(lens: list[int], padded: list[bool], in_place: bool, extra_tokens: int):
    rows = len(lens)
    src, dst, valid, num_slots = slot_plan(padded, in_place)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    tokens = int(cu[-1]) + extra_tokens
    tok_seq = torch.searchsorted(cu[1:], torch.arange(tokens, device=DEVICE, dtype=torch.int32), right=True)
    tok_valid = tok_seq < rows
    tok_valid[tok_valid.clone()] = valid[tok_seq[tok_valid]]
    return src, dst, valid, num_slots, cu, tokens, tok_valid


def _saves_plan(lens: list[int], valid: torch.Tensor, first_slot: int) -> tuple[StateSaves, torch.Tensor]:
    """States saved from inside every valid sequence of 2+ tokens, at offsets 1 (a window
    that reaches into the old state), the middle, and one before the end; their slots
    follow the sequences' own. Returns (saves, slots)."""
    cu, offsets = [0], []
    for length, ok in zip(lens, valid.tolist()):
        if ok and length >= 2:
            offsets += sorted({1, length // 2, length - 1})
        cu.append(len(offsets))
    slots = torch.arange(first_slot, first_slot + len(offsets), device=DEVICE)
    return StateSaves(torch.tensor(cu, dtype=torch.int32, device=DEVICE),
                      torch.tensor(offsets, dtype=torch.int32, device=DEVICE), slots), slots


VARLEN_CASES = [([1], [False]), ([2, 5, 1], [False, True, False]), ([37, 3, 130, 64], [False, False, False, True]),
                # enough sequences for several halvings of the kernels' token -> sequence search
                ([1, 4, 2, 1, 7, 3, 1, 1, 5, 2, 33], [False] * 9 + [True, False])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,padded", VARLEN_CASES)
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("with_saves", [False, True])
def test_causal_conv1d_varlen(dtype: torch.dtype, lens: list[int], padded: list[bool], in_place: bool,
                              with_saves: bool) -> None:
    """`with_saves`: states also written from inside the sequences (prefix-cache checkpoints)."""
    dim, width = 200, 4
    src, dst, valid, num_slots, cu, tokens, tok_valid = _varlen_plan(lens, padded, in_place, extra_tokens=3)
    saves, save_slots = _saves_plan(lens, valid, num_slots) if with_saves else (None, dst[:0])
    states = randn(num_slots + len(save_slots), dim, width - 1, dtype=dtype)
    states[save_slots] = float("nan")
    if not in_place:
        states[dst[valid]] = float("nan")
    x = randn(tokens, 3 * dim, dtype=dtype)[:, dim:2 * dim]
    weight, bias = randn(dim, width, dtype=dtype), randn(dim, dtype=dtype)
    expected_states = states.clone()
    expected = ref.causal_conv1d_varlen(x, weight, bias, expected_states, cu, src, dst, saves=saves)
    out = conv1d.causal_conv1d_varlen(x, weight, bias, states, cu, src, dst, saves=saves)
    assert_close(out[tok_valid], expected[tok_valid], TOL[dtype])
    assert (out[~tok_valid] == 0).all()
    check_pool(states, expected_states, torch.cat([dst[valid], save_slots]), TOL[dtype])


# ---------------------------------------------------------------- SSD / state update

SSM_SHAPES = [(8, 16, 2, 32), (128, 64, 8, 128)]  # (heads, head_dim, groups, state)
# (heads, head_dim, groups, state): the models' head_dim 64 / state 128, and odd sizes
# that exercise the channel and state masks.
SSD_SHAPES = [(8, 64, 2, 128), (128, 64, 8, 128), (6, 48, 3, 80)]


def _ssm_inputs(tokens: int, heads: int, head_dim: int, groups: int, state: int, dtype: torch.dtype):
    x = randn(tokens, heads, head_dim, dtype=dtype)
    dt = F.softplus(randn(tokens, heads) - 1.0)
    a = -torch.exp(randn(heads, scale=0.5))
    bc = randn(tokens, 2, groups, state, dtype=dtype)  # B and C as views of one buffer (strided)
    d_skip = randn(heads)
    return x, dt, a, bc[:, 0], bc[:, 1], d_skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 5, 64])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("shape", SSM_SHAPES)
@pytest.mark.parametrize("raw_dt", [False, True])
def test_ssm_state_update(dtype: torch.dtype, batch: int, in_place: bool, shape: tuple[int, int, int, int],
                          raw_dt: bool) -> None:
    if INTERPRET and shape[0] > 8:
        pytest.skip("too slow in the interpreter")
    heads, head_dim, groups, state = shape
    src, dst, valid, num_slots = slot_plan(every_third_padded(batch), in_place)
    states = randn(num_slots, heads, head_dim, state, scale=0.5)
    if not in_place:
        states[dst[valid]] = float("nan")
    x, dt, a, b, c, d_skip = _ssm_inputs(batch, heads, head_dim, groups, state, dtype)
    dt_bias = None
    if raw_dt:  # the model's decode path: raw projections in the model dtype, a strided slice
        dt = randn(batch, 2 * heads, dtype=dtype, scale=3.0)[:, ::2]  # spans softplus' linear and log ranges
        dt_bias = randn(heads)
    expected_states = states.clone()
    expected = ref.ssm_state_update(expected_states, x, dt, a, b, c, d_skip, src, dst, dt_bias)
    out = ssm_update.ssm_state_update(states, x, dt, a, b, c, d_skip, src, dst, dt_bias)
    assert_close(out[valid], expected[valid], TOL[dtype])
    assert (out[~valid] == 0).all()
    check_pool(states, expected_states, dst[valid], 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_ssm_state_update_checks_the_dt_limit(dtype: torch.dtype, batch: int) -> None:
    """With `dt_limit_hits`, the update flags the live rows with a head whose dt lies
    outside the limit (as the reference does, and as computed here), leaves the other
    entries as they were (a 1 is never cleared), and computes exactly what it computes
    without the check (the limit is not applied)."""
    heads, head_dim, groups, state = SSM_SHAPES[0]
    src, dst, valid, num_slots = slot_plan(every_third_padded(batch), False)
    states = randn(num_slots, heads, head_dim, state, scale=0.5)
    x, _, a, b, c, d_skip = _ssm_inputs(batch, heads, head_dim, groups, state, dtype)
    dt = randn(batch, heads, dtype=dtype, scale=3.0)
    dt_bias = randn(heads)
    limit = (0.01, 6.0)  # softplus(N(0, 9)) leaves it now and then: some rows flagged, most not
    dt_full = F.softplus(dt.float() + dt_bias)
    outside = ((dt_full < limit[0]) | (dt_full > limit[1])).any(1) & valid
    initial = torch.zeros(batch, dtype=torch.int32, device=DEVICE)
    initial[::4] = 1  # already set by an earlier layer
    expected_hits = torch.where(outside, 1, initial)
    if batch == 64:
        assert (outside & (initial == 0)).any() and not outside[valid].all(), "a case that flags some rows"
    hits, ref_hits = initial.clone(), initial.clone()
    unchecked_states, checked_states = states.clone(), states.clone()
    unchecked = ssm_update.ssm_state_update(unchecked_states, x, dt, a, b, c, d_skip, src, dst, dt_bias)
    out = ssm_update.ssm_state_update(checked_states, x, dt, a, b, c, d_skip, src, dst, dt_bias, limit, hits)
    ref.ssm_state_update(states.clone(), x, dt, a, b, c, d_skip, src, dst, dt_bias, limit, ref_hits)
    assert torch.equal(hits, expected_hits) and torch.equal(ref_hits, expected_hits)
    assert torch.equal(out, unchecked) and torch.equal(checked_states, unchecked_states)


def _check_ssd(dtype: torch.dtype, lens: list[int], padded: list[bool], in_place: bool,
               shape: tuple[int, int, int, int], dt_form: str = "processed", with_saves: bool = False) -> None:
    """The Triton SSD against the reference on one case: outputs, and every state slot."""
    from layers.kernels.triton import ssd

    heads, head_dim, groups, state = shape
    src, dst, valid, num_slots, cu, tokens, tok_valid = _varlen_plan(lens, padded, in_place, extra_tokens=2)
    saves, save_slots = _saves_plan(lens, valid, num_slots) if with_saves else (None, dst[:0])
    states = randn(num_slots + len(save_slots), heads, head_dim, state, scale=0.5)
    states[save_slots] = float("nan")
    if not in_place:
        states[dst[valid]] = float("nan")
    x, dt, a, b, c, d_skip = _ssm_inputs(tokens, heads, head_dim, groups, state, dtype)
    kwargs = {}
    if dt_form != "processed":  # the model's prefill path: the raw projection, a row-strided slice
        dt = randn(tokens, heads + 3, dtype=dtype, scale=3.0)[:, :heads]  # spans softplus' linear and log ranges
        kwargs["dt_bias"] = randn(heads)
        if "limit" in dt_form:
            kwargs["dt_limit"] = (0.3, 2.0)  # clamps a good share of softplus(N(0, 9)) from both sides
        if "masked" in dt_form:
            kwargs["dt_limit_mask"] = torch.rand(tokens, device=DEVICE) < 0.5
    hits = ref_hits = None
    if "masked" in dt_form:  # generated (unmasked) tokens' dt checked against the limit
        hits = torch.zeros(len(lens), dtype=torch.int32, device=DEVICE)
        ref_hits = hits.clone()
    expected_states = states.clone()
    expected = ref.ssd_chunk_scan_varlen(x, dt, a, b, c, d_skip, cu, expected_states, src, dst, **kwargs, saves=saves,
                                         dt_limit_hits=ref_hits)
    out = ssd.ssd_chunk_scan_varlen(x, dt, a, b, c, d_skip, cu, states, src, dst, **kwargs, saves=saves,
                                    dt_limit_hits=hits)
    assert_close(out[tok_valid], expected[tok_valid], TOL[dtype])
    assert (out[~tok_valid] == 0).all()
    check_pool(states, expected_states, torch.cat([dst[valid], save_slots]), TOL[dtype])
    if hits is not None:
        lo, hi = kwargs["dt_limit"]
        dt_full = F.softplus(dt.float() + kwargs["dt_bias"])
        outside = (((dt_full < lo) | (dt_full > hi)).any(1) & ~kwargs["dt_limit_mask"]).tolist()
        bounds = cu.tolist()
        expected_hits = [int(ok and any(outside[bounds[i]:bounds[i + 1]])) for i, ok in enumerate(valid.tolist())]
        assert hits.tolist() == expected_hits and ref_hits.tolist() == expected_hits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,padded", VARLEN_CASES)
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("shape", SSD_SHAPES)
def test_ssd_chunk_scan_varlen(dtype: torch.dtype, lens: list[int], padded: list[bool], in_place: bool,
                               shape: tuple[int, int, int, int]) -> None:
    _check_ssd(dtype, lens, padded, in_place, shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,padded", VARLEN_CASES)
@pytest.mark.parametrize("in_place", [False, True])
def test_ssd_chunk_scan_varlen_with_saves(dtype: torch.dtype, lens: list[int], padded: list[bool],
                                          in_place: bool) -> None:
    """States also written from inside the sequences (prefix-cache checkpoints): the scan
    restarts its blocks there, as the reference does, with the dt limit of prompt tokens."""
    _check_ssd(dtype, lens, padded, in_place, SSD_SHAPES[2], "raw+masked limit", with_saves=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,padded", VARLEN_CASES)
@pytest.mark.parametrize("dt_form", ["raw", "raw+masked limit", "raw+limit"])
def test_ssd_chunk_scan_varlen_raw_dt(dtype: torch.dtype, lens: list[int], padded: list[bool], dt_form: str) -> None:
    """dt as the model passes it: raw with dt_bias (softplus inside), with a dt limit on the
    masked tokens (the prompt tokens) or on every token."""
    _check_ssd(dtype, lens, padded, False, SSD_SHAPES[0], dt_form)


def compiled_variants(kernel) -> int:
    """How many specializations of a Triton kernel are compiled (over all devices)."""
    return sum(len(c[0] if isinstance(c, tuple) else c) for c in kernel.device_caches.values())


def at_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of `t` that starts `offset` rows into a larger buffer (as the prefill rows'
    slices start at the step's decode count)."""
    buffer = torch.zeros(offset + t.shape[0], *t.shape[1:], dtype=t.dtype, device=t.device)
    buffer[offset:] = t
    return buffer[offset:]


@pytest.mark.skipif(INTERPRET, reason="counts compiled kernels")
def test_prefill_ops_do_not_recompile_for_slices_at_the_decode_count() -> None:
    """A prefill step's slot lists and prompt mask are slices of the step buffer starting
    at the step's decode count, and its dt a slice of the in_proj output at the same row,
    so their 16-byte alignment can change from step to step. The conv and the SSD must not
    compile a specialization per alignment (each compile stalled serving for about a
    second) and must give the same results at every offset."""
    from layers.kernels.triton import ssd

    lens, dim, (heads, head_dim, groups, state) = [37, 3, 130], 200, SSD_SHAPES[2]
    src, dst, valid, num_slots, cu, tokens, _ = _varlen_plan(lens, [False] * 3, False, extra_tokens=0)
    conv_init, ssm_init = randn(num_slots, dim, 3, dtype=LOW), randn(num_slots, heads, head_dim, state)
    x_conv, weight = randn(tokens, dim, dtype=LOW), randn(dim, 4, dtype=LOW)
    x, _, a, b, c, d_skip = _ssm_inputs(tokens, heads, head_dim, groups, state, LOW)
    dt, dt_bias = randn(tokens, heads, dtype=LOW), randn(heads)
    mask = torch.rand(tokens, device=DEVICE) < 0.5
    kernels = (conv1d._conv_varlen_kernel, conv1d._conv_final_state_kernel, ssd._ssd_varlen_kernel)
    results, counts = [], []
    for offset in (0, 1, 2, 3, 16, 17):  # slots 8 bytes a row, dt 12 (6 heads), the mask 1
        conv_states, ssm_states = conv_init.clone(), ssm_init.clone()
        src_at, dst_at = at_offset(src, offset), at_offset(dst, offset)
        y_conv = conv1d.causal_conv1d_varlen(x_conv, weight, None, conv_states, cu, src_at, dst_at)
        y = ssd.ssd_chunk_scan_varlen(x, at_offset(dt, offset), a, b, c, d_skip, cu, ssm_states, src_at, dst_at,
                                      dt_bias=dt_bias, dt_limit=(0.0, 0.5), dt_limit_mask=at_offset(mask, offset))
        results.append((y_conv, conv_states, y, ssm_states))
        counts.append([compiled_variants(k) for k in kernels])
    assert all(n == counts[0] for n in counts), counts
    for other in results[1:]:
        assert all(torch.equal(u, v) for u, v in zip(results[0], other))


# ---------------------------------------------------------------- attention


def _paged_case(q_lens: list[int], seq_lens: list[int], block_size: int, heads: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype):
    """Cache filled with NaN except the keys each sequence owns; unused table entries point
    at a NaN block, so any read past seq_len shows up as NaN."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    max_blocks = max(blocks_per_seq) + 1
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_blocks - 1, device=DEVICE)  # block num_blocks-1 stays NaN
    tables = torch.full((len(seq_lens), max_blocks), num_blocks - 1, dtype=torch.int32, device=DEVICE)
    used = 0
    for s, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        tables[s, :nb] = perm[used:used + nb].int()
        used += nb
        slots = tables[s, torch.arange(n, device=DEVICE) // block_size].long() * block_size + \
            torch.arange(n, device=DEVICE) % block_size
        k_cache.view(-1, kv_heads, head_dim)[slots] = randn(n, kv_heads, head_dim, dtype=dtype)
        v_cache.view(-1, kv_heads, head_dim)[slots] = randn(n, kv_heads, head_dim, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = randn(int(cu[-1]), heads, head_dim, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables, lens, cu


ATTN_CASES = {
    # name: (q_lens, seq_lens, num_decode)
    "decode": ([1] * 8, [1, 16, 17, 64, 65, 300, 0, 1000], 8),
    "mixed": ([1, 1, 1, 5, 64, 130], [33, 1, 0, 40, 64, 200], 3),
    "prefill": ([1, 77, 3], [10, 77, 0], 0),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(ATTN_CASES))
@pytest.mark.parametrize("block_size", [16, 64])
# (head_dim 8: tiles padded to 16 columns, the least tl.dot takes; a tensor-parallel rank of
# the tiny test checkpoints has such heads)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 128), (4, 4, 64), (2, 1, 8)])
def test_paged_attention(dtype: torch.dtype, case: str, block_size: int, heads: int, kv_heads: int,
                         head_dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    q_lens, seq_lens, num_decode = ATTN_CASES[case]
    q, k_cache, v_cache, tables, lens, cu = _paged_case(q_lens, seq_lens, block_size, heads, kv_heads, head_dim, dtype)
    scale = head_dim ** -0.5
    expected = ref.paged_attention(q, k_cache, v_cache, tables, lens, cu, scale)
    # A decode-only step's output is not zero-filled first: allocated as NaN here, an output
    # row the kernels leave unwritten shows up.
    monkeypatch.setattr(torch, "empty_like", lambda t, **kwargs: torch.full_like(t, float("nan"), **kwargs))
    for max_q in (max(q_lens[num_decode:], default=1), None):
        out = attention.paged_attention(q, k_cache, v_cache, tables, lens, cu, scale, max_seqlen_q=max_q,
                                        num_decode=num_decode)
        assert_close(out, expected, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 64])
def test_write_kv_cache(dtype: torch.dtype, block_size: int) -> None:
    kv_heads, head_dim, num_blocks, tokens = 2, 96, 6, 20
    k_cache = randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    # Distinct slots (two tokens on one slot would race): a permutation without the two
    # block-boundary slots that rows 1 and 2 take.
    pool = torch.randperm(num_blocks * block_size, device=DEVICE)
    slots = pool[(pool != block_size - 1) & (pool != block_size)][:tokens].clone()
    slots[[0, 7, 19]] = -1
    slots[1] = block_size - 1  # last offset of block 0, then the first of block 1
    slots[2] = block_size
    kv = randn(tokens, 2, kv_heads, head_dim, dtype=dtype)
    k, v = kv[:, 0], kv[:, 1]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    ref.write_kv_cache(k, v, expected_k, expected_v, slots)
    attention.write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


# ---------------------------------------------------------------- backend / CUDA graphs


def test_available_ops_has_every_family() -> None:
    """With Triton present every family imports: every op is fast."""
    from layers.kernels import fast

    assert set(fast.available_ops()) == set(OP_NAMES)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA")
def test_decode_ops_capture_in_cuda_graph() -> None:
    """One decode step's ops captured once, replayed on new inputs, checked against the reference."""
    batch, heads, kv_heads, head_dim, block_size = 6, 8, 2, 128, 16
    src, dst, valid, num_slots = slot_plan(every_third_padded(batch), in_place=False)
    dim, width = 256, 4
    conv_states = randn(num_slots, dim, width - 1, dtype=torch.bfloat16)
    ssm_states = randn(num_slots, 8, 16, 32, scale=0.5)
    conv_w = randn(dim, width, dtype=torch.bfloat16)
    conv_x = randn(batch, dim, dtype=torch.bfloat16)
    x, dt, a, b, c, d_skip = _ssm_inputs(batch, 8, 16, 2, 32, torch.bfloat16)
    # Every sequence owns 80 keys; the step's lengths (captured, then replayed) use a prefix.
    q, k_cache, v_cache, tables, lens, cu = _paged_case([1] * batch, [80] * batch, block_size, heads, kv_heads,
                                                        head_dim, torch.bfloat16)
    lens.copy_(torch.tensor([5, 70, 0, 16, 17, 33], dtype=torch.int32, device=DEVICE))
    mx = randn(batch, 128, dtype=torch.bfloat16)
    w_up = randn(8, 96, 128, dtype=torch.bfloat16, scale=0.1)
    w_down = randn(8, 128, 96, dtype=torch.bfloat16, scale=0.1)
    weights, ids = torch.softmax(randn(batch, 2), dim=-1), torch.rand(batch, 8, device=DEVICE).argsort(dim=1)[:, :2]
    # Router inputs whose logits are exact in any summation order (one-hot rows, in
    # different K slices of the 1,024-wide router GEMM), so the ids can be compared exactly:
    # replays change the router weight, which holds the logits.
    route_x, router_w = exact_logits(torch.zeros(batch, 8, device=DEVICE, dtype=torch.bfloat16))
    bias = randn(8)
    proj_x, proj_w = randn(batch, 1000, dtype=torch.bfloat16), randn(200, 1000, dtype=torch.bfloat16, scale=0.03)
    proj_states = randn(num_slots, 130, width - 1, dtype=torch.bfloat16)
    proj_conv_w = randn(130, width, dtype=torch.bfloat16)
    assert linear.tiling(200, 1000).split > 1  # the conv epilogue behind the split-K fix-up
    lm_out = randn(batch, 3000, dtype=torch.bfloat16, scale=4.0)
    # q/k/v of 2 + 1 + 1 heads of 32 (the KV write behind the split-K fix-up) into 4 blocks of 16 slots.
    qkv_w = randn(128, 1000, dtype=torch.bfloat16, scale=0.03)
    kv_caches = [randn(4, block_size, 1, 32, dtype=torch.bfloat16) for _ in range(2)]
    kv_slots = torch.randperm(4 * block_size, device=DEVICE)[:batch]
    kv_slots[~valid] = -1

    def step():
        return (linear.linear_conv_update(proj_x, proj_w, None, 30, proj_conv_w, None, proj_states, src, dst),
                linear.linear_relu_square(proj_x, proj_w),
                conv1d.causal_conv1d_update(conv_x, conv_w, None, conv_states, src, dst),
                ssm_update.ssm_state_update(ssm_states, x, dt, a, b, c, d_skip, src, dst),
                attention.paged_attention(q, k_cache, v_cache, tables, lens, cu, 0.1, max_seqlen_q=1, num_decode=batch),
                moe.moe_experts(mx, w_up, w_down, weights, ids, "relu2"),
                *moe_routing.route_sigmoid_grouped(route_x, router_w, bias, 2, 2, 1, True, 2.5),
                *moe_routing.route_softmax_topk(route_x, router_w, 2),
                sampling.logits_argmax(lm_out, 6),
                linear.linear_write_kv(proj_x, qkv_w, None, 64, *kv_caches, kv_slots))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()

    for tensor in (proj_x, conv_x, x, dt, b, c, q, mx, weights, lm_out):
        tensor.copy_(torch.randn_like(tensor.float()).to(tensor.dtype))
    # Distinct logits (multiples of 1/16, exact in bf16): no ties, whose order torch.topk leaves open.
    router_w.copy_(exact_logits(((torch.randperm(8 * batch, device=DEVICE) - 24) / 16).view(batch, 8)
                                .to(torch.bfloat16))[1])
    lens.copy_(torch.tensor([9, 0, 80, 1, 48, 32], dtype=torch.int32, device=DEVICE))
    ids.copy_(torch.stack([torch.randperm(8, device=DEVICE)[:2] for _ in range(batch)]))
    kv_slots.copy_(torch.where(valid, torch.randperm(4 * block_size, device=DEVICE)[:batch], -1))
    proj_expected, conv_expected, ssm_expected = proj_states.clone(), conv_states.clone(), ssm_states.clone()
    kv_expected = [cache.clone() for cache in kv_caches]
    expected = (ref.linear_conv_update(proj_x, proj_w, None, 30, proj_conv_w, None, proj_expected, src, dst),
                ref.linear_relu_square(proj_x, proj_w),
                ref.causal_conv1d_update(conv_x, conv_w, None, conv_expected, src, dst),
                ref.ssm_state_update(ssm_expected, x, dt, a, b, c, d_skip, src, dst),
                ref.paged_attention(q, k_cache, v_cache, tables, lens, cu, 0.1),
                ref.moe_experts(mx, w_up, w_down, weights, ids, "relu2"),
                *ref.route_sigmoid_grouped(route_x, router_w, bias, 2, 2, 1, True, 2.5),
                *ref.route_softmax_topk(route_x, router_w, 2),
                ref.logits_argmax(lm_out, 6),
                ref.linear_write_kv(proj_x, qkv_w, None, 64, *kv_expected, kv_slots))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs[:6], expected[:6]):
        assert_close(got.float(), want.float(), 1e-2)
    assert_close(outs[6].sort(1)[0], expected[6].sort(1)[0], 1e-5)
    assert torch.equal(outs[7].sort(1)[0], expected[7].sort(1)[0])
    assert torch.equal(outs[9], expected[9])
    assert (outs[8] - expected[8]).abs().max().item() < 1e-6
    assert torch.equal(outs[10], expected[10])
    check_pool(proj_states, proj_expected, dst[valid], 1e-2)
    check_pool(conv_states, conv_expected, dst[valid], 1e-2)
    check_pool(ssm_states, ssm_expected, dst[valid], 1e-5)
    assert_close(outs[11].float(), expected[11].float(), 1e-2)
    for cache, expected_cache in zip(kv_caches, kv_expected):
        check_pool(cache.view(-1, 1, 32), expected_cache.view(-1, 1, 32), kv_slots[valid], 1e-2)
