"""GraniteMoeHybrid (Granite-4.0-H): each layer is a mixer (Mamba-2 or attention with
optional RoPE) then a feed-forward (softmax-top-k SwiGLU MoE + shared SwiGLU MLP, or the
dense MLP alone when the model has no experts), both scaled by `residual_multiplier`;
embeddings are scaled by `embedding_multiplier`, logits divided by `logits_scaling`."""
import torch
from torch import nn

from hybrid_engine.models.base import HybridForCausalLM, make_attention, make_mamba
from hybrid_engine.models.config import HybridConfig
from layers.forward_meta import ForwardMeta
from layers.kernels.ops import KernelOps
from layers.mlp import SwiGLUMLP
from layers.moe import GraniteMoE
from layers.norms import RMSNorm
from layers.parallel import SINGLE, ParallelContext

# transformers' internal (stacked) names -> the checkpoint names this model uses.
_HF_INTERNAL_NAMES = {
    "block_sparse_moe.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
    "block_sparse_moe.experts.down_proj": "block_sparse_moe.output_linear.weight",
    "block_sparse_moe.router.weight": "block_sparse_moe.router.layer.weight",
}


class GraniteBlock(nn.Module):
    """scaled residual add + norm (fused) -> mixer; scaled residual add + norm -> MoE +
    shared MLP."""

    def __init__(self, c: HybridConfig, kind: str, *, ops: KernelOps, tp: ParallelContext = SINGLE):
        super().__init__()
        self.residual_multiplier = c.residual_multiplier
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps, ops=ops, weight_in_fp32=False)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps, ops=ops, weight_in_fp32=False)
        if kind == "mamba":
            self.mamba = make_mamba(c, ops, tp)
        else:
            self.self_attn = make_attention(c, ops, tp)
        self.kind = kind
        self.block_sparse_moe = (
            GraniteMoE(c.hidden_size, c.num_experts, c.top_k, c.moe_intermediate_size, ops=ops, tp=tp)
            if c.num_experts else None
        )
        self.shared_mlp = SwiGLUMLP(c.hidden_size, c.intermediate_size, ops=ops, tp=tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                meta: ForwardMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds x (the previous block's feed-forward output, scaled; the embeddings as they
        are when residual is None) to the residual stream, returns (this block's
        feed-forward output, unscaled, the stream it is to be added to)."""
        scale = None if residual is None else self.residual_multiplier
        normed, residual = self.input_layernorm(x, residual, scale)
        normed, residual = self.post_attention_layernorm(self.mix(normed, meta), residual, self.residual_multiplier)
        return self.feed_forward(normed), residual

    def mix(self, x: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        """The mixer's output (Mamba-2 or attention) for the normed hidden states x."""
        return (self.mamba if self.kind == "mamba" else self.self_attn)(x, meta)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """MoE + shared MLP (or the dense MLP alone) for the normed hidden states x."""
        if self.block_sparse_moe is not None:  # the shared MLP runs inside the experts' kernels
            return self.block_sparse_moe(x, shared=self.shared_mlp)
        return self.shared_mlp(x)


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    """Parameter names follow the HF checkpoints (`model.embed_tokens`, `model.layers.N...`)."""

    block = GraniteBlock
    embeddings_name = "embed_tokens"
    final_norm_name = "norm"
    norm_weight_in_fp32 = False

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.config.embedding_multiplier

    def logits_divisor(self) -> float | None:
        return self.config.logits_scaling

    def branch_scale(self) -> float | None:
        return self.config.residual_multiplier

    def normalize_checkpoint_name(self, name: str) -> str | None:
        name = super().normalize_checkpoint_name(name)
        if name is None:
            return None
        for internal, on_disk in _HF_INTERNAL_NAMES.items():
            if name.endswith(internal):
                return name[: -len(internal)] + on_disk
        return name
