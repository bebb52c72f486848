"""Mixture-of-experts blocks: NemotronH's (sigmoid, grouped top-k, relu^2 experts, shared
expert, optional latent projections) and Granite's (softmax top-k, SwiGLU experts).

Each block is the router op (router GEMM and routing) and one `moe_experts` call that also
runs the shared expert when it can (no latent projections, no biases): on the GPU six
kernels per layer, two fewer at one token (no alignment, no combine kernel); for NemotronH
five at 2-16 tokens and three at one, whose router op is then one kernel, and seven or
eight past 32, where the float32 router weight's bfloat16 pieces get their own GEMM
(`layers/kernels/triton/moe_routing.py`, `moe.py`). The blocks feed the ops
their inputs as they are (hidden states, router weights, float32 routing weights); the ops
do the casts the reference makes.

Tensor parallel (`tp`): routers are replicated (every rank routes every token alike). With
`tp.expert_parallel` False every expert is split by its intermediate size; with it True
each rank holds whole experts (an even share, `_ExpertPlacement`) and the (token, k) pairs
routed elsewhere get weight 0. The shared expert is split like a dense MLP. Each rank's
output (routed + shared) is a partial sum: the block reduces it once.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from layers.kernels.ops import KernelOps
from layers.mlp import Relu2MLP, SwiGLUMLP
from layers.parallel import SINGLE, ParallelContext, Shard, set_shard


class _Router(nn.Module):
    """NemotronH's router parameters (checkpoint names `gate.weight`, `gate.e_score_correction_bias`);
    the ops' `route_sigmoid_grouped` computes the logits and routes. Both stay float32 in a
    half-precision model, as transformers keeps them (`_keep_in_fp32_modules_strict`) and
    vLLM builds them: a checkpoint's float32 router is not rounded, and the logits are
    float32 products of it."""

    def __init__(self, num_experts: int, hidden_size: int, correction_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=torch.float32))
        if correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))


@dataclass(frozen=True)
class _ExpertPlacement:
    """This rank's part of the stacked expert weights ([E, up rows, in] and [E, in, I]) and
    of the routing (experts [first, first + count) are local; `remote_routes`: some are not)."""

    up: Shard
    down: Shard
    first: int
    count: int
    remote_routes: bool

    @classmethod
    def of(cls, tp: ParallelContext, num_experts: int, inter: int, gated: bool) -> "_ExpertPlacement":
        """`gated`: the up rows are [gate | up], each of `inter` rows, cut alike."""
        if tp.expert_parallel:
            experts = tp.shard(0, num_experts)
            first, stop = experts.ranges[0]
            return cls(experts, experts, first, stop - first, tp.is_parallel)
        up = tp.shard(1, inter, pieces=(0, inter) if gated else (0,))
        return cls(up, tp.shard(2, inter), 0, num_experts, False)

    def stacks(self, num_experts: int, up_rows: int, in_dim: int, inter: int) -> tuple[nn.Parameter, nn.Parameter]:
        """This rank's (up, down) stacks (zeros, their cuts recorded) of the full model's
        [E, up_rows, in_dim] and [E, in_dim, inter]."""
        params = []
        for shard, shape in ((self.up, [num_experts, up_rows, in_dim]), (self.down, [num_experts, in_dim, inter])):
            shape[shard.dim] = shard.local_size
            params.append(nn.Parameter(torch.zeros(shape)))
            set_shard(params[-1], shard)
        return params[0], params[1]

    def local_routes(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing in local expert ids: a pair routed to another rank's expert becomes
        local expert 0 with weight 0 (it adds exactly nothing)."""
        if not self.remote_routes:
            return weights, ids
        local = ids - self.first
        mine = (local >= 0) & (local < self.count)
        return torch.where(mine, weights, 0.0), torch.where(mine, local, 0)


class _StackedExperts(nn.Module):
    """All (this rank's) experts' weights as [E, out, in] tensors (the layout grouped GEMMs want)."""

    def __init__(self, placement: _ExpertPlacement, num_experts: int, in_dim: int, inter: int, up_name: str,
                 down_name: str):
        super().__init__()
        self.up_name, self.down_name = up_name, down_name
        up, down = placement.stacks(num_experts, inter, in_dim, inter)
        self.register_parameter(up_name, up)
        self.register_parameter(down_name, down)

    @property
    def up(self) -> torch.Tensor:
        return getattr(self, self.up_name)

    @property
    def down(self) -> torch.Tensor:
        return getattr(self, self.down_name)


class NemotronHMoE(nn.Module):
    """Routed relu^2 experts (+ latent projections) plus one always-on shared expert."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        shared_intermediate_size: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
        latent_size: int | None = None,
        bias: bool = False,
        *,
        ops: KernelOps,
        tp: ParallelContext = SINGLE,
    ):
        super().__init__()
        self.ops, self.tp = ops, tp
        if num_experts % n_group:
            raise ValueError(f"n_routed_experts ({num_experts}) must be a multiple of n_group ({n_group})")
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        expert_dim = latent_size or hidden_size
        self.gate = _Router(num_experts, hidden_size, correction_bias=True)
        self.placement = _ExpertPlacement.of(tp, num_experts, intermediate_size, gated=False)
        self.experts = _StackedExperts(self.placement, num_experts, expert_dim, intermediate_size, "up_proj",
                                       "down_proj")
        self.shared_experts = Relu2MLP(hidden_size, shared_intermediate_size, bias=bias, ops=ops, tp=tp)
        # Replicated: the latent projections are small next to the experts.
        self.fc1_latent_proj = nn.Linear(hidden_size, latent_size, bias=bias) if latent_size else nn.Identity()
        self.fc2_latent_proj = nn.Linear(latent_size, hidden_size, bias=bias) if latent_size else nn.Identity()
        # The shared expert joins the routed ones in `moe_experts` when both see the same input.
        self.shared_in_experts = latent_size is None and not bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.placement.local_routes(*self.ops.route_sigmoid_grouped(
            x, self.gate.weight, self.gate.e_score_correction_bias, self.top_k, self.n_group,
            self.topk_group, self.norm_topk_prob, self.routed_scaling_factor,
        ))
        if self.shared_in_experts:
            return self.tp.all_reduce(self.ops.moe_experts(x, self.experts.up, self.experts.down, weights, ids,
                                                           "relu2", *self.shared_experts.expert_weights()))
        routed = self.ops.moe_experts(self.fc1_latent_proj(x), self.experts.up, self.experts.down, weights, ids,
                                      "relu2")
        if not self.tp.is_parallel:
            return self.fc2_latent_proj(routed) + self.shared_experts(x)
        # The routed partial goes through fc2's weight before the one reduce (it is linear);
        # fc2's bias, like the shared expert's, is added once after it.
        fc2 = self.fc2_latent_proj
        if isinstance(fc2, nn.Linear):
            routed = F.linear(routed, fc2.weight)
        out = self.shared_experts.finish(routed + self.shared_experts.partial(x))
        return out if getattr(fc2, "bias", None) is None else out + fc2.bias


class GraniteMoE(nn.Module):
    """Softmax-top-k routed SwiGLU experts (checkpoint names: input_linear / output_linear)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, *, ops: KernelOps,
                 tp: ParallelContext = SINGLE):
        super().__init__()
        self.ops, self.tp = ops, tp
        self.top_k = top_k
        self.router = nn.Module()
        self.router.layer = nn.Linear(hidden_size, num_experts, bias=False)
        self.placement = _ExpertPlacement.of(tp, num_experts, intermediate_size, gated=True)
        up, down = self.placement.stacks(num_experts, 2 * intermediate_size, hidden_size, intermediate_size)
        self.input_linear = nn.Module()
        self.input_linear.weight = up
        self.output_linear = nn.Module()
        self.output_linear.weight = down

    def forward(self, x: torch.Tensor, shared: SwiGLUMLP | None = None) -> torch.Tensor:
        """The routed experts' sum, plus the block's `shared` MLP when given (computed in the
        same kernels; with tensor parallelism it is split like the experts, and the block's
        output is reduced once)."""
        weights, ids = self.placement.local_routes(*self.ops.route_softmax_topk(x, self.router.layer.weight,
                                                                                 self.top_k))
        shared_weights = shared.expert_weights() if shared is not None else (None, None)
        return self.tp.all_reduce(self.ops.moe_experts(x, self.input_linear.weight, self.output_linear.weight,
                                                       weights, ids, "swiglu", *shared_weights))
