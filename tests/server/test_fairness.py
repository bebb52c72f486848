"""Fairness between HTTP requests: the per-request prompt cap (400), round-robin admission of
waiting prompts across requests, and aborting prompts still on the server-side list.

Ordering is observed deterministically: the engine records the order prompts reach it, and
its steps wait on a gate the test opens only once every request it sends was submitted.
"""
import threading
from typing import Iterator

import httpx
import pytest

from hybrid_engine.config import EngineConfig
from hybrid_engine.server.cli import parse_args
from tests.server.conftest import MAX_MODEL_LEN, FaultyEngine, Server, serve_in_thread, wait_until

SLOTS = 2  # max_num_seqs of the fairness server: few, so prompts wait on the server-side list
WAITING = 6  # its max_waiting_requests: 8 prompts in flight at most
PROMPTS_PER_REQUEST = 6


class GatedEngine(FaultyEngine):
    """Records the request ids in the order they reach the engine; steps wait while `gate` is clear."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.added: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def add_requests(self, requests):
        super().add_requests(requests)
        self.added.extend(request_id for request_id, _, _ in requests)

    def step(self):
        self.gate.wait()
        return super().step()


@pytest.fixture(scope="module")
def fair_server() -> Iterator[Server]:
    """A server with 2 Mamba slots, 6 waiting places and 6 prompts per request."""
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=SLOTS)
    with serve_in_thread(lambda: GatedEngine(config), max_waiting_requests=WAITING) as s:
        s.llm.max_prompts_per_request = PROMPTS_PER_REQUEST
        try:
            yield s
        finally:
            s.engine.gate.set()


@pytest.fixture
def gated(fair_server: Server, monkeypatch) -> Iterator[tuple[Server, list[str]]]:
    """The fairness server with its gate closed and a log of submitted request ids (in
    submission order); the gate is opened again afterwards."""
    engine: GatedEngine = fair_server.engine
    wait_until(fair_server.idle_and_free, what="an idle server")
    submitted: list[str] = []
    submit = fair_server.llm.submit

    async def recording_submit(request_id, requests):
        submitted.append(request_id)
        return await submit(request_id, requests)

    monkeypatch.setattr(fair_server.llm, "submit", recording_submit)
    engine.added.clear()
    engine.gate.clear()
    try:
        yield fair_server, submitted
    finally:
        engine.gate.set()


def _body(num_prompts: int, first_token: int, max_tokens: int = 8) -> dict:
    return {"prompt": [[first_token + i, 5, 6] for i in range(num_prompts)], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0}


def _post_in_thread(url: str, body: dict, results: dict, key: str) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.__setitem__(
        key, httpx.post(f"{url}/v1/completions", json=body, timeout=120)))
    thread.start()
    return thread


def _call(request_id: str) -> str:
    """The HTTP request an engine request id `{call}-{i}` belongs to."""
    return request_id.rsplit("-", 1)[0]


def test_too_many_prompts_is_a_400_and_queues_nothing(server: Server):
    """The default cap is max_num_seqs (16 on CPU): one more is a 400 naming "prompt" and the
    limit, decided before anything is queued; exactly the cap is served."""
    cap = server.llm.info.max_num_seqs
    assert server.llm.max_prompts_per_request == cap
    wait_until(server.idle_and_free, what="an idle server")
    before = server.metrics()
    r = httpx.post(f"{server.url}/v1/completions", json=_body(cap + 1, 1, max_tokens=1), timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["type"] == "invalid_request_error"
    assert f"at most {cap} per request" in error["message"] and "--max-prompts-per-request" in error["message"]
    after = server.metrics()
    assert after["hybrid_engine_prompt_tokens_total"] == before["hybrid_engine_prompt_tokens_total"]
    assert after["hybrid_engine_num_requests_in_flight"] == 0
    ok = httpx.post(f"{server.url}/v1/completions", json=_body(cap, 1, max_tokens=1), timeout=60)
    assert ok.status_code == 200, ok.text
    assert sorted(c["index"] for c in ok.json()["choices"]) == list(range(cap))


def test_max_prompts_per_request_flag():
    """Unset means the engine's max_num_seqs (None here); below 1 is a usage error."""
    assert parse_args([]).max_prompts_per_request is None
    assert parse_args(["--max-prompts-per-request", "64"]).max_prompts_per_request == 64
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--max-prompts-per-request", "0"])
    assert exit_info.value.code == 2


def test_small_request_is_admitted_before_a_big_requests_later_prompts(gated):
    """A 6-prompt request fills both slots; a 1-prompt request sent next gets the first slot
    that frees, ahead of the big request's remaining 4 prompts; neither gets a 429."""
    server, submitted = gated
    engine: GatedEngine = server.engine
    results: dict[str, httpx.Response] = {}
    threads = [_post_in_thread(server.url, _body(PROMPTS_PER_REQUEST, 10), results, "big")]
    wait_until(lambda: len(engine.added) == SLOTS, what="the big request's first prompts in the engine")
    threads.append(_post_in_thread(server.url, _body(1, 40), results, "small"))
    wait_until(lambda: len(submitted) == 2, what="the small request to be submitted")
    engine.gate.set()
    for thread in threads:
        thread.join()
    assert results["big"].status_code == 200 and results["small"].status_code == 200
    big, small = submitted
    assert [_call(rid) for rid in engine.added] == [big, big, small] + [big] * (PROMPTS_PER_REQUEST - SLOTS)
    assert [c["index"] for c in results["big"].json()["choices"]] == list(range(PROMPTS_PER_REQUEST))
    assert results["big"].json()["usage"]["completion_tokens"] == 8 * PROMPTS_PER_REQUEST
    assert results["small"].json()["usage"]["completion_tokens"] == 8
    wait_until(server.idle_and_free, what="every slot and block back")


def test_waiting_prompts_are_admitted_round_robin(gated):
    """With both slots busy, two requests wait (4 and 2 prompts); as slots free, the engine
    gets their prompts alternately, one from each in turn, and nobody gets a 429 with the
    server filled to capacity (2 + 6 prompts in flight)."""
    server, submitted = gated
    engine: GatedEngine = server.engine
    results: dict[str, httpx.Response] = {}
    threads = [_post_in_thread(server.url, _body(2, 10), results, "first")]
    wait_until(lambda: len(engine.added) == SLOTS, what="the first request in the engine")
    threads.append(_post_in_thread(server.url, _body(4, 20), results, "a"))
    wait_until(lambda: len(submitted) == 2, what="request a to be submitted")
    threads.append(_post_in_thread(server.url, _body(2, 30), results, "b"))
    wait_until(lambda: len(submitted) == 3, what="request b to be submitted")
    engine.gate.set()
    for thread in threads:
        thread.join()
    assert {key: r.status_code for key, r in results.items()} == {"first": 200, "a": 200, "b": 200}
    first, a, b = submitted
    assert [_call(rid) for rid in engine.added] == [first, first, a, b, a, b, a, a]
    # Each call's prompts still reach the engine in prompt order, and answers map back by index.
    for call, n in ((a, 4), (b, 2)):
        assert [rid for rid in engine.added if _call(rid) == call] == [f"{call}-{i}" for i in range(n)]
    for key, n in (("first", 2), ("a", 4), ("b", 2)):
        assert [c["index"] for c in results[key].json()["choices"]] == list(range(n))
        assert results[key].json()["usage"]["completion_tokens"] == 8 * n
    wait_until(server.idle_and_free, what="every slot and block back")


def test_abort_ends_prompts_still_waiting_without_reaching_the_engine(gated):
    """Aborting a request whose prompts are partly on the server-side list: those end with
    finish_reason "abort" and no tokens and never reach the engine; the two in the engine are
    aborted there; afterwards nothing leaks and the metrics add up."""
    server, _ = gated
    engine: GatedEngine = server.engine
    aborts = server.metrics().get("hybrid_engine_requests_total{finish_reason=abort}", 0.0)
    results: dict[str, httpx.Response] = {}
    thread = _post_in_thread(server.url, _body(PROMPTS_PER_REQUEST, 10, max_tokens=50), results, "big")
    wait_until(lambda: len(engine.added) == SLOTS, what="the request's first prompts in the engine")
    server.llm.abort_all()
    engine.gate.set()
    thread.join()
    response = results["big"]
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["abort"] * PROMPTS_PER_REQUEST
    assert all(c["text"] == "" for c in choices[SLOTS:])
    assert response.json()["usage"]["completion_tokens"] < SLOTS * 50
    assert [rid.rsplit("-", 1)[1] for rid in engine.added] == ["0", "1"]
    wait_until(server.idle_and_free, what="every slot and block back")
    m = server.metrics()
    assert m["hybrid_engine_requests_total{finish_reason=abort}"] == aborts + PROMPTS_PER_REQUEST
    assert m["hybrid_engine_num_requests_waiting"] == 0
    server.assert_healthy()


def test_client_disconnect_aborts_prompts_still_waiting(gated, monkeypatch):
    """A streaming client that hangs up while most of its prompts wait on the server-side
    list: they are dropped there, the engine never sees them, and nothing leaks."""
    server, _ = gated
    engine: GatedEngine = server.engine
    aborted: list[list[str]] = []
    abort = server.llm.abort
    monkeypatch.setattr(server.llm, "abort", lambda ids: (aborted.append(ids), abort(ids)))
    aborts = server.metrics().get("hybrid_engine_requests_total{finish_reason=abort}", 0.0)
    body = {**_body(PROMPTS_PER_REQUEST, 10, max_tokens=50), "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        wait_until(lambda: len(engine.added) == SLOTS, what="the request's first prompts in the engine")
    wait_until(lambda: aborted, what="the disconnect to abort the request")
    engine.gate.set()
    wait_until(server.idle_and_free, what="every slot and block back")
    assert [rid.rsplit("-", 1)[1] for rid in engine.added] == ["0", "1"]
    assert sorted(rid.rsplit("-", 1)[1] for rid in aborted[0]) == [str(i) for i in range(PROMPTS_PER_REQUEST)]
    assert server.metrics()["hybrid_engine_requests_total{finish_reason=abort}"] == aborts + PROMPTS_PER_REQUEST
