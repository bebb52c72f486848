"""Prefix caching where the model's prompt-only dt limit binds (CPU float32).

transformers' NemotronH clamps dt >= time_step_min in its chunked (prefill) scan and not in
its recurrent (decode) update; GraniteMoeHybrid does the same with time_step_limit. So the
state a request leaves after its answer (its generated tokens, unclamped) is not what a
prefill of the same text as the next turn's prompt computes (clamped) wherever an answer
token's dt lies outside the limit. The engine checks every generated token's dt and caches
nothing of a request from the first one outside the limit (docs/cache.md, "Exactness"):
each later turn resumes from the previous turn's prompt-end checkpoint and prefills the
answer again, and every turn's tokens are the uncached engine's and transformers' own.
"""
import pytest
import torch

from hybrid_engine import SamplingParams
from tests.engine.test_prefix_caching import PATHS, UNCACHED_ATOL, Conversations, assert_same_turns, conversations, \
    engine_for
from tests.models.conftest import hf_greedy, make_hf_checkpoint

# The limit binds on every answer here: NemotronH's dt init draws from [0.05, 0.1] with a
# 0.05 limit; GraniteMoeHybrid's draws from [0.001, 0.1] with a limit of (0, 0.06).
MODELS = ("nemotron_moe_sharp", "granite_moe_nope_sharp")
# Conversation seeds whose greedy choices have no near-tie (top-1 margin > 2e-3 everywhere)
# on each model: (multi-turn, pressure).
SEEDS = {"nemotron_moe_sharp": (0, 0), "granite_moe_nope_sharp": (1, 0)}
HF_ATOL = 1e-4
MIN_TOP1_MARGIN = 1e-3


@pytest.fixture(scope="module", params=MODELS)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return str(path), make_hf_checkpoint(path, request.param), SEEDS[request.param]


def assert_matches_hf_generate(hf, convs: Conversations) -> None:
    """Every turn's greedy tokens and logprobs are transformers' `generate` of that turn's
    prompt (prompt clamped, answer not), with an unambiguous top-1 at every position."""
    for i, turns in enumerate(convs.turns):
        for t, turn in enumerate(turns):
            tokens, logprobs = hf_greedy(hf, turn.prompt, len(turn.tokens))
            top2 = logprobs.topk(2).values
            assert (top2[:, 0] - top2[:, 1]).min() > MIN_TOP1_MARGIN, "near-tie in HF's greedy choice: change the seed"
            assert turn.tokens == tokens, f"conversation {i} turn {t}: {turn.tokens} != HF {tokens}"
            for pos, entry in enumerate(turn.logprobs):
                for token, value in entry.items():
                    assert abs(value - logprobs[pos, token].item()) <= HF_ATOL, f"c{i} t{t} pos {pos} token {token}"


def previous_prompt_hits(convs: Conversations) -> list[tuple[int, int]]:
    """Per later turn: (tokens served from the cache, the previous turn's prompt length)."""
    return [(turn.num_cached_tokens, len(prev.prompt)) for turns in convs.turns for prev, turn in zip(turns, turns[1:])]


@pytest.mark.parametrize("name", sorted(PATHS))
def test_multi_turn_resumes_at_the_previous_prompt_and_stays_exact(checkpoint, name):
    """Each later turn resumes at the previous turn's prompt end, never in its answer, and
    every turn equals the uncached engine's and HF's."""
    path, hf, (seed, _) = checkpoint
    kw = PATHS[name]
    engine = engine_for(path, **kw)
    cached = conversations(hf, n=3, turns=4, seed=seed).run(engine, stagger=2)
    uncached = conversations(hf, n=3, turns=4, seed=seed).run(engine_for(path, enable_prefix_caching=False, **kw),
                                                               stagger=2)
    assert_same_turns(cached, uncached, UNCACHED_ATOL)
    assert_matches_hf_generate(hf, cached)
    hits = previous_prompt_hits(cached)
    assert all(served == prompt for served, prompt in hits), hits
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == sum(served for served, _ in hits)
    assert stats["prefix_cache_dt_limited_requests"] == sum(map(len, cached.turns))  # every answer binds


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_pauses_and_evictions_stay_exact(checkpoint, async_scheduling):
    """Evicted requests are recomputed (their generated tokens prefilled unclamped, checked
    too) and resume no deeper than the cache may hold; outputs stay exact."""
    path, hf, (_, seed) = checkpoint
    kw = dict(kv_block_size=4, num_kv_blocks=40, max_num_seqs=4, async_scheduling=async_scheduling)
    engine = engine_for(path, prefix_cache_max_checkpoints=3, **kw)
    cached = conversations(hf, n=4, turns=3, seed=seed, answer=14).run(engine, stagger=1)
    uncached = conversations(hf, n=4, turns=3, seed=seed, answer=14).run(
        engine_for(path, enable_prefix_caching=False, **kw), stagger=1)
    stats = engine.stats()
    assert stats["pauses"] > 0 and stats["evictions"] > 0, stats
    assert_same_turns(cached, uncached, UNCACHED_ATOL)
    assert_matches_hf_generate(hf, cached)
    assert all(served <= prompt for served, prompt in previous_prompt_hits(cached))
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]


def test_a_recomputed_request_resumes_no_deeper_than_its_limit(checkpoint):
    """An evicted request whose answer left the limit is recomputed from no deeper than its
    `cache_limit`, even where another request cached that very text as its prompt
    (clamped): past the limit the evicted request's own tokens are generated ones."""
    path, hf, _ = checkpoint
    kw = dict(kv_block_size=4, async_scheduling=False)
    engine = engine_for(path, prefix_cache_checkpoint_interval=8, **kw)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    prompt = torch.randint(3, hf.config.vocab_size, (10,), generator=torch.Generator().manual_seed(0)).tolist()

    def run(request_id, tokens, sampling, evict_after=None):
        engine.add_request(request_id, tokens, sampling)
        while True:
            outputs = {out.request_id: out for out in engine.step()}
            if request_id in outputs and outputs[request_id].finished:
                return outputs[request_id]
            request = engine.requests.get(request_id)
            if evict_after is not None and len(request.output_token_ids) == evict_after and request.inflight == 0:
                engine.scheduler._evict(request)  # (what KV pressure does; forced here, at a known point)
                evict_after = None

    first = run("first", prompt, params)
    answer = first.output_token_ids
    run("prompt-with-the-answer", prompt + answer[:12], SamplingParams(max_tokens=1, ignore_eos=True))
    evicted = run("evicted", prompt, params, evict_after=14)
    assert engine.stats()["evictions"] == 1
    uncached = engine_for(path, enable_prefix_caching=False, **kw)
    uncached.add_request("u", prompt, params)
    reference = next(o for _ in range(100) for o in uncached.step() if o.finished)
    assert evicted.output_token_ids == answer == reference.output_token_ids
    for got, want in zip(evicted.logprobs, reference.logprobs):
        assert got.keys() == want.keys() and all(abs(got[t] - want[t]) <= UNCACHED_ATOL for t in got)
