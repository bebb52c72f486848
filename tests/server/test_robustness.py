"""Client disconnects free engine resources; failures stay contained to what failed."""
import json
import threading

import httpx
import pytest

from hybrid_engine.server import chat, serving
from hybrid_engine.server.serving import LARGE_TEXT_CHARS
from tests.server.conftest import FaultyEngine, Server, wait_until

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


@pytest.mark.parametrize("path, large_body, small_body", [
    ("/v1/completions", {"prompt": "a" * (LARGE_TEXT_CHARS + 1), "max_tokens": 1},
     {"prompt": "hi", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * (LARGE_TEXT_CHARS + 1)}], "max_tokens": 1},
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
])
def test_large_prompt_does_not_hold_up_small_ones(server: Server, monkeypatch, path, large_body, small_body):
    """A request with more text than LARGE_TEXT_CHARS is tokenized on a lane of its own: while
    its encoding is held (here on purpose, as a prompt of megabytes takes seconds), a small
    request is answered. With one tokenizer thread the small one would wait behind it and
    time out here."""
    entered, release = threading.Event(), threading.Event()
    real_encode = serving.encode_prompt if path == "/v1/completions" else chat.encode_prompt

    def held_encode(prompt, *args, **kwargs):
        if isinstance(prompt, str) and len(prompt) > LARGE_TEXT_CHARS:
            entered.set()
            assert release.wait(60), "the test never released the large prompt"
        return real_encode(prompt, *args, **kwargs)

    monkeypatch.setattr(serving if path == "/v1/completions" else chat, "encode_prompt", held_encode)
    large: dict[str, httpx.Response] = {}
    sender = threading.Thread(target=lambda: large.update(r=httpx.post(f"{server.url}{path}", json=large_body,
                                                                       timeout=90)))
    sender.start()
    try:
        assert entered.wait(30), "the large request never reached its encoding"
        small = httpx.post(f"{server.url}{path}", json=small_body, timeout=30)
        assert small.status_code == 200, small.text
        assert "r" not in large  # still held: the small one did not wait for it
    finally:
        release.set()
        sender.join(90)
    assert large["r"].status_code == 400 and large["r"].json()["error"]["code"] == "context_length_exceeded"
