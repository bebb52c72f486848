"""The embedded default model: a tiny NemotronH-style hybrid that needs no files.

`LLM()` with no model builds it in-process from this config with seeded random weights
and pairs it with the byte-level tokenizer, so every entry point runs on a fresh machine.
Its outputs are deterministic noise, not language: it exists to exercise the engine.
"""
from hybrid_engine.tokenizer import BOS_ID, BYTE_TOKENIZER_VOCAB_SIZE, EOS_ID, IM_END_ID, PAD_ID

EMBEDDED_MODEL_NAME = "hybrid-engine/embedded-tiny"
EMBEDDED_WEIGHT_SEED = 1234

EMBEDDED_CONFIG: dict = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": BYTE_TOKENIZER_VOCAB_SIZE,
    "hidden_size": 64,
    # Mamba, attention, MLP and MoE layers, each kind at least twice.
    "hybrid_override_pattern": "M*-ME-M*E",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "n_groups": 2,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "chunk_size": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 64,
    "n_group": 2,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 4096,
    "bos_token_id": BOS_ID,
    "eos_token_id": [EOS_ID, IM_END_ID],
    "pad_token_id": PAD_ID,
    "tie_word_embeddings": False,
}
