"""The tensor-parallel tests' oracle: tiny checkpoints whose KV heads and Mamba groups
(2 each) are split at 2 ranks and replicated at 4, prompts, and transformers' greedy
answers (CPU float32) with their logprobs."""
import faulthandler
import os
import signal
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from hybrid_engine import LLM, SamplingParams
from tests.models.conftest import hf_greedy, make_hf_checkpoint
from tests.spec.proposers import PartialProposer

PROMPT_LENS = (5, 23, 11)
MAX_TOKENS = 10
LOGPROB_ATOL = 1e-4
MIN_TOP1_MARGIN = 1e-3
HANG_S = 180  # kill_a_worker_mid_generation: past this a step is hung, not slow
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)


def tp_llm(path: str, size: int, device: str, **kwargs) -> LLM:
    """A float32 LLM of the checkpoint at `path` over `size` ranks on `device` ("cpu":
    gloo processes; "cuda": one GPU each, NCCL), with small KV blocks (16 on CUDA, the
    Triton kernels' least)."""
    return LLM(model=path, device=device, dtype="float32", tensor_parallel_size=size,
               kv_block_size=4 if device == "cpu" else 16, **kwargs)


def generate(llm: LLM, prompts, params: SamplingParams = GREEDY):
    """`llm.generate` without the progress bar."""
    return llm.generate(prompts, params, use_tqdm=False)


class Oracle:
    """A tiny checkpoint, prompts, and transformers' greedy answers with logprobs."""

    def __init__(self, path: str, hf, num_prompts: int = len(PROMPT_LENS), seed: int = 0):
        self.path = path
        gen = torch.Generator().manual_seed(seed)
        self.prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist()
                        for n in PROMPT_LENS[:num_prompts]]
        self.tokens, self.logprobs = [], []
        for prompt in self.prompts:
            tokens, logprobs = hf_greedy(hf, prompt, MAX_TOKENS)
            top2 = logprobs.topk(2).values
            assert (top2[:, 0] - top2[:, 1]).min() > MIN_TOP1_MARGIN, "near-tie in HF's greedy choice"
            self.tokens.append(tokens)
            self.logprobs.append(logprobs)

    def check(self, outputs) -> None:
        """Greedy tokens equal HF's; each sampled token's logprob within 1e-4 of HF's."""
        for out, tokens, logprobs in zip(outputs, self.tokens, self.logprobs):
            assert out.output_token_ids == tokens
            ours = torch.tensor([lp[t] for lp, t in zip(out.logprobs, tokens)])
            ref = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            torch.testing.assert_close(ours, ref, atol=LOGPROB_ATOL, rtol=0)


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory) -> Oracle:
    path = tmp_path_factory.mktemp("tp_nemotron")
    return Oracle(str(path), make_hf_checkpoint(path, "nemotron_moe_sharp"))


@pytest.fixture(scope="module")
def granite(tmp_path_factory) -> Oracle:
    path = tmp_path_factory.mktemp("tp_granite")
    return Oracle(str(path), make_hf_checkpoint(path, "granite_moe_rope_sharp"))




def speculative_then_cached_turns(oracle: Oracle, build: Callable[..., LLM], single: Callable[[], LLM]) -> None:
    """Drafts (HF's answer, every other one corrupted: verify rows accept a prefix, the state
    rolls back) on a tensor-parallel LLM from `build(**options)`, then each conversation's
    next turn, resumed from the prefix cache (its KV tail copies replayed on the workers, the
    Mamba state read in place), with seeded sampling and penalties (the token history written
    from the cached prefix): the same tokens as `single()`, one rank without caching."""
    ids = [f"generate-{i}" for i in range(len(oracle.prompts))]
    truth = {rid: p + t for rid, p, t in zip(ids, oracle.prompts, oracle.tokens)}
    proposer = PartialProposer(truth, rate=0.3, vocab_size=96)
    llm = build(speculative_config={"method": "proposer", "proposer": proposer, "num_speculative_tokens": 3})
    try:
        first = llm.generate(oracle.prompts, GREEDY, use_tqdm=False)
        oracle.check(first)
        stats = llm.engine.stats()
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
        turns = [p + o.output_token_ids + [7, 8, 9] for p, o in zip(oracle.prompts, first)]
        penalized = SamplingParams(max_tokens=6, temperature=0.8, seed=3, repetition_penalty=1.3,
                                   frequency_penalty=0.2)
        cached = llm.generate(turns, penalized, use_tqdm=False)
        assert llm.engine.stats()["prefix_cache_hits"] > 0
    finally:
        llm.shutdown()
    fresh = single().generate(turns, penalized, use_tqdm=False)
    assert [o.output_token_ids for o in cached] == [o.output_token_ids for o in fresh]


def kill_a_worker_mid_generation(oracle: Oracle, llm: LLM, max_tokens: int) -> None:
    """SIGKILL `llm`'s worker a few steps into generating every prompt: within 30 s every
    request (running or waiting) ends with finish_reason "error", the engine says why and
    refuses new requests, and the LLM shuts down, freeing the process group."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(oracle.prompts):
        engine.add_request(f"r{i}", prompt, params)
    ended = {}
    for _ in range(3):
        for out in engine.step():
            ended.update({out.request_id: out} if out.finished else {})
    # A step that never returns is the bug this checks for: end the run with every thread's
    # stack instead of hanging it.
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    try:
        os.kill(engine.group.workers[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            for out in engine.step():
                if out.finished:
                    ended[out.request_id] = out
        llm.shutdown()
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert not engine.has_unfinished_requests()
    assert {r: o.finish_reason for r, o in ended.items()} == {f"r{i}": "error" for i in range(len(oracle.prompts))}
    assert engine.dead is not None and "rank 1" in engine.dead
    with pytest.raises(RuntimeError, match="engine is dead"):
        engine.add_request("late", oracle.prompts[0], params)
    assert not dist.is_initialized()
