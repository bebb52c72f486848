"""MoE routers, one Triton kernel each: a program routes a tile of tokens, all experts of a
token in registers (no sort, no gather, no host sync; shapes depend only on T and k).

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
import triton
import triton.language as tl
from triton.language.extra import libdevice

from layers.kernels.triton.device import pdl, wait_for_previous_kernel

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
def _load_logits(logits_ptr, num_tokens, num_experts, stride_t, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """This program's tile of logits in float32 (0 outside the tokens and experts)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    r_in = rows < num_tokens
    c_in = cols < num_experts
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :],
                     mask=r_in[:, None] & c_in[None, :], other=0.0).to(tl.float32)
    return rows, r_in, cols, c_in, logits


@triton.jit
def _store_routes(weights_ptr, ids_ptr, rows, r_in, weights, ids, TOP_K: tl.constexpr, K_PAD: tl.constexpr):
    slots = tl.arange(0, K_PAD)[None, :]
    offs = rows.to(tl.int64)[:, None] * TOP_K + slots
    mask = r_in[:, None] & (slots < TOP_K)
    tl.store(weights_ptr + offs, weights, mask=mask)
    tl.store(ids_ptr + offs, ids.to(tl.int64), mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])  # per-step size: no recompiles
def _softmax_topk_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_t, EXACT: tl.constexpr,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    rows, r_in, cols, c_in, logits = _load_logits(logits_ptr, num_tokens, num_experts, stride_t, BLOCK_T, BLOCK_E)
    logits = tl.where(c_in[None, :], logits, float("-inf"))
    ids, top = _top_k(logits, logits, cols, TOP_K, K_PAD, BLOCK_E)
    slots = tl.arange(0, K_PAD)[None, :]
    # Softmax over the chosen k: slot 0 holds the row maximum.
    e = tl.where(slots < TOP_K, _exp(top - tl.max(top, axis=1)[:, None], EXACT), 0.0)
    weights = tl.math.div_rn(e, tl.sum(e, axis=1)[:, None])
    _store_routes(weights_ptr, ids_ptr, rows, r_in, weights, ids, TOP_K, K_PAD)


@triton.jit(do_not_specialize=["num_tokens"])  # per-step size: no recompiles
def _sigmoid_grouped_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_t, scaling, EXACT: tl.constexpr,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, N_GROUP: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr, NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    rows, r_in, cols, c_in, logits = _load_logits(logits_ptr, num_tokens, num_experts, stride_t, BLOCK_T, BLOCK_E)
    scores = tl.math.div_rn(1.0, 1.0 + _exp(-logits, EXACT))  # torch's sigmoid, step for step
    bias = tl.load(bias_ptr + cols, mask=c_in, other=0.0).to(tl.float32)
    choice = tl.where(c_in[None, :], scores + bias[None, :], float("-inf"))
    if TOPK_GROUP < N_GROUP:
        # Group score: the sum of the group's two best choices (one if groups are single experts).
        group = cols // GROUP_SIZE
        gcols = tl.arange(0, G_PAD)[None, :]
        group_scores = tl.full([BLOCK_T, G_PAD], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            members = tl.where((group == g)[None, :], choice, float("-inf"))
            best = tl.max(members, axis=1)
            if GROUP_SIZE > 1:
                first = tl.min(tl.where(members == best[:, None], cols[None, :], BLOCK_E), axis=1)
                best += tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), members), axis=1)
            group_scores = tl.where(gcols == g, best[:, None], group_scores)
        keep = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
        for _i in tl.static_range(TOPK_GROUP):
            best = tl.max(group_scores, axis=1)
            chosen = tl.min(tl.where(group_scores == best[:, None], gcols, G_PAD), axis=1)
            keep = keep | (group[None, :] == chosen[:, None])
            group_scores = tl.where(gcols == chosen[:, None], float("-inf"), group_scores)
        choice = tl.where(keep, choice, float("-inf"))
    ids, weights = _top_k(choice, scores, cols, TOP_K, K_PAD, BLOCK_E)
    if NORM:
        weights = tl.math.div_rn(weights, tl.sum(weights, axis=1)[:, None] + 1e-20)
    _store_routes(weights_ptr, ids_ptr, rows, r_in, weights * scaling, ids, TOP_K, K_PAD)


def _route_launch(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Outputs and the launch parameters both routers share."""
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}")
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=router_logits.device)
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(16, 2048 // block_e))
    params = dict(EXACT=_EXACT_EXP, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_T=block_t,
                  BLOCK_E=block_e, num_warps=4)
    return weights, ids, params


def route_softmax_topk(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Granite / Mixtral router: top-k of the logits, softmax over the chosen k.

    router_logits: [T, E] any float dtype (routed in float32). Returns (weights [T, k]
    float32, expert ids [T, k] int64), best first; ties go to the lowest expert index.
    """
    weights, ids, params = _route_launch(router_logits, top_k)
    num_tokens, num_experts = router_logits.shape
    if num_tokens:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        _softmax_topk_kernel[(triton.cdiv(num_tokens, params["BLOCK_T"]),)](
            logits, weights, ids, num_tokens, num_experts, logits.stride(0), **params, **pdl(logits))
    return weights, ids


def route_sigmoid_grouped(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NemotronH / DeepSeek-V3 router: sigmoid scores, group-limited top-k.

    The correction bias only steers which experts are chosen; the weights are the sigmoid
    scores of the chosen experts (optionally renormalized), times the scaling factor.
    router_logits: [T, E] any float dtype (routed in float32). Returns (weights [T, k]
    float32, expert ids [T, k] int64), best choice first; ties go to the lowest index.
    """
    num_tokens, num_experts = router_logits.shape
    if n_group < 1 or num_experts % n_group or not 0 < topk_group <= n_group:
        raise ValueError(f"n_group ({n_group}) must divide the {num_experts} experts and topk_group ({topk_group}) "
                         f"be in [1, n_group]")
    if top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"top_k ({top_k}) exceeds the experts of the topk_group ({topk_group}) groups kept")
    weights, ids, params = _route_launch(router_logits, top_k)
    if num_tokens:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        _sigmoid_grouped_kernel[(triton.cdiv(num_tokens, params["BLOCK_T"]),)](
            logits, correction_bias, weights, ids, num_tokens, num_experts, logits.stride(0),
            float(routed_scaling_factor), N_GROUP=n_group, G_PAD=triton.next_power_of_2(n_group),
            TOPK_GROUP=topk_group, GROUP_SIZE=num_experts // n_group, NORM=bool(norm_topk_prob), **params,
            **pdl(logits))
    return weights, ids
