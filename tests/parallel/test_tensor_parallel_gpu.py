"""Tensor and expert parallelism on two GPUs (NCCL, float32; skipped with fewer): the
collectives inside each rank's decode CUDA graphs, the Triton kernels at one rank's
shapes, launch-ahead, speculative decoding and prefix caching all reproduce
transformers (CPU float32), and a worker that dies ends every request with an error
instead of a hang."""
import pytest
import torch
import torch.distributed as dist

from hybrid_engine import LLM
from tests.parallel.conftest import generate, kill_a_worker_mid_generation, speculative_then_cached_turns, tp_llm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def _llm(path: str, size: int, **kwargs) -> LLM:
    return tp_llm(path, size, "cuda", **kwargs)


@pytest.mark.parametrize("model", ["nemotron", "granite"])
def test_two_gpus_match_hf_with_graphs_launch_ahead_and_rejections(model, request):
    """Decode steps replay CUDA graphs that hold NCCL all-reduces; prefills are chunked
    (16-token budget) and launch-ahead rejections are injected: tokens == HF's, logprobs
    within 1e-4."""
    oracle = request.getfixturevalue(model)
    llm = _llm(oracle.path, 2, inject_rejection_rate=0.3, max_num_seqs=4, max_num_batched_tokens=16)
    try:
        oracle.check(generate(llm, oracle.prompts))
        stats, graphs = llm.engine.stats(), llm.engine.runner.graphs
        assert graphs is not None and sum(graphs.replays.values()) > 0
        assert graphs in llm.engine.group.graphs  # (destroyed before NCCL's communicator at shutdown)
        assert stats["rejected_launches"] > 0 and stats["launch_ahead_steps"] > 0
    finally:
        llm.shutdown()
    assert not dist.is_initialized() and not graphs.sizes


def test_two_gpus_expert_parallel_matches_hf(nemotron):
    llm = _llm(nemotron.path, 2, enable_expert_parallel=True)
    try:
        nemotron.check(generate(llm, nemotron.prompts))
    finally:
        llm.shutdown()


def test_two_gpus_speculative_then_cached_turns_equal_one_gpu(granite):
    speculative_then_cached_turns(granite, lambda **options: _llm(granite.path, 2, **options),
                                  lambda: LLM(model=granite.path, device="cuda", dtype="float32", kv_block_size=16,
                                              enable_prefix_caching=False))


def test_a_dead_gpu_worker_fails_every_request_instead_of_hanging(nemotron):
    """NCCL's kernels wait for a dead peer forever: the driver's watch thread must abort
    them, or its wait for the step would never return."""
    kill_a_worker_mid_generation(nemotron, _llm(nemotron.path, 2, max_num_seqs=2), max_tokens=400)
