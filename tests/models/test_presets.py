"""The published-checkpoint presets (`hybrid_engine/models/preset_configs/*.json`): each one
builds the model its model card describes, with exactly the parameters transformers builds
from the same config.json."""
import re
from collections import Counter

import pytest
import torch
import transformers

from hybrid_engine.models.config import parse_hf_config
from hybrid_engine.models.loader import create_model
from hybrid_engine.models.presets import get_preset, preset_names, preset_source
from layers.kernels import REFERENCE_OPS

# What each model card states: layers by kind, total parameters and (MoE) active parameters
# including embeddings. Card sizes are rounded to the billion ("8B"), hence SIZE_TOLERANCE.
CARDS = {
    "nemotron-h-8b": (Counter(mamba=24, mlp=24, attention=4), 8e9, None),
    "nvidia-nemotron-nano-9b-v2": (Counter(mamba=27, mlp=25, attention=4), 9e9, None),
    "nemotron-3-nano-30b-a3b": (Counter(mamba=23, moe=23, attention=6), 31.6e9, 3.6e9),
    "granite-4.0-h-micro": (Counter(mamba=36, attention=4), 3e9, None),
    "granite-4.0-h-tiny": (Counter(mamba=36, attention=4), 7e9, None),
}
SIZE_TOLERANCE = 0.08
SOURCE_URL = re.compile(r"^https://huggingface\.co/[\w.-]+/[\w.-]+/blob/main/config\.json$")


def _meta_model(name: str):
    config = parse_hf_config(get_preset(name))
    model = create_model(config, torch.device("meta"), torch.bfloat16, ops=REFERENCE_OPS)
    if config.tie_word_embeddings:
        model.tie_embeddings()
    return config, model


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied table counts once


def test_every_card_has_a_preset() -> None:
    assert preset_names() == sorted(CARDS)


@pytest.mark.parametrize("name", sorted(CARDS))
def test_source_cites_the_published_config(name: str) -> None:
    assert SOURCE_URL.match(preset_source(name)), preset_source(name)
    assert not {"_source", "_notes"} & set(get_preset(name))  # ours, not the checkpoint's


def test_get_preset_returns_a_fresh_copy() -> None:
    cfg = get_preset("granite-4.0-h-tiny")
    cfg["layer_types"][0] = "attention"
    cfg["hidden_size"] = -1
    again = get_preset("granite-4.0-h-tiny")
    assert again["layer_types"][0] == "mamba" and again["hidden_size"] == 1536


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="no-such-model") as excinfo:
        get_preset("no-such-model")
    assert all(name in str(excinfo.value) for name in CARDS)


@pytest.mark.parametrize("name", sorted(CARDS))
def test_preset_builds_the_model_its_card_describes(name: str) -> None:
    layers, total, active = CARDS[name]
    config, model = _meta_model(name)
    assert Counter(config.layer_types) == layers
    assert len(config.layer_types) == get_preset(name)["num_hidden_layers"]
    n_params = _num_params(model)
    assert abs(n_params - total) <= SIZE_TOLERANCE * total, f"{n_params / 1e9:.2f}B parameters"
    if active is not None:  # routed experts count top_k of num_experts per token
        routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        n_active = n_params - routed * (1 - config.top_k / config.num_experts)
        assert abs(n_active - active) <= SIZE_TOLERANCE * active, f"{n_active / 1e9:.2f}B active"


@pytest.mark.parametrize("name", sorted(CARDS))
def test_parameter_count_equals_transformers(name: str) -> None:
    """transformers (the oracle) builds the same number of parameters from the same file."""
    cfg = get_preset(name)
    (architecture,) = cfg["architectures"]
    hf_config = getattr(transformers, architecture.replace("ForCausalLM", "Config"))(**cfg)
    with torch.device("meta"):
        hf_model = getattr(transformers, architecture)(hf_config)
    assert _num_params(_meta_model(name)[1]) == _num_params(hf_model)
