"""The skeleton both model families share: embeddings -> one block per layer -> final
RMSNorm -> LM head, a packed-token forward over bound caches, logits for the sampled rows,
and the mapping from checkpoint names to parameters. A family file says only what differs.

Tensor parallel: a model built with a `ParallelContext` of world size N holds this rank's
share of every layer (see `layers/parallel.py`); embeddings and LM head are split by
vocabulary rows, norms replicated; `forward` and `compute_logits` return the full hidden
states and logits on every rank."""
import re
from dataclasses import dataclass

import torch
from torch import nn

from hybrid_engine.models.config import HybridConfig
from hybrid_engine.models.tensor_parallel import validate_tensor_parallel
from layers.attention import PagedAttention
from layers.forward_meta import ForwardMeta
from layers.kernels.ops import KernelOps
from layers.mamba2 import Mamba2Mixer
from layers.norms import RMSNorm
from layers.parallel import SINGLE, ParallelContext, ParallelLMHead, VocabParallelEmbedding
from layers.rotary import RotaryEmbedding

# Per-expert checkpoint tensors ("...experts.3.up_proj.weight") stacked into one [E, ...]
# parameter; the loader groups by (prefix, name) and stacks by expert index.
PER_EXPERT_KEY = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<index>\d+)\.(?P<name>\w+)\.weight$")


@dataclass(frozen=True)
class PoolShape:
    """This rank's cache dimensions, read from the built layers (the engine sizes its KV and
    Mamba state pools from them): at world size 1 the config's, else the local shares."""

    num_attention_layers: int
    num_kv_heads: int
    head_dim: int
    num_mamba_layers: int
    mamba_conv_dim: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int


class HybridForCausalLM(nn.Module):
    """A hybrid decoder whose kernel-calling layers all run the op set `ops` given here.

    A family subclass sets `block` (built as `block(config, layer_kind, ops=ops, tp=tp)`, called as
    `block(x, residual, meta) -> (output, residual)`, see `forward`) and the checkpoint names
    of its embedding table and final norm; it overrides `embed` / `logits_divisor` /
    `branch_scale` where its model scales them.
    """

    block: type[nn.Module]
    embeddings_name: str  # under `model.`
    final_norm_name: str  # under `model.`
    norm_weight_in_fp32: bool = True  # see `KernelOps.rms_norm`

    def __init__(self, config: HybridConfig, *, ops: KernelOps, tp: ParallelContext = SINGLE):
        super().__init__()
        validate_tensor_parallel(config, tp.world_size, tp.expert_parallel)
        c = self.config = config
        self.tp = tp
        self.ops = ops
        self.model = nn.Module()
        self.model.add_module(self.embeddings_name, VocabParallelEmbedding(c.vocab_size, c.hidden_size, tp=tp))
        self.model.layers = nn.ModuleList(self.block(c, kind, ops=ops, tp=tp) for kind in c.layer_types)
        self.model.add_module(self.final_norm_name,
                              RMSNorm(c.hidden_size, c.norm_eps, ops=ops, weight_in_fp32=self.norm_weight_in_fp32))
        self.lm_head = ParallelLMHead(c.hidden_size, c.vocab_size, ops=ops, tp=tp)

    def forward(self, input_ids: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for the packed step tokens.

        The residual stream travels beside the blocks' outputs, so that every residual add
        is fused into the norm after it (`KernelOps.add_rms_norm`): a block takes the
        previous block's last branch output x, not yet added, and the stream before it
        (None before the first block: x is then the embeddings), and returns the same pair;
        the final norm adds the last output. The sums are the ones of `h = h + branch(h)`.
        """
        x, residual = self.embed(input_ids), None
        for layer in self.model.layers:
            x, residual = layer(x, residual, meta)
        normed, _ = getattr(self.model, self.final_norm_name)(x, residual, self.branch_scale())
        return normed

    def branch_scale(self) -> float | None:
        """The factor each block branch's output is multiplied by before its residual add
        (None: added as it is)."""
        return None

    def input_embeddings(self) -> nn.Embedding:
        """The token embedding table."""
        return getattr(self.model, self.embeddings_name)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first hidden states of the packed step tokens."""
        return self.input_embeddings()(input_ids)

    def tie_embeddings(self) -> None:
        """Share the embedding table with the LM head (`tie_word_embeddings`)."""
        self.lm_head.weight = self.input_embeddings().weight

    def logits_divisor(self) -> float | None:
        """What the LM head's output is divided by to give the logits (None: nothing)."""
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [rows, vocab] for the given hidden rows (all of them on every rank)."""
        raw, divisor = self.lm_head(hidden), self.logits_divisor()
        return (raw if divisor is None else raw / divisor).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of `compute_logits(hidden)` per row (int64 [rows]), without the float32
        logits: the scaling, cast and argmax are one op (`KernelOps.logits_argmax`)."""
        return self.ops.logits_argmax(self.lm_head(hidden), self.logits_divisor())

    def mamba_mixers(self) -> list[Mamba2Mixer]:
        """Mamba layers in order; their index is the layer's index in the Mamba state pools."""
        return [m for m in self.modules() if isinstance(m, Mamba2Mixer)]

    def attention_layers(self) -> list[PagedAttention]:
        """Attention layers in order; their index is the layer's index in the KV pools."""
        return [m for m in self.modules() if isinstance(m, PagedAttention)]

    def pool_shape(self) -> PoolShape:
        """This rank's cache dimensions (see `PoolShape`); without attention (or Mamba)
        layers the missing ones are the config's."""
        c, attention, mamba = self.config, self.attention_layers(), self.mamba_mixers()
        a, m = attention[0] if attention else None, mamba[0] if mamba else None
        return PoolShape(
            num_attention_layers=len(attention),
            num_kv_heads=a.num_kv_heads if a else c.num_kv_heads,
            head_dim=a.head_dim if a else c.head_dim,
            num_mamba_layers=len(mamba),
            mamba_conv_dim=m.conv_dim if m else c.mamba_conv_dim,
            mamba_num_heads=m.num_heads if m else c.mamba_num_heads,
            mamba_head_dim=m.head_dim if m else c.mamba_head_dim,
            ssm_state_size=m.state_size if m else c.ssm_state_size,
        )

    def normalize_checkpoint_name(self, name: str) -> str | None:
        """Map a checkpoint tensor name to this model's parameter name; None = ignore it."""
        if name.startswith("backbone."):
            name = "model." + name[len("backbone."):]
        if name.startswith("mtp.") or name.endswith("rotary_emb.inv_freq"):
            return None  # multi-token-prediction heads and derived buffers are not used
        return name


def make_attention(c: HybridConfig, ops: KernelOps, tp: ParallelContext = SINGLE) -> PagedAttention:
    """The attention mixer of either family (RoPE only where the config asks for it)."""
    rotary = RotaryEmbedding(c.head_dim, c.rope_theta) if c.rope_theta is not None else None
    return PagedAttention(c.hidden_size, c.num_attention_heads, c.num_kv_heads, c.head_dim, c.attention_scale,
                          bias=c.attention_bias, rotary=rotary, ops=ops, tp=tp)


def make_mamba(c: HybridConfig, ops: KernelOps, tp: ParallelContext = SINGLE) -> Mamba2Mixer:
    """The Mamba-2 mixer of either family."""
    return Mamba2Mixer(c.hidden_size, c.mamba_num_heads, c.mamba_head_dim, c.mamba_n_groups, c.ssm_state_size,
                       c.conv_kernel, c.dt_limit, c.norm_eps, c.use_conv_bias, c.mamba_proj_bias, ops=ops, tp=tp)
