"""Request validation: `SamplingParams` (ParameterError naming the field), the model-dependent
checks of `hybrid_engine.prompts`, and `LLMEngine.add_request` (ValueError naming the field,
nothing changed, engine keeps serving); then the sampling knobs end to end: penalties / top-k /
top-p / min-p change outputs, stay deterministic with a seed, and are batch-independent."""
import numpy as np
import pytest

from hybrid_engine import SamplingParams
from hybrid_engine.prompts import ContextLengthExceeded, RequestLimits, check_prompt, validate_request
from hybrid_engine.sampling_params import MAX_STOP_STRINGS, ParameterError
from hybrid_engine.tokenizer import build_byte_tokenizer
from tests.engine.engine_helpers import assert_drained, assert_mode_ran, byte_prompt, drive, greedy, seeded

OK_PROMPT = byte_prompt(8, 1)

BAD_PARAMS = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_k": -2}, "top_k"),  # (-1 is vLLM's "off", kept as 0)
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"seed": -2**63 - 1}, "seed"),
    ({"seed": 2**63}, "seed"),  # seeds fill an int64
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"repetition_penalty": 1e39}, "repetition_penalty"),  # beyond float32: inf in the sampler
    ({"logprobs": 21}, "logprobs"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", "\ud800"]}, "stop"),  # a lone surrogate: no text could ever match it
    ({"stop": ""}, "stop"),  # it would match before every token
    ({"stop": ["ok", ""]}, "stop"),
    ({"max_tokens": 4, "bogus_knob": 1}, "bogus_knob"),
]
# Valid for SamplingParams, invalid for the model serving it (the embedded vocab is 261).
MODEL_BAD_PARAMS = [({"stop_token_ids": [261]}, "stop_token_ids")]


@pytest.fixture
def busy_engine(make_llm):
    """An engine with a good request already mid-flight (so validation failures happen while
    it serves), small KV pool (8 blocks x 16 = 128 tokens) and max_model_len 100."""
    llm = make_llm(max_num_seqs=4, num_kv_blocks=8, kv_block_size=16, max_model_len=100)
    eng = llm.engine
    eng.add_request("good", OK_PROMPT, greedy(20))
    eng.step()
    eng.step()
    return eng


def _assert_rejected(eng, request_id, prompt, params, field):
    before = {k: v for k, v in eng.stats().items()}
    with pytest.raises(ValueError, match=field):
        eng.add_request(request_id, prompt, params)
    assert request_id not in eng.requests
    assert eng.stats() == before


@pytest.mark.parametrize("params,field", BAD_PARAMS + MODEL_BAD_PARAMS, ids=[f for _, f in BAD_PARAMS + MODEL_BAD_PARAMS])
def test_bad_params_rejected_and_engine_keeps_serving(busy_engine, solo, params, field):
    eng = busy_engine
    _assert_rejected(eng, "bad", OK_PROMPT, params, field)
    # The rejected id is free again, and everyone is served correctly.
    eng.add_request("bad", OK_PROMPT, seeded(6, seed=1))
    run = drive(eng, [(0, "late", byte_prompt(9, 2), greedy(10))])
    assert run.finals["good"].output_token_ids == solo(OK_PROMPT, greedy(20)).output_token_ids
    assert run.finals["bad"].output_token_ids == solo(OK_PROMPT, seeded(6, seed=1)).output_token_ids
    assert run.finals["late"].output_token_ids == solo(byte_prompt(9, 2), greedy(10)).output_token_ids
    assert_drained(eng)


@pytest.mark.parametrize("params,field", BAD_PARAMS[:-1], ids=[f for _, f in BAD_PARAMS[:-1]])
def test_sampling_params_constructor_validates(params, field):
    with pytest.raises(ParameterError, match=field) as info:
        SamplingParams(**params)
    assert info.value.param == field


def test_unknown_key_is_named():
    with pytest.raises(ParameterError, match="bogus_knob") as info:
        SamplingParams.from_dict({"max_tokens": 4, "bogus_knob": 1})
    assert info.value.param == "bogus_knob"


def test_values_are_normalised():
    """Ints given for float fields become floats; a single stop string becomes a list."""
    p = SamplingParams(temperature=2, top_p=1, repetition_penalty=300, stop="x")
    assert (p.temperature, p.top_p, p.repetition_penalty, p.stop) == (2.0, 1.0, 300.0, ["x"])
    assert all(type(v) is float for v in (p.temperature, p.top_p, p.repetition_penalty))


def test_numpy_scalars_and_tuples_are_taken_as_python_values():
    """A library caller's NumPy numbers and tuples work, stored as Python ints, floats and
    lists; NumPy bools, non-finite floats and out-of-range values are still refused."""
    p = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.5), top_k=np.int32(4), seed=np.uint64(7),
                       stop=("a", "b"), stop_token_ids=(np.int64(5), 6))
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.stop, p.stop_token_ids) == (3, 0.5, 4, 7, ["a", "b"],
                                                                                         [5, 6])
    assert [type(v) for v in (p.max_tokens, p.temperature, p.top_k, p.seed)] == [int, float, int, int]
    assert all(type(t) is int for t in p.stop_token_ids)
    for bad, field in (({"max_tokens": np.bool_(True)}, "max_tokens"), ({"max_tokens": np.float64(3.0)}, "max_tokens"),
                       ({"temperature": np.float32("inf")}, "temperature"), ({"top_p": np.float64(2.0)}, "top_p"),
                       ({"stop_token_ids": (np.int64(-1),)}, "stop_token_ids"), ({"stop": ("a", 1)}, "stop")):
        with pytest.raises(ParameterError, match=field):
            SamplingParams(**bad)


# ---- model-dependent checks (hybrid_engine.prompts) -------------------------------------
# The embedded model's numbers: vocab 261; a context of 100 and a KV cache of 128 tokens.
LIMITS = RequestLimits(vocab_size=261, max_model_len=100, kv_tokens=128)
BYTE_TOKENIZER = build_byte_tokenizer()

BAD_REQUESTS = [  # (prompt, params, tokenizer, limits, field, message fragment, too long)
    ("", greedy(4), BYTE_TOKENIZER, LIMITS, "prompt", "empty", False),
    ([], greedy(4), BYTE_TOKENIZER, LIMITS, "prompt", "empty", False),
    ([5, 261], greedy(4), BYTE_TOKENIZER, LIMITS, "prompt", "261", False),
    ([5, True], greedy(4), BYTE_TOKENIZER, LIMITS, "prompt", "token ids", False),
    ({"ids": [5]}, greedy(4), BYTE_TOKENIZER, LIMITS, "prompt", "token ids", False),
    ("text", greedy(4), None, LIMITS, "prompt", "tokenizer", False),
    (byte_prompt(100), greedy(1), BYTE_TOKENIZER, LIMITS, "prompt", "at least one generated token", True),
    (byte_prompt(90), greedy(11), BYTE_TOKENIZER, LIMITS, "max_tokens", "maximum context length (100", True),
    (byte_prompt(50), greedy(20), BYTE_TOKENIZER, RequestLimits(261, 100, 64), "max_tokens", "KV cache (64", True),
    ([5], greedy(4, stop_token_ids=[261]), BYTE_TOKENIZER, LIMITS, "stop_token_ids", "261", False),
    ([5], greedy(4, stop=["x"]), None, LIMITS, "stop", "tokenizer", False),
    ([5], greedy(4, logprobs=9), None, RequestLimits(8, 100, 128), "logprobs", "8 tokens", False),
]


@pytest.mark.parametrize("prompt, params, tokenizer, limits, field, fragment, too_long", BAD_REQUESTS,
                         ids=["empty_str", "empty_ids", "oov", "bool", "dict", "no_tokenizer", "no_room",
                              "context", "kv_cache", "stop_token_oov", "stop_no_tokenizer", "logprobs_over_vocab"])
def test_validate_request_names_the_field(prompt, params, tokenizer, limits, field, fragment, too_long):
    with pytest.raises(ParameterError, match=field) as info:
        validate_request(prompt, params, limits, tokenizer)
    assert info.value.param == field and fragment in str(info.value)
    assert isinstance(info.value, ContextLengthExceeded) == too_long


def test_validate_request_returns_token_ids():
    assert validate_request("hi", greedy(4), LIMITS, BYTE_TOKENIZER) == BYTE_TOKENIZER.encode("hi")
    assert validate_request((7, 8), greedy(4), LIMITS, None) == [7, 8]
    # The whole context: 99 prompt tokens + 1 generated = max_model_len.
    assert validate_request(byte_prompt(99), greedy(1), LIMITS, None) == byte_prompt(99)
    # As many logprobs as the vocabulary has tokens is the most there can be.
    assert validate_request([5], greedy(4, logprobs=8), RequestLimits(8, 100, 128), None) == [5]


def test_check_prompt_names_the_callers_field():
    """The server checks chat prompts under the name "messages"."""
    with pytest.raises(ParameterError) as info:
        check_prompt([], LIMITS, field="messages")
    assert info.value.param == "messages" and str(info.value).startswith("messages")


BAD_PROMPTS = [
    ("", "prompt"),
    ([], "prompt"),
    ([5, 261], r"prompt.*261"),  # vocab is 261: ids 0..260
    ([5, -1], "prompt"),
    ([5, 1.5], "prompt"),
    ([5, True], "prompt"),
    (byte_prompt(90), "max_tokens"),  # 90 + 20 > max_model_len 100
]


@pytest.mark.parametrize("prompt,field", BAD_PROMPTS, ids=["empty_str", "empty_ids", "oov", "negative",
                                                           "float", "bool", "too_long"])
def test_bad_prompts_rejected(busy_engine, solo, prompt, field):
    eng = busy_engine
    _assert_rejected(eng, "bad", prompt, greedy(20), field)
    run = drive(eng, [])
    assert run.finals["good"].output_token_ids == solo(OK_PROMPT, greedy(20)).output_token_ids
    assert_drained(eng)


def test_prompt_beyond_kv_capacity_rejected(make_llm):
    """Fits max_model_len (4096) but not the whole KV pool (4 blocks x 16 = 64 tokens)."""
    eng = make_llm(max_num_seqs=2, num_kv_blocks=4, kv_block_size=16).engine
    _assert_rejected(eng, "big", byte_prompt(50), greedy(20), "KV|max_tokens")
    eng.add_request("fits", byte_prompt(44), greedy(20))  # 64 tokens: exactly the pool
    out = drive(eng, []).finals["fits"]
    assert out.finish_reason == "length" and len(out.output_token_ids) == 20
    assert_drained(eng)


def test_bad_request_id_and_params_type(busy_engine):
    eng = busy_engine
    before = eng.stats()
    with pytest.raises(ValueError, match="request_id"):  # in use
        eng.add_request("good", OK_PROMPT, greedy(4))
    assert eng.stats() == before and eng.requests["good"].params.max_tokens == 20
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("", OK_PROMPT, greedy(4))
    with pytest.raises(ValueError, match="params"):
        eng.add_request("x", OK_PROMPT, 42)
    drive(eng, [])
    assert_drained(eng)


# ---- the knobs, end to end -------------------------------------------------------------
KNOBS = {
    "repetition_penalty": dict(repetition_penalty=1.8),
    "presence_penalty": dict(presence_penalty=1.5),
    "frequency_penalty": dict(frequency_penalty=1.5),
    "top_k": dict(top_k=3),
    "top_p": dict(top_p=0.3),
    "min_p": dict(min_p=0.9),  # the random model's distributions are nearly flat
}
N_TOKENS = 32


def _knob_params(knob, seed=11, temperature=1.0):
    return SamplingParams(max_tokens=N_TOKENS, temperature=temperature, seed=seed, ignore_eos=True, **KNOBS[knob])


def _plain(seed=11, temperature=1.0):
    return SamplingParams(max_tokens=N_TOKENS, temperature=temperature, seed=seed, ignore_eos=True)


@pytest.mark.parametrize("knob", sorted(KNOBS))
def test_knob_changes_output_and_is_deterministic(make_llm, knob):
    prompts = [byte_prompt(12, s) for s in range(3)]
    llm = make_llm(max_num_seqs=3)
    base = llm.generate(prompts, _plain(), use_tqdm=False)
    with_knob = llm.generate(prompts, _knob_params(knob), use_tqdm=False)
    again = make_llm(max_num_seqs=1).generate(prompts, _knob_params(knob), use_tqdm=False)
    assert [o.output_token_ids for o in with_knob] == [o.output_token_ids for o in again]
    assert any(a.output_token_ids != b.output_token_ids for a, b in zip(base, with_knob)), knob
    if knob.endswith("penalty"):  # penalties also act on greedy decoding
        g = llm.generate(prompts, _plain(temperature=0.0), use_tqdm=False)
        gk = llm.generate(prompts, _knob_params(knob, temperature=0.0), use_tqdm=False)
        assert any(a.output_token_ids != b.output_token_ids for a, b in zip(g, gk)), knob


@pytest.mark.parametrize("narrow", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)],
                         ids=["top_k1", "top_p_tiny", "min_p1"])
def test_degenerate_filters_equal_greedy(make_llm, solo, narrow):
    """Filters that keep only the top token turn seeded sampling into greedy decoding."""
    prompt = byte_prompt(15, 4)
    params = SamplingParams(max_tokens=N_TOKENS, temperature=1.3, seed=5, ignore_eos=True, **narrow)
    out = make_llm(max_num_seqs=1).generate([prompt], params, use_tqdm=False)[0]
    assert out.output_token_ids == solo(prompt, greedy(N_TOKENS)).output_token_ids


def test_seed_matters_and_greedy_ignores_it(make_llm):
    prompt = byte_prompt(10, 9)
    llm = make_llm(max_num_seqs=4)
    a, b, g1, g2 = llm.generate([prompt] * 4, [_plain(seed=1), _plain(seed=2), greedy(N_TOKENS, seed=1),
                                               greedy(N_TOKENS, seed=2)], use_tqdm=False)
    assert a.output_token_ids != b.output_token_ids
    assert g1.output_token_ids == g2.output_token_ids


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_mixed_params_batch_equals_solo(make_llm, solo, async_scheduling):
    """Every request's tokens are those of its solo run, batched with others using different
    params (penalties force the penalty path on the whole batch, logprobs on others)."""
    work = [(i // 2, knob, byte_prompt(6 + 5 * i, 20 + i), _knob_params(knob, seed=30 + i))
            for i, knob in enumerate(sorted(KNOBS))]
    work += [
        (1, "greedy", byte_prompt(17, 40), greedy(N_TOKENS)),
        (2, "plain", byte_prompt(23, 41), _plain(seed=3)),
        (3, "logprobs", byte_prompt(9, 42), SamplingParams(max_tokens=N_TOKENS, temperature=0.7, seed=4,
                                                           ignore_eos=True, logprobs=4)),
        (4, "greedy_rep", byte_prompt(30, 43), greedy(N_TOKENS, repetition_penalty=1.3, frequency_penalty=0.4)),
    ]
    llm = make_llm(max_num_seqs=len(work), max_num_batched_tokens=24, async_scheduling=async_scheduling)
    run = drive(llm.engine, work)
    for _, rid, prompt, params in work:
        ref = solo(prompt, params)
        assert run.finals[rid].output_token_ids == ref.output_token_ids, rid
    ref_lp = solo(work[-2][2], work[-2][3]).logprobs
    got_lp = run.finals["logprobs"].logprobs
    assert [sorted(d) for d in got_lp] == [sorted(d) for d in ref_lp]
    for got, ref in zip(got_lp, ref_lp):
        for tok, lp in ref.items():
            assert got[tok] == pytest.approx(lp, abs=1e-4)
    assert_mode_ran(llm.engine)
    assert_drained(llm.engine)


def test_params_edited_after_construction_are_validated_and_snapshotted(make_llm):
    """SamplingParams is a plain dataclass: a field set after construction is checked when the
    request is added, and editing the object later does not reach a queued request."""
    eng = make_llm().engine
    params = greedy(4)
    params.seed = 2**64
    with pytest.raises(ParameterError, match="seed"):
        eng.add_request("bad", OK_PROMPT, params)
    assert "bad" not in eng.requests
    params.seed = 5
    eng.add_request("good", OK_PROMPT, params)
    params.max_tokens = 1000
    run = drive(eng, [])
    assert len(run.finals["good"].output_token_ids) == 4
