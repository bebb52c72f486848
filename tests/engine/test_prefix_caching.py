"""Prefix caching against transformers (CPU float32): multi-turn conversations (each turn
resends the previous prompt + answer + a new message), a shared system prompt across
concurrent requests, KV and checkpoint pressure (pauses, evictions), async launch-ahead
with injected rejections, speculative decoding, penalties. Every path's tokens equal HF's
greedy ones and the uncached engine's, its logprobs are within 1e-4 of HF's and 1e-5 of
the uncached engine's (plus the uncached run's own rounding, below), and the cache really
served the reusable tokens.

Where the two engines' logprobs differ, float64 HF says whose rounding it is: the bound
between them is 1e-5 plus the uncached run's own distance from float64 HF (a random tiny
model with sharp weights can put a float32 run 1.5e-5 from the float64 value; the cached
run was the closer one there).

HF's oracle is one cache-free forward over a turn's prompt and answer (its cached
`generate` prefill disagrees with its own cache-free forward for some GraniteMoeHybrid
prompt lengths; the engine agrees with the latter). The checkpoints used here have a dt
limit that never binds: a turn-end checkpoint holds
the state the previous request computed with its answer as *generated* tokens, which a
fresh prefill would process as prompt tokens, with the prompt-only dt limit (docs/cache.md).
"""
import copy
import functools
from dataclasses import dataclass, field

import pytest
import torch

from hybrid_engine import LLM, SamplingParams
from tests.models.conftest import make_hf_checkpoint, skip_unless_hf_oracle

MODELS = ("nemotron_moe_sharp_open", "granite_moe_rope_sharp")
TOP_K = 2
HF_ATOL = 1e-4  # as the other HF oracle tests: CPU fp32, different op order
UNCACHED_ATOL = 1e-5  # the bound between a resumed request and an uncached run
MIN_TOP1_MARGIN = 1e-3


@pytest.fixture(scope="module", params=MODELS)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return str(path), make_hf_checkpoint(path, request.param)


@dataclass
class Turn:
    prompt: list[int]
    tokens: list[int]
    logprobs: list[dict[int, float]]
    num_cached_tokens: int


@dataclass
class Conversations:
    """Closed-loop conversations: turn t+1 is added as soon as turn t finishes."""

    first_prompts: list[list[int]]
    messages: list[list[list[int]]]  # [conversation][turn - 1]: the new user message
    params: SamplingParams
    turns: list[list[Turn]] = field(default_factory=list)

    def run(self, engine, stagger: int = 0) -> "Conversations":
        """Drive the engine; conversation i starts before step() call i * stagger."""
        self.turns = [[] for _ in self.first_prompts]
        prompts: dict[str, list[int]] = {}
        total = len(self.first_prompts) * (1 + len(self.messages[0]))
        step = 0
        while sum(map(len, self.turns)) < total:
            for i, prompt in enumerate(self.first_prompts):
                if step == i * stagger:
                    prompts[f"c{i}t0"] = prompt
                    engine.add_request(f"c{i}t0", prompt, self.params)
            for out in engine.step():
                if not out.finished:
                    continue
                i, t = (int(x) for x in out.request_id[1:].split("t"))
                prompt = prompts[out.request_id]
                self.turns[i].append(Turn(prompt, out.output_token_ids, out.logprobs, out.num_cached_tokens))
                if t < len(self.messages[i]):
                    rid = f"c{i}t{t + 1}"
                    prompts[rid] = prompt + out.output_token_ids + self.messages[i][t]
                    engine.add_request(rid, prompts[rid], self.params)
            step += 1
            assert step < 5000, "engine did not drain"
        return self


def random_tokens(gen: torch.Generator, vocab: int, low: int, high: int) -> list[int]:
    n = int(torch.randint(low, high + 1, (1,), generator=gen))
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


def conversations(hf, n: int, turns: int, system: list[int] | None = None, seed: int = 0,
                  params: SamplingParams | None = None, answer: int = 9) -> Conversations:
    gen = torch.Generator().manual_seed(seed)
    vocab = hf.config.vocab_size
    firsts = [(system or []) + random_tokens(gen, vocab, 5, 30) for _ in range(n)]
    messages = [[random_tokens(gen, vocab, 3, 12) for _ in range(turns - 1)] for _ in range(n)]
    params = params or SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True, logprobs=TOP_K)
    return Conversations(firsts, messages, params)


def engine_for(path: str, **kw):
    return LLM(model=path, device="cpu", dtype="float32", seed=0, **kw).engine


def assert_same_turns(got: Conversations, want: Conversations, atol: float, hf=None) -> None:
    """Same prompts and tokens turn by turn, logprobs (the sampled token and top-K) within
    atol; with `hf`, within atol plus `want`'s own distance from float64 HF (its rounding),
    which must stay within HF_ATOL, and `got` no further from float64 HF than `want` is,
    plus atol."""
    truth = None if hf is None else float64_oracle(hf)
    for i, (a_turns, b_turns) in enumerate(zip(got.turns, want.turns)):
        assert len(a_turns) == len(b_turns)
        for t, (a, b) in enumerate(zip(a_turns, b_turns)):
            assert a.prompt == b.prompt and a.tokens == b.tokens, f"conversation {i} turn {t}: {a.tokens} != {b.tokens}"
            exact = None if truth is None else hf_logprobs(truth, b.prompt, b.tokens)
            for pos, (ea, eb) in enumerate(zip(a.logprobs, b.logprobs)):
                assert ea.keys() == eb.keys(), f"conversation {i} turn {t} position {pos}: {ea} vs {eb}"
                for token in ea:
                    bound = atol
                    if exact is not None:
                        rounding = abs(eb[token] - exact[pos, token].item())
                        assert rounding <= HF_ATOL, f"c{i} t{t} pos {pos}: {eb} is {rounding} from float64 HF"
                        assert abs(ea[token] - exact[pos, token].item()) <= atol + rounding, \
                            f"c{i} t{t} pos {pos}: {ea} is further from float64 HF than {eb}"
                        bound += rounding
                    assert abs(ea[token] - eb[token]) <= bound, f"c{i} t{t} pos {pos}: {ea} vs {eb} (bound {bound})"


@functools.cache
def float64_oracle(hf):
    """A float64 copy of the HF model (eager experts: torch's grouped GEMM has no float64)."""
    model = copy.deepcopy(hf).double()
    model.config._experts_implementation = "eager"
    return model


def hf_logprobs(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """HF's log_softmax for each of `tokens` after `prompt`, from ONE cache-free forward over
    prompt + tokens[:-1]: every token processed as a prompt token, as an uncached prefill
    of the next turn processes the previous answer. ([len(tokens), vocab])"""
    skip_unless_hf_oracle(hf)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits.double(), dim=-1)


def assert_matches_hf(hf, convs: Conversations) -> None:
    """Every turn's greedy tokens are HF's choices (unambiguous top-1) after that turn's
    prompt and the tokens before, and its logprobs HF's within HF_ATOL."""
    for i, turns in enumerate(convs.turns):
        for t, turn in enumerate(turns):
            logprobs = hf_logprobs(hf, turn.prompt, turn.tokens)
            top2 = logprobs.topk(2).values
            assert (top2[:, 0] - top2[:, 1]).min() > MIN_TOP1_MARGIN, "near-tie in HF's greedy choice: change the seed"
            tokens = logprobs.argmax(dim=-1).tolist()
            assert turn.tokens == tokens, f"conversation {i} turn {t}: {turn.tokens} != HF {tokens}"
            for pos, entry in enumerate(turn.logprobs):
                keys = torch.tensor(list(entry))
                values = torch.tensor(list(entry.values()), dtype=torch.float64)
                torch.testing.assert_close(values, logprobs[pos, keys], atol=HF_ATOL, rtol=0)


def reusable_hit_rate(convs: Conversations) -> float:
    """Tokens resumed from the cache over reusable ones (previous prompt + answer - 1: the
    last answer token was never fed), over every turn after the first."""
    hits = reusable = 0
    for turns in convs.turns:
        for prev, turn in zip(turns, turns[1:]):
            reusable += len(prev.prompt) + len(prev.tokens) - 1
            hits += turn.num_cached_tokens
    return hits / reusable


PATHS = {
    "async-b4": dict(kv_block_size=4),
    "serial-b16": dict(kv_block_size=16, async_scheduling=False),
    "rejections-async-b4": dict(kv_block_size=4, inject_rejection_rate=0.5),
    "budget5-chunked-async-b4": dict(kv_block_size=4, max_num_batched_tokens=5, max_num_seqs=3),
    "ngram-spec-async-b4": dict(kv_block_size=4, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}),
}


@pytest.mark.parametrize("name", sorted(PATHS))
def test_multi_turn_conversations_match_hf_and_the_uncached_engine(checkpoint, name):
    path, hf = checkpoint
    kw = PATHS[name]
    cached_engine = engine_for(path, **kw)  # default cache settings: interval 512, 2 checkpoints per seq
    cached = conversations(hf, n=3, turns=4).run(cached_engine, stagger=2)
    uncached = conversations(hf, n=3, turns=4).run(engine_for(path, enable_prefix_caching=False, **kw), stagger=2)
    assert_same_turns(cached, uncached, UNCACHED_ATOL, hf)
    assert_matches_hf(hf, cached)
    assert reusable_hit_rate(cached) >= 0.9
    assert all(turns[0].num_cached_tokens == 0 for turns in cached.turns)  # nothing shared at turn 1
    stats = cached_engine.stats()
    assert stats["prefix_cache_dt_limited_requests"] == 0  # (the dt limit never binds here)
    assert stats["prefix_cache_hits"] == sum(t.num_cached_tokens for turns in cached.turns for t in turns)
    assert stats["prefix_cache_queries"] == sum(len(t.prompt) for turns in cached.turns for t in turns)
    if kw.get("inject_rejection_rate"):
        assert stats["rejected_launches"] > 0 and stats["state_restores"] > 0
    if "speculative_config" in kw:
        assert stats["spec_proposed_tokens"] > 0


def test_seeded_sampling_and_penalties_resume_exactly(checkpoint):
    """Sampling noise is keyed by (seed, output position) and penalties read the token
    history, which a resumed request fills for the tokens it never fed."""
    path, hf = checkpoint
    params = SamplingParams(max_tokens=9, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True, logprobs=TOP_K,
                            repetition_penalty=1.3, presence_penalty=0.2)
    runs = [conversations(hf, n=2, turns=4, params=params, seed=3).run(engine_for(path, kv_block_size=4, **kw))
            for kw in ({}, {"enable_prefix_caching": False})]
    assert_same_turns(runs[0], runs[1], UNCACHED_ATOL, hf)
    assert reusable_hit_rate(runs[0]) >= 0.9


def test_shared_system_prompt_across_concurrent_requests(checkpoint):
    """Later conversations resume inside the system prompt, from an interval checkpoint of
    an earlier one (the interval is 8 tokens here), which that one's chunk wrote from
    inside itself: 8, 16, ..., as deep as it has prefilled when they arrive."""
    path, hf = checkpoint
    gen = torch.Generator().manual_seed(11)
    system = torch.randint(3, hf.config.vocab_size, (37,), generator=gen).tolist()
    engine = engine_for(path, kv_block_size=4, prefix_cache_checkpoint_interval=8)
    cached = conversations(hf, n=4, turns=2, system=system, seed=8).run(engine, stagger=3)
    uncached = conversations(hf, n=4, turns=2, system=system, seed=8).run(
        engine_for(path, kv_block_size=4, enable_prefix_caching=False), stagger=3)
    assert_same_turns(cached, uncached, UNCACHED_ATOL, hf)
    assert_matches_hf(hf, cached)
    later_firsts = [turns[0].num_cached_tokens for turns in cached.turns[1:]]
    # 32: the deepest interval position inside the 37-token system prompt.
    assert all(8 <= n <= 32 and n % 8 == 0 for n in later_firsts) and 32 in later_firsts, later_firsts


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_kv_and_checkpoint_pressure_pause_evict_and_stay_exact(checkpoint, async_scheduling):
    """A KV pool too small for every conversation pauses and evicts requests (evicted ones
    resume from a checkpoint of their own state), and only 3 checkpoints fit, so cached
    blocks and checkpoints are evicted under the running requests; outputs stay exact."""
    path, hf = checkpoint
    kw = dict(kv_block_size=4, num_kv_blocks=40, max_num_seqs=4, async_scheduling=async_scheduling)
    engine = engine_for(path, prefix_cache_max_checkpoints=3, **kw)
    cached = conversations(hf, n=4, turns=3, seed=9, answer=14).run(engine, stagger=1)
    uncached = conversations(hf, n=4, turns=3, seed=9, answer=14).run(
        engine_for(path, enable_prefix_caching=False, **kw), stagger=1)
    stats = engine.stats()
    assert stats["pauses"] > 0 and stats["evictions"] > 0, stats
    assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_checkpoints"] <= 3
    assert_same_turns(cached, uncached, UNCACHED_ATOL, hf)
    assert_matches_hf(hf, cached)
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]  # everything back (cached blocks count free)


def test_interval_checkpoints_do_not_cut_prompts_into_chunks(checkpoint):
    """A burst of long prompts is chunked exactly as without caching (first come, first
    served; interval checkpoints are written from inside the chunks), the checkpoints are
    there, and a request sharing part of a prompt resumes at one, with HF's tokens."""
    path, hf = checkpoint
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, hf.config.vocab_size, (45,), generator=gen).tolist() for _ in range(3)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    kw = dict(kv_block_size=4, max_num_batched_tokens=64, prefix_cache_checkpoint_interval=8)
    chunks = {}
    for caching in (True, False):
        engine = engine_for(path, enable_prefix_caching=caching, **kw)
        schedule, launched = engine.scheduler.schedule, []

        def logged(*args, **kwargs):
            out = schedule(*args, **kwargs)
            launched.append([(c.request.request_id, c.start, c.num_tokens) for c in out.prefills])
            return out

        engine.scheduler.schedule = logged
        for i, prompt in enumerate(prompts):
            engine.add_request(f"p{i}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        chunks[caching] = launched
        if caching:
            # p0 in one chunk, p1 cut by the budget at 19, p2 from 0 and on: checkpoints
            # at 8 .. 40 of each (40 of p0 and p1; p2's at 40 lies in its second chunk).
            assert engine.stats()["prefix_cache_checkpoints"] >= 15
            engine.scheduler.schedule = schedule
            shared = prompts[1][:22] + torch.randint(3, hf.config.vocab_size, (6,), generator=gen).tolist()
            engine.add_request("shared", shared, params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    resumed = out
    assert chunks[True] == chunks[False] and chunks[True][0] == [("p0", 0, 45), ("p1", 0, 19)]
    assert resumed.num_cached_tokens == 16  # the interval checkpoint p1's first chunk wrote from inside
    assert hf_logprobs(hf, shared, resumed.output_token_ids).argmax(dim=-1).tolist() == resumed.output_token_ids


def test_prompt_end_checkpoint_equals_the_state_its_prefill_produced(checkpoint):
    path, hf = checkpoint
    prompt = torch.randint(3, hf.config.vocab_size, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    states = []
    for caching in (True, False):
        engine = engine_for(path, kv_block_size=4, async_scheduling=False, enable_prefix_caching=caching)
        engine.add_request("r", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        engine.step()  # the whole prompt in one chunk: its state is committed
        slot = engine.scheduler.running[0].state.committed
        states.append((engine.mamba.conv_states[:, slot].clone(), engine.mamba.ssm_states[:, slot].clone()))
        if caching:
            hit = engine.prefix_cache.acquire(prompt + [5])
            assert hit.position == len(prompt)
            checkpoint_slot = hit.checkpoint.slot
            checkpoint_state = (engine.mamba.conv_states[:, checkpoint_slot],
                                engine.mamba.ssm_states[:, checkpoint_slot])
            engine.prefix_cache.cancel(hit)
            while engine.has_unfinished_requests():  # the request goes on without touching its checkpoint
                engine.step()
    for a, b, c in zip(checkpoint_state, states[0], states[1]):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_identical_prompt_resumes_before_its_last_token_and_reports_it(checkpoint):
    path, hf = checkpoint
    prompt = torch.randint(3, hf.config.vocab_size, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    llm = LLM(model=path, device="cpu", dtype="float32", kv_block_size=4, prefix_cache_checkpoint_interval=8)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    first, second = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 24  # the deepest interval checkpoint < 30
    assert first.output_token_ids == second.output_token_ids
    assert hf_logprobs(hf, prompt, first.output_token_ids).argmax(dim=-1).tolist() == first.output_token_ids


def test_a_burst_of_one_prompt_does_not_evict_other_checkpoints(checkpoint):
    """Identical prompts admitted together (none can resume: nothing of theirs has
    committed) write each interval checkpoint once, so with few checkpoint slots they do not
    evict another conversation's finish checkpoint: its next turn still resumes there,
    with HF's tokens."""
    path, hf = checkpoint
    gen = torch.Generator().manual_seed(0)
    engine = engine_for(path, kv_block_size=4, max_num_batched_tokens=256, prefix_cache_checkpoint_interval=8,
                        prefix_cache_max_checkpoints=6)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    def run(prompts: dict[str, list[int]]) -> dict:
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, params)
        outs = {}
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o) for o in engine.step() if o.finished)
        return outs

    first = torch.randint(3, hf.config.vocab_size, (13,), generator=gen).tolist()
    answer = run({"z0": first})["z0"].output_token_ids
    shared = torch.randint(3, hf.config.vocab_size, (25,), generator=gen).tolist()
    run({f"b{i}": shared for i in range(4)})
    second = first + answer + [5, 6, 7]
    resumed = run({"z1": second})["z1"]
    assert resumed.num_cached_tokens == len(first) + len(answer) - 1  # its finish checkpoint
    assert hf_logprobs(hf, second, resumed.output_token_ids).argmax(dim=-1).tolist() == resumed.output_token_ids


def test_a_burst_whose_first_request_is_aborted_still_checkpoints_the_prefix(checkpoint):
    """x and y share 8 tokens and are launched together (launch-ahead), both past the
    interval position 8; x, which reserved it first, is aborted with its chunk in flight.
    y's spare slot keeps the checkpoint, so a later prompt with that prefix resumes at 8
    (found by a helper: without spares nobody wrote it)."""
    path, hf = checkpoint
    engine = engine_for(path, kv_block_size=4, prefix_cache_checkpoint_interval=8, num_kv_blocks=64, max_num_seqs=4,
                        prefix_cache_max_checkpoints=8)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    shared = [11, 12, 13, 14, 15, 16, 17, 18]
    engine.add_request("w", [5, 6, 7], params)
    engine.step()  # w's decode is launched ahead: the next two chunks are in flight together
    engine.add_request("x", shared + [21, 22, 23, 24], params)
    engine.add_request("y", shared + [31, 32, 33, 34, 35, 36, 37, 38], params)
    engine.step()
    engine.abort_request("x")
    while engine.has_unfinished_requests():
        engine.step()
    later = shared + [41, 42, 43, 44, 45]
    engine.add_request("z", later, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            resumed = out
    assert resumed.num_cached_tokens == 8
    assert hf_logprobs(hf, later, resumed.output_token_ids).argmax(dim=-1).tolist() == resumed.output_token_ids
    assert not engine.prefix_cache._pending  # nothing reserved once nothing runs


@pytest.mark.parametrize("bad, match", [
    (dict(prefix_cache_checkpoint_interval=24), "prefix_cache_checkpoint_interval"),  # not a multiple of 16
    (dict(prefix_cache_checkpoint_interval=0), "prefix_cache_checkpoint_interval"),
    (dict(prefix_cache_max_checkpoints=-1), "prefix_cache_max_checkpoints"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching"),
])
def test_bad_settings_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        LLM(device="cpu", **bad)
