"""Mixture-of-experts routing (both router kinds) and expert compute (reference)."""
import torch
import torch.nn.functional as F

from layers.kernels.reference.activation import relu_square


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
    """NemotronH / DeepSeek-V3 router: sigmoid scores, group-limited top-k.

    The correction bias only steers which experts are chosen; the weights are the raw
    sigmoid scores of the chosen experts (optionally renormalized), times the scaling factor.
    x: [T, H]; router_weight: [E, H]; the logits x @ router_weight^T are taken in float32
    (transformers casts both operands). Returns (weights [T, k] float32, expert ids [T, k]
    int64).
    """
    router_logits = F.linear(x.float(), router_weight.float())
    n_tokens, n_experts = router_logits.shape
    scores = router_logits.sigmoid()
    choice = scores + correction_bias.float()
    per_group = choice.view(n_tokens, n_group, n_experts // n_group)
    group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1)[0].sum(dim=-1)
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    expert_mask = group_mask.unsqueeze(-1).expand_as(per_group).reshape(n_tokens, n_experts)
    choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def route_softmax_topk(x: torch.Tensor, router_weight: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Granite / Mixtral router: top-k of the logits x @ router_weight^T, which are rounded
    to x's dtype (as transformers' router linear leaves them), softmax over the chosen k in
    float32."""
    top_logits, ids = F.linear(x, router_weight).float().topk(top_k, dim=-1)
    return torch.softmax(top_logits, dim=-1), ids


def _expert_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu2":
        return relu_square(h)
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    raise ValueError(f"unsupported expert activation: {activation!r}")


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
    topk_weights / topk_ids: [T, k]; shared_up: [S or 2S, H]; shared_down: [H, S]. The routed
    sum accumulates in float32 (each weight rounded to x's dtype first, as transformers does
    for Granite) and is rounded to x's dtype; the shared expert's output, in x's dtype, is
    added to it (the models' MoE blocks add the two this way).
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in topk_ids.unique().tolist():
        token_idx, k_idx = (topk_ids == expert).nonzero(as_tuple=True)
        h = _expert_activation(F.linear(x[token_idx], w_up[expert]), activation)
        h = F.linear(h, w_down[expert]) * topk_weights[token_idx, k_idx, None].to(h.dtype)
        out.index_add_(0, token_idx, h.float())
    out = out.to(x.dtype)
    if shared_up is not None:
        out = out + F.linear(_expert_activation(F.linear(x, shared_up), activation), shared_down)
    return out
