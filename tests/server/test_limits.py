"""The CLI server under load limits: bounded queue (429), and a clean SIGTERM drain.

One `scripts/serve_hybrid.py` subprocess with a single sequence slot and a single
waiting place, so a handful of concurrent long requests overflows it.
"""
import asyncio
import signal
import threading
import time
from typing import Iterator

import httpx
import pytest

from tests.server.conftest import start_subprocess_server, wait_until

LONG = {"prompt": "queue", "max_tokens": 300, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def tiny_server() -> Iterator[tuple[str, object]]:
    """The CLI server with one running and one waiting place."""
    with start_subprocess_server("--max-num-seqs", "1", "--max-waiting-requests", "1", "--max-model-len", "512",
                                 "--served-model-name", "tiny") as running:
        yield running


def test_queue_full_answers_429(tiny_server):
    """Beyond max_num_seqs + max_waiting_requests, requests get 429 with Retry-After."""
    url, _ = tiny_server

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=LONG) for _ in range(6)))

    responses = asyncio.run(fire())
    statuses = sorted(r.status_code for r in responses)
    # One running + one waiting are admitted; the rest are refused instead of queued.
    assert statuses.count(200) >= 2 and statuses.count(429) >= 1 and set(statuses) == {200, 429}, statuses
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            error = r.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        else:
            assert r.json()["usage"]["completion_tokens"] == 300 and r.json()["model"] == "tiny"
    assert httpx.get(f"{url}/metrics").text.count("hybrid_engine_queue_full_rejections_total 0.0") == 0
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "again", "max_tokens": 2}).status_code == 200


def test_sigterm_drains_in_flight_requests_and_exits_0(tiny_server):
    """SIGTERM lets the in-flight request finish, then the process exits 0."""
    url, proc = tiny_server
    result: list[httpx.Response] = []
    request = threading.Thread(target=lambda: result.append(
        httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 200}, timeout=60)))
    request.start()
    wait_until(lambda: "hybrid_engine_num_requests_in_flight 1.0" in httpx.get(f"{url}/metrics").text,
               what="the request to be in flight")
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    request.join()
    # Graceful: the in-flight request was allowed to finish rather than being cut off.
    assert result[0].status_code == 200 and result[0].json()["choices"][0]["finish_reason"] == "length"
    assert time.monotonic() - start < 15
