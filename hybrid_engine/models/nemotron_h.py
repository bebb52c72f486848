"""NemotronH (Nemotron-H, Nemotron-Nano-v2, Nemotron-3-Nano): each layer is one pre-normed
mixer -- Mamba-2, attention (no RoPE), relu^2 MLP or MoE -- with a residual around it."""
import torch
from torch import nn

from hybrid_engine.models.base import HybridForCausalLM, make_attention, make_mamba
from hybrid_engine.models.config import HybridConfig
from layers.forward_meta import ForwardMeta
from layers.mlp import Relu2MLP
from layers.moe import NemotronHMoE
from layers.norms import RMSNorm


class NemotronHBlock(nn.Module):
    """norm -> mixer -> residual add."""

    def __init__(self, c: HybridConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(c.hidden_size, c.norm_eps)
        if kind == "mamba":
            self.mixer = make_mamba(c)
        elif kind == "attention":
            self.mixer = make_attention(c)
        elif kind == "mlp":
            self.mixer = Relu2MLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        else:
            self.mixer = NemotronHMoE(c.hidden_size, c.num_experts, c.top_k, c.moe_intermediate_size,
                                      c.shared_intermediate_size, c.n_group, c.topk_group, c.norm_topk_prob,
                                      c.routed_scaling_factor, c.moe_latent_size, bias=c.mlp_bias)
        self.needs_meta = kind in ("mamba", "attention")

    def forward(self, h: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        x = self.norm(h)
        return h + (self.mixer(x, meta) if self.needs_meta else self.mixer(x))


class NemotronHForCausalLM(HybridForCausalLM):
    """Parameter names follow the HF checkpoints (`backbone.` read as `model.`)."""

    def __init__(self, c: HybridConfig):
        super().__init__()
        self.config = c
        self.model = nn.Module()
        self.model.embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.layers = nn.ModuleList(NemotronHBlock(c, kind) for kind in c.layer_types)
        self.model.norm_f = RMSNorm(c.hidden_size, c.norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embeddings

    def forward(self, input_ids: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        h = self.model.embeddings(input_ids)
        for layer in self.model.layers:
            h = layer(h, meta)
        return self.model.norm_f(h)

    def normalize_checkpoint_name(self, name: str) -> str | None:
        name = super().normalize_checkpoint_name(name)
        if name is None:
            return None
        if name == "model.embed_tokens.weight":
            return "model.embeddings.weight"
        return name
