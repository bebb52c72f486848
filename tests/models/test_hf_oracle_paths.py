"""transformers (CPU float32) is the oracle on every scheduling path: tiny token budgets
(prefill in chunks of 1-7 tokens), tiny KV pools (pauses and evictions), async with
injected rejections, serial, KV block sizes 4 and 16, batched and staggered arrivals. For
NemotronH with MoE and GraniteMoeHybrid with RoPE and NoPE, every request's greedy tokens
equal HF's exactly and its logprobs match HF's log_softmax within 1e-4. Speculative
decoding runs the same paths with drafts from HF's own answer (accepted), corrupted
(partly rejected: state rollback), n-gram, and a draft model: the checkpoint itself (every
draft accepted) or another random one (drafts rejected).

Public API only (`LLM`, `SamplingParams`, `engine.add_request/step/stats`), so the engine's
internals can change under these tests. Each path asserts from `stats()` that it really
took the path it is named for. One test also pads prompt steps as on CUDA (it sets the
runner's token alignment, the one internal it touches)."""
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.models.loader import read_config
from hybrid_engine.runner import TOKEN_ALIGNMENT, ModelRunner
from tests.engine.engine_helpers import drive
from tests.models.conftest import hf_greedy, make_hf_checkpoint
from tests.spec.proposers import OracleProposer, PartialProposer

MODELS = ("nemotron_moe_sharp", "granite_moe_rope_sharp", "granite_moe_nope_sharp")
PROMPT_LENS = (4, 40, 11, 23, 7)
MAX_TOKENS = (16, 9, 12, 8, 14)  # different lengths: requests finish at different steps
TOGETHER = (0, 0, 0, 0, 0)  # the step() call before which each request is added
STAGGERED = (0, 0, 2, 5, 9)  # later ones arrive mid-run, while others prefill or decode
TOP_K = 3  # SamplingParams.logprobs: the sampled token's logprob plus the top 3
LOGPROB_ATOL = 1e-4
# HF's greedy choice must be unambiguous at every step, far above fp32 rounding (~1e-6),
# or exact token equality would test rounding rather than the engine.
MIN_TOP1_MARGIN = 1e-3


@dataclass
class Oracle:
    """One tiny checkpoint, the requests run on it, and transformers' answers for them."""

    checkpoint: str
    draft_checkpoint: str  # another random checkpoint of the same architecture and vocabulary
    prompts: list[list[int]]
    tokens: list[list[int]]  # HF's greedy continuation per request
    logprobs: list[torch.Tensor]  # HF's log_softmax per request, [max_tokens, vocab]


@pytest.fixture(scope="module", params=MODELS)
def oracle(request, tmp_path_factory) -> Oracle:
    """Checkpoint and HF answers, computed once per model and shared by every path."""
    checkpoint = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(checkpoint, request.param)
    draft_checkpoint = tmp_path_factory.mktemp(f"{request.param}_draft")
    make_hf_checkpoint(draft_checkpoint, request.param, seed=1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    tokens, logprobs = [], []
    for prompt, n in zip(prompts, MAX_TOKENS):
        toks, lps = hf_greedy(hf, prompt, n)
        top2 = lps.topk(2).values
        assert (top2[:, 0] - top2[:, 1]).min() > MIN_TOP1_MARGIN, "near-tie in HF's greedy choice: change the seed"
        tokens.append(toks)
        logprobs.append(lps)
    return Oracle(str(checkpoint), str(draft_checkpoint), prompts, tokens, logprobs)


@dataclass(frozen=True)
class Path:
    """Engine settings, arrival steps, and the stats() facts that prove the path was taken."""

    engine: dict
    arrivals: tuple[int, ...]
    shows: tuple[Callable[[dict], bool], ...]
    # Drafts from "oracle" (HF's answer), "partial" (corrupted), "ngram", or a draft model:
    # "draft-self" (the checkpoint itself) or "draft-other" (another random checkpoint).
    speculative: str | None = None


def _launched_ahead(s: dict) -> bool:
    return s["launch_ahead_steps"] > 0


def _serial(s: dict) -> bool:
    return s["launch_ahead_steps"] == 0


def _paused(s: dict) -> bool:
    return s["pauses"] > 0


def _evicted(s: dict) -> bool:
    return s["evictions"] > 0


def _rejected_and_restored(s: dict) -> bool:
    return s["rejected_launches"] > 0 and s["state_restores"] > 0


def _speculated(s: dict) -> bool:
    return s["spec_accepted_tokens"] > 0


def _drafts_rejected(s: dict) -> bool:
    return 0 < s["spec_accepted_tokens"] < s["spec_proposed_tokens"]


def _drafts_all_accepted(s: dict) -> bool:
    return s["spec_accepted_tokens"] == s["spec_proposed_tokens"] > 0


def _drafts_mostly_rejected(s: dict) -> bool:
    return s["spec_accepted_tokens"] < s["spec_proposed_tokens"] / 2


# Each max_num_batched_tokens below is under the longest prompt (40), which is so prefilled in chunks.
PATHS = {
    "batched-async-b16": Path(dict(kv_block_size=16), TOGETHER, (_launched_ahead,)),
    "staggered-serial-b4": Path(dict(kv_block_size=4, async_scheduling=False), STAGGERED, (_serial,)),
    "budget7-async-b4": Path(dict(kv_block_size=4, max_num_batched_tokens=7, max_num_seqs=4), STAGGERED,
                             (_launched_ahead,)),
    "budget1-serial-b16": Path(dict(kv_block_size=16, max_num_batched_tokens=1, max_num_seqs=1,
                                    async_scheduling=False), TOGETHER, (_serial,)),
    "kv-pressure-async-b4": Path(dict(kv_block_size=4, num_kv_blocks=14, max_num_seqs=4), STAGGERED,
                                 (_paused, _evicted, _launched_ahead)),
    "kv-pressure-serial-b4": Path(dict(kv_block_size=4, num_kv_blocks=14, max_num_seqs=4, async_scheduling=False),
                                  TOGETHER, (_paused, _evicted, _serial)),
    # With 16-token blocks this workload pauses requests but never stalls all of them: no eviction.
    "kv-pauses-async-b16": Path(dict(kv_block_size=16, num_kv_blocks=4, max_num_seqs=4), TOGETHER,
                                (_paused, _launched_ahead)),
    "rejections-async-b16": Path(dict(kv_block_size=16, inject_rejection_rate=0.5), STAGGERED,
                                 (_rejected_and_restored,)),
    "rejections-budget5-kv-pressure-b4": Path(dict(kv_block_size=4, inject_rejection_rate=0.5, max_num_batched_tokens=5,
                                                   max_num_seqs=3, num_kv_blocks=14), STAGGERED,
                                              (_rejected_and_restored, _paused, _evicted)),
    "spec-oracle-async-b4": Path(dict(kv_block_size=4), STAGGERED, (_speculated, _launched_ahead), "oracle"),
    "spec-partial-serial-b16": Path(dict(kv_block_size=16, async_scheduling=False), TOGETHER,
                                    (_drafts_rejected, _serial), "partial"),
    "spec-partial-rejections-budget7-kv-pressure-b4": Path(
        dict(kv_block_size=4, inject_rejection_rate=0.3, max_num_batched_tokens=7, max_num_seqs=4, num_kv_blocks=13),
        STAGGERED, (_drafts_rejected, _rejected_and_restored, _paused), "partial"),
    "spec-ngram-async-b16": Path(dict(kv_block_size=16), TOGETHER, (_launched_ahead,), "ngram"),
    "spec-draft-self-async-b4": Path(dict(kv_block_size=4), STAGGERED, (_drafts_all_accepted, _launched_ahead),
                                     "draft-self"),
    "spec-draft-self-budget7-kv-pressure-serial-b4": Path(
        dict(kv_block_size=4, max_num_batched_tokens=7, max_num_seqs=4, num_kv_blocks=13, async_scheduling=False),
        STAGGERED, (_drafts_all_accepted, _paused, _serial), "draft-self"),
    "spec-draft-other-rejections-budget7-kv-pressure-b4": Path(
        dict(kv_block_size=4, inject_rejection_rate=0.3, max_num_batched_tokens=7, max_num_seqs=4, num_kv_blocks=13),
        STAGGERED, (_drafts_mostly_rejected, _rejected_and_restored, _paused), "draft-other"),
}


def _speculative_config(oracle: Oracle, kind: str | None) -> dict | None:
    if kind is None:
        return None
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if kind.startswith("draft-"):
        model = oracle.checkpoint if kind == "draft-self" else oracle.draft_checkpoint
        return {"method": "draft_model", "model": model, "num_speculative_tokens": 4}
    truth = {f"r{i}": p + t for i, (p, t) in enumerate(zip(oracle.prompts, oracle.tokens))}
    vocab_size = read_config(oracle.checkpoint)["vocab_size"]
    proposer = OracleProposer(truth) if kind == "oracle" else PartialProposer(truth, rate=0.3, vocab_size=vocab_size)
    return {"method": "proposer", "proposer": proposer, "num_speculative_tokens": 4}


def _run(oracle: Oracle, path: Path) -> tuple[dict, dict, list]:
    """Drive the engine step by step (request i added before step() call arrivals[i]).
    Returns (final output per request id, final stats, step() calls over the token budget)."""
    engine = LLM(model=oracle.checkpoint, device="cpu", dtype="float32", seed=0, **path.engine,
                 speculative_config=_speculative_config(oracle, path.speculative)).engine
    budget = path.engine.get("max_num_batched_tokens")
    overfull, last = [], engine.stats()

    def check_budget(engine, run) -> None:
        nonlocal last
        now = engine.stats()
        tokens = sum(now[k] - last[k] for k in ("prefill_tokens", "decode_tokens"))
        if budget is not None and tokens > budget * (now["steps"] - last["steps"]):
            overfull.append((run.steps, tokens, now["steps"] - last["steps"]))
        last = now

    arrivals = [(step, f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=TOP_K))
                for i, (step, prompt, n) in enumerate(zip(path.arrivals, oracle.prompts, MAX_TOKENS))]
    run = drive(engine, arrivals, on_step=check_budget)
    return run.finals, engine.stats(), overfull


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _assert_matches_oracle(oracle: Oracle, finals: dict) -> None:
    for i, (expected, ref) in enumerate(zip(oracle.tokens, oracle.logprobs)):
        out = finals[f"r{i}"]
        got = out.output_token_ids
        assert got == expected, (f"r{i} (prompt len {PROMPT_LENS[i]}): tokens differ from HF first at output "
                                 f"position {_first_difference(got, expected)}: {got} != {expected}")
        assert out.finish_reason == "length"
        assert len(out.logprobs) == len(expected)
        for pos, (entry, token) in enumerate(zip(out.logprobs, expected)):
            # Greedy: the sampled token is the top-1, so the entry is exactly the top TOP_K.
            assert token in entry and len(entry) == TOP_K, f"r{i} position {pos}: {entry}"
            keys = torch.tensor(list(entry))
            torch.testing.assert_close(torch.tensor(list(entry.values())), ref[pos, keys], atol=LOGPROB_ATOL, rtol=0,
                                       msg=lambda m, i=i, pos=pos: f"r{i} logprobs at output position {pos}: {m}")
            kth = ref[pos].topk(TOP_K).values[-1]  # HF's top TOP_K, up to the tolerance
            assert (ref[pos, keys] >= kth - LOGPROB_ATOL).all(), f"r{i} position {pos}: {entry} not HF's top {TOP_K}"


@pytest.mark.parametrize("name", sorted(PATHS))
def test_scheduling_path_matches_hf(oracle, name):
    path = PATHS[name]
    finals, stats, overfull = _run(oracle, path)
    for shows in path.shows:
        assert shows(stats), f"{name} did not take its path ({shows.__name__}): {stats}"
    assert not overfull, f"step() calls over the token budget (call, tokens, launches): {overfull}"
    _assert_matches_oracle(oracle, finals)


PADDED_PATHS = ("budget7-async-b4", "kv-pressure-async-b4", "rejections-budget5-kv-pressure-b4",
                "spec-partial-rejections-budget7-kv-pressure-b4", "spec-draft-other-rejections-budget7-kv-pressure-b4")


@pytest.mark.parametrize("name", PADDED_PATHS)
def test_padded_prompt_steps_match_hf(oracle, name, monkeypatch):
    """On CUDA a step with prompt tokens runs a multiple of 64 tokens, padding tokens after
    its last sequence (`runner.TOKEN_ALIGNMENT`); here the CPU pads to 8, so most prompt
    steps (the draft model's too) carry padding. Tokens and logprobs are still HF's."""
    monkeypatch.setitem(TOKEN_ALIGNMENT, "cpu", 8)
    padding = []
    pad = ModelRunner._write_tail_padding

    def recording_pad(runner, num_tokens):
        padded = pad(runner, num_tokens)
        padding.append(padded - num_tokens)
        return padded

    monkeypatch.setattr(ModelRunner, "_write_tail_padding", recording_pad)
    path = PATHS[name]
    finals, stats, overfull = _run(oracle, path)
    for shows in path.shows:
        assert shows(stats), f"{name} did not take its path ({shows.__name__}): {stats}"
    assert sum(p > 0 for p in padding) >= 3 and max(padding) < 8
    assert not overfull  # the budget counts scheduled tokens, not padding
    _assert_matches_oracle(oracle, finals)
