"""The CLI server under load limits and shutdown: bounded queue (429), a clean SIGTERM drain,
and `--shutdown-timeout` aborting what is still running.

Each test runs its own `scripts/serve_hybrid.py` subprocess (the SIGTERM tests end theirs),
so the tests do not depend on their order.
"""
import asyncio
import json
import signal
import threading

import httpx

from tests.server.conftest import start_subprocess_server, wait_until

LONG = {"prompt": "queue", "max_tokens": 300, "ignore_eos": True, "temperature": 0.0}
# Generous bound for a process to exit after SIGTERM; only a hang reaches it.
EXIT_TIMEOUT_S = 60


def _in_flight(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    line = next(line for line in text.splitlines() if line.startswith("hybrid_engine_num_requests_in_flight "))
    return float(line.split()[1])


def test_queue_full_answers_429():
    """Beyond max_num_seqs + max_waiting_requests, requests get 429 with Retry-After."""
    flags = ("--max-num-seqs", "1", "--max-waiting-requests", "1", "--max-model-len", "512",
             "--served-model-name", "tiny")
    with start_subprocess_server(*flags) as (url, _):
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


def test_sigterm_drains_in_flight_requests_and_exits_0():
    """SIGTERM lets the in-flight request finish (well within --shutdown-timeout), then the
    process exits 0."""
    with start_subprocess_server("--max-model-len", "512") as (url, proc):
        result: list[httpx.Response] = []
        request = threading.Thread(target=lambda: result.append(
            httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 200}, timeout=60)))
        request.start()
        wait_until(lambda: _in_flight(url) == 1, what="the request to be in flight")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=EXIT_TIMEOUT_S) == 0
        request.join()
    # Graceful: the in-flight request was allowed to finish rather than being cut off.
    assert result[0].status_code == 200 and result[0].json()["choices"][0]["finish_reason"] == "length"
    assert result[0].json()["usage"]["completion_tokens"] == 200


def test_sigterm_aborts_what_outlives_the_shutdown_timeout():
    """Requests still running --shutdown-timeout after SIGTERM are aborted: each client gets a
    complete response with finish_reason "abort" (a stream ends with [DONE]), and the process
    exits 0. The requests ask for ~4000 tokens, far more than the timeout leaves time for."""
    body = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "temperature": 0.0}
    with start_subprocess_server("--device", "cpu", "--max-model-len", "4096", "--shutdown-timeout", "0.5") \
            as (url, proc):
        plain: list[httpx.Response] = []
        streamed: list[str] = []

        def post() -> None:
            plain.append(httpx.post(f"{url}/v1/completions", json=body, timeout=EXIT_TIMEOUT_S))

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                              timeout=EXIT_TIMEOUT_S) as r:
                streamed.extend(line for line in r.iter_lines() if line)

        clients = [threading.Thread(target=post), threading.Thread(target=stream)]
        for client in clients:
            client.start()
        wait_until(lambda: _in_flight(url) == 2, what="both requests to be in flight")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=EXIT_TIMEOUT_S) == 0
        for client in clients:
            client.join()
    (response,) = plain
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and response.json()["usage"]["completion_tokens"] < 4000
    assert streamed[-1] == "data: [DONE]"
    finish = [json.loads(line.removeprefix("data: "))["choices"][0]["finish_reason"] for line in streamed[:-1]]
    assert finish[-1] == "abort" and all(reason is None for reason in finish[:-1])
