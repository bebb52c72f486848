"""MoE routers: the router logits GEMM, then a Triton routing kernel (NemotronH's router
takes a decode step's few rows in one kernel, logits included).

Routing: a program routes a tile of tokens, all experts of a token in registers (no sort,
no gather, no host sync; shapes depend only on T and k).

NemotronH's router, up to `routing_rows` rows (16 for up to 128 experts), computes its
float32 logits in the same kernel: programs split the router weight
into column tiles and K slices as the skinny projection kernel does (`linear.tiling`),
store float32 partial sums, and the last program to arrive (an arrival counter, reset by
that program) adds them in slice order and routes every row. The order is fixed, so the
result is deterministic. That replaces cuBLAS's float32-output GEMM and its split-K reduce,
which are not programmatic dependent launches. More rows get their logits from a separate
GEMM (`_float32_logits`), then the routing kernel. NemotronH's router weight is float32 (as
in transformers) in a half-precision model: against a bfloat16 x the kernels multiply its
three bfloat16 pieces on the tensor cores, exactly (`linear.row_tile_product`). Granite's
logits come from `linear` (the skinny kernel at decode, already a dependent launch), then
the routing kernel.

Top-k is k rounds of arg-max. Ties go to the lowest expert index (the reference's
torch.topk leaves tie order unspecified; exactly equal scores are the only case where the
two may choose differently). Ids come out in descending score order.

Sigmoid scores use libdevice's expf and an IEEE division, the operations torch's CUDA
sigmoid runs, so the scores (and hence the choice) should be bitwise the reference's on the
GPU; divisions are IEEE throughout. Triton's interpreter has no libdevice: there tl.exp
stands in.
"""
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from layers.kernels.triton.device import arrival_counters, pdl, wait_for_previous_kernel
from layers.kernels.triton.linear import (MAX_ROWS, linear, row_tile_product, skinny_linear, split_bfloat16_pieces,
                                          sum_slices, tiling)

# libdevice calls only compile for a GPU; the interpreter (TRITON_INTERPRET=1) lacks them.
_EXACT_EXP = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _exp(x, EXACT: tl.constexpr):
    if EXACT:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _top_k(choice, payload, cols, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr):
    """Per row of `choice` [BT, BLOCK_E] (-inf: not eligible) the TOP_K largest, ties to the
    lowest column: (expert ids [BT, K_PAD] int32, `payload` at those columns [BT, K_PAD])."""
    slots = tl.arange(0, K_PAD)[None, :]
    ids = tl.zeros([choice.shape[0], K_PAD], dtype=tl.int32)
    picked = tl.zeros([choice.shape[0], K_PAD], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.max(choice, axis=1)
        idx = tl.min(tl.where(choice == best[:, None], cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == idx[:, None]
        ids = tl.where(slots == i, idx[:, None], ids)
        picked = tl.where(slots == i, tl.sum(tl.where(hit, payload, 0.0), axis=1)[:, None], picked)
        choice = tl.where(hit, float("-inf"), choice)
    return ids, picked


@triton.jit
def _load_logits(logits_ptr, num_tokens, num_experts, stride_t, stride_addend, ADDENDS: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """This program's tile of logits in float32 (0 outside the tokens and experts): the sum
    of ADDENDS tiles `stride_addend` apart, added in order."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    r_in = rows < num_tokens
    c_in = cols < num_experts
    ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :]
    mask = r_in[:, None] & c_in[None, :]
    logits = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    for a in tl.static_range(1, ADDENDS):
        logits += tl.load(ptrs + a * stride_addend, mask=mask, other=0.0).to(tl.float32)
    return rows, r_in, cols, c_in, logits


@triton.jit
def _store_routes(weights_ptr, ids_ptr, rows, r_in, weights, ids, TOP_K: tl.constexpr, K_PAD: tl.constexpr):
    slots = tl.arange(0, K_PAD)[None, :]
    offs = rows.to(tl.int64)[:, None] * TOP_K + slots
    mask = r_in[:, None] & (slots < TOP_K)
    tl.store(weights_ptr + offs, weights, mask=mask)
    tl.store(ids_ptr + offs, ids.to(tl.int64), mask=mask)


@triton.jit
def _softmax_topk(logits, c_in, cols, EXACT: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    """Granite's routing of a [BT, BLOCK_E] float32 logits tile: (weights, ids) [BT, K_PAD]."""
    logits = tl.where(c_in[None, :], logits, float("-inf"))
    ids, top = _top_k(logits, logits, cols, TOP_K, K_PAD, BLOCK_E)
    slots = tl.arange(0, K_PAD)[None, :]
    # Softmax over the chosen k: slot 0 holds the row maximum.
    e = tl.where(slots < TOP_K, _exp(top - tl.max(top, axis=1)[:, None], EXACT), 0.0)
    return tl.math.div_rn(e, tl.sum(e, axis=1)[:, None]), ids


@triton.jit
def _sigmoid_grouped(logits, bias_ptr, c_in, cols, scaling, EXACT: tl.constexpr, TOP_K: tl.constexpr,
                     K_PAD: tl.constexpr, N_GROUP: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                     GROUP_SIZE: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr):
    """NemotronH's routing of a [BT, BLOCK_E] float32 logits tile: (weights, ids) [BT, K_PAD]."""
    scores = tl.math.div_rn(1.0, 1.0 + _exp(-logits, EXACT))  # torch's sigmoid, step for step
    bias = tl.load(bias_ptr + cols, mask=c_in, other=0.0).to(tl.float32)
    choice = tl.where(c_in[None, :], scores + bias[None, :], float("-inf"))
    if TOPK_GROUP < N_GROUP:
        # Group score: the sum of the group's two best choices (one if groups are single experts).
        group = cols // GROUP_SIZE
        gcols = tl.arange(0, G_PAD)[None, :]
        group_scores = tl.full([logits.shape[0], G_PAD], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            members = tl.where((group == g)[None, :], choice, float("-inf"))
            best = tl.max(members, axis=1)
            if GROUP_SIZE > 1:
                first = tl.min(tl.where(members == best[:, None], cols[None, :], BLOCK_E), axis=1)
                best += tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), members), axis=1)
            group_scores = tl.where(gcols == g, best[:, None], group_scores)
        keep = tl.zeros([logits.shape[0], BLOCK_E], dtype=tl.int1)
        for _i in tl.static_range(TOPK_GROUP):
            best = tl.max(group_scores, axis=1)
            chosen = tl.min(tl.where(group_scores == best[:, None], gcols, G_PAD), axis=1)
            keep = keep | (group[None, :] == chosen[:, None])
            group_scores = tl.where(gcols == chosen[:, None], float("-inf"), group_scores)
        choice = tl.where(keep, choice, float("-inf"))
    ids, weights = _top_k(choice, scores, cols, TOP_K, K_PAD, BLOCK_E)
    if NORM:
        weights = tl.math.div_rn(weights, tl.sum(weights, axis=1)[:, None] + 1e-20)
    return weights * scaling, ids


@triton.jit
def _route(logits, bias_ptr, weights_ptr, ids_ptr, rows, r_in, c_in, cols, scaling, SIGMOID: tl.constexpr,
           EXACT: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, N_GROUP: tl.constexpr,
           G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, NORM: tl.constexpr,
           BLOCK_E: tl.constexpr):
    """Route a logits tile with either router and store the routes of its rows."""
    if SIGMOID:
        weights, ids = _sigmoid_grouped(logits, bias_ptr, c_in, cols, scaling, EXACT, TOP_K, K_PAD, N_GROUP, G_PAD,
                                        TOPK_GROUP, GROUP_SIZE, NORM, BLOCK_E)
    else:
        weights, ids = _softmax_topk(logits, c_in, cols, EXACT, TOP_K, K_PAD, BLOCK_E)
    _store_routes(weights_ptr, ids_ptr, rows, r_in, weights, ids, TOP_K, K_PAD)


@triton.jit(do_not_specialize=["num_tokens"])  # per-step size: no recompiles
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_t, stride_addend, scaling,
    SIGMOID: tl.constexpr, EXACT: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, N_GROUP: tl.constexpr,
    G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, NORM: tl.constexpr,
    ADDENDS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    rows, r_in, cols, c_in, logits = _load_logits(logits_ptr, num_tokens, num_experts, stride_t, stride_addend,
                                                  ADDENDS, BLOCK_T, BLOCK_E)
    _route(logits, bias_ptr, weights_ptr, ids_ptr, rows, r_in, c_in, cols, scaling, SIGMOID, EXACT, TOP_K, K_PAD,
           N_GROUP, G_PAD, TOPK_GROUP, GROUP_SIZE, NORM, BLOCK_E)


@triton.jit(do_not_specialize=["num_tokens"])  # per-step size: no recompiles
def _gemm_route_kernel(
    x_ptr, w_ptr, bias_ptr, partial_ptr, arrivals_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, hidden,
    stride_x, stride_w, scaling, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EXACT: tl.constexpr, TOP_K: tl.constexpr,
    K_PAD: tl.constexpr, N_GROUP: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr, ROUTE_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # This program's [16, BLOCK_N] of the logits over its K slice, as a float32 partial sum.
    rows = tl.arange(0, 16)
    r_in = rows < num_tokens
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + cols[:, None] * stride_w
    ks = tl.arange(0, BLOCK_K)
    k_len = tl.cdiv(tl.cdiv(hidden, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = tl.program_id(1) * k_len
    k_stop = tl.minimum(k_start + k_len, hidden)
    acc = tl.zeros((16, BLOCK_N), tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        k = k0 + ks
        w = tl.load(w_rows + k[None, :], mask=(cols[:, None] < num_experts) & (k[None, :] < k_stop), other=0.0)
        acc = row_tile_product(acc, x_ptr, w, rows, k, num_tokens, k_stop, stride_x, PRECISION)
    partial = partial_ptr + tl.program_id(1) * 16 * num_experts
    tl.store(partial + rows[:, None] * num_experts + cols[None, :], acc,
             mask=r_in[:, None] & (cols[None, :] < num_experts))
    tl.debug_barrier()  # every thread's partial is stored before the arrival releases them
    programs = tl.num_programs(0) * tl.num_programs(1)
    if tl.atomic_add(arrivals_ptr, 1, sem="acq_rel") == programs - 1:
        # The last program to arrive: the whole logits tile, slices added in order, routed.
        # Only the rows there are (ROUTE_ROWS: T to a power of two): the routing is a chain
        # of reductions, whose latency grows with the elements each thread holds. For the
        # same reason 8 warps past 4 rows. Nano's router on the H200: 8.1 -> 6.3 us at one
        # row (4 warps, 1 row against 16), 8.4 -> 6.9 us at 16 rows (8 warps against 4).
        routed = tl.arange(0, ROUTE_ROWS)
        experts = tl.arange(0, BLOCK_E)
        e_in = experts < num_experts
        logits = sum_slices(partial_ptr, routed, experts, num_tokens, num_experts, 16, SPLIT_K)
        _route(logits, bias_ptr, weights_ptr, ids_ptr, routed, routed < num_tokens, e_in, experts, scaling, True,
               EXACT, TOP_K, K_PAD, N_GROUP, G_PAD, TOPK_GROUP, GROUP_SIZE, NORM, BLOCK_E)
        tl.atomic_xchg(arrivals_ptr, 0)  # ready for the next call


def routing_rows(num_experts: int) -> int:
    """The rows one routing kernel program takes (its tile holds at most 2,048 logits, at
    most 16 rows); up to this many rows NemotronH's router GEMM runs in the routing kernel
    (whose GEMM part is a 16-row tensor-core tile)."""
    return max(1, min(16, 2048 // triton.next_power_of_2(num_experts)))


def _check_router(x: torch.Tensor, router_weight: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (weights, ids) for x's rows, once the shapes are checked."""
    num_experts = router_weight.shape[0]
    if router_weight.dim() != 2 or x.dim() != 2 or router_weight.shape[1] != x.shape[1]:
        raise ValueError(f"router_weight {tuple(router_weight.shape)} does not match x {tuple(x.shape)}")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}")
    return (torch.empty((x.shape[0], top_k), dtype=torch.float32, device=x.device),
            torch.empty((x.shape[0], top_k), dtype=torch.int64, device=x.device))


def _route_logits(logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor,
                  **params) -> None:
    """The routing kernel over [T, E] logits (T > 0), or [T, A, E] addends of them (added
    in order), into weights / ids."""
    addends = logits if logits.dim() == 3 else logits.unsqueeze(1)
    if addends.stride(2) != 1:
        addends = addends.contiguous()
    num_tokens, count, num_experts = addends.shape
    block_t = routing_rows(num_experts)
    _route_kernel[(triton.cdiv(num_tokens, block_t),)](
        addends, bias, weights, ids, num_tokens, num_experts, addends.stride(0), addends.stride(1), **params,
        ADDENDS=count, BLOCK_T=block_t, num_warps=4, **pdl(addends))


def _routing_constants(num_experts: int, top_k: int) -> dict:
    return dict(EXACT=_EXACT_EXP, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
                BLOCK_E=triton.next_power_of_2(num_experts))


def route_softmax_topk(x: torch.Tensor, router_weight: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Granite / Mixtral router: top-k of the logits x @ router_weight^T (rounded to x's
    dtype, routed in float32), softmax over the chosen k.

    x: [T, H]; router_weight: [E, H]. Returns (weights [T, k] float32, expert ids [T, k]
    int64), best first; ties go to the lowest expert index. Two kernels: the logits
    (`linear`: the skinny kernel at decode) and the routing. Routing in the skinny kernel's
    last program instead measured no faster (granite-4.0-h-tiny, H200, docs/benchmarks.md).
    """
    weights, ids = _check_router(x, router_weight, top_k)
    if x.shape[0]:
        num_experts = router_weight.shape[0]
        _route_logits(linear(x, router_weight), weights, ids, router_weight, scaling=1.0, SIGMOID=False, N_GROUP=1,
                      G_PAD=1, TOPK_GROUP=1, GROUP_SIZE=num_experts, NORM=False,
                      **_routing_constants(num_experts, top_k))
    return weights, ids


def _float32_logits(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """x @ router_weight^T with float32 products and sums, as [T, A, E]: A addends that,
    added in order, are the logits (what `_route_logits` takes).

    Half-precision operands of one dtype on CUDA: one float32-output GEMM (the same exact
    products, without two cast kernels). NemotronH's float32 weight against a bfloat16 x:
    up to MAX_ROWS rows (a decode step past one routing tile) the skinny kernel with float32
    output, whose products of the weight's bfloat16 pieces are exact (`row_tile_product`);
    more rows (a prompt step) one float32-output bfloat16 GEMM against the three pieces
    stacked (`split_bfloat16_pieces`), whose three addends the routing kernel adds: tensor
    cores, where x converted and a float32 GEMM ran on the CUDA cores (nano's router at
    8,192 rows, H200: docs/benchmarks.md). Otherwise (CPU, float16 against float32) x
    converted and one float32 GEMM."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and router_weight.dtype == x.dtype:
        return torch.mm(x, router_weight.t(), out_dtype=torch.float32).unsqueeze(1)
    if x.is_cuda and x.dtype == torch.bfloat16 and router_weight.dtype == torch.float32:
        if x.shape[0] <= MAX_ROWS and x.stride(1) == 1 and router_weight.stride(1) == 1:
            logits = skinny_linear(x, router_weight, None, tiling(*router_weight.shape), out_dtype=torch.float32)
            return logits.unsqueeze(1)
        pieces = split_bfloat16_pieces(router_weight.contiguous())
        return torch.mm(x, pieces.t(), out_dtype=torch.float32).view(x.shape[0], 3, router_weight.shape[0])
    return F.linear(x.float(), router_weight.float()).unsqueeze(1)


def _takes_gemm_route_kernel(x: torch.Tensor, router_weight: torch.Tensor) -> bool:
    """A decode step's few rows (one routing tile) of a dtype the kernel multiplies, the
    weight in the same dtype or float32, both with contiguous rows."""
    return (0 < x.shape[0] <= routing_rows(router_weight.shape[0])
            and router_weight.dtype in (x.dtype, torch.float32)
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.stride(1) == 1
            and router_weight.stride(1) == 1)


def route_sigmoid_grouped(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NemotronH / DeepSeek-V3 router: sigmoid scores of the float32 logits x @
    router_weight^T, group-limited top-k.

    The correction bias only steers which experts are chosen; the weights are the sigmoid
    scores of the chosen experts (optionally renormalized), times the scaling factor.
    x: [T, H]; router_weight: [E, H]. Returns (weights [T, k] float32, expert ids [T, k]
    int64), best choice first; ties go to the lowest index. Up to `routing_rows` rows, one
    kernel (logits and routing); more rows: a float32-output GEMM, then the routing kernel.
    """
    num_experts, hidden = router_weight.shape
    if n_group < 1 or num_experts % n_group or not 0 < topk_group <= n_group:
        raise ValueError(f"n_group ({n_group}) must divide the {num_experts} experts and topk_group ({topk_group}) "
                         f"be in [1, n_group]")
    if top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"top_k ({top_k}) exceeds the experts of the topk_group ({topk_group}) groups kept")
    weights, ids = _check_router(x, router_weight, top_k)
    params = dict(scaling=float(routed_scaling_factor), N_GROUP=n_group, G_PAD=triton.next_power_of_2(n_group),
                  TOPK_GROUP=topk_group, GROUP_SIZE=num_experts // n_group, NORM=bool(norm_topk_prob),
                  **_routing_constants(num_experts, top_k))
    if _takes_gemm_route_kernel(x, router_weight):
        tiles = tiling(num_experts, hidden)
        partials = torch.empty((tiles.split, 16, num_experts), dtype=torch.float32, device=x.device)
        _gemm_route_kernel[(triton.cdiv(num_experts, tiles.block_n), tiles.split)](
            x, router_weight, correction_bias, partials, arrival_counters(x.device), weights, ids, x.shape[0],
            num_experts, hidden, x.stride(0), router_weight.stride(0), params.pop("scaling"),
            PRECISION="ieee" if router_weight.dtype == torch.float32 else "tf32", BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k,
            SPLIT_K=tiles.split, **params, ROUTE_ROWS=triton.next_power_of_2(x.shape[0]),
            num_warps=4 if x.shape[0] <= 4 else 8, num_stages=4, **pdl(x))
    elif x.shape[0]:
        _route_logits(_float32_logits(x, router_weight), weights, ids, correction_bias, SIGMOID=True, **params)
    return weights, ids
