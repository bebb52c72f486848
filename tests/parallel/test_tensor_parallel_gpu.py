"""Tensor and expert parallelism on two GPUs (NCCL, float32; skipped with fewer): the
collectives inside each rank's decode CUDA graphs, the Triton kernels at one rank's
shapes, launch-ahead, speculative decoding and prefix caching all reproduce
transformers (CPU float32), and a worker that dies ends every request with an error
instead of a hang."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from hybrid_engine import LLM, SamplingParams
from tests.parallel.conftest import GREEDY
from tests.spec.proposers import PartialProposer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def _llm(path: str, size: int, **kwargs) -> LLM:
    return LLM(model=path, device="cuda", dtype="float32", tensor_parallel_size=size, kv_block_size=16, **kwargs)


def _generate(llm: LLM, prompts, params=GREEDY):
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("model", ["nemotron", "granite"])
def test_two_gpus_match_hf_with_graphs_launch_ahead_and_rejections(model, request):
    """Decode steps replay CUDA graphs that hold NCCL all-reduces; prefills are chunked
    (16-token budget) and launch-ahead rejections are injected: tokens == HF's, logprobs
    within 1e-4."""
    oracle = request.getfixturevalue(model)
    llm = _llm(oracle.path, 2, inject_rejection_rate=0.3, max_num_seqs=4, max_num_batched_tokens=16)
    try:
        oracle.check(_generate(llm, oracle.prompts))
        stats, graphs = llm.engine.stats(), llm.engine.runner.graphs
        assert graphs is not None and sum(graphs.replays.values()) > 0
        assert stats["rejected_launches"] > 0 and stats["launch_ahead_steps"] > 0
    finally:
        llm.shutdown()
    assert not dist.is_initialized()


def test_two_gpus_expert_parallel_matches_hf(nemotron):
    llm = _llm(nemotron.path, 2, enable_expert_parallel=True)
    try:
        nemotron.check(_generate(llm, nemotron.prompts))
    finally:
        llm.shutdown()


def test_two_gpus_speculative_then_cached_turns_equal_one_gpu(granite):
    """Drafts (HF's answer, some corrupted) verified under TP, then next turns resumed from
    the prefix cache with seeded sampling and penalties: the same tokens as one GPU without
    caching."""
    ids = [f"generate-{i}" for i in range(len(granite.prompts))]
    truth = {rid: p + t for rid, p, t in zip(ids, granite.prompts, granite.tokens)}
    proposer = PartialProposer(truth, rate=0.3, vocab_size=96)
    llm = _llm(granite.path, 2, speculative_config={"method": "proposer", "proposer": proposer,
                                                    "num_speculative_tokens": 3})
    try:
        first = _generate(llm, granite.prompts)
        granite.check(first)
        assert 0 < llm.engine.stats()["spec_accepted_tokens"] < llm.engine.stats()["spec_proposed_tokens"]
        turns = [p + o.output_token_ids + [7, 8, 9] for p, o in zip(granite.prompts, first)]
        penalized = SamplingParams(max_tokens=6, temperature=0.8, seed=3, repetition_penalty=1.3,
                                   frequency_penalty=0.2)
        cached = _generate(llm, turns, penalized)
        assert llm.engine.stats()["prefix_cache_hits"] > 0
    finally:
        llm.shutdown()
    single = LLM(model=granite.path, device="cuda", dtype="float32", kv_block_size=16, enable_prefix_caching=False)
    assert [o.output_token_ids for o in cached] == [o.output_token_ids for o in _generate(single, turns, penalized)]


def test_a_dead_gpu_worker_fails_every_request_instead_of_hanging(nemotron):
    """SIGKILL the worker mid-generation: its NCCL peer's collectives never complete, so
    the driver must not wait on the device forever. Within 30 s every request ends with
    finish_reason "error", the engine says why, and the LLM shuts down."""
    llm = _llm(nemotron.path, 2, max_num_seqs=2)
    engine = llm.engine
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(nemotron.prompts):
        engine.add_request(f"r{i}", prompt, params)
    ended = {}
    for _ in range(5):
        for out in engine.step():
            ended.update({out.request_id: out} if out.finished else {})
    os.kill(engine.group.workers[0].pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                ended[out.request_id] = out
    assert not engine.has_unfinished_requests()
    assert {r: o.finish_reason for r, o in ended.items()} == {f"r{i}": "error" for i in range(len(nemotron.prompts))}
    assert engine.dead is not None and "rank 1" in engine.dead
    llm.shutdown()
    assert not dist.is_initialized()
