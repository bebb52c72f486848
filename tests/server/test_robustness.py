"""Client disconnects free engine resources; failures stay contained to what failed."""
import asyncio
import json
import threading
from dataclasses import dataclass
from typing import Iterator

import httpx
import pytest

from hybrid_engine.server import serving
from hybrid_engine.server.serving import LARGE_REQUEST_BYTES
from tests.server.conftest import FaultyEngine, Server, json_request, raw_connect, wait_until

LONG = {"prompt": "a long one", "max_tokens": 100, "ignore_eos": True}


def _aborts(server: Server) -> float:
    return server.metrics().get("hybrid_engine_requests_total{finish_reason=abort}", 0.0)


def _data_lines(lines) -> list[str]:
    return [line for line in lines if line.startswith("data: ")]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", LONG),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}], "max_tokens": 100,
                              "ignore_eos": True}),
])
def test_stream_disconnect_aborts_and_frees(server: Server, engine_switches: FaultyEngine, path, body):
    """Hanging up mid-stream aborts the request and frees its blocks and slot."""
    engine_switches.step_delay = 0.02  # ~2 s for 100 tokens: still generating when we hang up
    wait_until(server.idle_and_free, what="an idle server")
    aborts = _aborts(server)
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert next(lines).startswith("data: {")
            next(lines)  # the blank line ending the event
        m = server.metrics()
        assert m["hybrid_engine_num_requests_in_flight"] == 1
        assert m["hybrid_engine_kv_blocks_free"] < m["hybrid_engine_kv_blocks_total"]
        assert m["hybrid_engine_mamba_slots_free"] < m["hybrid_engine_mamba_slots_total"]
    # Leaving the block closed the connection mid-stream.
    wait_until(server.idle_and_free, timeout=10, what="blocks and slot to be freed")
    assert _aborts(server) == aborts + 1


def test_non_stream_disconnect_aborts_and_frees(server: Server, engine_switches: FaultyEngine):
    """A client timing out on a non-streamed request aborts it as well."""
    engine_switches.step_delay = 0.05  # ~5 s for 100 tokens
    wait_until(server.idle_and_free, what="an idle server")
    aborts = _aborts(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.5))
    wait_until(server.idle_and_free, timeout=10, what="blocks and slot to be freed")
    assert _aborts(server) == aborts + 1


def test_step_failure_fails_in_flight_requests_then_recovers(server: Server, engine_switches: FaultyEngine):
    """A raising step fails the in-flight requests (stream and not), then the server serves again."""
    engine_switches.step_delay = 0.02
    errors = server.metrics().get("hybrid_engine_requests_total{finish_reason=error}", 0.0)
    blocking: list[httpx.Response] = []
    side = threading.Thread(target=lambda: blocking.append(
        httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=30)))
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        side.start()
        wait_until(lambda: server.metrics()["hybrid_engine_num_requests_in_flight"] == 2, what="both requests")
        engine_switches.fail_next_step.set()
        rest = _data_lines(lines)
    side.join()
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert "injected step failure" in error["message"] and error["type"] == "server_error"
    (response,) = blocking
    assert response.status_code == 500 and "injected step failure" in response.json()["error"]["message"]
    assert server.metrics()["hybrid_engine_requests_total{finish_reason=error}"] == errors + 2
    wait_until(server.idle_and_free, what="the failed requests' resources to be freed")
    engine_switches.step_delay = 0.0
    server.assert_healthy()


def test_add_failure_fails_only_that_request(server: Server, engine_switches: FaultyEngine):
    """An engine error adding one request is a 500 for it alone; a running stream completes."""
    engine_switches.step_delay = 0.01
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "max_tokens": 30, "stream": True},
                      timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        engine_switches.fail_next_add.set()
        bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        rest = _data_lines(lines)
    assert bad.status_code == 500
    assert bad.json()["error"]["code"] == "internal_error" and "injected" in bad.json()["error"]["message"]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    server.assert_healthy()


@dataclass
class HeldLane:
    """`large_lane`: set when a job reached the lane; set to let the jobs go on; the prompts
    of the jobs that started there; the thread that decoded each body, on either lane."""

    entered: threading.Event
    release: threading.Event
    prompts: list[str | None]  # (chat bodies have none)
    threads: list[str]


@pytest.fixture
def large_lane(monkeypatch) -> Iterator[HeldLane]:
    """Jobs on the tokenizer thread's large lane held at their start until released."""
    held = HeldLane(threading.Event(), threading.Event(), [], [])
    real_validated = serving.validated

    def held_validated(model, raw, content_type):
        held.threads.append(threading.current_thread().name)
        if held.threads[-1].startswith("tokenizer-large"):
            held.prompts.append(json.loads(raw).get("prompt"))
            held.entered.set()
            assert held.release.wait(60), "the test never released the large lane"
        return real_validated(model, raw, content_type)

    monkeypatch.setattr(serving, "validated", held_validated)
    try:
        yield held
    finally:
        held.release.set()


@pytest.mark.parametrize("path, large_body, small_body", [
    ("/v1/completions", {"prompt": "a" * (LARGE_REQUEST_BYTES + 1), "max_tokens": 1},
     {"prompt": "hi", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * (LARGE_REQUEST_BYTES + 1)}],
                              "max_tokens": 1},
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    # hardly any text, but a template to render for each of 3,000 messages
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 3_000, "max_tokens": 1},
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
])
def test_large_body_does_not_hold_up_small_ones(server: Server, large_lane: HeldLane, path, large_body, small_body):
    """A body over LARGE_REQUEST_BYTES is decoded, validated and tokenized on a lane of its
    own: while that job is held (here on purpose, as a body of megabytes takes seconds), a
    small request is answered. With one tokenizer thread the small one would wait behind it
    and time out here, and on the event loop /health would too."""
    entered, release = large_lane.entered, large_lane.release
    large: dict[str, httpx.Response] = {}
    sender = threading.Thread(target=lambda: large.update(r=httpx.post(f"{server.url}{path}", json=large_body,
                                                                       timeout=90)))
    sender.start()
    try:
        assert entered.wait(30), "the large body never reached the large lane"
        small = httpx.post(f"{server.url}{path}", json=small_body, timeout=30)
        assert small.status_code == 200, small.text
        assert large_lane.threads[-1].startswith("tokenizer_")  # the small body: the small lane, off the loop
        server.assert_healthy()
        assert "r" not in large  # still held: the small one did not wait for it
    finally:
        release.set()
        sender.join(90)
    assert large["r"].status_code == 400 and large["r"].json()["error"]["code"] == "context_length_exceeded"


def test_a_queued_body_is_dropped_when_its_client_leaves(server: Server, large_lane: HeldLane, monkeypatch):
    """A large body waiting for the large lane is never decoded if its client hangs up first:
    the job is cancelled with the request (`cancel_on_disconnect`), so abandoned bodies do
    not hold up the ones behind them."""
    jobs: list[asyncio.Future] = []
    real_run = serving.TokenizerThread.run

    async def recorded_run(self, fn, *args, body_bytes):
        jobs.append(asyncio.ensure_future(real_run(self, fn, *args, body_bytes=body_bytes)))
        return await jobs[-1]

    monkeypatch.setattr(serving.TokenizerThread, "run", recorded_run)
    posted: list[httpx.Response] = []

    def post(letter: str) -> threading.Thread:
        body = {"prompt": letter * (LARGE_REQUEST_BYTES + 1), "max_tokens": 1}
        sender = threading.Thread(target=lambda: posted.append(httpx.post(f"{server.url}/v1/completions", json=body,
                                                                          timeout=90)))
        sender.start()
        return sender

    senders = [post("a")]
    try:
        assert large_lane.entered.wait(30), "the first body never reached the large lane"
        with raw_connect(server.url) as sock:  # the second: queued behind the first, then its client leaves
            sock.sendall(json_request("/v1/completions", {"prompt": "b" * (LARGE_REQUEST_BYTES + 1), "max_tokens": 1}))
            wait_until(lambda: len(jobs) == 2, what="the second body queued")
        wait_until(lambda: jobs[1].cancelled(), what="the second body's job cancelled")
        senders.append(post("c"))
        wait_until(lambda: len(jobs) == 3, what="the third body queued")
    finally:
        large_lane.release.set()
        for sender in senders:
            sender.join(90)
    assert [r.status_code for r in posted] == [400, 400]  # (both too long for the model)
    assert [prompt[0] for prompt in large_lane.prompts] == ["a", "c"]
    server.assert_healthy()
