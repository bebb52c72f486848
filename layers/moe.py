"""Mixture-of-experts blocks: NemotronH's (sigmoid, grouped top-k, relu^2 experts, shared
expert, optional latent projections) and Granite's (softmax top-k, SwiGLU experts).

Each block is the router GEMM, the router op and one `moe_experts` call that also runs the
shared expert when it can (no latent projections, no biases): on the GPU six kernels per
layer (`layers/kernels/triton/moe.py`). The blocks feed the ops their inputs as they are
(bf16 logits, float32 routing weights); the ops do the casts the reference makes.
"""
import torch
import torch.nn.functional as F
from torch import nn

from layers.kernels.ops import KernelOps
from layers.mlp import Relu2MLP, SwiGLUMLP


class _Router(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, correction_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        if correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def float32_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight^T with float32 products and sums (transformers casts both operands to
        float32). On CUDA, half-precision operands go into one float32-output GEMM instead:
        the same exact products, without two cast kernels."""
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and self.weight.dtype == x.dtype:
            return torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        return F.linear(x.float(), self.weight.float())


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
        # The shared expert joins the routed ones in `moe_experts` when both see the same input.
        self.shared_in_experts = latent_size is None and not bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.ops.route_sigmoid_grouped(
            self.gate.float32_logits(x), self.gate.e_score_correction_bias, self.top_k, self.n_group,
            self.topk_group, self.norm_topk_prob, self.routed_scaling_factor,
        )
        if self.shared_in_experts:
            return self.ops.moe_experts(x, self.experts.up, self.experts.down, weights, ids, "relu2",
                                        *self.shared_experts.expert_weights())
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

    def forward(self, x: torch.Tensor, shared: SwiGLUMLP | None = None) -> torch.Tensor:
        """The routed experts' sum, plus the block's `shared` MLP when given (computed in the
        same kernels)."""
        # Logits stay in x's dtype (transformers rounds them there before routing in float32).
        weights, ids = self.ops.route_softmax_topk(self.router.layer(x), self.top_k)
        shared_weights = shared.expert_weights() if shared is not None else (None, None)
        return self.ops.moe_experts(x, self.input_linear.weight, self.output_linear.weight, weights, ids, "swiglu",
                                    *shared_weights)
