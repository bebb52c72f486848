"""Tests for the published-checkpoint presets in ``hybrid_engine.models.presets``."""

import pytest
import transformers

from hybrid_engine.models.presets import PRESET_SOURCES, PRESETS, get_preset

NEMOTRON_H = "NemotronHForCausalLM"
GRANITE_HYBRID = "GraniteMoeHybridForCausalLM"

EXPECTED_NAMES = {
    "nemotron-h-8b",
    "nvidia-nemotron-nano-9b-v2",
    "nemotron-3-nano-30b-a3b",
    "granite-4.0-h-micro",
    "granite-4.0-h-tiny",
}


def _architecture(cfg: dict) -> str:
    """Return the single architecture a preset declares."""
    (architecture,) = cfg["architectures"]
    return architecture


def _layer_pattern(cfg: dict) -> list[str] | str | None:
    """Return the per-layer pattern field of a preset, whichever spelling it uses."""
    for key in ("hybrid_override_pattern", "layers_block_type", "layer_types"):
        if key in cfg:
            return cfg[key]
    return None


def _names_of(architecture: str) -> list[str]:
    """Return the names of the presets declaring ``architecture``."""
    return [name for name, cfg in PRESETS.items() if _architecture(cfg) == architecture]


def test_preset_names_and_sources() -> None:
    assert set(PRESETS) == EXPECTED_NAMES
    assert set(PRESET_SOURCES) == EXPECTED_NAMES
    for name, source in PRESET_SOURCES.items():
        assert source.startswith("https://huggingface.co/"), name


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_architecture_is_supported(name: str) -> None:
    assert _architecture(PRESETS[name]) in {NEMOTRON_H, GRANITE_HYBRID}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_layer_pattern_matches_layer_count(name: str) -> None:
    cfg = PRESETS[name]
    pattern = _layer_pattern(cfg)
    assert pattern is not None, f"{name} declares no layer pattern"
    assert len(pattern) == cfg["num_hidden_layers"]


def test_get_preset_returns_independent_copy() -> None:
    for name in PRESETS:
        cfg = get_preset(name)
        assert cfg == PRESETS[name]
        cfg["hidden_size"] = -1
        cfg["architectures"].append("Mutated")
        assert PRESETS[name]["hidden_size"] != -1
        assert PRESETS[name]["architectures"] != cfg["architectures"]

    tiny = get_preset("granite-4.0-h-tiny")
    tiny["layer_types"][0] = "attention"
    assert PRESETS["granite-4.0-h-tiny"]["layer_types"][0] == "mamba"
    assert PRESETS["granite-4.0-h-micro"]["layer_types"][0] == "mamba"


def test_get_preset_rejects_unknown_name() -> None:
    with pytest.raises(ValueError, match="no-such-model") as excinfo:
        get_preset("no-such-model")
    for name in PRESETS:
        assert name in str(excinfo.value)


@pytest.mark.parametrize("name", _names_of(NEMOTRON_H))
def test_nemotron_h_presets_build_transformers_config(name: str) -> None:
    cfg = get_preset(name)
    config = transformers.NemotronHConfig(**cfg)
    assert config.num_hidden_layers == cfg["num_hidden_layers"]
    assert config.hybrid_override_pattern == cfg["hybrid_override_pattern"]
    assert config.mamba_num_heads == cfg["mamba_num_heads"]
    assert config.mamba_head_dim == cfg["mamba_head_dim"]
    assert config.n_groups == cfg["n_groups"]
    assert config.ssm_state_size == cfg["ssm_state_size"]
    assert config.num_key_value_heads == cfg["num_key_value_heads"]


@pytest.mark.parametrize("name", _names_of(GRANITE_HYBRID))
def test_granite_presets_build_transformers_config(name: str) -> None:
    cfg = get_preset(name)
    config = transformers.GraniteMoeHybridConfig(**cfg)
    assert config.num_hidden_layers == cfg["num_hidden_layers"]
    # transformers 5 renames the checkpoint's "mamba"/"attention" to its own layer-type names.
    attention = [i for i, kind in enumerate(cfg["layer_types"]) if kind == "attention"]
    assert [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] == attention
    assert config.mamba_n_heads * config.mamba_d_head == config.mamba_expand * config.hidden_size
    assert config.num_local_experts == cfg["num_local_experts"]
