"""The server with its engine in a process of its own (`AsyncLLM(engine_process=True)`, what
`serve_hybrid.py` runs by default): the same answers as the engine on a thread, streams,
aborts and metrics across the process boundary, start-up errors, a killed engine process,
and no engine process left behind by a server that exits or is killed."""
import functools
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from hybrid_engine.config import EngineConfig
from hybrid_engine.engine import LLMEngine
from hybrid_engine.models.config import ConfigError
from hybrid_engine.server.async_llm import AsyncLLM
from hybrid_engine.server.engine_host import EngineProcessDied
from tests.server.conftest import (MAX_MODEL_LEN, REPO, Server, UnsendableEngine, child_processes, process_alive,
                                   process_engine,
                                   serve_engine_process, serve_in_thread, start_subprocess_server,
                                   wait_until)

CONFIG = EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)

BODIES = [
    ("/v1/completions", {"prompt": ["Hello", "abc", "Hello"], "max_tokens": 12, "temperature": 0.0,
                         "ignore_eos": True}),
    ("/v1/completions", {"prompt": "seeded", "max_tokens": 16, "temperature": 0.9, "seed": 11, "logprobs": 2,
                         "n": 2, "ignore_eos": True}),
    ("/v1/completions", {"prompt": "stop here", "max_tokens": 30, "temperature": 1.0, "seed": 2, "stop": ["e", "a"],
                         "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "temperature": 0.7,
                              "seed": 4, "logprobs": True, "top_logprobs": 2, "ignore_eos": True}),
]


@pytest.fixture(scope="module")
def process_server() -> Server:
    """The engine in its own process, 10 ms per step (so a request of 100 tokens is still
    running when its client hangs up)."""
    with serve_engine_process(process_engine(CONFIG, step_delay=0.01)) as s:
        yield s


@pytest.fixture(scope="module")
def thread_server() -> Server:
    """The same engine on a thread of this process, sent the same requests in the same order
    (so that both prefix caches hold the same prefixes)."""
    with serve_in_thread(lambda: LLMEngine(CONFIG)) as s:
        yield s


def _answer(url: str, path: str, body: dict) -> dict:
    """The response without its per-call fields (id, created)."""
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return {k: v for k, v in r.json().items() if k not in ("id", "created")}


def _stream(url: str, path: str, body: dict) -> list[dict]:
    """A streamed response's events (without id, created), up to [DONE]."""
    events = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append({k: v for k, v in json.loads(line[6:]).items() if k not in ("id", "created")})
    return events


def _by_choice(events: list[dict]) -> dict[int, tuple[str, list]]:
    """Per choice index: the streamed text, and the logprobs entries (completions: token and
    logprob pairs; chat: the content entries), in order."""
    choices: dict[int, tuple[str, list]] = {}
    for event in events:
        for choice in event["choices"]:
            text, logprobs = choices.get(choice["index"], ("", []))
            piece = choice.get("text", choice.get("delta", {}).get("content")) or ""
            entries = choice.get("logprobs") or {}
            if "tokens" in entries:
                entries = list(zip(entries["tokens"], entries["token_logprobs"]))
            else:
                entries = entries.get("content") or []
            choices[choice["index"]] = (text + piece, logprobs + entries)
    return choices


@pytest.mark.parametrize("path,body", BODIES)
def test_answers_equal_the_engine_on_a_thread(process_server: Server, thread_server: Server, path: str, body: dict):
    """Greedy, seeded with logprobs and n, stop strings, chat: the same response as the
    engine on a thread of the server process, and streams with the same texts and logprobs."""
    expected = _answer(thread_server.url, path, body)
    assert _answer(process_server.url, path, body) == expected
    streamed = _by_choice(_stream(process_server.url, path, body))
    assert streamed == _by_choice(_stream(thread_server.url, path, body))
    key = "text" if path == "/v1/completions" else "message"
    assert {i: text for i, (text, _) in streamed.items()} == {
        c["index"]: c[key] if key == "text" else c[key]["content"] for c in expected["choices"]}
    assert any(logprobs for _, logprobs in streamed.values()) == ("logprobs" in body)


def test_metrics_and_aborts_cross_the_process_boundary(process_server: Server):
    """A client that hangs up mid-stream aborts its request in the engine process; the
    step histogram, token and finish counters fill; the pools end free."""
    before = process_server.metrics()
    body = {"prompt": "long", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{process_server.url}/v1/completions", json=body, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    wait_until(process_server.idle_and_free, what="the aborted request to free its resources")
    after = process_server.metrics()
    assert after["hybrid_engine_requests_total{finish_reason=abort}"] == \
        before.get("hybrid_engine_requests_total{finish_reason=abort}", 0) + 1
    assert after["hybrid_engine_step_seconds_count"] > before.get("hybrid_engine_step_seconds_count", 0)
    assert after["hybrid_engine_generation_tokens_total"] > before.get("hybrid_engine_generation_tokens_total", 0)
    assert after["hybrid_engine_engine_steps_total"] >= after["hybrid_engine_step_seconds_count"]


def test_a_bad_model_fails_the_start_with_its_error(tmp_path):
    """The engine process's construction error is raised by the constructor, as its type
    (the CLI prints start-up ValueErrors as "cannot start: ...")."""
    with pytest.raises(ConfigError, match="no config.json"):
        AsyncLLM(functools.partial(LLMEngine, EngineConfig(model=str(tmp_path), device="cpu")), engine_process=True)


def test_an_engine_that_cannot_report_its_start_fails_the_start():
    """The engine was built but its `Started` report could not be sent: the constructor
    raises instead of waiting for it."""
    with pytest.raises(EngineProcessDied, match="could not send a report"):
        AsyncLLM(functools.partial(UnsendableEngine, CONFIG), engine_process=True)


def test_a_failing_step_fails_its_requests_across_the_pipe():
    """A step that raises in the engine process fails the requests in flight (500 with the
    error), and the server goes on serving."""
    with serve_engine_process(process_engine(CONFIG, fail_steps=(3,))) as server:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 20, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 500 and "engine step failed: RuntimeError: injected step failure" in r.text
        server.assert_healthy()
        wait_until(server.idle_and_free, what="the failed request's resources to return")
        assert server.metrics()["hybrid_engine_requests_total{finish_reason=error}"] == 1


_STARTER = """
import functools, signal, sys
sys.path.insert(0, {repo!r})
from hybrid_engine.config import EngineConfig
from hybrid_engine.server.async_llm import AsyncLLM
from hybrid_engine.server.engine_host import EngineProcessDied
from tests.server.conftest import process_engine
def leave(*_):
    raise SystemExit(3)
signal.signal(signal.SIGTERM, leave)
config = EngineConfig(device="cpu", dtype="float32", max_model_len=128)
llm = AsyncLLM(process_engine(config, start_delay={start_delay}), engine_process=True)
print(llm.engine_pid, flush=True)
"""


@pytest.mark.parametrize("how", ["signal while loading", "exit without shutdown"])
def test_no_engine_process_outlives_its_python_process(how: str):
    """A program that leaves while its engine process is still loading (a signal during a
    long load), or without calling `shutdown()`, exits at once, and its engine process with it."""
    loading = how == "signal while loading"
    code = _STARTER.format(repo=str(REPO), start_delay=600.0 if loading else 0.0)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        if loading:
            wait_until(lambda: [p for p in child_processes(proc.pid) if b"spawn_main" in _cmdline(p)],
                       what="the engine process to start")
            engine = _engine_process(proc.pid)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 3
        else:
            engine = int(proc.stdout.readline())
            assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_until(lambda: not process_alive(engine), timeout=30, what="the engine process to exit")


def test_killed_engine_process_fails_in_flight_then_503():
    """SIGKILL of the engine process: the stream in flight ends with an error event naming
    the exit, the server answers 503 from then on (instead of queueing for nobody), and
    /metrics counts no requests running or in flight any more."""
    with serve_engine_process(process_engine(CONFIG, step_delay=0.05)) as server:
        body = {"prompt": "long", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            os.kill(server.llm.engine_pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert "the engine process exited (exit code -9)" in error["message"]
        wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 503, what="/health to say 503")
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        metrics = server.metrics()
        for gauge in ("num_requests_running", "num_requests_in_flight", "num_requests_waiting"):
            assert metrics[f"hybrid_engine_{gauge}"] == 0, gauge


def _engine_process(server_pid: int) -> int:
    """The server's engine process (the spawned child; the other is multiprocessing's resource tracker)."""
    (pid,) = [pid for pid in child_processes(server_pid) if b"spawn_main" in _cmdline(pid)]
    return pid


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_no_engine_process_outlives_the_server(how: signal.Signals):
    """SIGTERM: the server drains and stops its engine process; SIGKILL: the engine process
    sees its command pipe close and exits by itself (it would hold the GPU otherwise)."""
    with start_subprocess_server("--device", "cpu", "--max-model-len", "128") as (url, proc):
        engine = _engine_process(proc.pid)
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200
        proc.send_signal(how)
        proc.wait(timeout=60)
        assert proc.returncode == (0 if how == signal.SIGTERM else -signal.SIGKILL)
    wait_until(lambda: not process_alive(engine), timeout=30, what="the engine process to exit")


def test_no_engine_process_flag_runs_the_engine_on_a_thread():
    """`--no-engine-process`: the server starts no engine process, serves, and exits 0 on SIGTERM."""
    with start_subprocess_server("--device", "cpu", "--max-model-len", "128", "--no-engine-process") as (url, proc):
        assert not [pid for pid in child_processes(proc.pid) if b"spawn_main" in _cmdline(pid)]
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
