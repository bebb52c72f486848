"""Decode CUDA graphs: same tokens as eager, with and without launch-ahead (GPU only)."""
import math

import pytest
import torch

from hybrid_engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _prompts(n: int) -> list[list[int]]:
    return [[3 + (13 * i + 7 * j) % 250 for j in range(4 + (i * 5) % 23)] for i in range(n)]


def _run(n_requests: int, max_tokens: int, seeded: bool = False, **kwargs) -> list[list[int]]:
    llm = LLM(max_num_seqs=32, **kwargs)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.8 if seeded and i % 2 else 0.0, seed=i,
                             ignore_eos=True) for i in range(n_requests)]
    return [o.output_token_ids for o in llm.generate(_prompts(n_requests), params, use_tqdm=False)]


def assert_same_tokens(got: list[list[int]], expected: list[list[int]]) -> None:
    """Token-for-token equality; a failure names the first differing request and position."""
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise AssertionError(f"request {i} differs first at output position {pos}: {a[pos:pos + 4]} vs "
                                 f"{b[pos:pos + 4]}")
    assert len(got) == len(expected)


def test_graphs_are_captured_and_replayed():
    llm = LLM(max_num_seqs=8, dtype="float32")
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    replays = []
    original = graphs.replay

    def recording_replay(plan, sampler):
        out = original(plan, sampler)
        if out is not None:
            replays.append(plan.num_decode)
        return out

    graphs.replay = recording_replay
    llm.generate(_prompts(5), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(replays) >= 6 and set(replays) == {8}  # 5 decoders padded to the size-8 graph
    assert graphs.forward_replays == {1: 0}  # no row wants penalties or logprobs


def test_graphs_on_equals_off_fp32():
    on = _run(12, 48, seeded=True, dtype="float32")
    off = _run(12, 48, seeded=True, dtype="float32", cuda_graphs=False)
    assert_same_tokens(on, off)


def test_async_graphs_equal_serial_eager_with_rejections():
    serial_eager = _run(12, 40, seeded=True, dtype="float32", async_scheduling=False, cuda_graphs=False)
    assert_same_tokens(_run(12, 40, seeded=True, dtype="float32"), serial_eager)
    assert_same_tokens(_run(12, 40, seeded=True, dtype="float32", inject_rejection_rate=0.3), serial_eager)


def test_bf16_graphs_equal_eager():
    """32 requests decode as one batch of 32, a captured size: the replayed graph runs the same
    kernels on the same shapes as eager, so even bf16 tokens are identical."""
    on = _run(32, 256, dtype="bfloat16")
    off = _run(32, 256, dtype="bfloat16", cuda_graphs=False)
    assert_same_tokens(on, off)


def _eager_sampler_params(i: int) -> SamplingParams:
    """Greedy and seeded rows, some with logprobs, a repetition or a frequency penalty (the
    first request, which takes token-history row 0 that padding rows also use, has one)."""
    return SamplingParams(max_tokens=32, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True,
                          logprobs=2 if i % 3 == 0 else None, repetition_penalty=1.3 if i % 4 in (0, 1) else 1.0,
                          frequency_penalty=0.5 if i % 4 == 2 else 0.0)


@pytest.mark.parametrize("batch", [5, 12])
def test_penalties_and_logprobs_decode_through_the_forward_graph(batch):
    """Steps whose rows want penalties or logprobs replay the forward graph and run the LM
    head and sampler eagerly: tokens and logprobs equal the eager engine's, serially and
    under launch-ahead with injected rejections (fp32), and padding rows leave every
    request's token history (what penalties read) as it was fed."""
    params = [_eager_sampler_params(i) for i in range(batch)]

    def run(**kwargs):
        llm = LLM(max_num_seqs=16, dtype="float32", **kwargs)
        return llm, llm.generate(_prompts(batch), params, use_tqdm=False)

    _, eager = run(cuda_graphs=False)
    for kwargs in ({"async_scheduling": False}, {"inject_rejection_rate": 0.3}):
        llm, graphed = run(**kwargs)
        runner = llm.engine.runner
        assert runner.graphs.forward_replays[1] >= 20, runner.graphs.forward_replays  # (31 decode steps each)
        history = runner._history.cpu()
        for prompt, out in zip(_prompts(batch), graphed):
            fed = torch.tensor(prompt + out.output_token_ids[:-1])
            assert any(torch.equal(history[row, :len(fed)], fed) for row in range(batch)), prompt
        assert_same_tokens([o.output_token_ids for o in graphed], [o.output_token_ids for o in eager])
        for i, (got, expected) in enumerate(zip(graphed, eager)):
            if params[i].logprobs is None:
                assert got.logprobs is None
                continue
            assert len(got.logprobs) == len(expected.logprobs) == 32
            for a, b in zip(got.logprobs, expected.logprobs):
                assert a.keys() == b.keys(), (i, a, b)
                assert all(math.isclose(a[t], b[t], rel_tol=0, abs_tol=1e-5) for t in a), (i, a, b)
