"""Mixture-of-experts blocks: NemotronH's (sigmoid, grouped top-k, relu^2 experts, shared
expert, optional latent projections) and Granite's (softmax top-k, SwiGLU experts)."""
import torch
from torch import nn

from layers.kernels.ops import KernelOps
from layers.mlp import Relu2MLP


class _Router(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, correction_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        if correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))


class _StackedExperts(nn.Module):
    """All experts' weights as [E, out, in] tensors (the layout grouped GEMMs want)."""

    def __init__(self, num_experts: int, up_rows: int, in_dim: int, inter: int, up_name: str, down_name: str):
        super().__init__()
        self.up_name, self.down_name = up_name, down_name
        self.register_parameter(up_name, nn.Parameter(torch.zeros(num_experts, up_rows, in_dim)))
        self.register_parameter(down_name, nn.Parameter(torch.zeros(num_experts, in_dim, inter)))

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
    ):
        super().__init__()
        self.ops = ops
        if num_experts % n_group:
            raise ValueError(f"n_routed_experts ({num_experts}) must be a multiple of n_group ({n_group})")
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        expert_dim = latent_size or hidden_size
        self.gate = _Router(num_experts, hidden_size, correction_bias=True)
        self.experts = _StackedExperts(num_experts, intermediate_size, expert_dim, intermediate_size, "up_proj", "down_proj")
        self.shared_experts = Relu2MLP(hidden_size, shared_intermediate_size, bias=bias)
        self.fc1_latent_proj = nn.Linear(hidden_size, latent_size, bias=bias) if latent_size else nn.Identity()
        self.fc2_latent_proj = nn.Linear(latent_size, hidden_size, bias=bias) if latent_size else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(x.float(), self.gate.weight.float())
        weights, ids = self.ops.route_sigmoid_grouped(
            logits, self.gate.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
            self.norm_topk_prob, self.routed_scaling_factor,
        )
        routed = self.ops.moe_experts(self.fc1_latent_proj(x), self.experts.up, self.experts.down, weights, ids,
                                      "relu2")
        return self.fc2_latent_proj(routed) + self.shared_experts(x)


class GraniteMoE(nn.Module):
    """Softmax-top-k routed SwiGLU experts (checkpoint names: input_linear / output_linear)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, *, ops: KernelOps):
        super().__init__()
        self.ops = ops
        self.top_k = top_k
        self.router = nn.Module()
        self.router.layer = nn.Linear(hidden_size, num_experts, bias=False)
        self.input_linear = nn.Module()
        self.input_linear.weight = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size, hidden_size))
        self.output_linear = nn.Module()
        self.output_linear.weight = nn.Parameter(torch.zeros(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.ops.route_softmax_topk(self.router.layer(x).float(), self.top_k)
        # transformers casts the routing weights to the activation dtype before use.
        weights = weights.to(x.dtype)
        return self.ops.moe_experts(x, self.input_linear.weight, self.output_linear.weight, weights, ids, "swiglu")
