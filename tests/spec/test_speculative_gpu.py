"""Speculative decoding on the GPU with the fast kernels, launch-ahead and CUDA graphs
(float32, so equality is exact up to fp32 rounding): outputs with drafts equal outputs
without, and verify steps replay their own CUDA graphs."""
import pytest
import torch

from hybrid_engine import LLM
from tests.engine.engine_helpers import assert_drained, drive
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
    workload = _workload(8, max_tokens=40) + [("lp", [3, 4, 5] * 6, _params(1, max_tokens=20, logprobs=2))]
    expected, _ = _run(workload)
    truth = {rid: p + expected[rid].output_token_ids for rid, p, _ in workload}
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
            if proposer == "ngram" else
            {"method": "proposer", "num_speculative_tokens": 4,
             "proposer": OracleProposer(truth) if proposer == "oracle" else PartialProposer(truth, rate=0.3)})
    finals, engine = _run(workload, speculative_config=spec)
    for rid, out in expected.items():
        assert finals[rid].output_token_ids == out.output_token_ids, rid
    stats = engine.stats()
    assert stats["spec_proposed_tokens"] > 0, stats
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.replays[engine.runner.max_width] > 0, graphs.replays
    if proposer == "oracle":
        assert stats["spec_accepted_tokens"] >= 0.9 * stats["spec_proposed_tokens"], stats
