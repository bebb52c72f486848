"""GraniteMoeHybrid (Granite-4.0-H): each layer is a mixer (Mamba-2 or attention with
optional RoPE) then a feed-forward (softmax-top-k SwiGLU MoE + shared SwiGLU MLP, or the
dense MLP alone when the model has no experts), both scaled by `residual_multiplier`."""
import torch
from torch import nn

from hybrid_engine.models.base import HybridForCausalLM, make_attention, make_mamba
from hybrid_engine.models.config import HybridConfig
from layers.forward_meta import ForwardMeta
from layers.mlp import SwiGLUMLP
from layers.moe import GraniteMoE
from layers.norms import RMSNorm

# transformers' internal (stacked) names -> the checkpoint names this model uses.
_HF_INTERNAL_NAMES = {
    "block_sparse_moe.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
    "block_sparse_moe.experts.down_proj": "block_sparse_moe.output_linear.weight",
    "block_sparse_moe.router.weight": "block_sparse_moe.router.layer.weight",
}


class GraniteBlock(nn.Module):
    """norm -> mixer -> scaled residual; norm -> MoE + shared MLP -> scaled residual."""

    def __init__(self, c: HybridConfig, kind: str):
        super().__init__()
        self.residual_multiplier = c.residual_multiplier
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps, weight_in_fp32=False)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps, weight_in_fp32=False)
        if kind == "mamba":
            self.mamba = make_mamba(c)
        else:
            self.self_attn = make_attention(c)
        self.kind = kind
        self.block_sparse_moe = (
            GraniteMoE(c.hidden_size, c.num_experts, c.top_k, c.moe_intermediate_size) if c.num_experts else None
        )
        self.shared_mlp = SwiGLUMLP(c.hidden_size, c.intermediate_size)

    def forward(self, h: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        mixer = self.mamba if self.kind == "mamba" else self.self_attn
        h = h + mixer(self.input_layernorm(h), meta) * self.residual_multiplier
        x = self.post_attention_layernorm(h)
        ff = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            ff = self.block_sparse_moe(x) + ff
        return h + ff * self.residual_multiplier


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    """Parameter names follow the HF checkpoints (`model.embed_tokens`, `model.layers.N...`)."""

    def __init__(self, c: HybridConfig):
        super().__init__()
        self.config = c
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.layers = nn.ModuleList(GraniteBlock(c, kind) for kind in c.layer_types)
        self.model.norm = RMSNorm(c.hidden_size, c.norm_eps, weight_in_fp32=False)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def forward(self, input_ids: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids) * self.config.embedding_multiplier
        for layer in self.model.layers:
            h = layer(h, meta)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lm_head(hidden) / self.config.logits_scaling).float()

    def normalize_checkpoint_name(self, name: str) -> str | None:
        name = super().normalize_checkpoint_name(name)
        if name is None:
            return None
        for internal, on_disk in _HF_INTERNAL_NAMES.items():
            if name.endswith(internal):
                return name[: -len(internal)] + on_disk
        return name
