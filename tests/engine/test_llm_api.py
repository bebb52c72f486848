"""The offline API as README.md documents it: `LLM().generate(...)` on the embedded model,
every prompt form, outputs in prompt order, logprobs shape, tqdm on and off."""
import math
import threading

import numpy as np
import pytest

from hybrid_engine import LLM, CompletionOutput, RequestOutput, SamplingParams
from tests.engine.engine_helpers import assert_drained, byte_prompt, greedy, seeded


def test_default_llm_generates():
    llm = LLM()
    outs = llm.generate("hello", use_tqdm=False)
    assert isinstance(outs, list) and len(outs) == 1
    out = outs[0]
    assert isinstance(out, RequestOutput) and out.finished
    assert out.prompt == "hello" and out.prompt_token_ids == list(b"hello")
    assert 1 <= len(out.output_token_ids) <= SamplingParams().max_tokens
    assert out.finish_reason in ("stop", "length") and isinstance(out.text, str)
    assert llm.get_tokenizer() is not None
    assert_drained(llm.engine)


def test_prompt_forms_agree(make_llm):
    llm = make_llm(max_num_seqs=4)
    p = greedy(12)
    text_a, text_b = "hello world", "Once upon a time"
    ids_a, ids_b = list(text_a.encode()), list(text_b.encode())
    (single_str,) = llm.generate(text_a, p, use_tqdm=False)
    (single_ids,) = llm.generate(ids_a, p, use_tqdm=False)
    list_str = llm.generate([text_a, text_b], p, use_tqdm=False)
    list_ids = llm.generate([ids_a, ids_b], p, use_tqdm=False)
    mixed = llm.generate([ids_b, text_a], p, use_tqdm=False)
    (single_tuple,) = llm.generate(tuple(ids_a), p, use_tqdm=False)  # token ids as a tuple, alone or in a list
    (listed_tuple,) = llm.generate([tuple(ids_a)], p, use_tqdm=False)
    assert single_tuple.prompt_token_ids == listed_tuple.prompt_token_ids == ids_a
    assert single_tuple.output_token_ids == listed_tuple.output_token_ids == single_str.output_token_ids
    (single_numpy,) = llm.generate([np.int64(t) for t in ids_a], p, use_tqdm=False)  # NumPy ints, alone or listed
    (listed_numpy,) = llm.generate([[np.int32(t) for t in ids_a]], p, use_tqdm=False)
    assert single_numpy.prompt_token_ids == listed_numpy.prompt_token_ids == ids_a
    assert all(type(t) is int for t in single_numpy.prompt_token_ids)
    assert single_numpy.output_token_ids == listed_numpy.output_token_ids == single_str.output_token_ids
    assert single_str.prompt_token_ids == single_ids.prompt_token_ids == ids_a
    assert single_str.prompt == text_a and single_ids.prompt is None
    expect_a, expect_b = single_str.output_token_ids, list_str[1].output_token_ids
    assert single_ids.output_token_ids == expect_a
    assert [o.output_token_ids for o in list_str] == [expect_a, expect_b]
    assert [o.output_token_ids for o in list_ids] == [expect_a, expect_b]
    assert [o.output_token_ids for o in mixed] == [expect_b, expect_a]
    assert single_ids.text == single_str.text  # text is decoded for token-id prompts too
    assert llm.generate([], p, use_tqdm=False) == []
    assert_drained(llm.engine)


def test_outputs_in_prompt_order(make_llm):
    """Requests finish in the reverse of their prompt order; outputs still follow the prompts."""
    llm = make_llm(max_num_seqs=8)
    prompts = [byte_prompt(4 + 3 * i, i) for i in range(6)]
    params = [greedy(30 - 4 * i) if i % 2 else seeded(30 - 4 * i, seed=i) for i in range(6)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.output_token_ids) for o in outs] == [p.max_tokens for p in params]
    assert len({o.request_id for o in outs}) == 6
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(prompts, params[:3], use_tqdm=False)


@pytest.mark.parametrize("n", [0, 1, 5, 20])
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_logprobs_shape(make_llm, n, temperature):
    llm = make_llm(max_num_seqs=2)
    params = SamplingParams(max_tokens=16, temperature=temperature, seed=3, ignore_eos=True, logprobs=n)
    plain = SamplingParams(max_tokens=16, temperature=temperature, seed=3, ignore_eos=True)
    out, no_lp = llm.generate(["hello", "hello"], [params, plain], use_tqdm=False)
    assert no_lp.logprobs is None
    assert out.output_token_ids == no_lp.output_token_ids  # asking for logprobs changes nothing
    assert isinstance(out.logprobs, list) and len(out.logprobs) == len(out.output_token_ids)
    sampled_in_top = 0
    for token, entry in zip(out.output_token_ids, out.logprobs):
        assert isinstance(entry, dict) and token in entry
        assert all(isinstance(k, int) and isinstance(v, float) and v <= 0.0 for k, v in entry.items())
        assert math.fsum(math.exp(v) for v in entry.values()) <= 1.0 + 1e-5
        others = [v for k, v in entry.items() if k != token]
        in_top = len(entry) == n  # the sampled token is one of the top n
        assert len(entry) in (n, n + 1) and (len(entry) == n + 1 or n >= 1)
        if in_top:
            sampled_in_top += 1
        else:  # the top n are all at least as likely as the sampled token
            assert all(v >= entry[token] - 1e-6 for v in others)
        if temperature == 0.0:  # greedy: the sampled token is the most likely one
            assert entry[token] >= max(others, default=-math.inf) - 1e-6
            assert len(entry) == max(n, 1)
    if temperature == 0.0 and n >= 1:
        assert sampled_in_top == len(out.output_token_ids)


def test_tqdm_on_and_off(make_llm, capsys):
    llm = make_llm(max_num_seqs=2)
    quiet = llm.generate(["hello", "abc"], greedy(8), use_tqdm=False)
    assert "Generating" not in capsys.readouterr().err
    loud = llm.generate(["hello", "abc"], greedy(8), use_tqdm=True)
    assert "Generating" in capsys.readouterr().err
    assert [o.output_token_ids for o in loud] == [o.output_token_ids for o in quiet]


def test_generate_rejecting_a_prompt_leaves_nothing_behind(make_llm):
    llm = make_llm(max_num_seqs=2)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", [5, 999]], greedy(8), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


BAD_CONFIGS = [
    (dict(dtype="fp8"), "dtype"),
    (dict(max_num_seqs=-1), "max_num_seqs"),
    (dict(num_kv_blocks=0), "num_kv_blocks"),
    (dict(max_num_seqs=4, max_num_batched_tokens=2), "max_num_batched_tokens"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(inject_rejection_rate=2.0), "inject_rejection_rate"),
    (dict(model="/no/such/checkpoint"), "model"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(kv_block_size=0), "kv_block_size"),
    (dict(max_model_len=-5), "max_model_len"),
    (dict(device="tpu"), "device"),
]


@pytest.mark.parametrize("kwargs,field", BAD_CONFIGS)
def test_bad_engine_config_raises_value_error_naming_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(device=kwargs.pop("device", "cpu"), **kwargs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_outputs_are_snapshots_of_their_step(make_llm, async_scheduling):
    """A RequestOutput keeps what its request had at that step (tokens, logprobs, text),
    even though it only references the request's growing lists."""
    engine = make_llm(async_scheduling=async_scheduling).engine
    engine.add_request("a", "Hello there", SamplingParams(max_tokens=12, temperature=0.9, seed=3, logprobs=2,
                                                          ignore_eos=True))
    seen = []  # (output, copies of its fields taken at that step)
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append((out, list(out.output_token_ids), out.text, [dict(d) for d in out.logprobs]))
    final = seen[-1][0]
    assert final.finished and len(final.output_token_ids) == 12
    streamed = []
    for out, tokens, text, logprobs in seen:
        streamed += out.new_token_ids
        assert out.output_token_ids == tokens == streamed  # unchanged by later steps
        assert out.text == text and final.text.startswith(text)
        assert out.logprobs == logprobs == final.logprobs[: len(tokens)]
    assert len({len(tokens) for _, tokens, _, _ in seen}) == len(seen)  # one snapshot per token count


def test_generate_with_an_invalid_prompt_queues_nothing(make_llm):
    """All or nothing: a lone surrogate in the second prompt is a ValueError naming the
    prompt, the valid first prompt is not left queued, and no step ran."""
    llm = make_llm()
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        llm.generate(["ok", "\ud800x"], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats()["steps"] == 0
    assert llm.generate(["ok"], use_tqdm=False)[0].finished


def test_generate_from_a_second_thread_meanwhile_raises_and_the_first_is_unharmed(make_llm):
    """While one thread's generate runs, another thread's call raises RuntimeError at once
    and queues nothing; the first call's outputs are those of a run alone."""
    prompts, params = [byte_prompt(24, salt=i) for i in range(3)], seeded(40, seed=11)
    alone = [o.output_token_ids for o in make_llm().generate(prompts, params, use_tqdm=False)]
    llm = make_llm()
    stepping, go_on = threading.Event(), threading.Event()
    step = llm.engine.step

    def first_step_waits():  # holds the first call inside generate until the second has tried
        stepping.set()
        go_on.wait()
        return step()

    llm.engine.step = first_step_waits
    results: list = []
    first = threading.Thread(target=lambda: results.append(llm.generate(prompts, params, use_tqdm=False)))
    first.start()
    try:
        assert stepping.wait(timeout=60)
        with pytest.raises(RuntimeError, match="already running in another thread"):
            llm.generate(prompts[:1], params, use_tqdm=False)
    finally:
        go_on.set()
        first.join()
    assert [o.output_token_ids for o in results[0]] == alone
    assert_drained(llm.engine)


def test_generate_takes_one_dict_of_sampling_params_for_every_prompt(make_llm):
    prompts = [byte_prompt(16, salt=i) for i in range(2)]
    from_dict = make_llm().generate(prompts, {"max_tokens": 5, "temperature": 0.0}, use_tqdm=False)
    from_params = make_llm().generate(prompts, SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
    assert [o.output_token_ids for o in from_dict] == [o.output_token_ids for o in from_params]
    assert all(len(o.output_token_ids) == 5 for o in from_dict)


@pytest.mark.parametrize("prompts, sampling_params, field", [
    ({"prompt": "The capital of France is"}, None, "prompts"),  # vLLM's prompt dict: not its keys' texts
    ({"prompt_token_ids": [1, 2, 3]}, None, "prompts"),
    (None, None, "prompts"),
    (5, None, "prompts"),
    ("hello", "abc", "sampling_params"),  # not three entries of one character each
])
def test_generate_names_what_is_wrong_with_its_arguments(make_llm, prompts, sampling_params, field):
    llm = make_llm()
    with pytest.raises(ValueError, match=f"^{field} must be "):
        llm.generate(prompts, sampling_params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_outputs_in_vllms_shape(make_llm):
    """`out.outputs[0]` (vLLM's CompletionOutput) holds the flat fields; its cumulative
    logprob is the sampled tokens' logprobs summed (None without logprobs)."""
    llm = make_llm()
    with_logprobs, plain = llm.generate(["abc", "xyz"], [seeded(6, seed=2, logprobs=2), greedy(5)], use_tqdm=False)
    (first,) = with_logprobs.outputs
    assert isinstance(first, CompletionOutput) and first.index == 0
    assert (first.text, first.token_ids, first.logprobs, first.finish_reason, first.stop_reason) == (
        with_logprobs.text, with_logprobs.output_token_ids, with_logprobs.logprobs, with_logprobs.finish_reason,
        with_logprobs.stop_reason)
    expected = sum(row[t] for t, row in zip(with_logprobs.output_token_ids, with_logprobs.logprobs))
    assert first.cumulative_logprob == pytest.approx(expected) and first.cumulative_logprob < 0
    assert plain.outputs[0].cumulative_logprob is None and plain.outputs[0].token_ids == plain.output_token_ids
