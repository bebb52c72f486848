"""What every model family offers the engine: a packed-token forward over bound caches,
logits for the sampled rows, and the mapping from checkpoint names to parameters."""
import re

import torch
from torch import nn

from hybrid_engine.models.config import HybridConfig
from layers.attention import PagedAttention
from layers.forward_meta import ForwardMeta
from layers.mamba2 import Mamba2Mixer
from layers.rotary import RotaryEmbedding

# Per-expert checkpoint tensors ("...experts.3.up_proj.weight") stacked into one [E, ...]
# parameter; the loader groups by (prefix, name) and stacks by expert index.
PER_EXPERT_KEY = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<index>\d+)\.(?P<name>\w+)\.weight$")


class HybridForCausalLM(nn.Module):
    """Base class: subclasses build `self.model` (embeddings, layers, final norm) and `lm_head`."""

    config: HybridConfig
    lm_head: nn.Linear

    def forward(self, input_ids: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for the packed step tokens."""
        raise NotImplementedError

    def input_embeddings(self) -> nn.Embedding:
        """The token embedding table."""
        raise NotImplementedError

    def tie_embeddings(self) -> None:
        """Share the embedding table with the LM head (`tie_word_embeddings`)."""
        self.lm_head.weight = self.input_embeddings().weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given hidden rows."""
        return self.lm_head(hidden).float()

    def mamba_mixers(self) -> list[Mamba2Mixer]:
        """Mamba layers in order; their index is the layer's index in the Mamba state pools."""
        return [m for m in self.modules() if isinstance(m, Mamba2Mixer)]

    def attention_layers(self) -> list[PagedAttention]:
        """Attention layers in order; their index is the layer's index in the KV pools."""
        return [m for m in self.modules() if isinstance(m, PagedAttention)]

    def normalize_checkpoint_name(self, name: str) -> str | None:
        """Map a checkpoint tensor name to this model's parameter name; None = ignore it."""
        if name.startswith("backbone."):
            name = "model." + name[len("backbone."):]
        if name.startswith("mtp.") or name.endswith("rotary_emb.inv_freq"):
            return None  # multi-token-prediction heads and derived buffers are not used
        return name


def make_attention(c: HybridConfig) -> PagedAttention:
    """The attention mixer of either family (RoPE only where the config asks for it)."""
    rotary = RotaryEmbedding(c.head_dim, c.rope_theta) if c.rope_theta is not None else None
    return PagedAttention(c.hidden_size, c.num_attention_heads, c.num_kv_heads, c.head_dim, c.attention_scale,
                          bias=c.attention_bias, rotary=rotary)


def make_mamba(c: HybridConfig) -> Mamba2Mixer:
    """The Mamba-2 mixer of either family."""
    return Mamba2Mixer(c.hidden_size, c.mamba_num_heads, c.mamba_head_dim, c.mamba_n_groups, c.ssm_state_size,
                       c.conv_kernel, c.chunk_size, c.dt_limit, c.norm_eps, c.use_conv_bias, c.mamba_proj_bias)
