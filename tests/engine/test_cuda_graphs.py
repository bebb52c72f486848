"""Decode CUDA graphs: same tokens as eager, with and without launch-ahead (GPU only)."""
import pytest

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

    def recording_replay(plan):
        out = original(plan)
        if out is not None:
            replays.append(plan.num_decode)
        return out

    graphs.replay = recording_replay
    llm.generate(_prompts(5), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(replays) >= 6 and set(replays) == {8}  # 5 decoders padded to the size-8 graph


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
