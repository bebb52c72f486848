"""Prefix caching on the GPU (float32, Triton kernels, launch-ahead, CUDA graphs):
multi-turn conversations resume from checkpoints with their tokens equal to HF's and to
the uncached engine's, the cache's device copies keep one host-to-device copy per step,
and speculative decoding on top changes nothing."""
import pytest
import torch

from hybrid_engine import LLM
from tests.engine.test_prefix_caching import (UNCACHED_ATOL, assert_matches_hf, assert_same_turns, conversations,
                                              reusable_hit_rate)
from tests.models.conftest import make_hf_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Float32 on the GPU: Triton kernels sum in another order than the CPU reference, so the
# logprob bound between cached and uncached runs is looser than on the CPU.
GPU_ATOL = max(UNCACHED_ATOL, 1e-4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotron_moe_sharp_open")
    return str(path), make_hf_checkpoint(path, "nemotron_moe_sharp_open")


def _engine(path: str, **kw):
    return LLM(model=path, device="cuda", dtype="float32", seed=0, max_num_seqs=8, **kw).engine


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_multi_turn_on_the_gpu_matches_the_uncached_engine_and_hf(checkpoint, spec):
    path, hf = checkpoint
    kw = dict(kv_block_size=16)
    if spec:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                    "prompt_lookup_max": 2}
    engine = _engine(path, prefix_cache_checkpoint_interval=32, **kw)
    cached = conversations(hf, n=4, turns=4, answer=12).run(engine, stagger=2)
    uncached = conversations(hf, n=4, turns=4, answer=12).run(_engine(path, enable_prefix_caching=False, **kw),
                                                              stagger=2)
    assert_same_turns(cached, uncached, GPU_ATOL)
    assert_matches_hf(hf, cached)  # (HF on the CPU)
    assert reusable_hit_rate(cached) >= 0.9
    assert engine.runner.graphs is not None and engine.stats()["launch_ahead_steps"] > 0
    # The cache's copies are device-to-device: still exactly one host-to-device copy per step.
    stats = engine.stats()
    assert stats["h2d_copies"] == stats["steps"], stats
