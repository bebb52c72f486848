"""`mamba_ssm_cache_dtype` (`LLM(...)`; the server flag's test is in tests/server/test_cli.py): validation, "auto"
resolved from the checkpoint config, the SSM pool's dtype and the pool sizing, what a
low-precision SSM cache does to outputs (measured bounds, not exact equality). The state
kernels' side is tests/kernels/test_ssm_cache_dtype.py.

The embedded model's random init leaves its SSM state ~1e-3 and its logits near-uniform,
where any cache dtype looks free; the accuracy tests also run it *sharpened* (Mamba input
projections x10, LM head x50: state O(1), mean greedy logprob -0.35), where bfloat16
rounding visibly moves logprobs. The drift measurement is `scripts/bench_ssm_cache_dtype.py`'s.
"""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from cache.mamba_cache import MambaStateAllocator
from hybrid_engine import LLM
from hybrid_engine.config import EngineConfig, resolve_mamba_ssm_cache_dtype
from hybrid_engine.models.embedded import EMBEDDED_CONFIG
from hybrid_engine.models.presets import get_preset
from layers.mamba2 import Mamba2Mixer
from tests.engine.engine_helpers import byte_prompt, greedy

_BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench_ssm_cache_dtype.py"
_spec = importlib.util.spec_from_file_location("bench_ssm_cache_dtype", _BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

PROMPTS = [byte_prompt(12 + 3 * s, salt=s) for s in range(8)]


def _llm(**kw) -> LLM:
    return LLM(device="cpu", dtype="float32", **kw)


def _sharpened(llm: LLM) -> LLM:
    with torch.no_grad():
        for module in llm.engine.model.modules():
            if isinstance(module, Mamba2Mixer):
                module.in_proj.weight.mul_(10)
        llm.engine.model.lm_head.weight.mul_(50)
    return llm


def _checkpoint(tmp_path: Path, **fields) -> str:
    """A config-only checkpoint directory of the embedded model (run with dummy weights)."""
    (tmp_path / "config.json").write_text(json.dumps({**EMBEDDED_CONFIG, **fields}))
    return str(tmp_path)


# ---- the option ------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["fp8", "bf16", "Float32", None])
def test_bad_value_is_a_value_error_naming_the_field(value):
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
        EngineConfig(mamba_ssm_cache_dtype=value).resolve()


def test_bad_value_through_llm():
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype must be one of"):
        _llm(mamba_ssm_cache_dtype="int8")


@pytest.mark.parametrize("requested,hf_config,expected", [
    ("auto", {}, "float32"),
    ("auto", {"mamba_ssm_cache_dtype": None}, "float32"),
    ("auto", {"mamba_ssm_cache_dtype": "bfloat16"}, "bfloat16"),
    ("auto", {"mamba_ssm_cache_dtype": "float16"}, "float16"),
    ("float16", {"mamba_ssm_cache_dtype": "bfloat16"}, "float16"),  # an explicit value wins
    ("bfloat16", {}, "bfloat16"),
])
def test_resolve(requested, hf_config, expected):
    assert resolve_mamba_ssm_cache_dtype(requested, hf_config) == expected


def test_resolve_reads_the_nemotron3_preset_key():
    config = get_preset("nemotron-3-nano-30b-a3b")
    assert config["mamba_ssm_cache_dtype"] == "float32"
    assert resolve_mamba_ssm_cache_dtype("auto", {**config, "mamba_ssm_cache_dtype": "bfloat16"}) == "bfloat16"
    assert resolve_mamba_ssm_cache_dtype("auto", config) == "float32"


@pytest.mark.parametrize("option,dtype", [("auto", torch.float32), ("float32", torch.float32),
                                          ("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_ssm_pool_takes_the_dtype_conv_pool_keeps_the_model_dtype(option, dtype):
    engine = _llm(mamba_ssm_cache_dtype=option).engine
    assert engine.mamba.ssm_states.dtype == dtype
    assert engine.mamba.conv_states.dtype == torch.float32
    assert engine.config.mamba_ssm_cache_dtype == str(dtype).removeprefix("torch.")


def test_auto_reads_the_checkpoint_config(tmp_path):
    model = _checkpoint(tmp_path, mamba_ssm_cache_dtype="bfloat16")
    assert _llm(model=model, load_format="dummy").engine.mamba.ssm_states.dtype == torch.bfloat16
    explicit = _llm(model=model, load_format="dummy", mamba_ssm_cache_dtype="float32")
    assert explicit.engine.mamba.ssm_states.dtype == torch.float32


def test_bad_checkpoint_value_is_a_value_error_naming_the_field(tmp_path):
    model = _checkpoint(tmp_path, mamba_ssm_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="config field 'mamba_ssm_cache_dtype'"):
        _llm(model=model, load_format="dummy")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_cache_admits_more_requests_on_cuda(tmp_path, monkeypatch):
    """With a fixed memory budget, the default max_num_seqs shrinks to what the Mamba state
    fits: a bfloat16 SSM cache (half the state bytes) admits about twice as many."""
    model = _checkpoint(tmp_path, mamba_num_heads=32, mamba_head_dim=64, ssm_state_size=128, n_groups=8)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 << 30, 3 << 30))
    seqs, seq_bytes = {}, {}
    for option in ("float32", "bfloat16"):
        engine = LLM(model=model, load_format="dummy", device="cuda", cuda_graphs=False, max_num_batched_tokens=1024,
                     mamba_ssm_cache_dtype=option).engine
        seqs[option] = engine.mamba.max_num_seqs
        mc = engine.model_config
        seq_bytes[option] = MambaStateAllocator.bytes_per_seq(
            len(mc.mamba_layers), mc.mamba_conv_dim, mc.conv_kernel - 1, mc.mamba_num_heads, mc.mamba_head_dim,
            mc.ssm_state_size, torch.bfloat16, copies_per_request=2, ssm_dtype=engine.mamba.ssm_states.dtype)
        del engine
    assert seqs["float32"] < seqs["bfloat16"] < 256, seqs
    assert seqs["bfloat16"] / seqs["float32"] == pytest.approx(seq_bytes["float32"] / seq_bytes["bfloat16"], rel=0.02)


# ---- what a low-precision cache does to outputs ------------------------------------------

def test_bf16_cache_greedy_tokens_match_the_float32_cache():
    """Embedded model as built: measured 100% equal tokens (8 x 48), logprobs within 2e-6
    (before any difference); the drift is non-zero, so the bfloat16 pool is what ran."""
    params = greedy(48, logprobs=0)
    runs = {dtype: _llm(mamba_ssm_cache_dtype=dtype).generate(PROMPTS, params, use_tqdm=False)
            for dtype in ("float32", "bfloat16")}
    same = total = 0
    drift = []
    for a, b in zip(runs["float32"], runs["bfloat16"]):
        equal = [x == y for x, y in zip(a.output_token_ids, b.output_token_ids)]
        same, total = same + sum(equal), total + len(equal)
        first = equal.index(False) if False in equal else len(equal)
        drift += [abs(a.logprobs[i][t] - b.logprobs[i][t]) for i, t in enumerate(a.output_token_ids[:first])]
    assert same / total >= 0.95
    assert 0 < max(drift) < 1e-4


def test_teacher_forced_drift_sharpened_model():
    """On the sharpened model (measured, 8 x 64 tokens): bfloat16 max |dlogprob| 0.042,
    mean 0.0032, forced greedy choices 99.8% equal, free-running tokens 96.9% equal; float16
    max 0.0043. Forcing a run on its own tokens reproduces it exactly (drift 0), so the
    measurement sees only what the cache dtype changes."""
    reference_llm = _sharpened(_llm(async_scheduling=False))
    reference = bench.greedy_traces(reference_llm, PROMPTS, 64)
    tokens = [t.tokens for t in reference]
    itself = bench.logprob_drift(reference, bench.greedy_traces(reference_llm, PROMPTS, 64, forced=tokens))
    assert itself["max"] == 0 and itself["argmax_agree"] == 1
    assert reference[0].logprobs[0] > -1  # sharpened: peaked logits

    results = {}
    for dtype in ("bfloat16", "float16"):
        llm = _sharpened(_llm(async_scheduling=False, mamba_ssm_cache_dtype=dtype))
        forced = bench.greedy_traces(llm, PROMPTS, 64, forced=tokens)
        assert [t.tokens for t in forced] == tokens
        results[dtype] = (bench.logprob_drift(reference, forced),
                          bench.token_agreement(reference, bench.greedy_traces(llm, PROMPTS, 64)))
    drift, free = results["bfloat16"]
    assert 1e-3 < drift["max"] < 0.2 and drift["mean"] < 0.02 and drift["outside_top"] == 0
    assert drift["argmax_agree"] >= 0.98 and free["agree"] >= 0.85
    assert results["float16"][0]["max"] < drift["max"]  # 10 mantissa bits against 7


def test_bf16_cache_keeps_output_independence():
    """The invariants hold within a bfloat16 cache: launch-ahead with rejections and
    speculative verify rows (every draft accepted) give the serial run's tokens."""
    params = greedy(40)
    serial = _sharpened(_llm(async_scheduling=False, mamba_ssm_cache_dtype="bfloat16"))
    expected = [o.output_token_ids for o in serial.generate(PROMPTS[:4], params, use_tqdm=False)]
    truth = {tuple(p): p + out for p, out in zip(PROMPTS[:4], expected)}

    class Oracle:
        def propose(self, request_id, token_ids, num_tokens):
            full = next((f for f in truth.values() if f[:len(token_ids)] == token_ids), [])
            return full[len(token_ids):len(token_ids) + num_tokens]

    for kw in (dict(inject_rejection_rate=0.3),
               dict(speculative_config={"method": "proposer", "num_speculative_tokens": 4, "proposer": Oracle()})):
        llm = _sharpened(_llm(mamba_ssm_cache_dtype="bfloat16", **kw))
        assert [o.output_token_ids for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)] == expected, kw
        if "speculative_config" in kw:
            assert llm.engine.stats()["spec_accepted_tokens"] > 0
