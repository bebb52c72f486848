"""NemotronH (Nemotron-H, Nemotron-Nano-v2, Nemotron-3-Nano): each layer is one pre-normed
mixer -- Mamba-2, attention (no RoPE), relu^2 MLP or MoE -- with a residual around it."""
import torch
from torch import nn

from hybrid_engine.models.base import HybridForCausalLM, make_attention, make_mamba
from hybrid_engine.models.config import HybridConfig
from layers.forward_meta import ForwardMeta
from layers.kernels.ops import KernelOps
from layers.mlp import Relu2MLP
from layers.moe import NemotronHMoE
from layers.norms import RMSNorm
from layers.parallel import SINGLE, ParallelContext


class NemotronHBlock(nn.Module):
    """residual add + norm (fused) -> mixer."""

    def __init__(self, c: HybridConfig, kind: str, *, ops: KernelOps, tp: ParallelContext = SINGLE):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(c.hidden_size, c.norm_eps, ops=ops)
        if kind == "mamba":
            self.mixer = make_mamba(c, ops, tp)
        elif kind == "attention":
            self.mixer = make_attention(c, ops, tp)
        elif kind == "mlp":
            self.mixer = Relu2MLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, ops=ops, tp=tp)
        else:
            self.mixer = NemotronHMoE(c.hidden_size, c.num_experts, c.top_k, c.moe_intermediate_size,
                                      c.shared_intermediate_size, c.n_group, c.topk_group, c.norm_topk_prob,
                                      c.routed_scaling_factor, c.moe_latent_size, bias=c.mlp_bias, ops=ops, tp=tp)
        self.needs_meta = kind in ("mamba", "attention")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                meta: ForwardMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds x (the previous block's output) to the residual stream, returns (this
        block's mixer output, the stream it is to be added to)."""
        normed, residual = self.norm(x, residual)
        return self.mix(normed, meta), residual

    def mix(self, x: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        """The mixer's output for the normed hidden states x."""
        return self.mixer(x, meta) if self.needs_meta else self.mixer(x)


class NemotronHForCausalLM(HybridForCausalLM):
    """Parameter names follow the HF checkpoints (`backbone.` read as `model.`)."""

    block = NemotronHBlock
    embeddings_name = "embeddings"
    final_norm_name = "norm_f"

    def normalize_checkpoint_name(self, name: str) -> str | None:
        name = super().normalize_checkpoint_name(name)
        if name == "model.embed_tokens.weight":  # transformers' internal name
            return "model.embeddings.weight"
        return name
