"""Published configurations of supported checkpoints, usable as ``LLM(model="preset:NAME")``.

Each preset is the ``config.json`` of a Hugging Face checkpoint this engine
serves, kept as a plain dict so that model construction, cache sizing
(attention KV blocks vs. Mamba-2 state slots) and tests can run without
downloading anything.  The dicts keep the checkpoint's own field names
(``hybrid_override_pattern`` for Nemotron-H, ``layer_types`` for Granite-4.0-H)
so they can be passed straight to ``transformers.NemotronHConfig`` /
``transformers.GraniteMoeHybridConfig``.

The Hugging Face model repositories themselves were not reachable from the
lookup tools used to write this file, so every dict was read from a copy of
the published file held in a public GitHub repository or HF page, as cited
above it.  Where no complete copy could be found, the comment says exactly
which fields were confirmed from which source and which were filled in.
Only ``auto_map`` (remote-code class paths) has been dropped.  A field that a
config.json does not carry (e.g. ``time_step_limit`` for the Nemotron-H
checkpoints) is left out rather than filled with the class default.
"""

import copy

# Nemotron-H-8B-Base-8K.
# Source: https://huggingface.co/nvidia/Nemotron-H-8B-Base-8K/blob/main/config.json
# Read from NVIDIA's own copy in github.com/NVIDIA-NeMo/Megatron-Bridge
# tests/unit_tests/models/nemotronh/test_nemotron_h_bridge.py (fixture
# `nemotronh_8b_config_dict`, commit 03c781b8), cross-checked against
# github.com/NVIDIA/TensorRT-LLM tests/unittest/_torch/modeling/test_modeling_nemotron_h.py
# (`NEMOTRON_H_CONFIG`).  The two agree on every field except `chunk_size`
# (Megatron-Bridge 128, TensorRT-LLM 256); 128 is kept, matching Megatron-Bridge
# (which also carries the file's `transformers_version`).  `sliding_window` is
# taken from the TensorRT-LLM copy.  The test-only keys of the Megatron-Bridge
# fixture (`hidden_act`, `n_routed_experts: None`) are not part of the
# published file and are omitted.
_NEMOTRON_H_8B: dict = {
    "architectures": ["NemotronHForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_head_dim": 128,
    "bos_token_id": 1,
    "chunk_size": 128,
    "conv_kernel": 4,
    "eos_token_id": 2,
    "expand": 2,
    "hidden_dropout": 0.0,
    "hidden_size": 4096,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "initializer_range": 0.02,
    "intermediate_size": 21504,
    "layer_norm_epsilon": 1e-05,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 128,
    "mamba_proj_bias": False,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "model_type": "nemotron_h",
    "n_groups": 8,
    "num_attention_heads": 32,
    "num_hidden_layers": 52,
    "num_key_value_heads": 8,
    "num_logits_to_keep": 1,
    "pad_token_id": 0,
    "rescale_prenorm_residual": True,
    "residual_in_fp32": False,
    "rms_norm_eps": 1e-05,
    "sliding_window": None,
    "ssm_state_size": 128,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.48.0.dev0",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "use_mamba_kernels": True,
    "vocab_size": 131072,
}

# NVIDIA-Nemotron-Nano-9B-v2.
# Source: https://huggingface.co/nvidia/NVIDIA-Nemotron-Nano-9B-v2/blob/main/config.json
# RECONSTRUCTED: no complete copy of this config.json was found.  The
# architecture fields below were each confirmed by at least two independent
# copies of the published values:
#   - NVIDIA's VoiceChat TensorRT build (`_THINKER_CONFIG`, pinned to
#     nvidia/NVIDIA-Nemotron-Nano-9B-v2 @ 6533e8de): hidden_size,
#     intermediate_size, num_hidden_layers, num_attention_heads,
#     num_key_value_heads, head_dim, rms_norm_eps, max_position_embeddings,
#     vocab_size, hybrid_override_pattern, mamba_num_heads, mamba_head_dim,
#     n_groups, ssm_state_size, conv_kernel;
#   - AgileRL arena memory tests ("published config.json values") and the
#     vllm-fit estimator tests: the same shapes and pattern;
#   - the Nemotron-Nano-12B-v2-Base spec sheet ("from HF config.json") and the
#     model card (56 layers = 27 Mamba-2 + 25 MLP + 4 attention): chunk_size 128,
#     131072 context.
# The remaining fields (dropouts, biases, activations, norm/residual flags,
# initializer_range, num_logits_to_keep, use_* flags, torch_dtype) are NOT
# confirmed for this checkpoint; they are the values every other published
# Nemotron-H config carries (the 8B and 30B-A3B files in this module).
# Likewise the token ids bos=1 / eos=2 / pad=0 are the Nemotron-H family values,
# not confirmed here (the VoiceChat build uses pad=12 for its own runtime).
_NEMOTRON_NANO_9B_V2: dict = {
    "architectures": ["NemotronHForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "chunk_size": 128,
    "conv_kernel": 4,
    "eos_token_id": 2,
    "expand": 2,
    "head_dim": 128,
    "hidden_dropout": 0.0,
    "hidden_size": 4480,
    "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
    "initializer_range": 0.02,
    "intermediate_size": 15680,
    "layer_norm_epsilon": 1e-05,
    "mamba_head_dim": 80,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 128,
    "mamba_proj_bias": False,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "model_type": "nemotron_h",
    "n_groups": 8,
    "num_attention_heads": 40,
    "num_hidden_layers": 56,
    "num_key_value_heads": 8,
    "num_logits_to_keep": 1,
    "pad_token_id": 0,
    "rescale_prenorm_residual": True,
    "residual_in_fp32": False,
    "rms_norm_eps": 1e-05,
    "sliding_window": None,
    "ssm_state_size": 128,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "use_mamba_kernels": True,
    "vocab_size": 131072,
}

# NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.
# Source: https://huggingface.co/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/blob/main/config.json
# Verbatim (minus `auto_map`) from the copy pasted into
# github.com/mehulbafnaa/jax-llm-examples nemotron3/tests/test_model.py
# (`NEMOTRON3_30B_JSON`, commit 3209b939), a fork of jax-ml/jax-llm-examples.
# Every shape also matches the config.json pages of the checkpoint's
# fine-tunes on HF (HebArabNlpProject/Hebatron, OpenResearcher/OpenResearcher-30B-A3B)
# and NVIDIA's Megatron-Bridge test fixture.  The file has no `time_step_limit`.
_NEMOTRON_3_NANO_30B_A3B: dict = {
    "architectures": ["NemotronHForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "chunk_size": 128,
    "conv_kernel": 4,
    "eos_token_id": 2,
    "expand": 2,
    "head_dim": 128,
    "hidden_dropout": 0.0,
    "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "initializer_range": 0.02,
    "intermediate_size": 1856,
    "layer_norm_epsilon": 1e-05,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 64,
    "mamba_proj_bias": False,
    "mamba_ssm_cache_dtype": "float32",
    "max_position_embeddings": 262144,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "model_type": "nemotron_h",
    "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712,
    "n_group": 1,
    "n_groups": 8,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "norm_eps": 1e-05,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 52,
    "num_key_value_heads": 2,
    "num_logits_to_keep": 1,
    "pad_token_id": 0,
    "partial_rotary_factor": 1.0,
    "rescale_prenorm_residual": True,
    "residual_in_fp32": False,
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "sliding_window": None,
    "ssm_state_size": 128,
    "tie_word_embeddings": False,
    "time_step_floor": 0.0001,
    "time_step_max": 0.1,
    "time_step_min": 0.001,
    "topk_group": 1,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.55.4",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "use_mamba_kernels": True,
    "vocab_size": 131072,
}

# Attention at layers 5, 15, 25 and 35, Mamba-2 everywhere else: the layout of
# all Granite-4.0-H 40-layer checkpoints (micro, tiny, 1b, small).
_GRANITE_4_0_H_LAYER_TYPES: list[str] = [
    "attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)
]

# granite-4.0-h-micro.
# Source: https://huggingface.co/ibm-granite/granite-4.0-h-micro/blob/main/config.json
# RECONSTRUCTED from partial copies; no complete copy was found.
#   - Fields `architectures` through `output_router_logits` (alphabetical order
#     below) are verbatim from the config.json page of a fine-tune of this
#     checkpoint on HF (huggingface.co/anuj6316/granite/blob/main/config.json,
#     cut off after `output_router_logits`; it was re-saved in float32, so its
#     `dtype` is not used).  Its shapes agree with a copy stated to be fetched
#     from huggingface.co/ibm-granite/granite-4.0-h-micro/raw/main/config.json
#     (hidden 2048, 32 heads, 8 kv heads, mamba 64x64, state 128, groups 1,
#     conv 4, 131072 positions, layer_types with attention at 5/15/25/35,
#     num_local_experts 0, shared_intermediate_size 8192).
#   - Filled in, not read from this checkpoint's file: pad_token_id 100256,
#     position_embedding_type "nope", residual_multiplier 0.22, rms_norm_eps
#     1e-05, rope_scaling None, rope_theta 10000, router_aux_loss_coef 0.0,
#     tie_word_embeddings True, torch_dtype "bfloat16", use_cache True,
#     vocab_size 100352.  These are the Granite-4.0 family values (the GGUF
#     metadata of IBM's Granite-4.0-H conversions on ollama.com: rms eps 1e-05,
#     rope base 10000, residual scale 0.22, vocab 100352, padding id 100256;
#     IBM: NoPE attention, BF16 weights).  `transformers_version` is unknown
#     and omitted.
_GRANITE_4_0_H_MICRO: dict = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_multiplier": 0.015625,
    "bos_token_id": 100257,
    "embedding_multiplier": 12,
    "eos_token_id": 100257,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.1,
    "intermediate_size": 8192,
    "layer_types": list(_GRANITE_4_0_H_LAYER_TYPES),
    "logits_scaling": 8,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_expand": 2,
    "mamba_n_groups": 1,
    "mamba_n_heads": 64,
    "mamba_proj_bias": False,
    "max_position_embeddings": 131072,
    "model_type": "granitemoehybrid",
    "normalization_function": "rmsnorm",
    "num_attention_heads": 32,
    "num_experts_per_tok": 0,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "num_local_experts": 0,
    "output_router_logits": False,
    "pad_token_id": 100256,
    "position_embedding_type": "nope",
    "residual_multiplier": 0.22,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000,
    "router_aux_loss_coef": 0.0,
    "shared_intermediate_size": 8192,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 100352,
}

# granite-4.0-h-tiny.
# Source: https://huggingface.co/ibm-granite/granite-4.0-h-tiny/blob/main/config.json
# RECONSTRUCTED from partial copies; no complete copy was found.
#   - Shapes and layout from a copy of the published config.json in a
#     performance-model test (`GRANITE_H_TINY_HF`): hidden 1536, 40 layers,
#     12 heads, 4 kv heads, intermediate 512, shared_intermediate_size 1024,
#     64 local experts, top-6, vocab 100352, tied embeddings, mamba 48x64,
#     state 128, groups 1, expand 2, conv 4, chunk 256, 131072 positions,
#     attention at layers 5/15/25/35.
#   - Multipliers and token ids from the GGUF metadata of IBM's own conversion
#     (ollama.com/library/granite4:tiny-h): attention scale 0.0078125,
#     embedding scale 12, logit scale 6, residual scale 0.22, rms eps 1e-05,
#     rope base 10000, bos/eos 100257.
#   - Filled in with the Granite-4.0-H family values of the micro preset above
#     (not read from this checkpoint's file): attention_bias, attention_dropout,
#     hidden_act, initializer_range, mamba_conv_bias, mamba_proj_bias,
#     model_type, normalization_function, output_router_logits, pad_token_id,
#     position_embedding_type, rope_scaling, router_aux_loss_coef, torch_dtype,
#     use_cache.  `transformers_version` is unknown and omitted.
_GRANITE_4_0_H_TINY: dict = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_multiplier": 0.0078125,
    "bos_token_id": 100257,
    "embedding_multiplier": 12,
    "eos_token_id": 100257,
    "hidden_act": "silu",
    "hidden_size": 1536,
    "initializer_range": 0.1,
    "intermediate_size": 512,
    "layer_types": list(_GRANITE_4_0_H_LAYER_TYPES),
    "logits_scaling": 6,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_expand": 2,
    "mamba_n_groups": 1,
    "mamba_n_heads": 48,
    "mamba_proj_bias": False,
    "max_position_embeddings": 131072,
    "model_type": "granitemoehybrid",
    "normalization_function": "rmsnorm",
    "num_attention_heads": 12,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 40,
    "num_key_value_heads": 4,
    "num_local_experts": 64,
    "output_router_logits": False,
    "pad_token_id": 100256,
    "position_embedding_type": "nope",
    "residual_multiplier": 0.22,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000,
    "router_aux_loss_coef": 0.0,
    "shared_intermediate_size": 1024,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 100352,
}

PRESETS: dict[str, dict] = {
    "nemotron-h-8b": _NEMOTRON_H_8B,
    "nvidia-nemotron-nano-9b-v2": _NEMOTRON_NANO_9B_V2,
    "nemotron-3-nano-30b-a3b": _NEMOTRON_3_NANO_30B_A3B,
    "granite-4.0-h-micro": _GRANITE_4_0_H_MICRO,
    "granite-4.0-h-tiny": _GRANITE_4_0_H_TINY,
}

PRESET_SOURCES: dict[str, str] = {
    "nemotron-h-8b": (
        "https://huggingface.co/nvidia/Nemotron-H-8B-Base-8K/blob/main/config.json "
        "(fetched via NVIDIA-NeMo/Megatron-Bridge "
        "tests/unit_tests/models/nemotronh/test_nemotron_h_bridge.py, cross-checked with "
        "NVIDIA/TensorRT-LLM tests/unittest/_torch/modeling/test_modeling_nemotron_h.py)"
    ),
    "nvidia-nemotron-nano-9b-v2": (
        "https://huggingface.co/nvidia/NVIDIA-Nemotron-Nano-9B-v2/blob/main/config.json "
        "(reconstructed: shapes from NVIDIA's VoiceChat TensorRT build pinned to revision "
        "6533e8de and other copies of the published values; non-shape fields are "
        "Nemotron-H family values)"
    ),
    "nemotron-3-nano-30b-a3b": (
        "https://huggingface.co/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/blob/main/config.json "
        "(fetched via mehulbafnaa/jax-llm-examples nemotron3/tests/test_model.py)"
    ),
    "granite-4.0-h-micro": (
        "https://huggingface.co/ibm-granite/granite-4.0-h-micro/blob/main/config.json "
        "(reconstructed: leading fields from the config.json of a fine-tune, "
        "huggingface.co/anuj6316/granite; the tail from Granite-4.0-H family values)"
    ),
    "granite-4.0-h-tiny": (
        "https://huggingface.co/ibm-granite/granite-4.0-h-tiny/blob/main/config.json "
        "(reconstructed: shapes from a copy of the published config.json, multipliers "
        "from IBM's GGUF metadata on ollama.com/library/granite4:tiny-h, the rest from "
        "Granite-4.0-H family values)"
    ),
}


def get_preset(name: str) -> dict:
    """Return a deep copy of the named preset's config dict.

    Args:
        name: A key of ``PRESETS``, e.g. ``"nemotron-h-8b"``.

    Returns:
        A fresh copy that the caller may mutate without affecting ``PRESETS``.

    Raises:
        ValueError: If ``name`` is not a known preset; the message lists the
            known names.
    """
    try:
        preset = PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown preset {name!r}; known presets: {known}") from None
    return copy.deepcopy(preset)
