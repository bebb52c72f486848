"""Prompt steps padded to a token alignment (`hybrid_engine/runner.py`, TOKEN_ALIGNMENT: 64
on CUDA): the padding tokens after the last sequence write nothing and change nothing.
HF-oracle paths with padding are in tests/models/test_hf_oracle_paths.py; here the
sampling side (penalties read a token history the step writes, logprobs, seeds) and the
step buffer's padding fields."""
import numpy as np
import pytest

from cache.step_buffer import TOKEN
from hybrid_engine.runner import TOKEN_ALIGNMENT
from tests.engine.engine_helpers import byte_prompt, drive, seeded

PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2, logprobs=2)


def _run(make_llm):
    """Staggered arrivals, 5-token budget (chunked prompts beside decode rows), penalties,
    logprobs and seeded sampling; returns (outputs by request id, the runner)."""
    engine = make_llm(max_num_batched_tokens=5, max_num_seqs=3, seed=3).engine
    arrivals = [(step, f"r{i}", byte_prompt(n, salt=i), seeded(10, seed=i, **PENALTIES))
                for i, (step, n) in enumerate([(0, 9), (0, 3), (2, 12), (6, 4)])]
    run = drive(engine, arrivals)
    return {rid: (o.output_token_ids, o.logprobs) for rid, o in run.finals.items()}, engine.runner


def test_padding_changes_no_output(make_llm, monkeypatch):
    """Same tokens; logprobs equal up to float32 rounding (a padded step's GEMMs have
    another M, which may change the order of the sums)."""
    unpadded, runner = _run(make_llm)
    assert runner.token_alignment == 1
    monkeypatch.setitem(TOKEN_ALIGNMENT, "cpu", 4)
    padded, runner = _run(make_llm)
    assert runner.token_alignment == 4
    assert padded.keys() == unpadded.keys()
    for rid, (tokens, logprobs) in unpadded.items():
        assert padded[rid][0] == tokens, rid
        for got, expected in zip(padded[rid][1], logprobs, strict=True):
            assert got.keys() == expected.keys(), rid
            assert list(got.values()) == pytest.approx(list(expected.values()), abs=1e-5), rid


def test_padding_tokens_write_no_kv_and_are_not_prompt(make_llm, monkeypatch):
    monkeypatch.setitem(TOKEN_ALIGNMENT, "cpu", 8)
    runner = make_llm().engine.runner
    h = runner.buffer.host_np
    tokens = runner.buffer.host_group("token_i64")
    tokens[:, :16] = 7  # stale values of an earlier step
    h["prompt_token_mask"][:16] = True
    assert runner._write_tail_padding(8) == 8 and runner._write_tail_padding(3) == 8
    assert np.array_equal(tokens[TOKEN.slot_mapping, 3:8], [-1] * 5)
    assert not tokens[TOKEN.input_ids, 3:8].any() and not tokens[TOKEN.positions, 3:8].any()
    assert not h["prompt_token_mask"][3:8].any() and h["prompt_token_mask"][:3].all()
    assert (tokens[:, 8:16] == 7).all()  # nothing past the padded count


def _two_turns(make_llm) -> tuple[list[list[int]], int]:
    """A conversation's second turn resends the first prompt + answer + a new message: it
    resumes from the prefix cache (blocks and a Mamba checkpoint) and prefills the rest in
    padded chunks. Returns both turns' tokens and the prompt tokens served from the cache."""
    llm = make_llm(max_num_batched_tokens=6, max_num_seqs=2, kv_block_size=4, seed=1)
    first = byte_prompt(21, salt=4)
    params = seeded(7, seed=9, **PENALTIES)
    answer = llm.generate([first], params, use_tqdm=False)[0].output_token_ids
    second = llm.generate([first + answer + byte_prompt(5, salt=8)], params, use_tqdm=False)[0]
    return [answer, second.output_token_ids], second.num_cached_tokens


def test_padding_with_prefix_cache_hits(make_llm, monkeypatch):
    unpadded, hits = _two_turns(make_llm)
    monkeypatch.setitem(TOKEN_ALIGNMENT, "cpu", 8)
    padded, padded_hits = _two_turns(make_llm)
    assert hits >= 20 and padded_hits == hits
    assert padded == unpadded
