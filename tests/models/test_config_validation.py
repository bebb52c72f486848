"""config.json values that would crash, mislead or silently give garbage are a ConfigError
(a ValueError) naming the field in the spelling the config's family uses."""
import json

import pytest

from hybrid_engine import LLM
from hybrid_engine.models.config import GRANITE_MOE_HYBRID, NEMOTRON_H, ConfigError, parse_hf_config
from tests.models.conftest import GRANITE_MOE_ROPE, NEMOTRON_LATENT, NEMOTRON_MOE

NEMOTRON = dict(NEMOTRON_MOE, architectures=[NEMOTRON_H])
GRANITE = dict(GRANITE_MOE_ROPE, architectures=[GRANITE_MOE_HYBRID])
BASES = {"nemotron": NEMOTRON, "granite": GRANITE}


@pytest.mark.parametrize("base, changes, match", [
    # head_dim: 0 raised ZeroDivisionError, a negative one a torch shape error.
    ("nemotron", {"head_dim": 0}, "'head_dim' must be positive"),
    ("nemotron", {"head_dim": -8}, "'head_dim' must be positive"),
    ("granite", {"head_dim": 0}, "'head_dim' must be positive"),
    # Norm epsilons: a negative one gave NaN activations (every output token 0).
    ("nemotron", {"layer_norm_epsilon": -1e-5}, "'layer_norm_epsilon' must be > 0"),
    ("nemotron", {"rms_norm_eps": 0.0}, "'rms_norm_eps' must be > 0"),
    ("nemotron", {"layer_norm_epsilon": "NaN"}, "'layer_norm_epsilon' must be a finite number"),
    ("granite", {"rms_norm_eps": -1e-6}, "'rms_norm_eps' must be > 0"),
    # max_position_embeddings 0 surfaced as "num_kv_blocks (0) ... must be positive".
    ("nemotron", {"max_position_embeddings": 0}, "'max_position_embeddings' must be positive"),
    ("granite", {"max_position_embeddings": -1}, "'max_position_embeddings' must be positive"),
    # Mamba group counts: 0 raised ZeroDivisionError, -1 a split error at the first step.
    ("nemotron", {"n_groups": 0}, "'n_groups' must be positive"),
    ("nemotron", {"n_groups": -1}, "'n_groups' must be positive"),
    ("granite", {"mamba_n_groups": 0}, "'mamba_n_groups' must be positive"),
    # Granite spells the Mamba fields its own way; messages named NemotronH's spelling.
    ("granite", {"mamba_d_state": 0}, "'mamba_d_state' must be positive"),
    ("granite", {"mamba_d_conv": 0}, "'mamba_d_conv' must be positive"),
    ("granite", {"mamba_n_groups": 3}, "'mamba_n_groups' must divide"),
    # MoE router groups: 0 raised ZeroDivisionError.
    ("nemotron", {"n_group": 0}, "'n_group' must be positive"),
    # Negative layer widths raised torch shape errors while building the model.
    ("nemotron", {"intermediate_size": -1}, "'intermediate_size' must be >= 0"),
    ("nemotron", {"moe_intermediate_size": -1}, "'moe_intermediate_size' must be >= 0"),
    ("nemotron", {"moe_shared_expert_intermediate_size": -1}, "'moe_shared_expert_intermediate_size' must be >= 0"),
    ("granite", {"intermediate_size": -1}, "'intermediate_size' must be >= 0"),
    ("granite", {"shared_intermediate_size": -1}, "'shared_intermediate_size' must be >= 0"),
    ("granite", {"num_local_experts": -1}, "'num_local_experts' must be >= 0"),
    # Values whose log is taken (dummy dt init), divisors and RoPE's base.
    ("nemotron", {"time_step_min": -0.001}, "'time_step_min' must be > 0"),
    ("nemotron", {"time_step_min": 0.5, "time_step_max": 0.1}, "'time_step_min' .* must be <= time_step_max"),
    ("granite", {"time_step_limit": [0.1, 0.01]}, "'time_step_limit' must satisfy 0 <= low <= high"),
    ("granite", {"time_step_limit": [0.0, "NaN"]}, "'time_step_limit' must be a finite number"),
    ("granite", {"rope_theta": 0}, "'rope_theta' must be > 0"),
    ("granite", {"logits_scaling": 0}, "'logits_scaling' must be > 0"),
    ("granite", {"embedding_multiplier": "Infinity"}, "'embedding_multiplier' must be a finite number"),
    ("granite", {"attention_multiplier": "NaN"}, "'attention_multiplier' must be a finite number"),
])
def test_bad_value_names_the_field(base, changes, match):
    with pytest.raises(ConfigError, match=match):
        parse_hf_config({**BASES[base], **changes})


def test_missing_num_attention_heads_is_named():
    """With attention layers the head count is required: it used to default to 1 and fail
    as "'num_key_value_heads' must divide num_attention_heads". Without them it stays optional."""
    for base in BASES.values():
        cfg = {k: v for k, v in base.items() if k != "num_attention_heads"}
        with pytest.raises(ConfigError, match="missing required field 'num_attention_heads'"):
            parse_hf_config(cfg)
    cfg = {k: v for k, v in NEMOTRON.items() if k not in ("num_attention_heads", "head_dim")}
    c = parse_hf_config({**cfg, "hybrid_override_pattern": "M-ME"})
    assert c.attention_layers == [] and c.mamba_layers == [0, 2]


def test_moe_latent_size_must_be_a_positive_integer():
    cfg = dict(NEMOTRON_LATENT, architectures=[NEMOTRON_H])
    assert parse_hf_config(cfg).moe_latent_size == 16
    for bad in (0, 16.5):
        with pytest.raises(ConfigError, match="moe_latent_size"):
            parse_hf_config({**cfg, "moe_latent_size": bad})


@pytest.mark.parametrize("changes, match", [
    ({"max_position_embeddings": 0}, "'max_position_embeddings' must be positive"),
    ({"layer_norm_epsilon": -1.0}, "'layer_norm_epsilon' must be > 0"),
])
def test_engine_refuses_the_checkpoint_naming_the_field(tmp_path, changes, match):
    """Through the engine, as a user meets it (before: a num_kv_blocks message / NaN outputs)."""
    (tmp_path / "config.json").write_text(json.dumps({**NEMOTRON, **changes}))
    with pytest.raises(ValueError, match=match):
        LLM(model=str(tmp_path), device="cpu", load_format="dummy")
