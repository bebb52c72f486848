"""Tiny random HF checkpoints (made with transformers' save_pretrained) and a direct
single-sequence driver of our model, shared by the model tests."""
import inspect

import pytest
import torch

from hybrid_engine.models.loader import load_model, read_config
from layers.forward_meta import ForwardMeta
from layers.parallel import SINGLE, ParallelContext

NEMOTRON_MOE = dict(
    vocab_size=96, hidden_size=32, hybrid_override_pattern="M*-ME-M*E", num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=8,
    chunk_size=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1, eos_token_id=2,
)
NEMOTRON_LATENT = dict(
    vocab_size=80, hidden_size=24, layers_block_type=["mamba", "moe", "attention", "mlp", "mamba"],
    num_attention_heads=3, num_key_value_heads=3, head_dim=8, intermediate_size=40, mamba_num_heads=4,
    mamba_head_dim=12, n_groups=1, ssm_state_size=6, chunk_size=8, n_routed_experts=6, num_experts_per_tok=3,
    moe_intermediate_size=12, moe_shared_expert_intermediate_size=20, moe_latent_size=16, n_group=1, topk_group=1,
    norm_topk_prob=False, routed_scaling_factor=2.5, use_conv_bias=False, eos_token_id=2,
)
GRANITE_MOE_ROPE = dict(
    vocab_size=96, hidden_size=32, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"],
    num_attention_heads=4, num_key_value_heads=2, intermediate_size=16, shared_intermediate_size=24,
    mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=4, num_local_experts=4,
    num_experts_per_tok=2, position_embedding_type="rope", embedding_multiplier=3.0, residual_multiplier=0.5,
    attention_multiplier=0.2, logits_scaling=2.0, tie_word_embeddings=True, attention_bias=True, eos_token_id=2,
)
GRANITE_DENSE_NOPE = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=3, layer_types=["mamba", "mamba", "attention"],
    num_attention_heads=4, num_key_value_heads=1, intermediate_size=16, shared_intermediate_size=40,
    mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16, num_local_experts=0,
    position_embedding_type="nope", eos_token_id=2,
)
# For the scheduling-path oracle tests (test_hf_oracle_paths.py). initializer_range 0.3 and
# untied Granite embeddings give peaked, varied greedy outputs (with the defaults a tiny
# random model repeats one token from near-uniform logits, which proves little). The dt
# limit binds: transformers applies it to prompt tokens (chunked scan) and not to generated
# ones (recurrent update), a split that chunking and evict-and-recompute must keep. NemotronH
# clamps dt >= time_step_min (its dt_bias init draws dt from [time_step_min, time_step_max]);
# GraniteMoeHybrid clamps to time_step_limit. position_embedding_type None is transformers' NoPE.
NEMOTRON_MOE_SHARP = dict(NEMOTRON_MOE, initializer_range=0.3, time_step_min=0.05, time_step_max=0.1)
GRANITE_MOE_ROPE_SHARP = dict(GRANITE_MOE_ROPE, initializer_range=0.3, tie_word_embeddings=False)
# Sharp, with a dt limit that never binds: dt >= time_step_min = 1e-30, where the dt_bias
# init (dt drawn from [1e-30, 0.1], floored at 1e-4) keeps softplus(dt + dt_bias) far above
# it. Prompt and generated tokens update the state alike, so a conversation's next turn,
# resumed from the state its previous answer left (prefix caching), equals a fresh
# prefill of the whole text. (1e-6 bound: generated tokens' dt fell under it.)
NEMOTRON_MOE_SHARP_OPEN = dict(NEMOTRON_MOE, initializer_range=0.3, time_step_min=1e-30, time_step_floor=1e-4,
                               head_dim=16)
GRANITE_MOE_NOPE_SHARP = dict(GRANITE_MOE_ROPE_SHARP, position_embedding_type=None, time_step_limit=(0.0, 0.06))
CHECKPOINTS = {
    "nemotron_moe": ("NemotronHConfig", "NemotronHForCausalLM", NEMOTRON_MOE),
    "nemotron_latent": ("NemotronHConfig", "NemotronHForCausalLM", NEMOTRON_LATENT),
    "granite_moe_rope": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", GRANITE_MOE_ROPE),
    "granite_dense_nope": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", GRANITE_DENSE_NOPE),
    "nemotron_moe_sharp": ("NemotronHConfig", "NemotronHForCausalLM", NEMOTRON_MOE_SHARP),
    "granite_moe_rope_sharp": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", GRANITE_MOE_ROPE_SHARP),
    "nemotron_moe_sharp_open": ("NemotronHConfig", "NemotronHForCausalLM", NEMOTRON_MOE_SHARP_OPEN),
    "granite_moe_nope_sharp": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", GRANITE_MOE_NOPE_SHARP),
}


def is_hf_oracle(hf) -> bool:
    """Whether this transformers computes `hf` as the checkpoint's own kernels do. Not so in
    transformers 5.17 for GraniteMoeHybrid with more than one Mamba group: it normalizes the
    gated RMSNorm over all groups at once, where mamba_ssm (and this engine, and
    transformers 5.24) normalize each group."""
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid

    per_group = "group_size" in inspect.signature(modeling_granitemoehybrid.GraniteMoeHybridRMSNormGated).parameters
    return per_group or hf.config.model_type != "granitemoehybrid" or hf.config.mamba_n_groups == 1


def skip_unless_hf_oracle(hf) -> None:
    """Skip the calling test where `hf` is no oracle (`is_hf_oracle`)."""
    import transformers

    if not is_hf_oracle(hf):
        pytest.skip(f"transformers {transformers.__version__} normalizes GraniteMoeHybrid's gated RMSNorm over all "
                    "Mamba groups at once, not per group as the checkpoints' mamba_ssm kernels and this engine do "
                    "(later transformers, e.g. 5.24, do too): no oracle for mamba_n_groups > 1")


def make_hf_checkpoint(path, name: str | tuple[str, str, dict], seed: int = 0, **save_kwargs):
    """Build the named tiny HF model (or a (config class, model class, kwargs) one) with random
    weights, save it to `path`, return the HF model."""
    import transformers

    config_cls, model_cls, kwargs = CHECKPOINTS[name] if isinstance(name, str) else name
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()
    with torch.no_grad():  # non-trivial values where HF's init leaves zeros / ones
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith("layernorm.weight") or pname.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if pname.endswith("dt_bias") or pname.endswith(".D"):
                p.add_(torch.randn_like(p) * 0.3)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    model.save_pretrained(path, **save_kwargs)
    return model


@pytest.fixture(scope="session", params=sorted(CHECKPOINTS))
def hf_checkpoint(request, tmp_path_factory):
    """(name, checkpoint dir, HF model) for every tiny architecture variant of CHECKPOINTS."""
    path = tmp_path_factory.mktemp(request.param)
    return request.param, str(path), make_hf_checkpoint(path, request.param)


class SingleSequence:
    """Drives our model directly on one sequence with hand-built step metadata (`tp`: this
    process's rank of a tensor-parallel model; its caches hold the rank's share)."""

    def __init__(self, path: str, block_size: int = 4, num_blocks: int = 64, tp: ParallelContext = SINGLE):
        self.model = load_model(read_config(path), path, torch.device("cpu"), torch.float32, tp=tp)
        c, pool = self.model.config, self.model.pool_shape()
        self.block_size = block_size
        for layer in self.model.attention_layers():
            shape = (num_blocks, block_size, pool.num_kv_heads, pool.head_dim)
            layer.kv_cache = (torch.zeros(shape), torch.zeros(shape))
        for mixer in self.model.mamba_mixers():
            mixer.conv_state = torch.zeros(1, pool.mamba_conv_dim, c.conv_kernel - 1)
            mixer.ssm_state = torch.zeros(1, pool.mamba_num_heads, pool.mamba_head_dim, pool.ssm_state_size)
        self.block_table = torch.randperm(num_blocks, dtype=torch.int32)[None]  # non-contiguous pages
        self.length = 0

    @torch.no_grad()
    def feed(self, ids: list[int], decode: bool = False, prompt: bool = True) -> torch.Tensor:
        """Run `ids` as one chunk (or one decode token); returns logits for every fed token."""
        n, start = len(ids), self.length
        pos = torch.arange(start, start + n)
        slots = self.block_table[0, pos // self.block_size].long() * self.block_size + pos % self.block_size
        cu = torch.tensor([0, n], dtype=torch.int32)
        meta = ForwardMeta(
            num_decode=int(decode), num_prefill=int(not decode), num_tokens=n, max_seqlen_q=n, positions=pos,
            prompt_token_mask=torch.full((n,), prompt and not decode), slot_mapping=slots, cu_seqlens_q=cu,
            prefill_cu_seqlens=cu, seq_lens=torch.tensor([start + n], dtype=torch.int32),
            block_tables=self.block_table, mamba_src=torch.zeros(1, dtype=torch.long),
            mamba_dst=torch.zeros(1, dtype=torch.long), logits_indices=torch.tensor([n - 1]),
        )
        self.length += n
        return self.model.compute_logits(self.model(torch.tensor(ids), meta))

    def states(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(m.conv_state.clone(), m.ssm_state.clone()) for m in self.model.mamba_mixers()]


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of `prompt` with its cache (prompt prefilled by the
    chunked scan, each generated token a recurrent decode step: the engine's semantics), and
    the log_softmax of its raw logits at every generated position ([max_new_tokens, vocab])."""
    skip_unless_hf_oracle(hf)
    ids = torch.tensor([prompt])
    # (An explicit mask: generate would mask out prompt tokens equal to pad_token_id.)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                      min_new_tokens=max_new_tokens,
                      do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                      return_dict_in_generate=True)
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    return out.sequences[0, len(prompt):].tolist(), logprobs
