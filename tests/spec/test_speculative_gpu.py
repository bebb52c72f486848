"""Speculative decoding on the GPU with the fast kernels, launch-ahead and CUDA graphs
(float32, so equality is exact up to fp32 rounding): outputs with drafts equal outputs
without, and verify steps replay their own CUDA graphs; a draft model's tokens equal HF's."""
import pytest
import torch

from hybrid_engine import LLM, SamplingParams
from tests.engine.engine_helpers import assert_drained, drive
from tests.models.conftest import hf_greedy, make_hf_checkpoint
from tests.spec.proposers import OracleProposer, PartialProposer
from tests.spec.test_speculative import _params, _workload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(workload, **kw):
    llm = LLM(device="cuda", dtype="float32", seed=7, max_num_seqs=8, **kw)
    run = drive(llm.engine, [(i % 3, rid, p, s) for i, (rid, p, s) in enumerate(workload)])
    assert_drained(llm.engine)
    return run.finals, llm.engine


@pytest.mark.parametrize("proposer", ["oracle", "partial", "ngram"])
def test_verify_steps_run_as_graphs_and_change_nothing(proposer):
    workload = _workload(8, max_tokens=40) + [("lp", [3, 4, 5] * 6, _params(1, max_tokens=20, logprobs=2)),
                                              ("pen", [6, 7, 8] * 6, _params(2, max_tokens=20, repetition_penalty=1.3))]
    expected, _ = _run(workload)
    truth = {rid: p + expected[rid].output_token_ids for rid, p, _ in workload}
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
            if proposer == "ngram" else
            {"method": "proposer", "num_speculative_tokens": 4,
             "proposer": OracleProposer(truth) if proposer == "oracle" else PartialProposer(truth, rate=0.3)})
    finals, engine = _run(workload, speculative_config=spec)
    for rid, out in expected.items():
        assert finals[rid].output_token_ids == out.output_token_ids, rid
    for a, b in zip(finals["lp"].logprobs, expected["lp"].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-5 for t in a), (a, b)
    stats = engine.stats()
    assert stats["spec_proposed_tokens"] > 0, stats
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.replays[engine.runner.max_width] > 0, graphs.replays
    # the verify steps of the logprobs and penalty requests sample eagerly after a forward graph
    assert graphs.forward_replays[engine.runner.max_width] > 0, graphs.forward_replays
    if proposer == "oracle":
        assert stats["spec_accepted_tokens"] >= 0.9 * stats["spec_proposed_tokens"], stats


@pytest.mark.parametrize("draft", ["self", "other"])
def test_draft_model_on_the_gpu_matches_hf(tmp_path_factory, draft):
    """A draft model (the target itself, or another random checkpoint) on the GPU with
    Triton kernels, launch-ahead and CUDA graphs in both engines: greedy tokens equal HF's
    (on the CPU), every draft of the target's twin is accepted, and the draft engine gets
    as many requests and KV blocks as the target."""
    target = tmp_path_factory.mktemp("target")
    hf = make_hf_checkpoint(target, "nemotron_moe_sharp_open")
    model = str(target)
    if draft == "other":
        model = str(tmp_path_factory.mktemp("draft"))
        make_hf_checkpoint(model, "nemotron_moe_sharp_open", seed=1)
    llm = LLM(str(target), device="cuda", dtype="float32", seed=0, max_num_seqs=8, kv_block_size=16,
              speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 4})
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (5, 30, 17, 9)]
    workload = [(f"r{i}", p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(prompts)]
    finals = drive(llm.engine, [(i, rid, p, s) for i, (rid, p, s) in enumerate(workload)]).finals
    for rid, prompt, _ in workload:
        assert finals[rid].output_token_ids == hf_greedy(hf, prompt, 20)[0], rid
    engine, draft_engine = llm.engine, llm.engine.draft_engine
    assert_drained(engine)
    assert_drained(draft_engine)
    stats = engine.stats()
    assert stats["spec_proposed_tokens"] > 0 and stats["launch_ahead_steps"] > 0, stats
    if draft == "self":
        assert stats["spec_accepted_tokens"] >= 0.99 * stats["spec_proposed_tokens"], stats
    assert engine.runner.graphs is not None and draft_engine.runner.graphs is not None
    assert draft_engine.kv.num_blocks == engine.kv.num_blocks
    assert draft_engine.mamba.max_num_seqs == engine.mamba.max_num_seqs
