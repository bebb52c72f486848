"""Chunk size never changes a request's tokens: prompts of 5 / 40 / 100 tokens, greedy and
seeded, under token budgets of 1, 7, 64 and the default, with staggered arrivals so that
steps mix decode rows and prefill chunks."""
import pytest

from tests.engine.engine_helpers import assert_drained, byte_prompt, drive, greedy, seeded

PROMPT_LENS = (5, 40, 100)

# (max_num_seqs, max_num_batched_tokens): the budget must be >= max_num_seqs.
BUDGETS = [(1, 1), (4, 7), (6, 64), (6, None)]


def _work(max_tokens: int = 12):
    work = []
    for i, n in enumerate(PROMPT_LENS):
        prompt = byte_prompt(n, salt=100 + i)
        work.append((3 * i, f"g{n}", prompt, greedy(max_tokens)))
        work.append((3 * i + 1, f"s{n}", prompt, seeded(max_tokens, seed=7 + i)))
    return work


def _record_plans(llm):
    runner, plans = llm.engine.runner, []
    original = runner.prepare

    def recording(sched, *args, **kwargs):
        plan = original(sched, *args, **kwargs)
        plans.append((plan.num_decode, plan.num_prefill, plan.num_tokens,
                      [(c.request.request_id, c.num_tokens) for c in sched.prefills]))
        return plan

    runner.prepare = recording
    return plans


@pytest.mark.parametrize("max_num_seqs,budget", BUDGETS, ids=[f"budget{b}" for _, b in BUDGETS])
def test_chunked_prefill_outputs_identical(make_llm, solo, max_num_seqs, budget):
    llm = make_llm(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    plans = _record_plans(llm)
    work = _work()
    run = drive(llm.engine, work)
    for _, rid, prompt, params in work:
        out = run.finals[rid]
        assert out.output_token_ids == solo(prompt, params).output_token_ids, (rid, budget)
        assert out.finish_reason == "length"
    limit = budget or 2048
    assert all(t <= limit for _, _, t, _ in plans)
    # The paths under test actually ran: prompts were split into chunks when the budget is
    # smaller than a prompt, and (with room for several sequences) some steps mixed decode
    # rows with prefill chunks.
    chunks_of_100 = [n for *_, pre in plans for rid, n in pre if rid == "g100"]
    if limit < 100:
        assert len(chunks_of_100) > 1 and max(chunks_of_100) <= limit
    if max_num_seqs > 1:
        assert any(d > 0 and p > 0 for d, p, _, _ in plans)
    stats = llm.engine.stats()
    assert stats["prefill_tokens"] >= sum(PROMPT_LENS) * 2
    assert_drained(llm.engine)


def test_chunk_boundaries_inside_mamba_chunk_and_kv_block(make_llm, solo):
    """Budgets 3, 13 and 17 put chunk ends at every offset of the 16-token Mamba chunk and
    KV block; the long prompt's greedy tokens never change."""
    prompt = byte_prompt(100, salt=7)
    params = greedy(8)
    expected = solo(prompt, params).output_token_ids
    for budget in (3, 13, 17):
        llm = make_llm(max_num_seqs=2, max_num_batched_tokens=budget)
        assert llm.generate([prompt], params, use_tqdm=False)[0].output_token_ids == expected, budget
