"""Invariant 1 under memory pressure: with staggered arrivals, pauses and evictions, every
request gets exactly the tokens of its solo run; invariant 4: one final output each, and
every KV block / Mamba slot is back after draining. Also: top logprobs that do not depend
on the batch."""
import pytest

from hybrid_engine import SamplingParams
from tests.engine.engine_helpers import assert_drained, assert_mode_ran, byte_prompt, drive, greedy, seeded

MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])


def _params(i: int, max_tokens: int):
    return greedy(max_tokens) if i % 2 == 0 else seeded(max_tokens, seed=1000 + i)


def _pause_workload():
    """8 requests, each needing at most 2 KV blocks of 16 (prompt + max_tokens <= 32), in a
    pool of 8 blocks with 6 Mamba slots: requests pause at their second block while the two
    holders of the spare blocks finish -- but someone holding 2 blocks can always run, so
    nothing is ever evicted."""
    lens = [3, 14, 7, 10, 5, 12, 9, 4]
    arrivals = [0, 0, 1, 2, 3, 5, 8, 13]
    return [(step, f"p{i}", byte_prompt(n, salt=i), _params(i, 32 - n))
            for i, (n, step) in enumerate(zip(lens, arrivals))]


def _evict_workload():
    """8 requests needing 3-9 KV blocks each (prompts 5..68, 40..75 new tokens) in a pool of 9:
    running requests all end up paused, so the scheduler must evict (recompute) the newest,
    many times, while others keep allocating the freed blocks."""
    spec = [(3 * i, 5 + 9 * i, 40 + 5 * i) for i in range(8)]  # (arrival step, prompt len, max_tokens)
    return [(step, f"e{i}", byte_prompt(n, salt=50 + i), _params(i, mt)) for i, (step, n, mt) in enumerate(spec)]


EVICT_BLOCKS = 9


def _pressure_llm(make_llm, async_scheduling, num_kv_blocks):
    return make_llm(num_kv_blocks=num_kv_blocks, kv_block_size=16, max_num_seqs=6,
                    async_scheduling=async_scheduling)


@MODES
def test_pauses_keep_outputs_identical(make_llm, solo, async_scheduling):
    llm = _pressure_llm(make_llm, async_scheduling, num_kv_blocks=8)
    work = _pause_workload()
    run = drive(llm.engine, work)
    stats = llm.engine.stats()
    assert stats["pauses"] > 0, stats
    assert stats["evictions"] == 0, stats  # by construction (see _pause_workload)
    for _, rid, prompt, params in work:
        out = run.finals[rid]
        assert out.output_token_ids == solo(prompt, params).output_token_ids, rid
        assert out.finish_reason == "length" and len(out.output_token_ids) == params.max_tokens
    assert_mode_ran(llm.engine)
    assert_drained(llm.engine)


@MODES
def test_evictions_return_resources_and_finish_everyone(make_llm, async_scheduling):
    llm = _pressure_llm(make_llm, async_scheduling, num_kv_blocks=EVICT_BLOCKS)
    work = _evict_workload()
    run = drive(llm.engine, work)
    stats = llm.engine.stats()
    assert stats["evictions"] > 0 and stats["pauses"] > 0, stats
    for _, rid, _, params in work:
        out = run.finals[rid]
        assert out.finish_reason == "length" and len(out.output_token_ids) == params.max_tokens, rid
    assert_mode_ran(llm.engine)
    assert_drained(llm.engine)


@MODES
def test_evictions_keep_outputs_identical(make_llm, solo, async_scheduling):
    llm = _pressure_llm(make_llm, async_scheduling, num_kv_blocks=EVICT_BLOCKS)
    work = _evict_workload()
    run = drive(llm.engine, work)
    assert llm.engine.stats()["evictions"] > 0
    bad = [rid for _, rid, prompt, params in work
           if run.finals[rid].output_token_ids != solo(prompt, params).output_token_ids]
    assert not bad, f"outputs differ from solo runs: {bad}"


def test_step_block_tables_match_request_blocks(make_llm):
    """Every scheduled row's block table (device view) lists exactly the request's blocks."""
    llm = _pressure_llm(make_llm, False, num_kv_blocks=EVICT_BLOCKS)
    runner = llm.engine.runner
    original = runner.prepare
    mismatches = []

    def checked_prepare(sched, *args, **kwargs):
        plan = original(sched, *args, **kwargs)
        tables = runner.buffer.device["block_tables"]
        for row, chunk in enumerate(sched.chunks):
            blocks = chunk.request.blocks
            if tables[row, :len(blocks)].tolist() != blocks:
                mismatches.append((chunk.request.request_id, tables[row, :len(blocks)].tolist(), list(blocks)))
        return plan

    runner.prepare = checked_prepare
    drive(llm.engine, _evict_workload())
    assert llm.engine.stats()["evictions"] > 0
    assert not mismatches, f"{len(mismatches)} stale block-table rows, first: {mismatches[0]}"


@MODES
def test_stop_token_and_abort_under_pressure(make_llm, solo, async_scheduling):
    """Inside the pausing scenario: a greedy request stops on a stop token id, another is
    aborted mid-decode; everyone else still matches their solo run."""
    work = _pause_workload()
    # p2 (greedy) stops at the first occurrence of its 9th solo token.
    _, _, p2_prompt, p2_params = work[2]
    p2_solo = solo(p2_prompt, p2_params).output_token_ids
    stop_tok = p2_solo[8]
    cut = p2_solo.index(stop_tok) + 1
    stop_params = greedy(p2_params.max_tokens, stop_token_ids=[stop_tok])
    work[2] = (work[2][0], "p2", p2_prompt, stop_params)
    abort_step = 12  # p3 arrives at step 2: by step 12 it is decoding
    llm = _pressure_llm(make_llm, async_scheduling, num_kv_blocks=8)
    run = drive(llm.engine, work, aborts={abort_step: ["p3"]})

    stopped = run.finals["p2"]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_tok
    assert stopped.output_token_ids == p2_solo[:cut]

    aborted = run.finals["p3"]
    _, _, p3_prompt, p3_params = work[3]
    p3_solo = solo(p3_prompt, p3_params).output_token_ids
    assert aborted.finish_reason == "abort"
    assert 0 < len(aborted.output_token_ids) < p3_params.max_tokens
    assert aborted.output_token_ids == p3_solo[:len(aborted.output_token_ids)]
    assert run.step_of_final["p3"] <= abort_step + 1

    for _, rid, prompt, params in work:
        if rid not in ("p2", "p3"):
            assert run.finals[rid].output_token_ids == solo(prompt, params).output_token_ids, rid
            assert run.finals[rid].finish_reason == "length"
    assert llm.engine.stats()["pauses"] > 0
    assert_mode_ran(llm.engine)
    assert_drained(llm.engine)


def test_top_logprobs_do_not_depend_on_the_batch(make_llm):
    """A request's top-n logprobs (ids and order) are the same alone and beside a request
    that asks for 20: bfloat16 logits tie often, and a step computes the most logprobs any
    row wants (with torch.topk's own tie order, 4 of these 6 requests differed)."""
    llm = make_llm(dtype="bfloat16", max_num_seqs=4)
    prompts = [[(7 * i + 3 * j) % 200 + 30 for j in range(12 + i)] for i in range(6)]
    few = SamplingParams(max_tokens=32, temperature=0, logprobs=3, ignore_eos=True)
    many = SamplingParams(max_tokens=32, temperature=0, logprobs=20, ignore_eos=True)
    ties = 0
    for i, prompt in enumerate(prompts):
        alone = llm.generate([prompt], [few], use_tqdm=False)[0]
        batched = llm.generate([prompt, prompts[(i + 1) % 6]], [few, many], use_tqdm=False)[0]
        assert batched.output_token_ids == alone.output_token_ids
        assert [list(d.items()) for d in batched.logprobs] == [list(d.items()) for d in alone.logprobs], i
        ties += sum(len(set(d.values())) < len(d) for d in alone.logprobs)
    assert ties > 0  # the workload has the ties that exposed the dependence
