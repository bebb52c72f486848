"""Prefix caching (issue 13) under stress: paths the main suite does not reach.

- Speculative decoding: a verify row commits several positions at once, and its accepted
  drafts become tokens only when they are appended afterwards; the cache must register
  blocks and checkpoints only over the request's real tokens.
- Random workloads (conversations, identical / prefix / extension prompts, aborts, stop
  tokens, penalties, seeded sampling) under chunking, KV and checkpoint pressure,
  injected rejections and failed steps: every finished request equals a fresh uncached
  engine's output, and the pools, refcounts and trie stay consistent after every step.
- Pool sizing on CUDA: the default checkpoint budget never makes a configuration that
  fits without caching fail.

CPU float32, tiny HF checkpoints whose dt limit does not bind (cached == uncached).
"""
import dataclasses
import random
import types

import pytest
import torch

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.engine import LLMEngine
from tests.models.conftest import make_hf_checkpoint
from tests.spec.proposers import OracleProposer

TOKEN_LOW = 3  # token ids from here up: no special tokens
LOGPROB_ATOL = 1e-4  # tokens must be equal; logprobs agree to rounding


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotron_moe_sharp_open")
    make_hf_checkpoint(path, "nemotron_moe_sharp_open")
    return str(path)


def engine_for(path: str, **kw):
    """An engine on the CPU in float32 over the checkpoint at `path`."""
    return LLM(model=path, device="cpu", dtype="float32", seed=0, **kw).engine


def run_one(engine, request_id: str, prompt: list[int], params: SamplingParams):
    """Add one request and step until the engine is idle; its final output."""
    engine.add_request(request_id, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


def oracle_spec(truth: dict[str, list[int]], k: int = 3) -> dict:
    """A speculative_config drafting `k` tokens of each request's true continuation
    (`truth[request_id]`: prompt + output; other requests, e.g. a next turn, get none)."""
    truth = dict(truth, b=[])
    return {"method": "proposer", "proposer": OracleProposer(truth), "num_speculative_tokens": k}


def trie_problems(cache) -> list[str]:
    """What is inconsistent in the prefix cache's trie: nodes whose key is not one full
    block of tokens, checkpoints whose position is not their node's end plus their tail."""
    problems, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            if len(key) != cache.block_size:
                problems.append(f"node at depth {child.depth} keyed by {len(key)} tokens")
            stack.append(child)
        for tail, checkpoint in node.checkpoints.items():
            if checkpoint.position != node.depth * cache.block_size + len(tail):
                problems.append(f"checkpoint at {checkpoint.position} with node end "
                                f"{node.depth * cache.block_size} and a {len(tail)}-token tail")
    return problems


# ---- speculative decoding -------------------------------------------------------------------------------

def test_blocks_completed_by_accepted_drafts_are_registered_and_reused(model_path):
    """A verify row whose accepted drafts fill a KV block: the next turn of the conversation
    resumes after the whole previous turn, as without speculation."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(TOKEN_LOW, 96, (10,), generator=gen).tolist()
    message = torch.randint(TOKEN_LOW, 96, (5,), generator=gen).tolist()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    answer = run_one(engine_for(model_path, enable_prefix_caching=False), "a", prompt, params).output_token_ids
    engine = engine_for(model_path, kv_block_size=4, speculative_config=oracle_spec({"a": prompt + answer}))
    first = run_one(engine, "a", prompt, params)
    assert first.output_token_ids == answer and engine.stats()["spec_accepted_tokens"] > 0
    assert trie_problems(engine.prefix_cache) == []
    second = run_one(engine, "b", prompt + answer + message, params)
    assert second.num_cached_tokens == len(prompt) + len(answer) - 1


def test_stop_among_accepted_drafts_leaves_no_checkpoint_past_the_request(model_path):
    """A stop token accepted as a draft with more drafts accepted after it: the request ends
    at the stop, so what the cache keeps of it ends there too, and the next turn (which
    resends its prompt + answer) equals an uncached run. Each output position in turn is
    the stop token (where that token does not occur earlier in the output)."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(TOKEN_LOW, 96, (10,), generator=gen).tolist()
    message = torch.randint(TOKEN_LOW, 96, (6,), generator=gen).tolist()
    free = run_one(engine_for(model_path, enable_prefix_caching=False), "a", prompt,
                   SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)).output_token_ids
    stop_indices = [i for i in range(1, 8) if free[i] not in free[:i]]
    assert len(stop_indices) >= 3, free
    for i in stop_indices:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[free[i]], logprobs=2)
        cached = engine_for(model_path, kv_block_size=16, speculative_config=oracle_spec({"a": prompt + free}))
        uncached = engine_for(model_path, kv_block_size=16, enable_prefix_caching=False)
        first = run_one(cached, "a", prompt, params)
        assert first.output_token_ids == free[:i + 1]
        assert trie_problems(cached.prefix_cache) == [], f"stop at output {i}"
        turn2 = prompt + first.output_token_ids + message
        got, want = run_one(cached, "b", turn2, params), run_one(uncached, "b", turn2, params)
        # (The stop token itself may be cached: a verify row fed it as a draft.)
        assert got.num_cached_tokens <= len(prompt) + len(first.output_token_ids), f"stop at output {i}"
        assert got.output_token_ids == want.output_token_ids, f"stop at output {i}"


# ---- random workloads -----------------------------------------------------------------------------------

def check_pools(engine, requests) -> None:
    """Refcounts equal the block lists of the requests; every unheld block is free xor
    cached-evictable; cached flags, the trie and the checkpoint slots agree."""
    kv, mamba, cache = engine.kv, engine.mamba, engine.prefix_cache
    free, evictable = kv._free, kv._evictable
    assert len(set(free)) == len(free) and not set(free) & set(evictable)
    refs = [0] * kv.num_blocks
    for request in requests:
        for block in request.blocks:
            refs[block] += 1
    assert kv._holders == refs
    for block in range(kv.num_blocks):
        if refs[block] == 0:
            assert (block in evictable) == kv._is_cached[block] != (block in free), block
        else:
            assert block not in evictable and block not in free, block
    if cache is None:
        return
    assert trie_problems(cache) == []
    assert [kv._is_cached[b] for b in range(kv.num_blocks)] == [b in cache._by_block for b in range(kv.num_blocks)]
    slots = [c.slot for c in cache._checkpoints]
    tails = [c.tail_block for c in cache._checkpoints if c.tail_block >= 0]
    assert len(set(slots)) == len(slots) and len(set(tails)) == len(tails)
    assert not set(slots) & set(mamba._free_checkpoint_slots)
    # A slot the cache gave back while a resumed request reads it is free only after that.
    released = mamba._released_while_read
    assert not released & (set(slots) | set(mamba._free_checkpoint_slots))
    read = {r.state.reads_checkpoint for r in requests if r.state is not None and r.state.reads_checkpoint >= 0}
    assert released <= read <= set(slots) | released
    # Slots reserved for states that launched chunks write from inside themselves.
    pending = [save for progress in cache._progress.values() for save in progress.reserved]
    reserved = [save.slot for save in pending]
    assert len(set(reserved)) == len(reserved) and not set(reserved) & (set(slots) | released)
    # The reservations by prefix are exactly those (none leaks: its prefix would never be
    # checkpointed again without evicting; none is missing: a later request would evict to
    # reserve a prefix a chunk in flight already writes).
    marked = [save for saves in cache._pending.values() for save in saves]
    assert sorted(map(id, marked)) == sorted(map(id, pending)) and all(cache._pending.values())
    assert all(save.key == key for key, saves in cache._pending.items() for save in saves)
    assert len(slots) + len(mamba._free_checkpoint_slots) + len(released) + len(reserved) == mamba.checkpoint_slots


def random_workload(engine, seed: int, fail_rate: float = 0.0):
    """Closed-loop conversations whose next prompt is the previous prompt + answer, extended,
    repeated or cut short; random aborts, stop tokens, penalties and seeded sampling;
    `fail_rate`: that share of launches raises. Checks the pools after every step. Returns
    [(request_id, prompt, params, final output)] of the requests that ended normally."""
    rng = random.Random(seed)
    if fail_rate:
        launch = engine.runner.launch

        def flaky(plan):
            if rng.random() < fail_rate:
                raise RuntimeError("injected fault")
            return launch(plan)

        engine.runner.launch = flaky
    system = [rng.randrange(TOKEN_LOW, 96) for _ in range(rng.randrange(0, 30))]

    def params() -> SamplingParams:
        kw = dict(max_tokens=rng.randrange(1, 14), logprobs=2, ignore_eos=rng.random() < 0.7)
        if rng.random() < 0.4:
            kw.update(temperature=0.8, seed=rng.randrange(1000))
        else:
            kw.update(temperature=0.0)
        if rng.random() < 0.25:
            kw.update(repetition_penalty=1.2, frequency_penalty=0.1)
        if rng.random() < 0.3:
            kw.update(stop_token_ids=[rng.randrange(TOKEN_LOW, 96)])
        return SamplingParams(**kw)

    def next_prompt(base: list[int] | None) -> list[int]:
        r = rng.random()
        if base is None or r < 0.15:
            return system + [rng.randrange(TOKEN_LOW, 96) for _ in range(rng.randrange(1, 25))]
        if r < 0.3:
            return list(base)
        if r < 0.45:
            return base[:rng.randrange(1, len(base) + 1)]
        return (base + [rng.randrange(TOKEN_LOW, 96) for _ in range(rng.randrange(1, 10))])[:engine.max_model_len - 14]

    arrivals = [(rng.randrange(6), f"r{i}", next_prompt(None), params(), 0) for i in range(5)]
    count, step, requests, live, aborts, done = len(arrivals), 0, [], {}, {}, []
    while arrivals or engine.has_unfinished_requests():
        for item in [a for a in arrivals if a[0] <= step]:
            arrivals.remove(item)
            _, rid, prompt, sampling, turn = item
            engine.add_request(rid, prompt, sampling)
            requests.append(engine.requests[rid])
            live[rid] = (prompt, sampling, turn)
            if rng.random() < 0.12:
                aborts[rid] = step + rng.randrange(5)
        for rid in [r for r, when in aborts.items() if when == step]:
            engine.abort_request(rid)
        for out in engine.step():
            if not out.finished:
                continue
            prompt, sampling, turn = live.pop(out.request_id)
            aborts.pop(out.request_id, None)
            assert out.finish_reason != "error" or "injected fault" in out.error
            if out.finish_reason not in ("abort", "error"):
                done.append((out.request_id, prompt, sampling, out))
            if turn < 3:
                arrivals.append((step + rng.randrange(3), f"r{count}", next_prompt(prompt + out.output_token_ids),
                                 params(), turn + 1))
                count += 1
        check_pools(engine, requests)
        step += 1
        assert step < 3000, "engine did not drain"
    stats = engine.stats()
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]
    assert stats["free_mamba_slots"] == stats["total_mamba_slots"]
    return done


def assert_match_uncached(path: str, done, **kw) -> None:
    """Each request's tokens equal a fresh uncached engine's, logprobs within LOGPROB_ATOL."""
    reference = engine_for(path, enable_prefix_caching=False, **kw)
    for rid, prompt, sampling, _ in done:
        reference.add_request(rid, prompt, sampling)
    want = {}
    while reference.has_unfinished_requests():
        want.update({o.request_id: o for o in reference.step() if o.finished})
    for rid, prompt, _, got in done:
        assert got.output_token_ids == want[rid].output_token_ids, (rid, len(prompt), got.num_cached_tokens)
        for a, b in zip(got.logprobs, want[rid].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= LOGPROB_ATOL for t in a), (rid, a, b)


NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
# Pools of a few hundred blocks: the per-step checks walk every block.
ROOMY = dict(kv_block_size=4, num_kv_blocks=300, max_num_seqs=8)
WORKLOADS = {
    "async": (ROOMY, {}),
    "serial": (dict(ROOMY, async_scheduling=False), {}),
    "rejections-interval8": (dict(ROOMY, inject_rejection_rate=0.4, prefix_cache_checkpoint_interval=8), {}),
    "budget5-interval8": (dict(kv_block_size=4, num_kv_blocks=300, max_num_batched_tokens=5, max_num_seqs=3,
                               prefix_cache_checkpoint_interval=8), dict(max_num_batched_tokens=5, max_num_seqs=3)),
    "kv-pressure-1-checkpoint": (dict(kv_block_size=4, num_kv_blocks=40, max_num_seqs=4,
                                      prefix_cache_max_checkpoints=1), dict(max_num_seqs=4)),
    "block1-interval3": (dict(kv_block_size=1, prefix_cache_checkpoint_interval=3, prefix_cache_max_checkpoints=4,
                              num_kv_blocks=160, max_num_seqs=4), dict(max_num_seqs=4)),
    "ngram-kv-pressure-rejections": (dict(kv_block_size=4, num_kv_blocks=40, max_num_seqs=4, inject_rejection_rate=0.3,
                                          speculative_config=NGRAM), dict(max_num_seqs=4, speculative_config=NGRAM)),
}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_random_workloads_equal_uncached_and_keep_the_pools_consistent(model_path, name):
    cached_kw, reference_kw = WORKLOADS[name]
    for seed in range(2):
        done = random_workload(engine_for(model_path, **cached_kw), seed)
        assert_match_uncached(model_path, done, **reference_kw)


@pytest.mark.parametrize("name", ["async", "kv-pressure-1-checkpoint"])
def test_failed_steps_leave_the_cache_consistent(model_path, name):
    """A tenth of the launches raise: their requests end with "error", the others are exact,
    and everything returns to the pools."""
    cached_kw, reference_kw = WORKLOADS[name]
    done = random_workload(engine_for(model_path, **cached_kw), seed=5, fail_rate=0.1)
    assert_match_uncached(model_path, done, **reference_kw)


def test_abort_mid_prefill_then_the_same_prefix_resumes_exactly(model_path):
    """An abort during a chunked prefill checkpoints the state it committed; a request
    extending the aborted prefix resumes there and equals an uncached run."""
    prompt = torch.randint(TOKEN_LOW, 96, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    kw = dict(kv_block_size=4, max_num_batched_tokens=6, max_num_seqs=2)
    engine = engine_for(model_path, **kw)
    engine.add_request("a", prompt, params)
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    follow = prompt + [7, 8, 9]
    got = run_one(engine, "b", follow, params)
    want = run_one(engine_for(model_path, enable_prefix_caching=False, **kw), "b", follow, params)
    assert got.num_cached_tokens > 0
    assert got.output_token_ids == want.output_token_ids
    assert engine.stats()["free_kv_blocks"] == engine.stats()["total_kv_blocks"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_see_the_whole_prefix_after_an_eviction_and_a_deeper_hit(model_path, async_scheduling):
    """A request with penalties is evicted mid-prompt (KV pressure), another request with
    the same prompt runs on and leaves checkpoints deeper in it, and the evicted request is
    readmitted -- into its old row -- resuming from the deeper hit: the penalties' token
    history must hold every token before the hit, as a fresh uncached run's does."""
    prompt = torch.randint(TOKEN_LOW, 96, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    penalized = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=3.0,
                               presence_penalty=1.5)
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = engine_for(model_path, kv_block_size=4, num_kv_blocks=13, max_num_seqs=2, prefix_cache_max_checkpoints=8,
                        prefix_cache_checkpoint_interval=8, async_scheduling=async_scheduling)
    engine.add_request("plain", prompt, plain)
    got = run_one(engine, "penalized", prompt, penalized)
    want = run_one(engine_for(model_path, enable_prefix_caching=False, async_scheduling=False, kv_block_size=4),
                   "penalized", prompt, penalized)
    assert engine.stats()["evictions"] > 0 and engine.stats()["prefix_cache_hits"] > 0
    assert got.output_token_ids == want.output_token_ids


# ---- pool sizing ------------------------------------------------------------------------------------------

def test_default_checkpoints_never_make_a_fitting_configuration_fail(model_path, monkeypatch):
    """`_size_pools` on a (simulated) CUDA device with an explicit max_num_seqs: the smallest
    memory budget that fits without prefix caching also fits with it, the default number of
    checkpoints shrinking to what is left (prefix_cache_max_checkpoints was not given)."""
    engine = engine_for(model_path, max_num_seqs=64)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def size(budget: int, caching: bool):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (budget, budget))
        config = dataclasses.replace(engine.config, enable_prefix_caching=caching, num_kv_blocks=None,
                                     gpu_memory_utilization=1.0)
        fake = types.SimpleNamespace(config=config, model_config=engine.model_config,
                                     max_model_len=engine.max_model_len, state_banks=engine.state_banks,
                                     state_positions=engine.state_positions, _user_max_num_seqs=True,
                                     device=torch.device("cuda"), model=engine.model, group=None)
        fake.kv_blocks_floor = lambda: LLMEngine.kv_blocks_floor(fake)
        fake._pool_bytes = lambda *args: LLMEngine._pool_bytes(fake, *args)
        try:
            return LLMEngine._size_pools(fake)
        except ValueError:
            return None

    low, high = 1 << 30, 1 << 34  # bisect the smallest budget that fits without caching
    while high - low > 1 << 10:
        mid = (low + high) // 2
        low, high = (low, mid) if size(mid, False) is not None else (mid, high)
    assert size(high, False) is not None
    assert size(high, True) is not None, "default checkpoints turned a fitting configuration into an error"
