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
from layers.kernels import REFERENCE_OPS
from layers.mamba2 import Mamba2Mixer
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
    assert (c.mamba_n_groups, c.conv_kernel, c.dt_limit[0]) == (2, 3, 0.01)
    assert c.layer_types == ["mamba", "attention"]


def test_checkpoint_without_tokenizer_takes_token_ids(nemotron_dir):
    llm = LLM(model=nemotron_dir, device="cpu", dtype="float32")
    assert llm.get_tokenizer() is None
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.output_token_ids) == 4 and out.text is None
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text prompt", use_tqdm=False)


def test_nemotron_router_stays_float32_in_a_bfloat16_model(tmp_path):
    """As transformers keeps it (`_keep_in_fp32_modules_strict`): a checkpoint's float32
    router weight is loaded unrounded, next to bf16 experts."""
    make_hf_checkpoint(tmp_path, "nemotron_moe")
    model = load_model(read_config(str(tmp_path)), str(tmp_path), torch.device("cpu"), torch.bfloat16)
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    routers = [(name, m) for name, m in model.named_modules() if name.endswith(".gate") and hasattr(m, "weight")]
    assert routers
    for name, router in routers:
        key = next(k for k in tensors if k.endswith(name.split("layers.", 1)[1] + ".weight"))
        assert tensors[key].dtype == torch.float32
        assert router.weight.dtype == torch.float32 and torch.equal(router.weight, tensors[key])
        assert router.e_score_correction_bias.dtype == torch.float32
    experts = next(m for name, m in model.named_modules() if name.endswith(".experts"))
    assert experts.up.dtype == torch.bfloat16


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


def test_attention_stacks_hold_the_checkpoint_q_k_v(nemotron_dir):
    """Loading writes q_proj / k_proj / v_proj in place, so the stacked projection each
    attention layer runs holds the checkpoint's three tensors (converted to bf16)."""
    model = load_model(read_config(nemotron_dir), nemotron_dir, torch.device("cpu"), torch.bfloat16,
                       ops=REFERENCE_OPS)
    tensors = load_file(os.path.join(nemotron_dir, "model.safetensors"))
    by_model_name = {model.normalize_checkpoint_name(name): t for name, t in tensors.items()}
    names = {module: name for name, module in model.named_modules()}
    assert model.attention_layers()
    for layer in model.attention_layers():
        prefix = names[layer]
        expected = torch.cat([by_model_name[f"{prefix}.{p}_proj.weight"] for p in "qkv"]).bfloat16()
        assert torch.equal(layer.qkv_weight, expected)


def _dummy(cfg: dict, seed: int, dtype: torch.dtype = torch.float32):
    return load_model(cfg, None, torch.device("cpu"), dtype, load_format="dummy", seed=seed, ops=REFERENCE_OPS)


def test_dummy_weights_have_the_checkpoint_shapes_and_init(nemotron_dir):
    """Dummy weights: every tensor the checkpoint has, same shape; seeded; matrices drawn
    like the models' init (std 0.02), norms 1, biases 0, Mamba A/D/dt_bias/conv in range."""
    cfg = read_config(nemotron_dir)
    real = load_model(cfg, nemotron_dir, torch.device("cpu"), torch.float32, ops=REFERENCE_OPS).state_dict()
    model = _dummy(cfg, seed=3)
    dummy = model.state_dict()
    assert {k: v.shape for k, v in dummy.items()} == {k: v.shape for k, v in real.items()}
    again, other = _dummy(cfg, seed=3).state_dict(), _dummy(cfg, seed=4).state_dict()
    assert all(torch.equal(dummy[k], again[k]) for k in dummy)
    matrices = [k for k, v in dummy.items() if v.ndim >= 2 and not k.endswith("conv1d.weight")]
    assert all(not torch.equal(dummy[k], other[k]) for k in matrices)
    for k in matrices:
        assert abs(dummy[k].std().item() - 0.02) < 0.005, k
    for k, v in dummy.items():
        if k.endswith("norm.weight") or k.endswith("norm_f.weight"):
            assert torch.equal(v, torch.ones_like(v)), k
        elif k.endswith("bias") and v.ndim == 1 and "dt_bias" not in k and "correction_bias" not in k:
            assert torch.equal(v, torch.zeros_like(v)), k
    c = model.config
    for mixer in model.mamba_mixers():
        heads = mixer.num_heads
        assert torch.equal(mixer.A_log, torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))
        assert torch.equal(mixer.D, torch.ones(heads))
        dt = torch.nn.functional.softplus(mixer.dt_bias)  # the initial time step of each head
        assert ((dt > c.time_step_min * 0.999) & (dt < c.time_step_max * 1.001)).all()
        bound = mixer.conv1d.weight.shape[-1] ** -0.5
        assert 0 < mixer.conv1d.weight.abs().max() <= bound
    assert model.lm_head.weight.data_ptr() != model.input_embeddings().weight.data_ptr()


def test_dummy_weights_tie_embeddings_and_keep_mamba_fp32(nemotron_dir):
    cfg = {**read_config(nemotron_dir), "tie_word_embeddings": True}
    model = _dummy(cfg, seed=0, dtype=torch.bfloat16)
    assert model.lm_head.weight is model.input_embeddings().weight
    assert model.lm_head.weight.dtype == torch.bfloat16
    for mixer in model.modules():
        if isinstance(mixer, Mamba2Mixer):
            assert {p.dtype for p in (mixer.A_log, mixer.D, mixer.dt_bias)} == {torch.float32}
            assert mixer.in_proj.weight.dtype == torch.bfloat16


def _as_index_checkpoint(src: str, dst, weight_map_file: str, shard_dir=None) -> str:
    """`src`'s config plus an index whose weight_map sends every tensor to `weight_map_file`;
    the tensors are written to `shard_dir / basename(weight_map_file)` (default: inside `dst`)."""
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), dst)
    shard_dir = shard_dir or dst
    os.makedirs(shard_dir, exist_ok=True)
    shutil.copy(os.path.join(src, "model.safetensors"), os.path.join(shard_dir, os.path.basename(weight_map_file)))
    keys = load_file(os.path.join(src, "model.safetensors")).keys()
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: weight_map_file for k in keys}}, f)
    return str(dst)


def _load(path: str, dtype: torch.dtype = torch.float32):
    return load_model(read_config(path), path, torch.device("cpu"), dtype, ops=REFERENCE_OPS)


def test_index_that_is_not_json_names_the_file(tmp_path, nemotron_dir):
    path = _as_index_checkpoint(nemotron_dir, tmp_path / "ckpt", "model-00001-of-00001.safetensors")
    _load(path)  # the well-formed index loads
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text('{"weight_map": {')
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json is not valid JSON"):
        _load(path)


def test_index_cannot_point_outside_the_checkpoint(tmp_path, nemotron_dir):
    """A weight_map entry that leaves the directory is refused (it used to be loaded), even
    though the file it names exists and holds the right tensors. A symlink inside the
    directory to a file elsewhere is the owner's choice and loads: the Hugging Face cache
    keeps snapshot files as symlinks into ../../blobs."""
    other = tmp_path / "other"
    for i, shard in enumerate(["../other/model.safetensors", "sub/../../other/model.safetensors",
                               str(other / "model.safetensors")]):
        path = _as_index_checkpoint(nemotron_dir, tmp_path / f"ckpt{i}", shard, shard_dir=other)
        with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
            _load(path)

    snapshot = tmp_path / "snapshots" / "rev"
    path = _as_index_checkpoint(nemotron_dir, snapshot, "model.safetensors", shard_dir=tmp_path / "blobs")
    os.symlink(os.path.join("..", "..", "blobs", "model.safetensors"), snapshot / "model.safetensors")
    expected = load_file(os.path.join(nemotron_dir, "model.safetensors"))["lm_head.weight"]
    assert torch.equal(_load(path).lm_head.weight, expected)


def test_unreadable_safetensors_names_the_file(tmp_path, nemotron_dir):
    path = _rewrite(nemotron_dir, tmp_path / "truncated", lambda t: t)
    file = os.path.join(path, "model.safetensors")
    os.truncate(file, os.path.getsize(file) // 2)
    with pytest.raises(CheckpointError, match=rf"cannot read {file}"):
        _load(path)
    missing = _as_index_checkpoint(nemotron_dir, tmp_path / "missing", "model-00001-of-00001.safetensors")
    os.remove(os.path.join(missing, "model-00001-of-00001.safetensors"))
    with pytest.raises(CheckpointError, match=r"cannot read .*model-00001-of-00001\.safetensors"):
        _load(missing)


@pytest.mark.parametrize("key, bad", [
    ("backbone.layers.0.mixer.in_proj.weight", float("nan")),
    ("backbone.norm_f.weight", float("inf")),
    ("backbone.layers.4.mixer.experts.2.up_proj.weight", float("-inf")),  # stacked at load: still named
    ("backbone.layers.0.mixer.A_log", float("nan")),  # a tensor kept in float32
])
def test_non_finite_weight_is_refused_naming_the_tensor(tmp_path, nemotron_dir, key, bad):
    def poison(tensors: dict) -> dict:
        tensors[key].view(-1)[-1] = bad
        return tensors

    path = _rewrite(nemotron_dir, tmp_path / "poisoned", poison)
    with pytest.raises(CheckpointError, match=rf"weight '{key}' .* holds NaN or infinite values$"):
        _load(path)


def test_weight_overflowing_the_model_dtype_is_refused(tmp_path, nemotron_dir):
    """Finite in the float32 checkpoint, infinite once converted to float16."""
    key = "backbone.layers.1.mixer.o_proj.weight"

    def enlarge(tensors: dict) -> dict:
        tensors[key][0, 0] = 1e6
        return tensors

    path = _rewrite(nemotron_dir, tmp_path / "large", enlarge)
    assert _load(path).state_dict()["model.layers.1.mixer.o_proj.weight"][0, 0] == 1e6  # fine in float32
    with pytest.raises(CheckpointError, match=rf"weight '{key}' .* once converted to torch.float16"):
        _load(path, torch.float16)
