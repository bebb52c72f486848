"""scripts/bench_serving.py: the workload split over client processes, and a run against
the embedded model's server (CPU) through several of them."""
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from hybrid_engine.config import EngineConfig
from hybrid_engine.engine import LLMEngine
from tests.server.conftest import serve_in_thread

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_serving import run_all, shares  # noqa: E402


@pytest.mark.parametrize("processes, concurrency, requests", [(1, 16, 100), (4, 130, 257), (3, 3, 3)])
def test_shares_split_the_whole_workload(processes, concurrency, requests):
    args = Namespace(client_processes=processes, concurrency=concurrency, num_requests=requests,
                     request_rate=40.0, seed=5)
    parts = shares(args)
    assert len(parts) == processes
    assert sum(p.concurrency for p in parts) == concurrency and sum(p.num_requests for p in parts) == requests
    assert all(p.concurrency >= 1 and p.warmup_requests == 0 for p in parts)
    assert sum(p.request_rate for p in parts) == pytest.approx(40.0)
    assert len({p.seed for p in parts}) == processes  # different prompts per process


def test_a_run_over_two_client_processes_gets_every_request():
    """Against the embedded model's server (CPU): every request of both processes' shares
    streams its tokens, and the wall time spans the shares, which ran side by side."""
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=64)
    with serve_in_thread(lambda: LLMEngine(config)) as server:
        args = Namespace(base_url=server.url, model=None, concurrency=4, num_requests=6, request_rate=float("inf"),
                         prompt_len=8, output_len=3, seed=0, timeout=120.0, warmup_requests=2, client_processes=2)
        results, wall, model = run_all(args)
    assert len(results) == 6 and all(r.ok for r in results), [r.error for r in results]
    assert all(r.output_tokens == 3 and 0 < r.ttft <= r.latency <= wall for r in results)
    assert model == "hybrid-engine/embedded-tiny"


def test_a_failing_client_process_reports_its_requests_failed():
    """A client process that cannot reach the server puts one failed result per request of
    its share (and releases the others from the start barrier) instead of dying silently."""
    import queue
    import threading

    from bench_serving import Share, client_process
    from tests.server.conftest import free_port

    args = Namespace(base_url=f"http://127.0.0.1:{free_port()}", model=None, prompt_len=4, output_len=2,
                     timeout=5.0)  # (no model name: the process asks the server for it, and fails)
    barrier, out = threading.Barrier(2), queue.Queue()
    client_process(args, Share(2, 3, float("inf"), 0, 0), barrier, out)
    timed = out.get_nowait()
    assert len(timed.results) == 3 and not any(r.ok for r in timed.results)
    assert timed.results[0].error.startswith("client process failed: ConnectError")
    assert barrier.broken
