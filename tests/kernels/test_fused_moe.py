"""The fused MoE path (layers/kernels/triton/moe*.py) against the reference ops.

Run on a GPU: `python -m pytest tests/kernels -m gpu -q`. Without CUDA these tests skip,
unless TRITON_INTERPRET=1 runs the kernels on the CPU through Triton's interpreter (slow;
float16 stands in for bfloat16, whose interpreted dot is wrong; the preset-sized cases,
CUDA graphs and kernel counts need CUDA).
"""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from layers.kernels import REFERENCE_OPS
from layers.kernels import reference as ref
# The device choice (skips without CUDA unless interpreting), seeding and comparisons of the
# other fast-op tests.
from tests.kernels.test_fast_ops import (DEVICE, DTYPES, INTERPRET, LOW, TOL, assert_close, exact_logits,  # noqa: F401
                                        fixed_seed, randn)

pytestmark = pytest.mark.gpu
RUNS_IN_TRITON_INTERPRETER = True  # conftest: TRITON_INTERPRET=1 runs these on the CPU

from layers.kernels import fast  # noqa: E402
from layers.kernels.triton import linear, moe, moe_align, moe_routing  # noqa: E402
from layers.kernels.triton.device import arrival_counters  # noqa: E402
from layers.mlp import SwiGLUMLP  # noqa: E402
from layers.moe import GraniteMoE, NemotronHMoE  # noqa: E402

needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both routes with their k slots in expert order (the reference's order is unspecified)."""
    order = ids.argsort(dim=1)
    return weights.gather(1, order), ids.gather(1, order)


# ---------------------------------------------------------------- routers


# Up to routing_rows (16 here) NemotronH's router GEMM runs in the routing kernel; 37 and
# 300 rows take the GEMM and the routing kernel after it.
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (5, 64, 6), (16, 128, 6), (37, 40, 6), (300, 128, 8),
                                                  (3, 64, 1)])
def test_route_softmax_topk(tokens: int, experts: int, top_k: int) -> None:
    logits = randn(tokens, experts)
    x, weight = exact_logits(logits)
    weights, ids = moe_routing.route_softmax_topk(x, weight, top_k)
    expected_weights, expected_ids = ref.route_softmax_topk(x, weight, top_k)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, expected_ids)  # both best first
    assert (weights - expected_weights).abs().max().item() < 1e-6


@pytest.mark.parametrize("tokens", [16, 64])  # one fused routing tile, and the GEMM + routing kernel
def test_route_softmax_topk_ties_pick_the_lowest_expert(tokens: int) -> None:
    """Half-precision logits tie often: the documented order is a stable descending sort."""
    logits = torch.randint(-3, 4, (tokens, 32), device=DEVICE).to(LOW)  # 7 values over 32 experts: many ties
    weights, ids = moe_routing.route_softmax_topk(*exact_logits(logits), 6)
    assert torch.equal(ids, torch.sort(-logits.float(), dim=1, stable=True)[1][:, :6])
    expected = torch.softmax(logits.float().gather(1, ids), dim=-1)
    assert (weights - expected).abs().max().item() < 1e-6


SIGMOID_CASES = [
    # tokens, experts, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor
    (1, 8, 2, 2, 1, True, 1.0),
    (7, 64, 6, 8, 4, True, 2.5),
    (33, 64, 6, 8, 4, False, 2.5),
    (300, 128, 6, 1, 1, True, 2.5),  # Nemotron-3-Nano's router
    (16, 128, 6, 1, 1, True, 2.5),  # the same, one fused routing tile
    (9, 16, 2, 16, 3, True, 1.5),  # single-expert groups
    (5, 48, 4, 4, 2, False, 1.0),  # experts not a power of two
]


@pytest.mark.parametrize("tokens,experts,top_k,n_group,topk_group,norm,scale", SIGMOID_CASES)
def test_route_sigmoid_grouped(tokens: int, experts: int, top_k: int, n_group: int, topk_group: int, norm: bool,
                               scale: float) -> None:
    logits, bias = randn(tokens, experts), randn(experts, scale=0.1)
    x, weight = exact_logits(logits)
    weights, ids = moe_routing.route_sigmoid_grouped(x, weight, bias, top_k, n_group, topk_group, norm, scale)
    expected = ref.route_sigmoid_grouped(x, weight, bias, top_k, n_group, topk_group, norm, scale)
    (w, i), (ew, ei) = by_expert(weights, ids), by_expert(*expected)
    assert torch.equal(i, ei)
    assert (w - ew).abs().max().item() < 1e-6
    choice = (torch.sigmoid(logits) + bias).gather(1, ids)
    assert (choice[:, :-1] >= choice[:, 1:]).all(), "not best first"


@pytest.mark.parametrize("tokens", [1, 16, 17, 33])  # one kernel up to 16 rows; then logits, then routing
def test_sigmoid_router_reads_a_float32_weight_unrounded(tokens: int) -> None:
    """NemotronH's router weight stays float32 in a half-precision model: its logits are
    float32 products (exact here: one-hot rows), not those of a rounded weight."""
    logits = randn(tokens, 64, scale=2.0)
    assert not torch.equal(logits, logits.to(LOW).float())  # rounding the weight would change them
    x, weight = exact_logits(logits)
    x = x.to(LOW)  # one-hot: exact in any dtype
    bias = randn(64, scale=0.1)
    weights, ids = moe_routing.route_sigmoid_grouped(x, weight, bias, 6, 8, 4, True, 2.5)
    expected_weights, expected_ids = ref.route_sigmoid_grouped(x, weight, bias, 6, 8, 4, True, 2.5)
    (w, i), (ew, ei) = by_expert(weights, ids), by_expert(expected_weights, expected_ids)
    assert torch.equal(i, ei) and (w - ew).abs().max().item() < 1e-6


def added_in_order(addends: torch.Tensor) -> torch.Tensor:
    """[T, A, E] addends summed over A in order, as the routing kernel adds them."""
    total = addends[:, 0]
    for a in range(1, addends.shape[1]):
        total = total + addends[:, a]
    return total


@needs_cuda  # bfloat16 x (the interpreter runs float16, which has no three-piece split)
@pytest.mark.parametrize("tokens", [1, 16, 17, 32, 33, 300])  # skinny kernel up to 32 rows, then the pieces' GEMM
def test_float32_router_logits_keep_every_bit_of_the_weight(tokens: int) -> None:
    """A bfloat16 x against a float32 weight: each logit of a one-hot row is one weight value,
    and the kernels' three bfloat16 pieces must add back to it exactly (dropping the low
    piece loses its last 8 bits)."""
    logits = randn(tokens, 128)
    x, weight = exact_logits(logits, hidden=2688)
    x = x.to(torch.bfloat16)
    assert torch.equal(F.linear(x.float(), weight), logits)
    if tokens <= linear.MAX_ROWS:
        tiles = linear.tiling(*weight.shape)
        assert torch.equal(linear.skinny_linear(x, weight, None, tiles, out_dtype=torch.float32), logits)
    assert torch.equal(added_in_order(moe_routing._float32_logits(x, weight)), logits)


def test_bfloat16_pieces_add_back_to_the_weight() -> None:
    """high + middle + low, added in that order, is the float32 weight bit for bit, and each
    piece is needed (weights spread over many binades, both signs)."""
    weight = randn(128, 2688) * torch.exp2(torch.randint(-60, 60, (128, 2688), device=DEVICE).float())
    high, middle, low = linear.split_bfloat16_pieces(weight).float().chunk(3)
    assert torch.equal(high + middle + low, weight)
    assert not torch.equal(high + middle, weight) and not torch.equal(high, weight)


def test_skinny_linear_refuses_a_float16_x_against_a_float32_weight() -> None:
    """Its dots would round the float32 weight to tf32: only a bfloat16 x has the exact split."""
    x, weight = randn(2, 256, dtype=torch.float16), randn(32, 256)
    with pytest.raises(ValueError, match="torch.float32 weight takes a bfloat16 x"):
        linear.skinny_linear(x, weight, None, linear.tiling(*weight.shape), out_dtype=torch.float32)


def test_skinny_linear_refuses_the_weight_major_product_for_a_float32_weight() -> None:
    """The exact three-piece products of a float32 weight are row-major only."""
    x, weight = randn(2, 256, dtype=torch.bfloat16), randn(32, 256)
    with pytest.raises(ValueError, match="row-major"):
        linear.skinny_linear(x, weight, None, linear.Tiling(32, 128, 1, weight_major=True), out_dtype=torch.float32)


@needs_cuda
def test_fused_float32_router_decides_on_the_low_piece() -> None:
    """Two experts whose logits differ only in the weight's low bfloat16 piece (2^-16 apart
    at -12 - 2^-7): with the piece the router picks the larger, expert 2; without it they tie
    and expert 0 would win the tie."""
    logits = torch.full((1, 16), -30.0, device=DEVICE)
    logits[0, 0] = -12 - 2 ** -7 - 2 ** -16
    logits[0, 2] = -12 - 2 ** -7
    x, weight = exact_logits(logits)
    weights, ids = moe_routing.route_sigmoid_grouped(x.to(torch.bfloat16), weight, torch.zeros(16, device=DEVICE),
                                                     1, 1, 1, False, 1.0)
    assert ids.tolist() == [[2]]


def assert_routes_the_top_k(ids: torch.Tensor, choice: torch.Tensor, tol: float) -> None:
    """Each row's ids are k distinct experts whose choice values are the row's k largest, up
    to `tol` (logits summed in another order may swap near-ties)."""
    k = ids.shape[1]
    assert all(len(set(row)) == k for row in ids.tolist())
    chosen = torch.zeros_like(choice, dtype=torch.bool).scatter_(1, ids, True)
    worst_chosen = choice.masked_fill(~chosen, float("inf")).min(1).values
    best_other = choice.masked_fill(chosen, float("-inf")).max(1).values
    assert (worst_chosen >= best_other - tol).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 6, 16, 17, 33])  # NemotronH's router GEMM in its routing kernel up to 16 rows
@pytest.mark.parametrize("router", ["softmax", "sigmoid", "sigmoid, float32 weight"])
def test_routers_from_random_hidden_states(dtype: torch.dtype, tokens: int, router: str) -> None:
    """The router GEMM of real-sized inputs (Nemotron-3-Nano's 2,688 x 128 router: for the
    sigmoid router a split-K GEMM in the routing kernel; NemotronH's weight is float32 in a
    bf16 model): the routes are the top-k of the float64 logits, up to the summation order,
    and the weights are the reference formula at the chosen experts."""
    hidden, experts, top_k = 2688, 128, 6
    weight_dtype = torch.float32 if "float32" in router else dtype
    x, weight = randn(tokens, hidden, dtype=dtype), randn(experts, hidden, dtype=weight_dtype, scale=hidden ** -0.5)
    logits = x.double() @ weight.double().t()
    if router == "softmax":
        weights, ids = moe_routing.route_softmax_topk(x, weight, top_k)
        logits = logits.to(dtype).double()  # Granite's logits in x's dtype
        assert_routes_the_top_k(ids, logits, 1e-5 if dtype == torch.float32 else 1e-2)
        expected = torch.softmax(logits.gather(1, ids), dim=-1)
    else:
        bias = randn(experts, scale=0.1)
        weights, ids = moe_routing.route_sigmoid_grouped(x, weight, bias, top_k, 1, 1, True, 2.5)
        scores = torch.sigmoid(logits)
        assert_routes_the_top_k(ids, scores + bias.double(), 1e-5)
        expected = scores.gather(1, ids) / scores.gather(1, ids).sum(1, keepdim=True) * 2.5
    assert (weights.double() - expected).abs().max().item() < (1e-5 if router != "softmax" or dtype == torch.float32
                                                                 else 1e-2)
    again = (moe_routing.route_softmax_topk(x, weight, top_k) if router == "softmax"
             else moe_routing.route_sigmoid_grouped(x, weight, bias, top_k, 1, 1, True, 2.5))
    assert torch.equal(again[0], weights) and torch.equal(again[1], ids), "not deterministic"
    assert not arrival_counters(x.device).any(), "an arrival counter was left set"


def test_routers_reject_impossible_configs() -> None:
    x, weight = exact_logits(randn(2, 16))
    with pytest.raises(ValueError, match="top_k"):
        moe_routing.route_softmax_topk(x, weight, 17)
    with pytest.raises(ValueError, match="n_group"):
        moe_routing.route_sigmoid_grouped(x, weight, randn(16), 2, 3, 1, True, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        moe_routing.route_sigmoid_grouped(x, weight, randn(16), 5, 4, 1, True, 1.0)
    with pytest.raises(ValueError, match="router_weight"):
        moe_routing.route_softmax_topk(x, weight[:, :-1], 2)


# ---------------------------------------------------------------- alignment


# The later ones span several align programs (`chunk_sizes`: 32-pair chunks placed 16 at
# a time up to 2,048 pairs; 128-pair chunks placed 32 at a time at 600 tokens; 512- and
# 1,024-pair chunks in the last two, a prefill's sizes).
ALIGN_CASES = [(1, 8, 2, 0, 16), (1, 64, 6, 2, 16), (5, 8, 2, 2, 16), (40, 16, 6, 1, 32), (300, 64, 6, 2, 16),
               (260, 8, 2, 3, 128), (100, 130, 8, 0, 64), (600, 8, 6, 2, 16),
               pytest.param(2100, 64, 6, 2, 64, marks=needs_cuda), pytest.param(9000, 32, 4, 0, 128, marks=needs_cuda)]


@pytest.mark.parametrize("tokens,experts,top_k,chunks,block_m", ALIGN_CASES)
@pytest.mark.parametrize("routing", ["random", "one_expert"])
def test_align_pairs(tokens: int, experts: int, top_k: int, chunks: int, block_m: int, routing: str) -> None:
    """Each expert's rows: its pairs in token order, padded to block_m; blocks past the
    last real one marked -1."""
    if routing == "random":
        ids = torch.rand(tokens, experts, device=DEVICE).argsort(dim=1)[:, :top_k]
    else:  # every token on the same k experts: one long segment each, the rest empty
        ids = torch.arange(top_k, device=DEVICE).expand(tokens, top_k).contiguous()
    rows = moe_align.align_pairs(ids, experts, chunks, block_m)
    shared_ids = experts + torch.arange(chunks, device=DEVICE).expand(tokens, chunks)
    expert_of_pair = torch.cat([ids, shared_ids], dim=1).reshape(-1)
    counts = torch.bincount(expert_of_pair, minlength=experts + chunks)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    assert torch.equal(rows.expert_end.long(), starts + counts)
    used = int(padded.sum()) // block_m
    assert used <= rows.max_blocks == moe_align.max_row_blocks(expert_of_pair.numel(), experts + chunks, block_m)
    expected_blocks = torch.repeat_interleave(torch.arange(experts + chunks, device=DEVICE), padded // block_m)
    assert torch.equal(rows.block_expert[:used].long(), expected_blocks)
    assert (rows.block_expert[used:] == -1).all()
    for e in range(experts + chunks):
        got = rows.pairs[starts[e]:starts[e] + counts[e]].long()
        assert torch.equal(got, torch.nonzero(expert_of_pair == e).flatten()), f"expert {e}"


# ---------------------------------------------------------------- experts


def _moe_case(tokens: int, activation: str, dtype: torch.dtype, shared: int | None, routing: str = "random",
              experts: int = 8, top_k: int = 2, hidden: int = 128, inter: int = 96):
    if routing == "random":  # experts 3 and 6 get no tokens
        allowed = torch.tensor([e for e in range(experts) if e not in (3, 6)], device=DEVICE)
        ids = allowed[torch.rand(tokens, len(allowed), device=DEVICE).argsort(dim=1)[:, :top_k]]
    else:  # every token on the same experts
        ids = torch.tensor([5, 0, 2, 7, 1, 4][:top_k], device=DEVICE).expand(tokens, top_k).contiguous()
    weights = torch.softmax(randn(tokens, top_k), dim=-1)
    mult = 2 if activation == "swiglu" else 1
    x = randn(tokens, hidden, dtype=dtype)
    w_up = randn(experts, mult * inter, hidden, dtype=dtype, scale=hidden ** -0.5)
    w_down = randn(experts, hidden, inter, dtype=dtype, scale=inter ** -0.5)
    shared_up = shared_down = None
    if shared:
        shared_up = randn(mult * shared, hidden, dtype=dtype, scale=hidden ** -0.5)
        shared_down = randn(hidden, shared, dtype=dtype, scale=shared ** -0.5)
    return x, w_up, w_down, weights, ids, shared_up, shared_down


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 64, 600])  # 600 x 4 slots: prefill tiles, several align programs
@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
@pytest.mark.parametrize("shared", [None, 192, 136])  # shared width: 2 routed widths, and a ragged last chunk
def test_moe_experts(dtype: torch.dtype, tokens: int, activation: str, shared: int | None) -> None:
    args = _moe_case(tokens, activation, dtype, shared)
    out = moe.moe_experts(*args[:5], activation, *args[5:])
    assert out.dtype == dtype
    assert_close(out, ref.moe_experts(*args[:5], activation, *args[5:]), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [5, 600])
@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
def test_moe_experts_all_tokens_on_the_same_experts(dtype: torch.dtype, tokens: int, activation: str) -> None:
    args = _moe_case(tokens, activation, dtype, 96, routing="same", top_k=2)
    assert_close(moe.moe_experts(*args[:5], activation, *args[5:]),
                 ref.moe_experts(*args[:5], activation, *args[5:]), TOL[dtype])


def assert_one_token_alone_is_its_row_in_the_batch(args: tuple, activation: str) -> None:
    """Each token alone (the two-kernel path: no alignment, the combine in the down GEMM)
    gives bit for bit its row of the whole batch (the four-kernel path), and the arrival
    counters are left at zero."""
    x, w_up, w_down, weights, ids, shared_up, shared_down = args
    with pytest.MonkeyPatch.context() as patch:
        if INTERPRET:
            # The interpreter's dot is the host BLAS, whose rounding changes with the K step
            # (on the GPU the K steps accumulate in one order): one token takes the batch's.
            patch.setattr(moe, "ONE_TOKEN_UP_TILES", moe.MOE_TILES[16].up)
        batch = moe.moe_experts(*args[:5], activation, *args[5:])
        for t in range(x.shape[0]):
            alone = moe.moe_experts(x[t:t + 1], w_up, w_down, weights[t:t + 1], ids[t:t + 1], activation, shared_up,
                                    shared_down)
            assert torch.equal(alone, batch[t:t + 1]), t
    assert not arrival_counters(x.device).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
# shared width (136: a ragged last chunk), top-k, hidden size (100, 200: ragged column tiles)
@pytest.mark.parametrize("shared, top_k, hidden", [(None, 2, 128), (136, 2, 128), (None, 1, 100), (96, 1, 200)])
def test_moe_experts_one_token_alone_equals_its_row_among_others(dtype: torch.dtype, activation: str,
                                                                shared: int | None, top_k: int, hidden: int) -> None:
    """A request's expert outputs do not depend on whether it decodes alone."""
    args = _moe_case(5, activation, dtype, shared, top_k=top_k, hidden=hidden)
    assert_one_token_alone_is_its_row_in_the_batch(args, activation)


def assert_both_product_orders_give_the_same_bits(monkeypatch, args: tuple, activation: str) -> None:
    """Every GEMM weight-major and every GEMM row-major (`GemmTiles.weight_major`) give the
    reference's result within tolerance, and on the GPU the same bits (the interpreter's
    matmul is the host BLAS, whose rounding depends on the order). Columns stay 64 wide
    (PROGRAMS_PER_SM 0: no narrowing), where in 16-row tiles the weight-major product takes
    Hopper's warpgroup instruction (wgmma) and the row-major one does not."""
    monkeypatch.setattr(moe, "PROGRAMS_PER_SM", 0)
    results = {}
    for weight_major in (False, True):
        def in_order(gemm: moe.GemmTiles) -> moe.GemmTiles:
            return replace(gemm, weight_major=weight_major)
        monkeypatch.setattr(moe, "MOE_TILES", {bm: replace(t, up=in_order(t.up), down=in_order(t.down))
                                               for bm, t in moe.MOE_TILES.items()})
        monkeypatch.setattr(moe, "ONE_TOKEN_UP_TILES", in_order(moe.ONE_TOKEN_UP_TILES))
        results[weight_major] = moe.moe_experts(*args[:5], activation, *args[5:])
        assert_close(results[weight_major], ref.moe_experts(*args[:5], activation, *args[5:]), TOL[args[0].dtype])
    if not INTERPRET:
        assert torch.equal(results[True], results[False])


@pytest.mark.parametrize("tokens", [1, 5, 100])  # one token (two kernels), 16-row tiles, 32 or 64 rows
@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
@pytest.mark.parametrize("shared", [None, 136])
def test_moe_experts_product_order_gives_the_same_bits(monkeypatch, tokens: int, activation: str,
                                                        shared: int | None) -> None:
    """Both product orders, over several K steps with ragged tails (hidden 320, intermediate
    288). float32 always runs row-major (FLOAT32_GEMM_TILES): only the half-precision dtype
    is compared."""
    args = _moe_case(tokens, activation, LOW, shared, hidden=320, inter=288)
    assert_both_product_orders_give_the_same_bits(monkeypatch, args, activation)


def test_moe_experts_one_token_without_enough_arrival_counters_keeps_the_combine_kernel(monkeypatch) -> None:
    """A hidden size with more column tiles than arrival counters: the down GEMM leaves the
    combine to the combine kernel, with the same result bit for bit."""
    args = _moe_case(1, "swiglu", LOW, 136)
    in_down_gemm = moe.moe_experts(*args[:5], "swiglu", *args[5:])
    monkeypatch.setattr(moe, "MAX_ARRIVAL_COUNTERS", 1)
    assert torch.equal(moe.moe_experts(*args[:5], "swiglu", *args[5:]), in_down_gemm)


@needs_cuda
@pytest.mark.parametrize("preset", ["granite-4.0-h-tiny", "nemotron-3-nano-30b-a3b"])
# 16-row tiles; 64 (granite) and 32 (nano) rows; 128 and 64 rows
@pytest.mark.parametrize("tokens", [3, 300, 600])
def test_moe_experts_one_token_alone_equals_its_row_at_preset_shapes(preset: str, tokens: int) -> None:
    """The same at the presets' shapes, where one token's tiles differ from a batch's: the
    one-token up GEMM's deeper K steps (nano), narrower columns (`moe_tiles` keeps every SM
    busy), and past 16 rows per expert row-major down GEMMs on other row tiles and
    instructions. The products do not change with them."""
    experts, top_k, hidden, inter, shared, activation = PRESET_SHAPES[preset]
    args = _moe_case(tokens, activation, torch.bfloat16, shared, experts=experts, top_k=top_k, hidden=hidden,
                     inter=inter)
    assert_one_token_alone_is_its_row_in_the_batch(args, activation)


@needs_cuda
@pytest.mark.parametrize("preset", ["granite-4.0-h-tiny", "nemotron-3-nano-30b-a3b"])
@pytest.mark.parametrize("tokens", [1, 32])
def test_moe_experts_product_order_gives_the_same_bits_at_preset_shapes(monkeypatch, preset: str,
                                                                         tokens: int) -> None:
    """Both product orders at the presets' shapes, one token and 16-row tiles."""
    experts, top_k, hidden, inter, shared, activation = PRESET_SHAPES[preset]
    args = _moe_case(tokens, activation, torch.bfloat16, shared, experts=experts, top_k=top_k, hidden=hidden,
                     inter=inter)
    assert_both_product_orders_give_the_same_bits(monkeypatch, args, activation)


def test_moe_experts_is_deterministic_and_handles_no_tokens() -> None:
    args = _moe_case(64, "swiglu", LOW, 192, experts=16, top_k=6)
    first = moe.moe_experts(*args[:5], "swiglu", *args[5:])
    assert torch.equal(first, moe.moe_experts(*args[:5], "swiglu", *args[5:]))
    empty = _moe_case(0, "relu2", LOW, 96)
    assert moe.moe_experts(*empty[:5], "relu2", *empty[5:]).shape == (0, 128)


def test_moe_experts_rejects_mismatched_weights() -> None:
    x, w_up, w_down, weights, ids, shared_up, shared_down = _moe_case(4, "swiglu", LOW, 96)
    with pytest.raises(ValueError, match="w_up"):
        moe.moe_experts(x, w_up[:, :96], w_down, weights, ids, "swiglu")
    with pytest.raises(ValueError, match="go together"):
        moe.moe_experts(x, w_up, w_down, weights, ids, "swiglu", shared_up, None)
    with pytest.raises(ValueError, match="activation"):
        moe.moe_experts(x, w_up, w_down, weights, ids, "gelu")


PRESET_SHAPES = {
    # name: (experts, top_k, hidden, inter, shared, activation)
    "granite-4.0-h-tiny": (64, 6, 1536, 512, 1024, "swiglu"),
    "nemotron-3-nano-30b-a3b": (128, 6, 2688, 1856, 3712, "relu2"),
}


@needs_cuda
@pytest.mark.parametrize("preset", list(PRESET_SHAPES))
@pytest.mark.parametrize("tokens", [1, 32, 2048])
def test_moe_experts_at_preset_shapes(preset: str, tokens: int) -> None:
    """The real tile classes and column-tile fitting, at the presets' expert shapes (bf16)."""
    experts, top_k, hidden, inter, shared, activation = PRESET_SHAPES[preset]
    args = _moe_case(tokens, activation, torch.bfloat16, shared, experts=experts, top_k=top_k, hidden=hidden,
                     inter=inter)
    assert_close(moe.moe_experts(*args[:5], activation, *args[5:]),
                 ref.moe_experts(*args[:5], activation, *args[5:]), 1e-2)


# ---------------------------------------------------------------- layers, graphs, kernel counts

FAST_OPS = REFERENCE_OPS.with_ops("fast", fast.available_ops())


def _randomize(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        for b in module.buffers():
            b.copy_(torch.randn_like(b) * 0.1)


def _layers(dtype: torch.dtype) -> dict[str, tuple[torch.nn.Module, torch.nn.Module, tuple]]:
    """name -> (fast layer, reference layer with the same weights, extra forward args)."""
    nemotron = dict(hidden_size=128, num_experts=16, top_k=4, intermediate_size=64, shared_intermediate_size=96,
                    n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    built = {}
    for name, make in {"nemotron": lambda ops: NemotronHMoE(**nemotron, ops=ops),
                       "nemotron_latent": lambda ops: NemotronHMoE(**nemotron, latent_size=96, ops=ops),
                       "granite": lambda ops: GraniteMoE(128, 16, 4, 64, ops=ops)}.items():
        reference = make(REFERENCE_OPS)
        _randomize(reference)
        fast_layer = make(FAST_OPS)
        fast_layer.load_state_dict(reference.state_dict())
        built[name] = (fast_layer.to(DEVICE, dtype), reference.to(DEVICE, dtype), ())
    shared = SwiGLUMLP(128, 96, ops=REFERENCE_OPS)
    _randomize(shared)
    granite_fast, granite_ref, _ = built["granite"]
    built["granite_shared"] = (granite_fast, granite_ref, (shared.to(DEVICE, dtype),))
    return built


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer", ["nemotron", "nemotron_latent", "granite", "granite_shared"])
@pytest.mark.parametrize("tokens", [5, 37])  # NemotronH's router: one kernel, then GEMM + routing kernel
def test_moe_layers_fast_vs_reference(dtype: torch.dtype, layer: str, tokens: int) -> None:
    fast_layer, reference, extra = _layers(dtype)[layer]
    x = randn(tokens, 128, dtype=dtype)
    with torch.no_grad():
        assert_close(fast_layer(x, *extra), reference(x, *extra), TOL[dtype])


@needs_cuda
@pytest.mark.parametrize("layer", ["nemotron", "granite_shared"])
@pytest.mark.parametrize("tokens", [1, 6])  # one token: no alignment, the combine in the down GEMM
def test_moe_layer_captures_in_cuda_graph(layer: str, tokens: int) -> None:
    """One MoE layer (router GEMM, router, alignment, GEMMs, combine) captured once and
    replayed on new inputs: no host sync, no data-dependent shapes, arrival counters left
    at zero."""
    fast_layer, reference, extra = _layers(torch.bfloat16)[layer]
    x = randn(tokens, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fast_layer(x, *extra)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fast_layer(x, *extra)
        for _ in range(3):  # new tokens route to new experts each time
            x.copy_(randn(tokens, 128, dtype=torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            assert_close(out, reference(x, *extra), 1e-2)
            assert not arrival_counters(x.device).any()


@needs_cuda
@pytest.mark.parametrize("layer", ["nemotron", "granite_shared"])
@pytest.mark.parametrize("tokens", [1, 64])
def test_moe_layer_kernel_count(layer: str, tokens: int) -> None:
    """A MoE layer with its shared expert launches at most 8 kernels (issue 14's target):
    router GEMM, router, alignment, up GEMM, down GEMM, combine; NemotronH's router GEMM and
    routing are one kernel for a decode step's few rows, and one token needs neither the
    alignment nor the combine kernel."""
    fast_layer, _, extra = _layers(torch.bfloat16)[layer]
    x = randn(tokens, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        fast_layer(x, *extra)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fast_layer(x, *extra)
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if tokens == 1:
        router = ["_gemm_route_kernel"] if layer == "nemotron" else ["", "_route_kernel"]  # granite: linear, routing
        assert len(kernels) == len(router) + 2 and all(name in k for name, k in zip(router, kernels)), kernels
        assert all("_moe_gemm_kernel" in k for k in kernels[len(router):]), kernels
    else:
        assert 6 <= len(kernels) <= 8, kernels
