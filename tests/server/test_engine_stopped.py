"""Once the engine thread is gone -- shut down, or killed by an exception the loop does not
contain -- /health is 503 and new requests get 503 `engine_unavailable` (docs/server.md).

Each test stops the engine of its own server, never the shared one.
"""
import threading
import time

import httpx
import pytest

from hybrid_engine.config import EngineConfig
from hybrid_engine.engine import LLMEngine
from tests.server.conftest import MAX_MODEL_LEN, Server, serve_in_thread, wait_until


class EngineThreadKiller(BaseException):
    """Not an Exception: the engine loop contains Exceptions, so this one ends the thread."""


class DyingEngine(LLMEngine):
    """LLMEngine whose next step can raise `EngineThreadKiller` (once), slowed down so that a
    request is still running when it does."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.die = threading.Event()

    def step(self):
        if self.die.is_set():
            self.die.clear()
            raise EngineThreadKiller("the engine thread dies")
        time.sleep(0.02)
        return super().step()


def _server():
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    return serve_in_thread(lambda: DyingEngine(config))


def _assert_unavailable(server: Server) -> None:
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and health.json() == {"status": "engine not running"}
    for path, body in [("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})]:
        r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["code"] == "engine_unavailable" and error["type"] == "server_error"


def test_after_shutdown_health_and_requests_are_503():
    with _server() as server:
        server.assert_healthy()
        server.llm.shutdown()
        _assert_unavailable(server)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_engine_thread_death_aborts_in_flight_then_503():
    """The request running when the engine thread dies ends with finish_reason "abort"; after
    that the server says the engine is gone instead of queueing requests nobody serves."""
    with _server() as server:
        result: list[httpx.Response] = []
        body = {"prompt": "long", "max_tokens": 100, "ignore_eos": True}
        request = threading.Thread(target=lambda: result.append(
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)))
        request.start()
        wait_until(lambda: server.metrics()["hybrid_engine_num_requests_running"] == 1, what="a running request")
        server.engine.die.set()
        request.join()
        (response,) = result
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "abort" and response.json()["usage"]["completion_tokens"] < 100
        _assert_unavailable(server)
