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
