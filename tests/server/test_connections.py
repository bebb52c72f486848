"""Connections that misbehave (slowloris, too many, beyond the open-file limit, malformed) are
closed or refused while /health keeps answering, without tracebacks in the log; a client that
half-closes after its request still gets the whole response.

Timeouts and limits run in `scripts/serve_hybrid.py` subprocesses (their logs are checked);
the protocol-level behaviour on the shared in-process server.
"""
import json
import select
import socket
import tempfile
from typing import BinaryIO, Iterator

import httpx
import pytest

from hybrid_engine.server.connections import MAX_HEAD_BYTES, RESERVED_FDS
from tests.server.conftest import (FaultyEngine, Server, json_request, raw_connect, read_response, request_head,
                                   start_subprocess_server, wait_until)

MAX_CONNECTIONS = 4
OPEN_FILES = RESERVED_FDS + 64  # the capped server closes connections beyond 64 at accept
PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: test\r\n"


def _log_text(log: BinaryIO) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")


def _health(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=30).status_code


@pytest.fixture(scope="module")
def impatient() -> Iterator[tuple[str, BinaryIO]]:
    """A server that gives a request 1 s to arrive and keeps idle connections 1 s; (url, log)."""
    with tempfile.TemporaryFile() as log, start_subprocess_server(
            "--request-read-timeout", "1", "--timeout-keep-alive", "1", log=log) as (url, _):
        yield url, log


@pytest.fixture(scope="module")
def capped() -> Iterator[tuple[str, BinaryIO]]:
    """A server serving 4 connections, with room for 64 within its open-file limit; (url, log)."""
    with tempfile.TemporaryFile() as log, start_subprocess_server(
            "--max-connections", str(MAX_CONNECTIONS), log=log, open_files=OPEN_FILES) as (url, _):
        yield url, log


def test_slow_requests_are_closed_after_the_read_timeout(impatient):
    """A connection that sends nothing, half a head, or half a body is closed unanswered once
    --request-read-timeout passes; /health answers meanwhile and after."""
    url, log = impatient
    with raw_connect(url) as silent, raw_connect(url) as partial, raw_connect(url) as slow_body:
        partial.sendall(PARTIAL_HEAD)
        slow_body.sendall(request_head("POST", "/v1/completions", content_type="application/json",
                                       content_length="100") + b'{"prompt": ')
        assert _health(url) == 200
        for sock in (silent, partial, slow_body):
            assert sock.recv(1024) == b""  # closed by the server, nothing sent
    assert _health(url) == 200
    assert "Traceback" not in _log_text(log)


def test_idle_keep_alive_connection_is_closed(impatient):
    url, _ = impatient
    with raw_connect(url) as sock:
        sock.sendall(request_head("GET", "/health"))
        assert read_response(sock).status == 200
        assert sock.recv(1) == b""  # --timeout-keep-alive passed


def _served_connection(url: str) -> socket.socket:
    """A new connection that the server serves (its /health answered 200), kept open;
    retried while earlier connections still hold the places."""
    served: list[socket.socket] = []

    def try_one() -> bool:
        sock = raw_connect(url)
        sock.sendall(request_head("GET", "/health"))
        if read_response(sock).status == 200:
            served.append(sock)
            return True
        sock.close()
        return False

    wait_until(try_one, what="a connection to be served")
    return served[0]


def test_connections_beyond_the_limit_get_503_then_health_recovers(capped):
    """With --max-connections 4, four connections are served and requests on further ones are
    answered a JSON 503 (logged once however often it happens), while the served connections
    keep being answered; once connections close, /health is 200 again."""
    url, log = capped
    served: list[socket.socket] = []
    beyond = None
    try:
        for _ in range(MAX_CONNECTIONS):
            served.append(_served_connection(url))
        # Each holds half a request (the read timeout, not the keep-alive one, runs); the
        # first one's is the head of a GET that it completes later.
        served[0].sendall(request_head("GET", "/health")[:-2])
        for sock in served[1:]:
            sock.sendall(PARTIAL_HEAD)
        beyond = raw_connect(url)  # a fifth connection, held open
        for _ in range(3):  # a sixth, each time
            r = httpx.get(f"{url}/health", timeout=30)
            assert r.status_code == 503 and r.headers["connection"] == "close"
            assert r.json()["error"]["code"] == "too_many_connections"
        # With more connections open than the limit, the served ones are still answered.
        served[0].sendall(b"\r\n")
        assert read_response(served[0]).status == 200
        served[0].sendall(request_head("GET", "/health"))
        assert read_response(served[0]).status == 200
        beyond.sendall(request_head("GET", "/health"))
        refused = read_response(beyond)
        assert refused.status == 503 and refused.json()["error"]["code"] == "too_many_connections"
    finally:
        for sock in served + [beyond] * (beyond is not None):
            sock.close()
    wait_until(lambda: _health(url) == 200, what="/health to recover")
    text = _log_text(log)
    assert text.count("beyond --max-connections (4) was answered 503") == 1, text
    assert "Traceback" not in text


def _closed(socks: list[socket.socket], wait: float) -> set[socket.socket]:
    """The sockets among `socks` the server has closed (readable: at EOF or reset) within `wait` seconds."""
    readable, _, _ = select.select(socks, [], [], wait)
    closed = set()
    for sock in readable:
        try:
            if sock.recv(1) == b"":
                closed.add(sock)
        except ConnectionResetError:
            closed.add(sock)
    return closed


def test_connections_beyond_the_open_file_limit_are_closed_at_once(capped):
    """Far more connections than the open-file limit leaves room for: those beyond it are closed
    as they are accepted (accept never runs out of file descriptors), the rest stay open, and
    the server is healthy once they are gone, with no traceback (no "Too many open files")."""
    url, log = capped
    room = OPEN_FILES - RESERVED_FDS
    socks = [raw_connect(url) for _ in range(room + 40)]
    try:
        closed: set[socket.socket] = set()

        def beyond_room_closed() -> bool:
            closed.update(_closed([s for s in socks if s not in closed], 0.2))
            return len(closed) >= 40

        wait_until(beyond_room_closed, what="the connections beyond the room to be closed")
        closed |= _closed([s for s in socks if s not in closed], 1.0)  # and no more
        # The first ones stay open (at most `room` of them: an earlier test's connection may
        # not have closed yet), every later one was closed.
        kept = len(socks) - len(closed)
        assert 0 < kept <= room and closed == set(socks[kept:])
    finally:
        for sock in socks:
            sock.close()
    wait_until(lambda: _health(url) == 200, what="/health to recover")
    text = _log_text(log)
    assert "Traceback" not in text and "Too many open files" not in text


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_half_closed_client_gets_the_whole_response(server: Server, stream):
    """shutdown(SHUT_WR) right after the request: the response still comes in full (after an
    interim 100 Continue, the server's probe that the client is still there, if the response
    had not started), then the server closes the connection."""
    body = {"prompt": "half", "max_tokens": 20, "ignore_eos": True, "stream": stream}
    with raw_connect(server.url) as sock:
        sock.sendall(json_request("/v1/completions", body))
        sock.shutdown(socket.SHUT_WR)
        r = read_response(sock)
        assert sock.recv(1) == b""
    assert r.status == 200
    # The server probes with an interim 100 Continue when the EOF came before the response
    # started (a stream may start first).
    assert r.interim == [100] or (stream and r.interim == [])
    if stream:
        # (an SSE comment, the server's probe when the stream had started, is not an event)
        events = [line.removeprefix(b"data: ") for line in r.body.split(b"\n\n") if line and not line.startswith(b":")]
        assert events[-1] == b"[DONE]"
        choices = [json.loads(e)["choices"] for e in events[:-1]]
        assert [c[0]["finish_reason"] for c in choices if c][-1] == "length"
    else:
        assert r.json()["usage"]["completion_tokens"] == 20 and r.json()["choices"][0]["finish_reason"] == "length"


def test_malformed_request_is_a_json_400(server: Server):
    with raw_connect(server.url) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        r = read_response(sock)
    assert r.status == 400 and r.json()["error"]["code"] == "invalid_http_request"


def test_oversized_request_head_is_a_json_400(server: Server):
    """More than MAX_HEAD_BYTES of a head still without its end."""
    with raw_connect(server.url) as sock:
        sock.sendall(PARTIAL_HEAD + b"x-padding: " + b"a" * MAX_HEAD_BYTES)
        r = read_response(sock)
    assert r.status == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_half_close_after_the_stream_started_still_gets_the_rest(server: Server, engine_switches: FaultyEngine):
    """The stream's first event is already out when the client shuts down its sending side:
    the server probes with an SSE comment (which clients skip) and streams the rest."""
    engine_switches.step_delay = 0.02
    body = {"prompt": "half", "max_tokens": 20, "ignore_eos": True, "stream": True}
    with raw_connect(server.url) as sock:
        sock.sendall(json_request("/v1/completions", body))
        received = b""
        while b"data: " not in received:
            received += sock.recv(65536)
        sock.shutdown(socket.SHUT_WR)
        while chunk := sock.recv(65536):
            received += chunk
    assert b": connection check" in received
    assert received.rstrip().endswith(b"0") and b"data: [DONE]" in received  # chunked body ends
    events = [json.loads(line.removeprefix(b"data: ")) for line in received.split(b"\n")
              if line.startswith(b"data: {")]
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "length"
    assert sum(len(c["text"]) > 0 for e in events for c in e["choices"]) >= 1
