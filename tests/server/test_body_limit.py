"""Request size and the event loop: a body over `--max-request-body-bytes` is a 413 JSON error
sent before the body is read (declared or chunked); tokenizing a big prompt and building a big
response happen off the event loop, so /health and other clients' streams go on meanwhile.

Ordering, not timing: hooks hold the tokenizer (or the response builder) on an Event until the
test has seen /health answer and another stream make progress.
"""
import json
import threading
from typing import Iterator

import httpx
import pytest

from hybrid_engine.config import EngineConfig
from hybrid_engine.server import serving
from hybrid_engine.server.completions import CompletionsHandler
from hybrid_engine.server.limits import ServerLimits
from tests.server.conftest import (MAX_MODEL_LEN, FaultyEngine, Server, raw_connect, read_response, request_head,
                                   serve_in_thread)

LIMIT = 64 * 1024
SMALL = {"prompt": "hi", "max_tokens": 2}
# Generous bound on a hook's wait; only a bug (the work ran on the event loop) reaches it.
HOOK_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def limited() -> Iterator[Server]:
    """A server that takes request bodies of at most LIMIT bytes."""
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    with serve_in_thread(lambda: FaultyEngine(config), limits=ServerLimits(max_request_body_bytes=LIMIT)) as s:
        yield s


@pytest.fixture
def tokenized(monkeypatch) -> list[object]:
    """Records every prompt the server tokenizes."""
    seen: list[object] = []
    encode = serving.encode_prompt

    def recording(prompt, *args, **kwargs):
        seen.append(prompt)
        return encode(prompt, *args, **kwargs)

    monkeypatch.setattr(serving, "encode_prompt", recording)
    return seen


def _padded(body: dict, size: int) -> bytes:
    """`body` as JSON, padded with trailing whitespace (still valid JSON) to exactly `size` bytes."""
    data = json.dumps(body).encode()
    assert len(data) <= size
    return data + b" " * (size - len(data))


def _assert_413(status: int, error: dict) -> None:
    assert status == 413
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert str(LIMIT) in error["message"] and "--max-request-body-bytes" in error["message"]


def _chunks(data: bytes, size: int = 8192) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_at_the_limit_is_accepted(limited: Server, chunked):
    data = _padded(SMALL, LIMIT)
    r = httpx.post(f"{limited.url}/v1/completions", content=_chunks(data) if chunked else data,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_oversized_body_is_413_json(limited: Server, tokenized, chunked):
    """A client that sends its whole (too big) body before reading still gets the 413, and the
    prompt is never tokenized; the connection then serves its next request."""
    data = _padded({"prompt": "x" * (2 * LIMIT), "max_tokens": 2}, 3 * LIMIT)
    with httpx.Client(base_url=limited.url, timeout=60) as client:
        r = client.post("/v1/completions", content=_chunks(data) if chunked else data,
                        headers={"content-type": "application/json"})
        _assert_413(r.status_code, r.json()["error"])
        assert client.post("/v1/completions", json=SMALL).status_code == 200
    assert tokenized == ["hi"]


def test_declared_oversize_is_answered_before_the_body_is_sent(limited: Server, tokenized):
    """A Content-Length over the limit is answered with nothing of the body sent."""
    with raw_connect(limited.url) as sock:
        sock.sendall(request_head("POST", "/v1/completions", content_type="application/json",
                                  content_length=str(LIMIT + 1)))
        r = read_response(sock)
    _assert_413(r.status, r.json()["error"])
    assert tokenized == []


def test_chunked_oversize_is_answered_before_the_body_ends(limited: Server, tokenized):
    """A chunked body is refused as soon as it passes the limit, before its last chunk."""
    with raw_connect(limited.url) as sock:
        sock.sendall(request_head("POST", "/v1/completions", content_type="application/json",
                                  transfer_encoding="chunked"))
        for chunk in _chunks(b"[" + b" " * LIMIT):  # one byte over; the terminating chunk never sent
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        r = read_response(sock)
    _assert_413(r.status, r.json()["error"])
    assert tokenized == []


def _stream_lines(url: str, lines: list[str], started: threading.Event) -> None:
    body = {"prompt": "keep going", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                started.set()


def test_health_and_streams_go_on_while_a_big_prompt_is_tokenized(server: Server, engine_switches, monkeypatch):
    """The tokenizer is held on an Event while it encodes a big prompt: meanwhile /health
    answers and a running stream keeps receiving chunks (the event loop is free)."""
    engine_switches.step_delay = 0.05  # the stream (~5 s) outlives the checks below
    big = "y" * (1024 * 1024)
    encoding, release = threading.Event(), threading.Event()
    encode = serving.encode_prompt

    def held(prompt, *args, **kwargs):
        if prompt == big:
            encoding.set()
            assert release.wait(HOOK_TIMEOUT_S)
        return encode(prompt, *args, **kwargs)

    monkeypatch.setattr(serving, "encode_prompt", held)
    lines: list[str] = []
    started = threading.Event()
    stream = threading.Thread(target=_stream_lines, args=(server.url, lines, started))
    stream.start()
    responses: list[httpx.Response] = []
    poster = threading.Thread(target=lambda: responses.append(
        httpx.post(f"{server.url}/v1/completions", json={"prompt": big, "max_tokens": 1}, timeout=60)))
    try:
        assert started.wait(HOOK_TIMEOUT_S)
        poster.start()
        assert encoding.wait(HOOK_TIMEOUT_S)
        seen = len(lines)
        assert httpx.get(f"{server.url}/health", timeout=HOOK_TIMEOUT_S).status_code == 200
        while len(lines) == seen:  # the stream moves on while the tokenizer is held
            assert stream.is_alive(), "the stream ended"
            stream.join(0.01)
        assert not release.is_set()
    finally:
        release.set()
        poster.join()
        stream.join()
    (response,) = responses
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert lines[-1] == "data: [DONE]"


def test_health_answers_while_a_big_response_is_built(server: Server, monkeypatch):
    """Building a non-streamed response is held on an Event: /health answers meanwhile."""
    building, release = threading.Event(), threading.Event()
    build = CompletionsHandler._response

    def held(self, *args):
        building.set()
        assert release.wait(HOOK_TIMEOUT_S)
        return build(self, *args)

    monkeypatch.setattr(CompletionsHandler, "_response", held)
    responses: list[httpx.Response] = []
    poster = threading.Thread(target=lambda: responses.append(httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "z", "max_tokens": 8, "logprobs": 20, "ignore_eos": True}, timeout=60)))
    poster.start()
    try:
        assert building.wait(HOOK_TIMEOUT_S)
        assert httpx.get(f"{server.url}/health", timeout=HOOK_TIMEOUT_S).status_code == 200
        assert not release.is_set()
    finally:
        release.set()
        poster.join()
    (response,) = responses
    assert response.status_code == 200 and len(response.json()["choices"][0]["logprobs"]["top_logprobs"]) == 8

