"""Documented `LLM(...)` options beyond the embedded defaults: `model="preset:NAME"`,
`dtype="float16"`, and (on a GPU) `gpu_memory_utilization` sizing the KV cache.

Every preset is a multi-billion-parameter model, too big to build on the CPU in CI: there
the preset plumbing runs on the real smallest preset shrunk to toy sizes; the GPU tests
build the real one.
"""
import gc

import pytest
import torch

import hybrid_engine.engine as engine_module
from cache.kv_cache import KVBlockAllocator
from hybrid_engine import LLM, SamplingParams
from hybrid_engine.models.presets import get_preset

SMALLEST_PRESET = "granite-4.0-h-micro"  # 3.4B parameters


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def _toy_sized(config: dict) -> dict:
    """A Granite-4.0-H preset with toy widths and its first 6 layers (5 Mamba, 1 attention):
    architecture, vocabulary, special tokens, multipliers and position embedding stay the preset's."""
    layer_types = config["layer_types"][:6]
    assert "attention" in layer_types and "mamba" in layer_types
    return {**config, "hidden_size": 64, "intermediate_size": 64, "shared_intermediate_size": 64,
            "layer_types": layer_types, "num_hidden_layers": len(layer_types), "num_attention_heads": 4,
            "num_key_value_heads": 2, "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16,
            "mamba_chunk_size": 16}


@pytest.fixture
def toy_presets(monkeypatch) -> list[str]:
    """Makes the engine's preset lookup return toy-sized copies of the real presets; records
    the names it was asked for."""
    asked = []

    def toy_preset(name: str) -> dict:
        asked.append(name)
        return _toy_sized(get_preset(name))

    monkeypatch.setattr(engine_module, "get_preset", toy_preset)
    return asked


def test_preset_model_builds_the_named_preset(toy_presets):
    """`LLM(model="preset:NAME")` builds that preset's architecture and vocabulary with seeded
    random weights (whatever load_format says) and no tokenizer: token-id prompts only."""
    preset = get_preset(SMALLEST_PRESET)
    llm = LLM(model=f"preset:{SMALLEST_PRESET}", device="cpu", dtype="float32", load_format="auto",
              max_model_len=64, max_num_seqs=2)
    assert set(toy_presets) == {SMALLEST_PRESET}  # (its config is read to check max_model_len, then to load)
    engine = llm.engine
    assert engine.model_name == f"preset:{SMALLEST_PRESET}" and llm.get_tokenizer() is None
    assert type(engine.model).__name__ == preset["architectures"][0]
    assert engine.model_config.vocab_size == preset["vocab_size"]
    prompt = [preset["vocab_size"] - 1, 17, 4242]  # ids only this vocabulary has
    out = llm.generate([prompt], _greedy(6), use_tqdm=False)[0]
    assert len(out.output_token_ids) == 6 and out.finish_reason == "length" and out.text is None
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["text needs a tokenizer"], _greedy(2), use_tqdm=False)
    # The weights come from the engine seed: the same seed gives the same model.
    same = LLM(model=f"preset:{SMALLEST_PRESET}", device="cpu", dtype="float32", max_model_len=64, max_num_seqs=2)
    assert same.generate([prompt], _greedy(6), use_tqdm=False)[0].output_token_ids == out.output_token_ids
    other = LLM(model=f"preset:{SMALLEST_PRESET}", device="cpu", dtype="float32", max_model_len=64, max_num_seqs=2,
                seed=1)
    other_weights = dict(other.engine.model.named_parameters())
    assert any(not torch.equal(p, other_weights[name]) for name, p in engine.model.named_parameters())


def test_unknown_preset_is_a_value_error_listing_the_known_ones():
    with pytest.raises(ValueError, match=SMALLEST_PRESET):
        LLM(model="preset:no-such-model", device="cpu")


def test_float16_on_cpu_tracks_float32():
    """dtype="float16" runs on the CPU: half-precision weights, the same greedy tokens as
    float32, and logprobs within half precision's rounding of float32's."""
    half = LLM(device="cpu", dtype="float16")
    full = LLM(device="cpu", dtype="float32")
    weights = max(half.engine.model.parameters(), key=torch.Tensor.numel)
    assert half.engine.config.dtype == "float16" and weights.dtype == torch.float16
    params = _greedy(24, logprobs=5)
    for prompt in ("Once upon a time", [1, 2, 3]):
        (a,) = half.generate([prompt], params, use_tqdm=False)
        (b,) = full.generate([prompt], params, use_tqdm=False)
        assert a.output_token_ids == b.output_token_ids
        # float16 keeps 11 significant bits (~5e-4 relative) per operation; through the
        # model's 8 layers the logprobs drift by ~1e-3 from float32's.
        for lp_a, lp_b in zip(a.logprobs, b.logprobs):
            for token in lp_a.keys() & lp_b.keys():
                assert lp_a[token] == pytest.approx(lp_b[token], abs=1e-2)


@pytest.mark.gpu
def test_smallest_preset_generates_on_gpu():
    """The real smallest preset (3.4B parameters, random weights) builds and generates on a GPU,
    reproducibly, with CUDA graphs and launch-ahead."""
    llm = LLM(model=f"preset:{SMALLEST_PRESET}", max_model_len=512, max_num_seqs=4)
    prompts = [[5 + (31 * i + 7 * j) % 1000 for j in range(8 + 5 * i)] for i in range(4)]
    first = llm.generate(prompts, _greedy(16), use_tqdm=False)
    assert all(len(o.output_token_ids) == 16 and o.finish_reason == "length" for o in first)
    again = llm.generate(prompts, _greedy(16), use_tqdm=False)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in first]


@pytest.mark.gpu
def test_gpu_memory_utilization_sizes_the_kv_cache():
    """Without num_kv_blocks the KV pool takes what gpu_memory_utilization leaves after the
    weights, the activation reserve, the Mamba state and the prefix cache's checkpoints (a
    fixed count here: by default they scale with memory too): lowering the fraction by 0.2
    removes 0.2 x (GPU memory) / (bytes per block) blocks, since nothing else changes."""
    kwargs = dict(model=f"preset:{SMALLEST_PRESET}", max_num_seqs=64, cuda_graphs=False,
                  prefix_cache_max_checkpoints=16)
    total_memory = torch.cuda.mem_get_info()[1]
    blocks = {}
    for fraction in (0.5, 0.3):
        llm = LLM(gpu_memory_utilization=fraction, **kwargs)
        engine, mc = llm.engine, llm.engine.model_config
        blocks[fraction] = engine.stats()["total_kv_blocks"]
        block_bytes = KVBlockAllocator.bytes_per_block(engine.config.kv_block_size, len(mc.attention_layers),
                                                       mc.num_kv_heads, mc.head_dim, engine.config.torch_dtype)
        # Memory, not the "every sequence at full length" cap, decided the size.
        assert blocks[fraction] < 64 * engine.max_model_len // engine.config.kv_block_size
        del llm, engine
        gc.collect()
        torch.cuda.empty_cache()
    expected = 0.2 * total_memory / block_bytes
    # On an H100 this holds to the block (the floor aside). 1% (~160 MiB here) leaves room for
    # memory the first engine takes for good while it is built (kernel modules, library
    # handles: ~90 MiB measured), which the second engine then finds already in use.
    assert blocks[0.5] - blocks[0.3] == pytest.approx(expected, rel=0.01), (blocks, expected)


def test_pools_too_large_for_host_memory_are_an_error_naming_the_flags(monkeypatch):
    """On the CPU the pools are sized as asked: pools that cannot fit in the host memory
    available fail the build with a ValueError naming the flags (the server prints it as
    "cannot start"), not with an allocator error halfway through."""
    monkeypatch.setattr(engine_module, "available_host_memory", lambda: 1 << 20)  # 64 requests need ~130 MiB
    with pytest.raises(ValueError, match=r"not enough host memory for 64 Mamba state slots .* lower max_num_seqs"):
        LLM(max_num_seqs=64)
    monkeypatch.setattr(engine_module, "available_host_memory", lambda: 1 << 40)
    assert LLM(max_num_seqs=64).engine.mamba.max_num_seqs == 64


def test_max_model_len_past_the_models_positions_is_a_value_error():
    """As in vLLM, a context longer than the model's max_position_embeddings is refused (it
    was cut to the model's silently); up to it, the engine takes the value as given."""
    limit = LLM(device="cpu", max_model_len=64).engine.model_config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"max_model_len \({limit + 1}\) is greater than the model's "
                                         rf"max_position_embeddings \({limit}\)"):
        LLM(device="cpu", max_model_len=limit + 1)
    assert LLM(device="cpu", max_model_len=limit).engine.max_model_len == limit
