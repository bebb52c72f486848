"""scripts/bench_serving.py: the workload split over client processes, and a run against
the embedded model's server (CPU) through several of them."""
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from tests.server.conftest import Server, server  # noqa: F401 (the fixture)

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


def test_a_run_over_two_client_processes_gets_every_request(server: Server):
    args = Namespace(base_url=server.url, model=None, concurrency=4, num_requests=6, request_rate=float("inf"),
                     prompt_len=8, output_len=3, seed=0, timeout=120.0, warmup_requests=2, client_processes=2)
    results, wall, model = run_all(args)
    assert len(results) == 6 and all(r.ok for r in results), [r.error for r in results]
    assert all(r.output_tokens == 3 and r.ttft > 0 for r in results)
    assert wall > 0 and model
