"""Checkpoint loading: layouts transformers and other tools write, and every error path."""
import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.models.config import ConfigError, parse_hf_config
from hybrid_engine.models.loader import CheckpointError, load_model, read_config
from tests.models.conftest import make_hf_checkpoint

PROMPT = [5, 17, 33, 9, 41, 12, 7]


def _greedy(path: str, **kwargs) -> list[int]:
    llm = LLM(model=path, device="cpu", dtype="float32", **kwargs)
    return llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0].output_token_ids


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotron")
    make_hf_checkpoint(path, "nemotron_moe")
    return str(path)


def _rewrite(src: str, dst, transform) -> str:
    """Copy a checkpoint, passing its tensors through `transform(dict) -> dict`."""
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), dst)
    save_file(transform(load_file(os.path.join(src, "model.safetensors"))), os.path.join(dst, "model.safetensors"))
    return str(dst)


def test_sharded_checkpoint_loads_like_single_file(tmp_path, nemotron_dir):
    sharded = tmp_path / "sharded"
    make_hf_checkpoint(sharded, "nemotron_moe", max_shard_size="20KB")
    assert os.path.isfile(sharded / "model.safetensors.index.json")
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    assert _greedy(str(sharded)) == _greedy(nemotron_dir)


def test_model_prefix_and_stacked_experts(tmp_path, nemotron_dir):
    def to_stacked(tensors: dict) -> dict:
        out, experts = {}, {}
        for key, value in tensors.items():
            key = key.replace("backbone.", "model.")
            parts = key.split(".")
            if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
                i = parts.index("experts")
                name = ".".join(parts[: i + 1] + [parts[i + 2]])
                experts.setdefault(name, {})[int(parts[i + 1])] = value
            else:
                out[key] = value
        for name, by_index in experts.items():
            out[name] = torch.stack([by_index[i] for i in sorted(by_index)])
        return out

    stacked = _rewrite(nemotron_dir, tmp_path / "stacked", to_stacked)
    assert _greedy(stacked) == _greedy(nemotron_dir)


def test_missing_weight_is_named(tmp_path, nemotron_dir):
    key = "backbone.layers.1.mixer.k_proj.weight"
    path = _rewrite(nemotron_dir, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(CheckpointError, match="model.layers.1.mixer.k_proj.weight"):
        load_model(read_config(path), path, torch.device("cpu"), torch.float32)


def test_wrong_shape_is_named(tmp_path, nemotron_dir):
    key = "backbone.layers.0.mixer.in_proj.weight"
    path = _rewrite(nemotron_dir, tmp_path / "shape", lambda t: {**t, key: t[key][:-1]})
    with pytest.raises(CheckpointError, match=r"in_proj\.weight.*shape"):
        load_model(read_config(path), path, torch.device("cpu"), torch.float32)


def test_unexpected_weight_is_named(tmp_path, nemotron_dir):
    path = _rewrite(nemotron_dir, tmp_path / "extra", lambda t: {**t, "backbone.layers.0.mixer.bogus": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="bogus"):
        load_model(read_config(path), path, torch.device("cpu"), torch.float32)


def test_unknown_architecture(nemotron_dir):
    cfg = read_config(nemotron_dir)
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    with pytest.raises(ConfigError, match="architectures"):
        parse_hf_config(cfg)


@pytest.mark.parametrize("field, value, match", [
    ("hybrid_override_pattern", "M*X", "unknown layer type"),
    ("hidden_size", "big", "hidden_size"),
    ("hidden_size", None, "hidden_size"),
    ("num_key_value_heads", 3, "num_key_value_heads"),
    ("n_groups", 3, "n_groups"),
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
])
def test_malformed_config_names_the_field(nemotron_dir, field, value, match):
    cfg = read_config(nemotron_dir)
    cfg.pop("layers_block_type", None)
    cfg["hybrid_override_pattern"] = cfg.get("hybrid_override_pattern", "M*-ME-M*E")
    cfg[field] = value
    with pytest.raises(ConfigError, match=match):
        parse_hf_config(cfg)


def test_invalid_json_and_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        read_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_config(str(tmp_path))


@pytest.mark.parametrize("limit", [[0.0, "Infinity"], [0.0, {"__float__": "Infinity"}], [0.0, float("inf")]])
def test_time_step_limit_spellings(limit):
    cfg = {"architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 10, "hidden_size": 8,
           "num_attention_heads": 2, "layer_types": ["mamba"], "mamba_n_heads": 2, "mamba_d_state": 4,
           "num_local_experts": 0, "shared_intermediate_size": 8, "time_step_limit": limit}
    assert parse_hf_config(cfg).dt_limit == (0.0, math.inf)


def test_legacy_nemotron_field_names():
    cfg = {"architectures": ["NemotronHForCausalLM"], "vocab_size": 10, "hidden_size": 8, "num_attention_heads": 2,
           "head_dim": 4, "hybrid_override_pattern": "M*", "mamba_num_heads": 2, "mamba_head_dim": 8,
           "mamba_n_groups": 2, "mamba_d_conv": 3, "mamba_chunk_size": 32, "mamba_dt_min": 0.01,
           "ssm_state_size": 4}
    c = parse_hf_config(cfg)
    assert (c.mamba_n_groups, c.conv_kernel, c.chunk_size, c.dt_limit[0]) == (2, 3, 32, 0.01)
    assert c.layer_types == ["mamba", "attention"]


def test_checkpoint_without_tokenizer_takes_token_ids(nemotron_dir):
    llm = LLM(model=nemotron_dir, device="cpu", dtype="float32")
    assert llm.get_tokenizer() is None
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.output_token_ids) == 4 and out.text is None
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text prompt", use_tqdm=False)


def test_dummy_load_format_is_seeded(nemotron_dir):
    a = _greedy(nemotron_dir, load_format="dummy", seed=3)
    assert a == _greedy(nemotron_dir, load_format="dummy", seed=3)
    assert a != _greedy(nemotron_dir)


def test_bfloat16_conversion(nemotron_dir):
    model = load_model(read_config(nemotron_dir), nemotron_dir, torch.device("cpu"), torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.mamba_mixers()[0].A_log.dtype == torch.float32  # kept in fp32 on purpose
    ref = load_file(os.path.join(nemotron_dir, "model.safetensors"))["lm_head.weight"]
    torch.testing.assert_close(model.lm_head.weight.float(), ref.bfloat16().float())


def test_presets_build_with_dummy_weights_on_meta():
    from hybrid_engine.models.loader import create_model
    from hybrid_engine.models.presets import PRESETS

    for name, cfg in PRESETS.items():
        config = parse_hf_config(cfg)
        model = create_model(config, torch.device("meta"), torch.bfloat16)
        n_params = sum(p.numel() for p in model.parameters())
        assert n_params > 1e9, name
        json.dumps(cfg, default=str)
